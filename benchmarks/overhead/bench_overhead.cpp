// bench_overhead: what ferry's stages cost per element, beside a hand-written loop doing
// the same work in the same run.
//
//   1. from_range | map(+1) | batch(256), consumed batch by batch, against a loop that
//      reads the same array, adds 1 and writes each group of 256 into a reused buffer.
//   2. prefetch's hand-off per batch: the same batches with and without prefetch(4).
//   3. any_source (type erasure): case 1 with from_range erased (batch pulls it in runs),
//      and from_range | map pulled element by element, typed against erased.
//
// Output: a table, a JSON line, and last `overhead_ratio: <ferry ns/elem / loop ns/elem>`.
// Usage: bench_overhead [elements (default 16777216)] [repetitions (default 7)]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "common/timing.hpp"
#include "ferry/ferry.hpp"

namespace {

// Consumes a batch the same way in both variants: a checksum the compiler cannot drop.
inline std::uint64_t consume(const std::uint32_t* p, std::size_t n) {
  std::uint64_t s = 0;
  for (std::size_t i = 0; i < n; ++i) s += p[i];
  return s;
}

volatile std::uint64_t sink;

}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (std::size_t(1) << 24);
  const int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  constexpr std::size_t bs = 256;
  std::vector<std::uint32_t> data(n);
  for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<std::uint32_t>(i * 2654435761u);

  std::uint64_t ref = 0, got = 0;
  const double loop_s = bench::median_seconds(reps, [&] {
    std::vector<std::uint32_t> buf(bs);
    std::uint64_t s = 0;
    for (std::size_t i = 0; i < n; i += bs) {
      const std::size_t m = std::min(bs, n - i);
      for (std::size_t j = 0; j < m; ++j) buf[j] = data[i + j] + 1;
      s += consume(buf.data(), m);
    }
    ref = s;
  });
  const double ferry_s = bench::median_seconds(reps, [&] {
    auto p = ferry::from_range(std::span<const std::uint32_t>(data)) |
             ferry::map([](std::uint32_t x) { return x + 1; }) | ferry::batch(bs);
    std::uint64_t s = 0;
    for (auto& b : p) s += consume(b.field().data(), b.size());
    got = s;
  });
  if (got != ref) {
    std::fprintf(stderr, "bench_overhead: checksums differ (%llu vs %llu)\n", (unsigned long long)got,
                 (unsigned long long)ref);
    return 1;
  }

  // prefetch hand-off: batches of 256 made by from_generator, with and without prefetch.
  const std::size_t batches = n / bs;
  auto make = [&] {
    return ferry::from_range(std::span<const std::uint32_t>(data)) | ferry::batch(bs);
  };
  std::uint64_t s1 = 0, s2 = 0;
  const double direct_s = bench::median_seconds(reps, [&] {
    auto p = make();
    std::uint64_t s = 0;
    for (auto& b : p) s += consume(b.field().data(), b.size());
    s1 = s;
  });
  const double prefetch_s = bench::median_seconds(reps, [&] {
    auto p = make() | ferry::prefetch(4);
    std::uint64_t s = 0;
    for (auto& b : p) s += consume(b.field().data(), b.size());
    s2 = s;
  });
  sink = s1 + s2;
  if (s1 != s2) {
    std::fprintf(stderr, "bench_overhead: prefetch changed the data\n");
    return 1;
  }

  // any_source: batch pulls the erased source in runs (one virtual call per batch), and
  // element-by-element pulling (one virtual call per element) against the typed pipeline.
  std::uint64_t s3 = 0, s4 = 0, s5 = 0;
  const double erased_batch_s = bench::median_seconds(reps, [&] {
    ferry::any_source<std::uint32_t> src = ferry::from_range(std::span<const std::uint32_t>(data));
    auto p = std::move(src) | ferry::map([](std::uint32_t x) { return x + 1; }) | ferry::batch(bs);
    std::uint64_t s = 0;
    for (auto& b : p) s += consume(b.field().data(), b.size());
    s3 = s;
  });
  auto make_elems = [&] {
    return ferry::from_range(std::span<const std::uint32_t>(data)) |
           ferry::map([](std::uint32_t x) { return x + 1; });
  };
  const double typed_next_s = bench::median_seconds(reps, [&] {
    auto p = make_elems();
    std::uint64_t s = 0;
    while (auto x = p.next()) s += *x;
    s4 = s;
  });
  const double erased_next_s = bench::median_seconds(reps, [&] {
    ferry::any_source<std::uint32_t> p = make_elems();
    std::uint64_t s = 0;
    while (auto x = p.next()) s += *x;
    s5 = s;
  });
  sink = s3 + s4 + s5;
  if (s3 != ref || s4 != ref || s5 != ref) {
    std::fprintf(stderr, "bench_overhead: the erased pipelines changed the data\n");
    return 1;
  }

  const double loop_ns = loop_s * 1e9 / n, ferry_ns = ferry_s * 1e9 / n;
  const double erased_batch_ns = erased_batch_s * 1e9 / n, typed_next_ns = typed_next_s * 1e9 / n,
               erased_next_ns = erased_next_s * 1e9 / n;
  const double handoff_ns = (prefetch_s - direct_s) * 1e9 / batches;
  std::printf("%-44s %12s %12s %10s\n", "case", "elements", "ns/elem", "Melem/s");
  std::printf("%-44s %12zu %12.3f %10.1f\n", "hand-written loop (+1, groups of 256)", n, loop_ns, 1e3 / loop_ns);
  std::printf("%-44s %12zu %12.3f %10.1f\n", "ferry from_range|map(+1)|batch(256)", n, ferry_ns, 1e3 / ferry_ns);
  std::printf("%-44s %12s %12s %10s\n", "case", "batches", "ns/batch", "");
  std::printf("%-44s %12zu %12.1f\n", "batch(256), consumed directly", batches, direct_s * 1e9 / batches);
  std::printf("%-44s %12zu %12.1f\n", "batch(256) | prefetch(4)", batches, prefetch_s * 1e9 / batches);
  std::printf("%-44s %12s %12.1f\n", "prefetch hand-off per batch (difference)", "", handoff_ns);
  std::printf("%-44s %12s %12s %10s\n", "case (any_source)", "elements", "ns/elem", "ratio");
  std::printf("%-44s %12zu %12.3f %10.3f\n", "erased from_range|map(+1)|batch(256)", n, erased_batch_ns,
              erased_batch_ns / ferry_ns);
  std::printf("%-44s %12zu %12.3f %10s\n", "typed from_range|map(+1), next() each", n, typed_next_ns, "");
  std::printf("%-44s %12zu %12.3f %10.3f\n", "erased from_range|map(+1), next() each", n, erased_next_ns,
              erased_next_ns / typed_next_ns);
  std::printf("{\"bench\":\"overhead\",\"elements\":%zu,\"loop_ns_per_elem\":%.4f,\"ferry_ns_per_elem\":%.4f,"
              "\"direct_ns_per_batch\":%.1f,\"prefetch_ns_per_batch\":%.1f,\"prefetch_handoff_ns\":%.1f,"
              "\"erased_batch_ns_per_elem\":%.4f,\"typed_next_ns_per_elem\":%.4f,\"erased_next_ns_per_elem\":%.4f}\n",
              n, loop_ns, ferry_ns, direct_s * 1e9 / batches, prefetch_s * 1e9 / batches, handoff_ns,
              erased_batch_ns, typed_next_ns, erased_next_ns);
  std::printf("overhead_ratio: %.3f\n", ferry_ns / loop_ns);
}
