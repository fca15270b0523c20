// buffer_pool: size classes, the cache bound and eviction, statistics. The ragged-batch
// case is the audit's: every batch of random-length vectors has a new byte count, and the
// cache must stay bounded while upstream allocation stops after warm-up.
#include <doctest/doctest.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <memory_resource>
#include <new>
#include <random>
#include <vector>

#include "ferry/memory/buffer.hpp"
#include "ferry/sources/from_generator.hpp"
#include "ferry/stages/batch.hpp"

// Every operator new in this program, counted: the pool's own bookkeeping must not
// allocate in steady state.
namespace {
std::atomic<std::uint64_t> global_news{0};
}  // namespace
// malloc/free behind new/delete is the point here, not a mismatch.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t n) {
  global_news.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace {

// Counts blocks and bytes held from new/delete, checking each free matches its allocation.
struct counting_resource : std::pmr::memory_resource {
  std::uint64_t allocs = 0, frees = 0, held = 0, mismatched = 0;
  std::vector<std::pair<void*, std::size_t>> live;
  void* do_allocate(std::size_t b, std::size_t a) override {
    // Refuses what no machine has, as operator new would; the sanitizers' allocators
    // abort on such a request instead of throwing.
    if (b > (std::size_t(1) << 40)) throw std::bad_alloc();
    void* p = std::pmr::new_delete_resource()->allocate(b, a);
    ++allocs;
    held += b;
    live.emplace_back(p, b);
    return p;
  }
  void do_deallocate(void* p, std::size_t b, std::size_t a) override {
    ++frees;
    held -= b;
    bool found = false;
    for (auto it = live.begin(); it != live.end(); ++it)
      if (it->first == p) {
        if (it->second != b) ++mismatched;
        live.erase(it);
        found = true;
        break;
      }
    if (!found) ++mismatched;
    std::pmr::new_delete_resource()->deallocate(p, b, a);
  }
  bool do_is_equal(const std::pmr::memory_resource& o) const noexcept override { return this == &o; }
};

}  // namespace

TEST_CASE("buffer_pool: size classes waste at most 1/8 and are monotonic") {
  std::size_t prev = 0;
  for (std::size_t b = 1; b < (1u << 20); b += 1 + b / 64) {
    const std::size_t c = ferry::buffer_pool::size_class(b);
    CHECK(c >= b);
    CHECK(c >= prev);
    if (b > ferry::buffer_pool::min_class_bytes) CHECK(c - b <= b / 8);
    prev = c;
  }
  CHECK(ferry::buffer_pool::size_class(1000) == ferry::buffer_pool::size_class(1010));
  // Near the top of size_t the class would overflow: the request itself is used.
  const std::size_t huge = std::numeric_limits<std::size_t>::max() - 5;
  CHECK(ferry::buffer_pool::size_class(huge) == huge);
}

TEST_CASE("buffer_pool: ragged batches of random sizes: cache bounded, allocation stops" *
          doctest::timeout(60)) {
  auto pool = std::make_shared<ferry::buffer_pool>();
  auto p = ferry::from_generator(64 * 3000, [](std::uint64_t i) {
             std::mt19937 rng(static_cast<std::uint32_t>(i));
             return std::vector<float>(rng() % 200, float(i));
           }) |
           ferry::batch(64, {.resource = pool});
  std::uint64_t after_warmup = 0, max_cached = 0, n = 0;
  for (auto& b : p) {
    CHECK(b.size() == 64);
    const auto s = pool->statistics();
    if (s.cached_bytes > max_cached) max_cached = s.cached_bytes;
    if (++n == 1000) after_warmup = s.upstream_allocations;
  }
  CHECK(n == 3000);
  const auto s = pool->statistics();
  MESSAGE("upstream allocations " << s.upstream_allocations << " (after warm-up " << after_warmup
                                  << "), reuses " << s.reuses << ", max cached " << max_cached);
  // Each batch is ~26 KB of floats and a few live at once: the cache holds a few classes'
  // worth, not one block per distinct byte count (the old exact-size cache grew per batch).
  CHECK(max_cached < 1024 * 1024);
  CHECK(s.upstream_allocations == after_warmup);
  CHECK(s.upstream_allocations < 100);
  CHECK(s.outstanding_bytes == 0);
  CHECK(s.cached_bytes <= pool->max_cached_bytes());
}

TEST_CASE("buffer_pool: max_cached_bytes is respected, evicting the oldest first") {
  counting_resource up;
  {
    ferry::buffer_pool pool(&up, 10'000);
    std::vector<void*> ps;
    for (std::size_t i = 0; i < 8; ++i) ps.push_back(pool.allocate(2048 + i * 512, 256));
    const std::size_t first_class = ferry::buffer_pool::size_class(2048);
    for (std::size_t i = 0; i < ps.size(); ++i) {
      pool.deallocate(ps[i], 2048 + i * 512, 256);
      CHECK(pool.statistics().cached_bytes <= 10'000);
    }
    const auto s = pool.statistics();
    CHECK(s.evictions > 0);
    CHECK(s.outstanding_bytes == 0);
    CHECK(up.held == s.cached_bytes);  // what the pool keeps is exactly what upstream holds
    // The oldest (the first freed, 2048 bytes) went first: a new 2048-byte request is not
    // served from the cache, while the newest (2048 + 7*512) still is.
    const auto reuses = s.reuses;
    void* newest = pool.allocate(2048 + 7 * 512, 256);
    CHECK(pool.statistics().reuses == reuses + 1);
    void* oldest = pool.allocate(first_class, 256);
    CHECK(pool.statistics().reuses == reuses + 1);
    pool.deallocate(newest, 2048 + 7 * 512, 256);
    pool.deallocate(oldest, first_class, 256);
    CHECK(pool.statistics().cached_bytes <= 10'000);
  }
  CHECK(up.held == 0);
  CHECK(up.allocs == up.frees);
  CHECK(up.mismatched == 0);
}

TEST_CASE("buffer_pool: a smaller request is served from a larger cached class and returned "
          "at that class's size") {
  counting_resource up;
  {
    ferry::buffer_pool pool(&up);
    void* big = pool.allocate(3000, 256);
    pool.deallocate(big, 3000, 256);
    void* small = pool.allocate(2000, 256);  // class 2048 <= cached 3072 <= 2 * 2048
    CHECK(small == big);
    CHECK(pool.statistics().reuses == 1);
    CHECK(pool.statistics().outstanding_bytes == 2000);
    std::memset(small, 1, 3000);
    pool.deallocate(small, 2000, 256);
    CHECK(pool.statistics().cached_bytes == ferry::buffer_pool::size_class(3000));
    void* again = pool.allocate(3000, 256);  // still the full block
    CHECK(again == big);
    pool.deallocate(again, 3000, 256);
  }
  CHECK(up.held == 0);
  CHECK(up.mismatched == 0);
}

TEST_CASE("buffer_pool: a request larger than the cache bound (or any class) still works") {
  counting_resource up;
  {
    ferry::buffer_pool pool(&up, 1 << 16);
    for (int i = 0; i < 3; ++i) {
      ferry::buffer b(std::shared_ptr<std::pmr::memory_resource>(std::shared_ptr<void>(), &pool),
                      (1 << 20) + 3);
      std::memset(b.data(), 7, b.size());
      CHECK(pool.statistics().outstanding_bytes == (1u << 20) + 3);
    }
    const auto s = pool.statistics();
    CHECK(s.upstream_allocations == 3);  // never cached: it could never fit
    CHECK(s.cached_bytes == 0);
    CHECK(up.held == 0);
    CHECK_THROWS_AS((void)pool.allocate(std::numeric_limits<std::size_t>::max() - 300, 256), std::bad_alloc);
    CHECK(pool.statistics().outstanding_bytes == 0);
  }
  CHECK(up.mismatched == 0);
}

TEST_CASE("buffer_pool: the default bound grows with the largest block, so big batches are reused too") {
  counting_resource up;
  {
    ferry::buffer_pool pool(&up);  // auto: 256 MiB, or 16 of the largest class
    CHECK(pool.max_cached_bytes() == ferry::buffer_pool::default_max_cached_bytes);
    // 300 MiB blocks (never touched: new/delete only reserves them), beyond 256 MiB.
    const std::size_t big = std::size_t(300) << 20;
    for (int i = 0; i < 4; ++i) {
      void* p = pool.allocate(big, 256);
      pool.deallocate(p, big, 256);
    }
    const auto s = pool.statistics();
    CHECK(s.upstream_allocations == 1);  // a batch of any size is pooled, not re-made per use
    CHECK(s.reuses == 3);
    CHECK(pool.max_cached_bytes() >= 16 * big);
    CHECK(s.cached_bytes <= pool.max_cached_bytes());
    // Small ragged blocks afterwards are bounded by the same (now larger) bound.
    std::mt19937_64 g(3);
    for (int i = 0; i < 2000; ++i) {
      const std::size_t n = 1000 + g() % 100000;
      void* p = pool.allocate(n, 64);
      pool.deallocate(p, n, 64);
    }
    CHECK(pool.statistics().upstream_allocations < 1 + 40);  // one block per class at most
  }
  CHECK(up.held == 0);
  CHECK(up.mismatched == 0);
}

// The automatic bound follows the blocks the pool has made: a request that upstream
// refuses (a corrupt length asking for a terabyte, skipped by the user) must not lift it,
// or the process-wide pinned pool would cache without bound from then on.
TEST_CASE("buffer_pool: a refused request leaves the automatic bound where it was") {
  counting_resource up;
  {
    ferry::buffer_pool pool(&up);
    void* p = pool.allocate(1 << 20, 256);
    const std::size_t before = pool.max_cached_bytes();
    CHECK_THROWS_AS((void)pool.allocate(std::size_t(1) << 41, 256), std::bad_alloc);
    CHECK_THROWS_AS((void)pool.allocate(std::numeric_limits<std::size_t>::max() - 300, 256), std::bad_alloc);
    CHECK(pool.max_cached_bytes() == before);
    pool.deallocate(p, 1 << 20, 256);
    // A block that did come grows it, and is cached at its class.
    const std::size_t big = std::size_t(300) << 20;
    void* q = pool.allocate(big, 256);
    CHECK(pool.max_cached_bytes() >= 16 * ferry::buffer_pool::size_class(big));
    pool.deallocate(q, big, 256);
    CHECK(pool.statistics().cached_bytes == ferry::buffer_pool::size_class(big) + ferry::buffer_pool::size_class(1 << 20));
  }
  CHECK(up.held == 0);
  CHECK(up.mismatched == 0);
}

namespace {
// An upstream whose free takes the pool's lock (through statistics()): a free made while
// the pool holds its lock would deadlock here. cudaFreeHost is the real case: it can take
// milliseconds, and every thread's batch would wait on the pool meanwhile.
struct reentrant_resource : counting_resource {
  ferry::buffer_pool* pool = nullptr;
  std::uint64_t calls = 0, cached_seen = 0;
  void do_deallocate(void* p, std::size_t b, std::size_t a) override {
    ++calls;
    if (pool) cached_seen = pool->statistics().cached_bytes;
    counting_resource::do_deallocate(p, b, a);
  }
};
}  // namespace

TEST_CASE("buffer_pool: blocks go upstream outside the pool's lock (eviction and trim)" *
          doctest::timeout(30)) {
  reentrant_resource up;
  {
    ferry::buffer_pool pool(&up, 10'000);
    up.pool = &pool;
    std::vector<void*> ps;
    for (std::size_t i = 0; i < 8; ++i) ps.push_back(pool.allocate(2048 + i * 512, 256));
    for (std::size_t i = 0; i < ps.size(); ++i) pool.deallocate(ps[i], 2048 + i * 512, 256);
    const auto s = pool.statistics();
    CHECK(s.evictions > 0);
    CHECK(up.calls == s.evictions);
    // The evicted block was out of the cache's count before its free: what upstream
    // holds then is the cache, the block being freed and nothing else.
    CHECK(up.cached_seen == s.cached_bytes);
    pool.trim();
    CHECK(up.held == 0);
    CHECK(pool.statistics().cached_bytes == 0);
    up.pool = nullptr;
  }
  CHECK(up.allocs == up.frees);
  CHECK(up.mismatched == 0);
}

TEST_CASE("buffer_pool: a steady allocate/deallocate cycle allocates nothing, not even bookkeeping") {
  counting_resource up;
  ferry::buffer_pool pool(&up);
  auto cycle = [&] {  // one batch's buffers: two fields of different classes
    void* a = pool.allocate(1024, 256);
    void* b = pool.allocate(5000, 256);
    pool.deallocate(a, 1024, 256);
    pool.deallocate(b, 5000, 256);
  };
  for (int i = 0; i < 3; ++i) cycle();
  const std::uint64_t news = global_news.load(), ups = up.allocs;
  for (int i = 0; i < 1000; ++i) cycle();
  CHECK(global_news.load() == news);  // the class entries and their vectors stay
  CHECK(up.allocs == ups);
  CHECK(pool.statistics().reuses >= 2000);
}
