// The conformance suite: one body per property, run over every stage and source (the
// shape of taskflow's unittests/test_exceptions.cpp). Each case below is a pipeline with
// one stage under test over a generated source, and a naive oracle of what that stage
// hands out, errors included, as events. Every case is checked for:
//   - its events against the oracle, with and without an error in user code upstream
//     (the generator's function throws at element e), which must arrive at its place
//     with nothing lost;
//   - exact resume at every position, through pipeline_state bytes;
//   - a refused restore: next() and save_state() throw until rewind() or a good restore;
//   - rewind() mid-epoch giving what a fresh pipeline's next epoch gives;
//   - a move mid-epoch: the new one goes on exactly, the moved-from one throws config_error;
//   - destruction mid-epoch returning promptly (threads joined);
//   - report() listing every stage, in order;
//   - batch_size() reaching distribute through every stage that keeps batches whole.
// A stage joins by one line in the `cases` list at the end (with its case struct above it).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/doubles.hpp"
#include "sources/helpers.hpp"
#include "ferry/any_source.hpp"
#include "ferry/collective/communicator.hpp"
#include "ferry/ferry.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/sources/from_files.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/stages/interleave.hpp"
#include "ferry/stats.hpp"

namespace {

using u64 = std::uint64_t;
using namespace std::chrono_literals;
constexpr u64 none = ~u64{0};

// One thing a pipeline hands out: an element (flattened to numbers) or an error.
struct ev {
  bool error = false;
  std::vector<u64> v;
  friend bool operator==(const ev&, const ev&) = default;
};
using events = std::vector<ev>;

doctest::String describe(const events& es) {
  std::string s = "[";
  for (const ev& e : es) {
    if (e.error) {
      s += "E ";
      continue;
    }
    s += "(";
    for (u64 x : e.v) s += std::to_string(x) + " ";
    s += ") ";
  }
  return (s + "]").c_str();
}

ev val(u64 x) { return ev{false, {x}}; }
ev err() { return ev{true, {}}; }

// Elements to numbers.
std::vector<u64> flat(u64 x) { return {x}; }
std::vector<u64> flat(const std::pair<u64, u64>& p) { return {p.first, p.second}; }
std::vector<u64> flat(const ferry::batch_of<u64>& b) {
  auto f = b.field<0>();
  return {f.begin(), f.end()};
}
// A padded batch: each row's length, then its L values (padding included).
std::vector<u64> flat(const ferry::batch_of<ferry::padded<u64>>& b) {
  ferry::padded_view<u64> t = b.field<0>();
  std::vector<u64> out;
  for (std::size_t i = 0; i < t.size(); ++i) {
    out.push_back(t.lengths[i]);
    out.insert(out.end(), t[i].begin(), t[i].end());
  }
  return out;
}
// A padded batch with its mask: each row's length, then its L values and its L mask bytes.
std::vector<u64> flat(const ferry::batch_of<std::tuple<ferry::padded<u64>, ferry::padded<std::uint8_t>>>& b) {
  ferry::padded_view<u64> t = b.field<0>();
  ferry::padded_view<std::uint8_t> m = b.field<1>();
  std::vector<u64> out;
  for (std::size_t i = 0; i < t.size(); ++i) {
    out.push_back(t.lengths[i]);
    out.insert(out.end(), t[i].begin(), t[i].end());
    out.insert(out.end(), m[i].begin(), m[i].end());
  }
  return out;
}
// A packed batch: each row's length, then its L tokens, segment ids and positions.
std::vector<u64> flat(const ferry::batch_of<ferry::packed_element_t<u64>>& b) {
  ferry::padded_view<u64> t = b.field<0>();
  ferry::padded_view<std::uint32_t> s = b.field<1>(), p = b.field<2>();
  std::vector<u64> out;
  for (std::size_t i = 0; i < t.size(); ++i) {
    out.push_back(t.lengths[i]);
    out.insert(out.end(), t[i].begin(), t[i].end());
    out.insert(out.end(), s[i].begin(), s[i].end());
    out.insert(out.end(), p[i].begin(), p[i].end());
  }
  return out;
}
std::vector<u64> flat(const ferry::step<u64>& s) {
  std::vector<u64> out;
  for (std::size_t r = 0; r < s.replicas(); ++r) {
    auto f = s[r].field<0>();
    out.insert(out.end(), f.begin(), f.begin() + static_cast<std::ptrdiff_t>(s[r].valid()));
  }
  return out;
}
std::vector<u64> flat(const ferry::record& r) {
  std::vector<u64> out;
  for (std::byte b : r.bytes()) out.push_back(std::to_integer<u64>(b));
  return out;
}

// The next event, or nullopt at the end.
template <class P>
std::optional<ev> pull(P& p) {
  try {
    auto e = p.next();
    if (!e) return std::nullopt;
    return ev{false, flat(*e)};
  } catch (const ferry::config_error&) {
    throw;  // a misuse, never data: the test fails
  } catch (const std::exception&) {
    return err();
  }
}
// Everything left this epoch; with stop_at_error, up to the first error (zip: every
// next() after one throws). At most `cap` events: a stage that errs forever fails here.
template <class P>
events rest(P& p, bool stop_at_error = false, std::size_t cap = 100000) {
  events out;
  while (out.size() < cap)
    if (auto e = pull(p)) {
      out.push_back(std::move(*e));
      if (stop_at_error && out.back().error) break;
    } else {
      break;
    }
  return out;
}
template <class P>
events take_n(P& p, std::size_t k) {
  events out;
  for (std::size_t i = 0; i < k; ++i)
    if (auto e = pull(p)) out.push_back(std::move(*e));
    else break;
  return out;
}

// The generated input: element i is i * 7 + 3, and the function throws at `bad`
// (from_generator skips that index: the error takes its place).
inline u64 gen_value(u64 i) { return i * 7 + 3; }
inline auto gen(u64 n, u64 bad = none, u64 salt = 0) {
  return ferry::from_generator(n, [bad, salt](u64 i) -> u64 {
    if (i == bad) throw std::runtime_error("user function failed at " + std::to_string(i));
    return gen_value(i) + salt;
  });
}
inline events gen_events(u64 n, u64 bad = none, u64 salt = 0) {
  events out;
  for (u64 i = 0; i < n; ++i) out.push_back(i == bad ? err() : val(gen_value(i) + salt));
  return out;
}

// ---- the cases ---------------------------------------------------------------------------
// Each: make(bad) builds the pipeline over the generator (bad: the failing index, or none);
// oracle(bad) gives its first epoch's events; epoch2(bad) its second's (after rewind());
// names: report()'s rows; flags for what it cannot do.

constexpr u64 N = 37;

struct case_from_range {
  static constexpr const char* label = "from_range";
  static constexpr bool user_errors = false;
  static auto make(u64) {
    std::vector<u64> v;
    for (u64 i = 0; i < N; ++i) v.push_back(gen_value(i));
    return ferry::from_range(std::move(v));
  }
  static events oracle(u64) { return gen_events(N); }
  static std::vector<std::string> names() { return {"from_range"}; }
};

struct case_from_generator {
  static constexpr const char* label = "from_generator";
  static auto make(u64 bad) { return gen(N, bad); }
  static events oracle(u64 bad) { return gen_events(N, bad); }
  static std::vector<std::string> names() { return {"from_generator"}; }
};

struct case_filter {
  static constexpr const char* label = "filter";
  static auto make(u64 bad) { return gen(N, bad) | ferry::filter([](u64 x) { return x % 3 != 0; }); }
  static events oracle(u64 bad) {
    events out;
    for (const ev& e : gen_events(N, bad))
      if (e.error || e.v[0] % 3 != 0) out.push_back(e);
    return out;
  }
  static std::vector<std::string> names() { return {"from_generator", "filter"}; }
};

template <class Self, u64 K>
struct take_skip_oracles {
  static events take(u64 bad) {  // errors do not count toward K; none is seen after K values
    events out;
    u64 got = 0;
    for (const ev& e : gen_events(N, bad)) {
      if (got == K) break;
      out.push_back(e);
      if (!e.error) ++got;
    }
    return out;
  }
  static events skip(u64 bad) {  // errors do not count toward K and reach the consumer
    events out;
    u64 dropped = 0;
    for (const ev& e : gen_events(N, bad)) {
      if (!e.error && dropped < K) {
        ++dropped;
        continue;
      }
      out.push_back(e);
    }
    return out;
  }
};

struct case_take : take_skip_oracles<case_take, 20> {
  static constexpr const char* label = "take";
  static auto make(u64 bad) { return gen(N, bad) | ferry::take(20); }
  static events oracle(u64 bad) { return take(bad); }
  static std::vector<std::string> names() { return {"from_generator", "take"}; }
};

struct case_skip : take_skip_oracles<case_skip, 11> {
  static constexpr const char* label = "skip";
  static auto make(u64 bad) { return gen(N, bad) | ferry::skip(11); }
  static events oracle(u64 bad) { return skip(bad); }
  static std::vector<std::string> names() { return {"from_generator", "skip"}; }
};

struct case_shard {
  static constexpr const char* label = "shard";
  static auto make(u64 bad) { return gen(N, bad) | ferry::shard(3, 1); }
  static events oracle(u64 bad) {  // element k of the values goes to shard k % 3; errors to every shard
    events out;
    u64 k = 0;
    for (const ev& e : gen_events(N, bad))
      if (e.error || k++ % 3 == 1) out.push_back(e);
    return out;
  }
  static std::vector<std::string> names() { return {"from_generator", "shard"}; }
};

struct case_repeat {
  static constexpr const char* label = "repeat";
  static auto make(u64 bad) { return gen(N, bad) | ferry::repeat(2); }
  static events oracle(u64 bad) {
    events a = gen_events(N, bad), b = a;
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }
  static std::vector<std::string> names() { return {"from_generator", "repeat"}; }
};

// Windows of up to B values permuted by (seed, epoch, window); an error ends its window,
// which is handed out first, then the error.
struct case_shuffle {
  static constexpr const char* label = "shuffle";
  static constexpr u64 B = 8, seed = 5;
  static auto make(u64 bad) { return gen(N, bad) | ferry::shuffle(B, seed); }
  static events epoch(u64 bad, u64 e) {
    events out, in = gen_events(N, bad);
    std::vector<ev> win;
    u64 window = 0;
    auto flush = [&] {
      if (win.empty()) return;
      ferry::detail::splitmix64 g(ferry::detail::mix_seed({seed, e, window++}));
      ferry::detail::permute(win, g);
      out.insert(out.end(), win.begin(), win.end());
      win.clear();
    };
    for (const ev& x : in) {
      if (x.error) {
        flush();
        out.push_back(x);
        continue;
      }
      win.push_back(x);
      if (win.size() == B) flush();
    }
    flush();
    return out;
  }
  static events oracle(u64 bad) { return epoch(bad, 0); }
  static events epoch2(u64 bad) { return epoch(bad, 1); }
  static std::vector<std::string> names() { return {"from_generator", "shuffle"}; }
};

struct case_map_inline {
  static constexpr const char* label = "map inline";
  static auto make(u64 bad) { return gen(N, bad) | ferry::map([](u64 x) { return x * 2 + 1; }); }
  static events oracle(u64 bad) {
    events out = gen_events(N, bad);
    for (ev& e : out)
      if (!e.error) e.v[0] = e.v[0] * 2 + 1;
    return out;
  }
  static std::vector<std::string> names() { return {"from_generator", "map"}; }
};

struct case_map_workers : case_map_inline {
  static constexpr const char* label = "map with 3 workers";
  static auto make(u64 bad) {
    return gen(N, bad) | ferry::map([](u64 x) { return x * 2 + 1; }, {.workers = 3, .window = 8});
  }
};

// Not resumable exactly (save() refuses), and its order is the finishing order.
struct case_map_unordered : case_map_inline {
  static constexpr const char* label = "map unordered";
  static constexpr bool any_order = true;
  static constexpr bool resumable = false;
  static auto make(u64 bad) {
    return gen(N, bad) | ferry::map([](u64 x) { return x * 2 + 1; }, {.workers = 2, .ordered = false});
  }
};

struct case_flat_map {
  static constexpr const char* label = "flat_map";
  static auto make(u64 bad) {
    return gen(N, bad) | ferry::flat_map([](u64 x) { return std::vector<u64>(x % 3, x); });
  }
  static events oracle(u64 bad) {
    events out;
    for (const ev& e : gen_events(N, bad)) {
      if (e.error) {
        out.push_back(e);
        continue;
      }
      for (u64 j = 0; j < e.v[0] % 3; ++j) out.push_back(e);
    }
    return out;
  }
  static std::vector<std::string> names() { return {"from_generator", "flat_map"}; }
};

// Batches of 5; an error drops the batch being built and takes its place.
inline events batch_oracle(const events& in, std::size_t n) {
  events out;
  ev cur;
  for (const ev& e : in) {
    if (e.error) {
      cur.v.clear();
      out.push_back(e);
      continue;
    }
    cur.v.push_back(e.v[0]);
    if (cur.v.size() == n) {
      out.push_back(cur);
      cur.v.clear();
    }
  }
  if (!cur.v.empty()) out.push_back(cur);
  return out;
}

struct case_batch {
  static constexpr const char* label = "batch";
  static auto make(u64 bad) { return gen(N, bad) | ferry::batch(5); }
  static events oracle(u64 bad) { return batch_oracle(gen_events(N, bad), 5); }
  static std::vector<std::string> names() { return {"from_generator", "batch"}; }
};

// Element x becomes x % 3 copies of x, padded to each batch's longest row with 9; with a
// mask, each row's L mask values follow its L values.
events padded_oracle(u64 bad, bool mask) {
  events out;
  for (const ev& e : batch_oracle(gen_events(N, bad), 5)) {
    if (e.error) {
      out.push_back(e);
      continue;
    }
    u64 width = 0;
    for (u64 x : e.v) width = std::max(width, x % 3);
    ev p;
    for (u64 x : e.v) {
      p.v.push_back(x % 3);
      for (u64 j = 0; j < width; ++j) p.v.push_back(j < x % 3 ? x : 9);
      for (u64 j = 0; mask && j < width; ++j) p.v.push_back(j < x % 3 ? 1 : 0);
    }
    out.push_back(p);
  }
  return out;
}
auto copies_mod3(u64 bad) {
  return gen(N, bad) | ferry::map([](u64 x) { return std::vector<u64>(x % 3, x); });
}
struct case_padded_batch {
  static constexpr const char* label = "padded_batch";
  static auto make(u64 bad) { return copies_mod3(bad) | ferry::padded_batch(5, {.pad_value = 9}); }
  static events oracle(u64 bad) { return padded_oracle(bad, false); }
  static std::vector<std::string> names() { return {"from_generator", "map", "padded_batch"}; }
};
struct case_padded_batch_mask {
  static constexpr const char* label = "padded_batch with_mask";
  static auto make(u64 bad) { return copies_mod3(bad) | ferry::padded_batch(5, {.pad_value = 9}, ferry::with_mask); }
  static events oracle(u64 bad) { return padded_oracle(bad, true); }
  static std::vector<std::string> names() { return {"from_generator", "map", "padded_batch"}; }
};

// Element x becomes x % 5 copies of x, bucketed by that length into [0, 2), [2, 4), [4, inf)
// with batch sizes 3, 2, 4; rows padded with 0 to each batch's longest. An error arrives
// when its element is pulled; the buckets keep their rows.
struct case_bucket {
  static constexpr const char* label = "bucket_by_sequence_length";
  static auto make(u64 bad) {
    return gen(N, bad) | ferry::map([](u64 x) { return std::vector<u64>(x % 5, x); }) |
           ferry::bucket_by_sequence_length([](const std::vector<u64>& v) { return v.size(); }, {2, 4}, {3, 2, 4});
  }
  static events oracle(u64 bad) {
    const std::size_t size[3] = {3, 2, 4};
    std::vector<std::vector<u64>> held(3);
    std::vector<std::pair<std::size_t, u64>> first;  // (bucket, first row's index) of partial buckets
    events out;
    auto emit = [&](std::size_t b) {
      u64 width = 0;
      for (u64 x : held[b]) width = std::max(width, x % 5);
      ev p;
      for (u64 x : held[b]) {
        p.v.push_back(x % 5);
        for (u64 j = 0; j < width; ++j) p.v.push_back(j < x % 5 ? x : 0);
      }
      out.push_back(p);
      held[b].clear();
    };
    std::vector<u64> started(3, 0);
    u64 i = 0;
    for (const ev& e : gen_events(N, bad)) {
      const u64 idx = i++;
      if (e.error) {
        out.push_back(e);
        continue;
      }
      const u64 x = e.v[0], len = x % 5;
      const std::size_t b = len < 2 ? 0 : len < 4 ? 1 : 2;
      if (held[b].empty()) started[b] = idx;
      held[b].push_back(x);
      if (held[b].size() == size[b]) emit(b);
    }
    for (;;) {  // the partial buckets, oldest first
      std::size_t best = 3;
      for (std::size_t b = 0; b < 3; ++b)
        if (!held[b].empty() && (best == 3 || started[b] < started[best])) best = b;
      if (best == 3) break;
      emit(best);
    }
    return out;
  }
  static std::vector<std::string> names() { return {"from_generator", "map", "bucket_by_sequence_length"}; }
};

// Element x becomes x % 4 copies of x, packed into rows of 3 tokens, 2 rows a batch. An
// error drops the batch being built (no sequence is being split then: errors come with
// the pull of the next one).
struct case_pack {
  static constexpr const char* label = "pack";
  static constexpr std::size_t L = 3, n = 2;
  static auto make(u64 bad) {
    return gen(N, bad) | ferry::map([](u64 x) { return std::vector<u64>(x % 4, x); }) | ferry::pack(L, n);
  }
  static events oracle(u64 bad) {
    struct tok {
      u64 t, seg, pos;
    };
    events out;
    std::vector<std::vector<tok>> rows;
    std::vector<tok> row;
    u64 segment = 0;
    auto close_row = [&] {
      rows.push_back(row);
      row.clear();
      segment = 0;
    };
    auto emit = [&] {
      ev e;
      for (const auto& r : rows) {
        e.v.push_back(r.size());
        for (std::size_t j = 0; j < L; ++j) e.v.push_back(j < r.size() ? r[j].t : 0);
        for (std::size_t j = 0; j < L; ++j) e.v.push_back(j < r.size() ? r[j].seg : 0);
        for (std::size_t j = 0; j < L; ++j) e.v.push_back(j < r.size() ? r[j].pos : 0);
      }
      out.push_back(e);
      rows.clear();
    };
    for (const ev& e : gen_events(N, bad)) {
      if (e.error) {
        out.push_back(e);
        rows.clear(), row.clear(), segment = 0;
        continue;
      }
      bool started = false;
      u64 pos = 0;
      for (u64 k = 0; k < e.v[0] % 4; ++k) {
        if (!started) ++segment, pos = 0, started = true;
        row.push_back({e.v[0], segment, pos++});
        if (row.size() == L) {
          close_row();
          started = false;
          if (rows.size() == n) emit();
        }
      }
    }
    if (!row.empty()) close_row();
    if (!rows.empty()) emit();
    return out;
  }
  static std::vector<std::string> names() { return {"from_generator", "map", "pack"}; }
};

struct case_prefetch {
  static constexpr const char* label = "prefetch";
  static auto make(u64 bad) { return gen(N, bad) | ferry::prefetch(3); }
  static events oracle(u64 bad) { return gen_events(N, bad); }
  static std::vector<std::string> names() { return {"from_generator", "prefetch"}; }
};

// A pass with an error is handed on and not kept: every epoch reads the upstream again.
struct case_cache {
  static constexpr const char* label = "cache";
  static auto make(u64 bad) { return gen(N, bad) | ferry::cache(); }
  static events oracle(u64 bad) { return gen_events(N, bad); }
  static std::vector<std::string> names() { return {"from_generator", "cache"}; }
};

struct case_concatenate {
  static constexpr const char* label = "concatenate";
  static auto make(u64 bad) { return ferry::concatenate(gen(N, bad), gen(9, none, 1000)); }
  static events oracle(u64 bad) {
    events a = gen_events(N, bad), b = gen_events(9, none, 1000);
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }
  static std::vector<std::string> names() { return {"from_generator", "from_generator", "concatenate"}; }
};

// After an error zip cannot pair what follows: every later next() throws until rewind().
struct case_zip {
  static constexpr const char* label = "zip";
  static constexpr bool errors_end_epoch = true;
  static auto make(u64 bad) { return ferry::zip(gen(N, bad), gen(N, none, 1000)); }
  static events oracle(u64 bad) {
    events out;
    for (u64 i = 0; i < N; ++i) {
      if (i == bad) {
        out.push_back(err());
        return out;
      }
      out.push_back(ev{false, {gen_value(i), gen_value(i) + 1000}});
    }
    return out;
  }
  static std::vector<std::string> names() { return {"from_generator", "from_generator", "zip"}; }
};

// Draw d of epoch e picks the first active source whose cumulative weight exceeds
// u * total, u = sample_draw(mix_seed({seed, e}), d) (the documented rule).
struct case_sample_from {
  static constexpr const char* label = "sample_from";
  static constexpr u64 seed = 9;
  static auto make(u64 bad) {
    return ferry::sample_from({.weights = {2.0, 1.0}, .seed = seed}, gen(N, bad), gen(12, none, 1000));
  }
  static events epoch(u64 bad, u64 e) {
    events src[2] = {gen_events(N, bad), gen_events(12, none, 1000)};
    std::size_t at[2] = {0, 0};
    double w[2] = {2.0, 1.0};
    bool active[2] = {true, true};
    const u64 key = ferry::detail::mix_seed({seed, e});
    events out;
    for (u64 d = 0; active[0] || active[1]; ++d) {
      const double total = (active[0] ? w[0] : 0) + (active[1] ? w[1] : 0);
      const double x = ferry::detail::sample_draw(key, d) * total;
      const int i = active[0] && (!active[1] || x < w[0]) ? 0 : 1;
      if (at[i] == src[i].size())
        active[i] = false;
      else
        out.push_back(src[i][at[i]++]);
    }
    return out;
  }
  static events oracle(u64 bad) { return epoch(bad, 0); }
  static events epoch2(u64 bad) { return epoch(bad, 1); }
  static std::vector<std::string> names() { return {"from_generator", "from_generator", "sample_from"}; }
};

// Full batches of 6 split over 2 host replicas; the short last batch dropped.
struct case_distribute {
  static constexpr const char* label = "distribute";
  static auto make(u64 bad) {
    return gen(N, bad) | ferry::batch(6) | ferry::distribute(ferry::host_replicas{2});
  }
  static events oracle(u64 bad) {
    events out;
    for (const ev& e : batch_oracle(gen_events(N, bad), 6))
      if (e.error || e.v.size() == 6) out.push_back(e);
    return out;
  }
  static std::vector<std::string> names() { return {"from_generator", "batch", "distribute"}; }
};

// lockstep over one rank (a solo_communicator): distribute's steps, agreed one by one.
struct case_lockstep : case_distribute {
  static constexpr const char* label = "lockstep";
  static auto make(u64 bad) {
    static ferry::solo_communicator solo;
    return case_distribute::make(bad) | ferry::lockstep(solo, ferry::step_policy::pad);
  }
  static std::vector<std::string> names() { return {"from_generator", "batch", "distribute", "lockstep"}; }
};

// Files: three TFRecord files of byte records (errors in user code come from the other
// stages' cases; the file sources' own errors have their tests in tests/sources).
struct record_files {
  src_test::temp_dir dir;
  std::vector<std::string> paths;
  std::vector<std::vector<u64>> recs;  // in file order, each record's bytes
  record_files() {
    for (int f = 0; f < 3; ++f) {
      std::string out;
      for (int r = 0; r < 5 + 3 * f; ++r) {
        std::string payload(std::size_t(1 + (r * 7 + f) % 9), '\0');
        std::vector<u64> bytes;
        for (std::size_t j = 0; j < payload.size(); ++j) {
          payload[j] = char((f * 50 + r * 3 + int(j)) & 0xff);
          bytes.push_back(static_cast<unsigned char>(payload[j]));
        }
        out += src_test::tfrecord_of(payload);
        recs.push_back(bytes);
      }
      paths.push_back(dir / ("part-" + std::to_string(f) + ".tfrecord"));
      src_test::write_file(paths.back(), out);
    }
  }
};
record_files& files() {
  static record_files f;
  return f;
}

struct case_from_files {
  static constexpr const char* label = "from_files";
  static constexpr bool user_errors = false;
  static auto make(u64) { return ferry::from_files(files().paths, ferry::tfrecord{}); }
  static events oracle(u64) {
    events out;
    for (const auto& r : files().recs) out.push_back(ev{false, r});
    return out;
  }
  static std::vector<std::string> names() { return {"from_files"}; }
};

// WebDataset shards: a record is a sample, the bytes of its members (the writer's spans).
struct tar_files {
  src_test::temp_dir dir;
  std::vector<std::string> paths;
  std::vector<std::vector<u64>> samples;  // in file order, each sample's bytes
  tar_files() {
    for (int f = 0; f < 2; ++f) {
      src_test::tar_writer w;
      for (int k = 0; k < 4 + 2 * f; ++k) {
        const std::size_t from = w.out.size();
        const std::string key = "s" + std::to_string(f) + "/" + std::to_string(k);
        w.add(key + ".jpg", std::string(std::size_t(1 + (k * 131 + f) % 700), char('a' + k)));
        if (k % 2 == 0) w.add(key + ".cls", std::to_string(k));
        samples.emplace_back(w.out.begin() + std::ptrdiff_t(from), w.out.end());
      }
      w.end();
      paths.push_back(dir / ("part-" + std::to_string(f) + ".tar"));
      src_test::write_file(paths.back(), w.out);
    }
    for (auto& s : samples)
      for (auto& b : s) b &= 0xff;  // the bytes as flat() gives them
  }
};

struct case_webdataset {
  static constexpr const char* label = "from_files(webdataset)";
  static constexpr bool user_errors = false;
  static auto make(u64) {
    static tar_files f;
    files_ = &f;
    return ferry::from_files(f.paths, ferry::webdataset{}, {.chunk_bytes = 1024});
  }
  static events oracle(u64 bad) {
    make(bad);
    events out;
    for (const auto& s : files_->samples) out.push_back(ev{false, s});
    return out;
  }
  static std::vector<std::string> names() { return {"from_files"}; }
  static inline tar_files* files_ = nullptr;
};

// Slot s reads files s, s + cycle, ...; block records from each slot in turn.
struct case_interleave {
  static constexpr const char* label = "interleave";
  static constexpr bool user_errors = false;
  static auto make(u64) {
    return ferry::from_files(files().paths, ferry::tfrecord{}) | ferry::interleave(2, {.workers = 2, .block = 2});
  }
  static events oracle(u64) {
    const auto& f = files();
    std::vector<events> per_file(3);
    std::size_t k = 0;
    for (int i = 0; i < 3; ++i)
      for (int r = 0; r < 5 + 3 * i; ++r) per_file[std::size_t(i)].push_back(ev{false, f.recs[k++]});
    std::vector<events> slot(2);
    for (std::size_t i = 0; i < 3; ++i) slot[i % 2].insert(slot[i % 2].end(), per_file[i].begin(), per_file[i].end());
    events out;
    std::size_t pos[2] = {0, 0};
    for (std::size_t s = 0; pos[0] < slot[0].size() || pos[1] < slot[1].size(); s = (s + 1) % 2)
      for (int b = 0; b < 2 && pos[s] < slot[s].size(); ++b) out.push_back(slot[s][pos[s]++]);
    return out;
  }
  static std::vector<std::string> names() { return {"interleave"}; }
};


// tf.data's order: at its turn a slot takes up to `block` elements of its source; an empty
// slot opens the next upstream element's source (an upstream error keeps the turn).
template <std::size_t Workers>
struct case_interleave_fn {
  static constexpr const char* label = Workers ? "interleave(fn) with threads" : "interleave(fn)";
  static constexpr std::size_t cycle = 3, block = 2;
  static auto inner(u64 x) {
    return ferry::from_generator(x % 4, [x](u64 j) { return x * 100 + j; });
  }
  static auto make(u64 bad) {
    return gen(N, bad) | ferry::interleave([](u64 x) { return inner(x); },
                                           {.workers = Workers, .block = block, .buffer = 3, .cycle = cycle});
  }
  static events oracle(u64 bad) {
    const events input = gen_events(N, bad);
    std::size_t next_in = 0, cur = 0, taken = 0;
    std::vector<std::optional<events>> slots(cycle);
    events out;
    auto advance = [&] {
      taken = 0;
      cur = (cur + 1) % cycle;
    };
    for (;;) {
      if (slots[cur]) {
        if (!slots[cur]->empty()) {
          out.push_back(slots[cur]->front());
          slots[cur]->erase(slots[cur]->begin());
          if (++taken >= block) advance();
        } else {
          slots[cur].reset();
          advance();
        }
      } else if (next_in < input.size()) {
        const ev& x = input[next_in++];
        if (x.error) {
          out.push_back(x);
          continue;
        }
        events inner_events;
        for (u64 j = 0; j < x.v[0] % 4; ++j) inner_events.push_back(val(x.v[0] * 100 + j));
        slots[cur] = inner_events;
      } else {
        if (std::none_of(slots.begin(), slots.end(), [](const auto& o) { return o.has_value(); })) break;
        advance();
      }
    }
    return out;
  }
  static std::vector<std::string> names() { return {"from_generator", "interleave"}; }
};


// any_source: the held pipeline, type erased; every property goes through one virtual call.
struct case_any_source {
  static constexpr const char* label = "any_source";
  static ferry::any_source<u64> make(u64 bad) { return gen(N, bad) | ferry::filter([](u64 x) { return x % 3 != 0; }); }
  static events oracle(u64 bad) { return case_filter::oracle(bad); }
  static std::vector<std::string> names() { return {"from_generator", "filter"}; }
};

// ---- the properties ----------------------------------------------------------------------

template <class C>
constexpr bool resumable_case() {
  if constexpr (requires { C::resumable; })
    return C::resumable;
  else
    return true;
}
template <class C>
constexpr bool user_errors_case() {
  if constexpr (requires { C::user_errors; })
    return C::user_errors;
  else
    return true;
}
template <class C>
constexpr bool any_order_case() {
  if constexpr (requires { C::any_order; })
    return C::any_order;
  else
    return false;
}
template <class C>
constexpr bool errors_end_epoch_case() {
  if constexpr (requires { C::errors_end_epoch; })
    return C::errors_end_epoch;
  else
    return false;
}
template <class C>
events second_epoch(u64 bad) {
  if constexpr (requires { C::epoch2(bad); })
    return C::epoch2(bad);
  else
    return C::oracle(bad);
}

events sorted(events es) {
  std::sort(es.begin(), es.end(), [](const ev& a, const ev& b) { return std::tie(a.error, a.v) < std::tie(b.error, b.v); });
  return es;
}

// The failing indices tried: none, the first, one inside, the last.
std::vector<u64> bad_indices(bool user_errors) {
  if (!user_errors) return {none};
  return {none, 0, 13, N - 1};
}

template <class C>
void check_events(u64 bad) {
  auto p = C::make(bad);
  const events got = rest(p, errors_end_epoch_case<C>()), want = C::oracle(bad);
  if constexpr (any_order_case<C>())
    CHECK_MESSAGE(sorted(got) == sorted(want), describe(got) << " vs " << describe(want));
  else
    CHECK_MESSAGE(got == want, describe(got) << " vs " << describe(want));
}

template <class C>
void check_resume_everywhere(u64 bad) {
  constexpr bool stop = errors_end_epoch_case<C>();
  const events want = C::oracle(bad);
  for (std::size_t k = 0; k <= want.size(); ++k) {
    CAPTURE(k);
    auto p = C::make(bad);
    const events head = take_n(p, k);
    REQUIRE(head == events(want.begin(), want.begin() + static_cast<std::ptrdiff_t>(k)));
    if (stop && k > 0 && head.back().error) {  // out of step: no exact position to save
      CHECK_THROWS_AS(ferry::save_state(p), ferry::error);
      continue;
    }
    const std::string bytes = ferry::save_state(p).to_bytes();
    auto q = C::make(bad);
    ferry::restore_state(q, ferry::pipeline_state::from_bytes(bytes));
    const events tail = rest(q, stop);
    CHECK_MESSAGE(tail == events(want.begin() + static_cast<std::ptrdiff_t>(k), want.end()), describe(tail));
    CHECK(rest(p, stop) == tail);  // the one saved goes on the same way
  }
}

// A refused restore (a state one word short: the last stage's restore refuses part way,
// after some stages took their words; one word long: every stage took its words, then
// restore_state refuses) leaves the pipeline marked: next() and save_state() throw
// config_error, not an epoch that is neither the state's nor a fresh one's; rewind() gives
// the next epoch whole; a good restore then goes on exactly.
template <class C>
void check_refused_restore(u64 bad) {
  constexpr bool stop = errors_end_epoch_case<C>();
  const events want = C::oracle(bad);
  for (std::size_t k : {std::size_t(0), std::size_t(1), want.size() / 2, want.size()}) {
    CAPTURE(k);
    auto p = C::make(bad);
    const events head = take_n(p, k);
    if (stop && k > 0 && head.back().error) continue;  // no exact position to save
    const ferry::pipeline_state good = ferry::save_state(p);
    ferry::pipeline_state shorter = good, longer = good;
    shorter.words.pop_back();
    longer.words.push_back(0);
    for (const ferry::pipeline_state* refused : {&shorter, &longer}) {
      INFO((refused == &shorter ? "a state one word short" : "a state one word long"));
      auto q = C::make(bad);
      CHECK_THROWS_AS(ferry::restore_state(q, *refused), ferry::config_error);
      CHECK_THROWS_WITH_AS(q.next(), doctest::Contains("a restore or rewind() of this pipeline failed part way"),
                           ferry::config_error);
      CHECK_THROWS_AS(ferry::save_state(q), ferry::config_error);
      // A good restore after the refused one: exact.
      ferry::restore_state(q, good);
      const events tail = rest(q, stop);
      CHECK_MESSAGE(tail == events(want.begin() + static_cast<std::ptrdiff_t>(k), want.end()), describe(tail));
      if constexpr (requires { q.rewind(); }) {
        // Refused again, then rewound: the next epoch, whole, as a fresh pipeline's.
        auto r = C::make(bad);
        CHECK_THROWS_AS(ferry::restore_state(r, *refused), ferry::config_error);
        CHECK_THROWS_AS(r.next(), ferry::config_error);
        r.rewind();
        const events got = rest(r, stop), second = second_epoch<C>(bad);
        if constexpr (any_order_case<C>())
          CHECK(sorted(got) == sorted(second));
        else
          CHECK_MESSAGE(got == second, describe(got) << " vs " << describe(second));
      }
    }
  }
}

template <class C>
void check_rewind(u64 bad) {
  const events first = C::oracle(bad), second = second_epoch<C>(bad);
  for (std::size_t k : {std::size_t(0), first.size() / 2, first.size()}) {
    CAPTURE(k);
    auto p = C::make(bad);
    take_n(p, k);
    p.rewind();
    const events got = rest(p, errors_end_epoch_case<C>());
    if constexpr (any_order_case<C>())
      CHECK(sorted(got) == sorted(second));
    else
      CHECK_MESSAGE(got == second, describe(got) << " vs " << describe(second));
  }
}

template <class C>
void check_move(u64 bad) {
  const events want = C::oracle(bad);
  std::size_t k = want.size() / 2;
  if (errors_end_epoch_case<C>())  // moved before its error: after one it only throws
    for (std::size_t i = 0; i < k; ++i)
      if (want[i].error) k = i;
  auto p = C::make(bad);
  const events head = take_n(p, k);
  auto q = std::move(p);
  events all = head;
  const events tail = rest(q, errors_end_epoch_case<C>());
  all.insert(all.end(), tail.begin(), tail.end());
  if constexpr (any_order_case<C>())
    CHECK(sorted(all) == sorted(want));
  else
    CHECK_MESSAGE(all == want, describe(all));
  CHECK_THROWS_AS(p.next(), ferry::config_error);  // NOLINT(bugprone-use-after-move): the point
  // Handed on, the moved-from one is refused where it is handed over (a stage reading it
  // does not ask again: it gave an empty epoch, or crashed for a threaded one).
  if constexpr (requires { p.live(); }) {
    CHECK(!p.live());  // NOLINT(bugprone-use-after-move)
    CHECK_THROWS_AS(std::move(p) | ferry::take(1), ferry::config_error);  // NOLINT(bugprone-use-after-move)
    CHECK_THROWS_AS(ferry::any_source<ferry::value_t<decltype(p)>>(std::move(p)), ferry::config_error);
  }
}

template <class C>
void check_destroy_mid_epoch() {
  for (std::size_t k : {0, 1, 5}) {
    auto p = std::make_optional(C::make(none));
    take_n(*p, k);
    const auto t0 = std::chrono::steady_clock::now();
    p.reset();
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK_MESSAGE(took < 2.0, "destruction took " << took << " s");
  }
}

template <class C>
void check_report() {
  ferry::enable_stats(true);
  struct off {
    ~off() { ferry::enable_stats(false); }
  } guard;
  auto p = C::make(none);
  rest(p, errors_end_epoch_case<C>());
  std::vector<std::string> kinds;
  for (const auto& s : ferry::report(p).stages) kinds.push_back(s.kind);
  CHECK(kinds == C::names());
}

// batch(4) | <the stage, over batches> | distribute: the batch size reaches distribute
// through a stage that keeps batches whole, so a short first batch is never taken for it.
template <class Stage>
void check_batch_size_reaches_distribute(const char* label, Stage stage) {
  INFO("stage: " << label);
  auto p = gen(10) | ferry::batch(4) | stage;
  static_assert(ferry::sized_batches<decltype(p)>, "this stage keeps batches whole: it must say their size");
  CHECK(p.batch_size() == 4);
  auto d = std::move(p) | ferry::distribute(ferry::host_replicas{2}, {.remainder = ferry::remainder_policy::pad});
  std::size_t steps = 0;
  while (auto s = d.next()) {
    CHECK(s->global_size() == 4);
    ++steps;
  }
  CHECK(steps >= 1);
  CHECK(d.global_batch() == 4);
}

template <class C>
void conform() {
  INFO("case: " << C::label);
  ferry_test::watchdog w(120s, C::label);
  for (u64 bad : bad_indices(user_errors_case<C>())) {
    CAPTURE(bad);
    check_events<C>(bad);
    if constexpr (requires(decltype(C::make(bad)) p) { p.rewind(); }) check_rewind<C>(bad);
    if constexpr (resumable_case<C>()) {
      check_resume_everywhere<C>(bad);
      check_refused_restore<C>(bad);
    } else {
      auto p = C::make(bad);
      take_n(p, 3);
      CHECK_THROWS_AS(ferry::save_state(p), ferry::config_error);
    }
    check_move<C>(bad);
  }
  check_destroy_mid_epoch<C>();
  check_report<C>();
}

}  // namespace

TEST_CASE_TEMPLATE("conformance: every stage and source" * doctest::timeout(300), C,
                   case_from_range, case_from_generator, case_filter, case_take, case_skip, case_shard,
                   case_repeat, case_shuffle, case_map_inline, case_map_workers, case_map_unordered,
                   case_flat_map, case_batch, case_padded_batch, case_padded_batch_mask, case_bucket, case_pack, case_prefetch, case_cache, case_concatenate, case_zip,
                   case_sample_from, case_distribute, case_lockstep, case_from_files, case_webdataset, case_interleave,
                   case_interleave_fn<0>, case_interleave_fn<2>, case_any_source) {
  conform<C>();
}

TEST_CASE("conformance: batch_size() reaches distribute through every stage that keeps batches whole" *
          doctest::timeout(60)) {
  ferry_test::watchdog w(60s);
  check_batch_size_reaches_distribute("filter", ferry::filter([](const ferry::batch_of<u64>&) { return true; }));
  check_batch_size_reaches_distribute("take", ferry::take(100));
  check_batch_size_reaches_distribute("skip", ferry::skip(0));
  check_batch_size_reaches_distribute("shard", ferry::shard(1, 0));
  check_batch_size_reaches_distribute("repeat", ferry::repeat(2));
  check_batch_size_reaches_distribute("shuffle", ferry::shuffle(4, 1));  // the short batch may come first
  check_batch_size_reaches_distribute("prefetch", ferry::prefetch(2));
  // concatenate: both sides' common size.
  auto c = ferry::concatenate(gen(10) | ferry::batch(4), gen(7) | ferry::batch(4));
  CHECK(c.batch_size() == 4);
  auto d = ferry::concatenate(gen(10) | ferry::batch(4), gen(7) | ferry::batch(5));
  CHECK(d.batch_size() == 0);  // differing sizes: unknown, distribute infers it
}
