// ferry/sources/compression.hpp: how a file is compressed, and which library inflates it
// (from_files_options::compress and ::inflater; ferry/sources/file_options.hpp). Plain
// enums: no threads, nothing thrown.
#pragma once

namespace ferry {

// How a file is compressed. automatic: gzip/zlib when the name ends in ".gz", ".gzip",
// ".zlib", ".GZ" or ".tgz" (a gzipped tar shard), plain otherwise.
enum class compression { automatic, none, gzip };

// Which library inflates compressed files. automatic: the environment's FERRY_INFLATE
// ("zlib" or "isal") when set, else ISA-L when ferry was built with it (FERRY_WITH_ISAL:
// Meson defines it when Debian's libisal-dev is installed), else zlib.
enum class inflate_engine { automatic, zlib, isal };

}  // namespace ferry
