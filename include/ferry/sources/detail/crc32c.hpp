// ferry/sources/detail/crc32c.hpp: CRC-32C (Castagnoli), as TFRecord uses it.
//
// With FERRY_WITH_ISAL (Meson defines it when Debian's libisal-dev is installed, and
// links -lisal): buffers of 256 bytes and more go to Intel ISA-L's crc32_iscsi, which
// folds with (V)PCLMULQDQ and picks its kernel at run time: 1.9x the path below on 1 KiB
// records, 2.6x on 64 KiB, on this project's AVX-512 machines.
// Otherwise, and for short buffers: the SSE4.2 `crc32` instruction, three independent
// streams over large buffers (the instruction has a latency of 3 and a throughput of 1
// per cycle) joined with zlib's GF(2) "multiply mod P" combine. Chosen at run time (the
// build needs no -msse4.2).
// Elsewhere, or on a CPU without SSE4.2: a slow bit-at-a-time fallback, kept only so the
// library stays portable; it is also the oracle the tests compare against.
// Thread-safe; throws nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define FERRY_CRC32C_X86 1
#endif
#if defined(FERRY_WITH_ISAL)
#include <isa-l/crc.h>
#endif

namespace ferry::detail::crc32c {

inline constexpr std::uint32_t poly = 0x82F63B78u;  // reflected Castagnoli polynomial

// Bitwise reference (slow): crc of `data` continuing from the finished crc `crc`.
inline std::uint32_t extend_portable(std::uint32_t crc, const void* data, std::size_t n) noexcept {
  auto p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
  for (std::size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (poly & (0u - (c & 1u)));
  }
  return ~c;
}

// a * b mod P in GF(2), reflected (zlib's multmodp).
constexpr std::uint32_t multmodp(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ poly : b >> 1;
  }
  return p;
}
// x^(8 n) mod P: the operator that shifts a crc over n zero bytes.
constexpr std::uint32_t shift_op(std::uint64_t n) noexcept {
  std::uint32_t p = 1u << 31;   // x^0
  std::uint32_t sq = 1u << 30;  // x^1
  // x^(2^k) for k = 0.., squaring as we go; start from x^8 (= x^(2^3)).
  for (int k = 0; k < 3; ++k) sq = multmodp(sq, sq);
  while (n) {
    if (n & 1) p = multmodp(sq, p);
    sq = multmodp(sq, sq);
    n >>= 1;
  }
  return p;
}
// crc(A || B) from crc(A), crc(B) and |B|.
constexpr std::uint32_t combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t len_b) noexcept {
  return multmodp(shift_op(len_b), crc_a) ^ crc_b;
}

#ifdef FERRY_CRC32C_X86
// Shifting a crc over a fixed number of zero bytes is linear in its bits: four 256-entry
// tables of the operator (Mark Adler's crc32c.c) make it four loads.
struct shift_table {
  std::uint32_t t[4][256];
  explicit shift_table(std::uint64_t bytes) {
    const std::uint32_t op = shift_op(bytes);
    for (int k = 0; k < 4; ++k)
      for (std::uint32_t b = 0; b < 256; ++b) t[k][b] = multmodp(op, b << (8 * k));
  }
  std::uint32_t operator()(std::uint32_t c) const noexcept {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
  }
};

__attribute__((target("sse4.2"))) inline std::uint32_t raw_sse(std::uint32_t c, const unsigned char* p,
                                                               std::size_t n) noexcept {
  std::uint64_t c64 = c;
  while (n >= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
    p += 8;
    n -= 8;
  }
  c = static_cast<std::uint32_t>(c64);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}

// Three streams of `stripe` bytes each, joined: crc(A B C) from the finished crc so far.
template <std::size_t stripe>
__attribute__((target("sse4.2"))) inline std::uint32_t three_way(std::uint32_t crc, const unsigned char*& p,
                                                                 std::size_t& n) noexcept {
  static const shift_table shift(stripe);
  while (n >= 3 * stripe) {
    std::uint64_t a = ~crc, b = 0xFFFFFFFFu, c = 0xFFFFFFFFu;
    const unsigned char *pa = p, *pb = p + stripe, *pc = p + 2 * stripe;
    for (std::size_t i = 0; i < stripe; i += 8) {
      std::uint64_t va, vb, vc;
      std::memcpy(&va, pa + i, 8);
      std::memcpy(&vb, pb + i, 8);
      std::memcpy(&vc, pc + i, 8);
      a = _mm_crc32_u64(a, va);
      b = _mm_crc32_u64(b, vb);
      c = _mm_crc32_u64(c, vc);
    }
    const std::uint32_t ca = ~static_cast<std::uint32_t>(a), cb = ~static_cast<std::uint32_t>(b),
                        cc = ~static_cast<std::uint32_t>(c);
    crc = shift(shift(ca) ^ cb) ^ cc;
    p += 3 * stripe;
    n -= 3 * stripe;
  }
  return crc;
}

__attribute__((target("sse4.2"))) inline std::uint32_t extend_sse(std::uint32_t crc, const void* data,
                                                                  std::size_t n) noexcept {
  auto p = static_cast<const unsigned char*>(data);
  if (n >= 3 * 8192) crc = three_way<8192>(crc, p, n);
  if (n >= 3 * 256) crc = three_way<256>(crc, p, n);
  // The tail of a typical 1 KiB record: three short streams still beat one dependent chain.
  if (n >= 3 * 64) crc = three_way<64>(crc, p, n);
  return ~raw_sse(~crc, p, n);
}

inline bool have_sse42() noexcept {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}

// Four buffers of n bytes each: four independent chains interleaved, so the instruction's
// 3-cycle latency overlaps (one chain per short record runs at a third of the rate).
__attribute__((target("sse4.2"))) inline void value_x4_sse(const unsigned char* const p[4], std::size_t n,
                                                           std::uint32_t out[4]) noexcept {
  std::uint64_t c0 = 0xFFFFFFFFu, c1 = c0, c2 = c0, c3 = c0;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t v0, v1, v2, v3;
    std::memcpy(&v0, p[0] + i, 8);
    std::memcpy(&v1, p[1] + i, 8);
    std::memcpy(&v2, p[2] + i, 8);
    std::memcpy(&v3, p[3] + i, 8);
    c0 = _mm_crc32_u64(c0, v0);
    c1 = _mm_crc32_u64(c1, v1);
    c2 = _mm_crc32_u64(c2, v2);
    c3 = _mm_crc32_u64(c3, v3);
  }
  std::uint32_t d[4] = {static_cast<std::uint32_t>(c0), static_cast<std::uint32_t>(c1),
                        static_cast<std::uint32_t>(c2), static_cast<std::uint32_t>(c3)};
  for (; i < n; ++i)
    for (int k = 0; k < 4; ++k) d[k] = _mm_crc32_u8(d[k], p[k][i]);
  for (int k = 0; k < 4; ++k) out[k] = ~d[k];
}
#endif

#if defined(FERRY_WITH_ISAL)
// ISA-L's crc32_iscsi keeps the register un-inverted between calls and takes an int
// length: crc of `data` continuing from the finished crc `crc`.
inline std::uint32_t extend_isal(std::uint32_t crc, const void* data, std::size_t n) noexcept {
  auto p = static_cast<unsigned char*>(const_cast<void*>(data));  // ISA-L only reads it
  std::uint32_t c = ~crc;
  while (n > 0) {
    const int k = n > (std::size_t(1) << 30) ? 1 << 30 : static_cast<int>(n);
    c = crc32_iscsi(p, k, c);
    p += k;
    n -= std::size_t(k);
  }
  return ~c;
}
inline constexpr std::size_t isal_min_bytes = 256;  // below this the SSE4.2 path is faster
#endif

// crc of `data` continuing from the finished crc `crc` (0 to start).
inline std::uint32_t extend(std::uint32_t crc, const void* data, std::size_t n) noexcept {
#if defined(FERRY_WITH_ISAL)
  if (n >= isal_min_bytes) return extend_isal(crc, data, n);
#endif
#ifdef FERRY_CRC32C_X86
  if (have_sse42()) return extend_sse(crc, data, n);
#endif
  return extend_portable(crc, data, n);
}
inline std::uint32_t value(const void* data, std::size_t n) noexcept { return extend(0, data, n); }

// The crcs of four buffers of n bytes each (out[k] = value(p[k], n)), computed together:
// for short records, where one chain is latency-bound.
inline void value_x4(const unsigned char* const p[4], std::size_t n, std::uint32_t out[4]) noexcept {
#ifdef FERRY_CRC32C_X86
  if (have_sse42()) return value_x4_sse(p, n, out);
#endif
  for (int k = 0; k < 4; ++k) out[k] = value(p[k], n);
}

// TFRecord's masking, so a CRC stored inside CRC'd data does not cancel out.
constexpr std::uint32_t mask(std::uint32_t c) noexcept { return ((c >> 15) | (c << 17)) + 0xa282ead8u; }
constexpr std::uint32_t unmask(std::uint32_t m) noexcept {
  std::uint32_t r = m - 0xa282ead8u;
  return (r >> 17) | (r << 15);
}

}  // namespace ferry::detail::crc32c
