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

#include "common/plus_one.hpp"
#include "common/timing.hpp"
#include "ferry/ferry.hpp"

namespace {

using bench::consume;

volatile std::uint64_t sink;

using span = std::span<const std::uint32_t>;
constexpr std::size_t bs = 256;

// Each case is a function of its own, kept out of line, so that how GCC compiles one case
// (what it inlines into it, where its loop lands) does not change with the code of the
// others: with every case inlined into main(), a change to batch's code moved the typed
// next() loop's figure by 17% with that loop's own code unchanged.
[[gnu::noinline]] std::uint64_t hand_loop(span data) { return bench::plus_one_loop(data, bs); }
[[gnu::noinline]] std::uint64_t ferry_batches(span data) {
  auto p = ferry::from_range(data) | ferry::map([](std::uint32_t x) { return x + 1; }) | ferry::batch(bs);
  std::uint64_t s = 0;
  for (auto& b : p) s += consume(b.field().data(), b.size());
  return s;
}
[[gnu::noinline]] std::uint64_t direct_batches(span data, bool prefetch) {
  std::uint64_t s = 0;
  if (prefetch) {
    auto p = ferry::from_range(data) | ferry::batch(bs) | ferry::prefetch(4);
    for (auto& b : p) s += consume(b.field().data(), b.size());
  } else {
    auto p = ferry::from_range(data) | ferry::batch(bs);
    for (auto& b : p) s += consume(b.field().data(), b.size());
  }
  return s;
}
[[gnu::noinline]] std::uint64_t erased_batches(span data) {
  ferry::any_source<std::uint32_t> src = ferry::from_range(data);
  auto p = std::move(src) | ferry::map([](std::uint32_t x) { return x + 1; }) | ferry::batch(bs);
  std::uint64_t s = 0;
  for (auto& b : p) s += consume(b.field().data(), b.size());
  return s;
}
auto mapped(span data) {
  return ferry::from_range(data) | ferry::map([](std::uint32_t x) { return x + 1; });
}
[[gnu::noinline]] std::uint64_t typed_next(span data) {
  auto p = mapped(data);
  std::uint64_t s = 0;
  while (auto x = p.next()) s += *x;
  return s;
}
[[gnu::noinline]] std::uint64_t erased_next(span data) {
  ferry::any_source<std::uint32_t> p = mapped(data);
  std::uint64_t s = 0;
  while (auto x = p.next()) s += *x;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (std::size_t(1) << 24);
  const int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  std::vector<std::uint32_t> data(n);
  for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<std::uint32_t>(i * 2654435761u);
  const span d(data);

  std::uint64_t ref = 0, got = 0;
  const double loop_s = bench::median_seconds(reps, [&] { ref = hand_loop(d); });
  const double ferry_s = bench::median_seconds(reps, [&] { got = ferry_batches(d); });
  if (got != ref) {
    std::fprintf(stderr, "bench_overhead: checksums differ (%llu vs %llu)\n", (unsigned long long)got,
                 (unsigned long long)ref);
    return 1;
  }

  // prefetch hand-off: batches of 256, with and without prefetch.
  const std::size_t batches = n / bs;
  std::uint64_t s1 = 0, s2 = 0;
  const double direct_s = bench::median_seconds(reps, [&] { s1 = direct_batches(d, false); });
  const double prefetch_s = bench::median_seconds(reps, [&] { s2 = direct_batches(d, true); });
  sink = s1 + s2;
  if (s1 != s2) {
    std::fprintf(stderr, "bench_overhead: prefetch changed the data\n");
    return 1;
  }

  // any_source: batch pulls the erased source in runs (one virtual call per batch), and
  // element-by-element pulling (one virtual call per element) against the typed pipeline.
  std::uint64_t s3 = 0, s4 = 0, s5 = 0;
  const double erased_batch_s = bench::median_seconds(reps, [&] { s3 = erased_batches(d); });
  const double typed_next_s = bench::median_seconds(reps, [&] { s4 = typed_next(d); });
  const double erased_next_s = bench::median_seconds(reps, [&] { s5 = erased_next(d); });
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
