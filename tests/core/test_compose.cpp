// Compositions: random chains of 2-6 stages over a generated source, each checked against a
// composed naive oracle (test_conformance checks each stage alone; interaction bugs live in
// chains: a restore through stacked stages, a threaded stage under a shuffling or batching
// one, take/skip/repeat around shuffle, user errors travelling through several stages).
//
// A pipeline is drawn from a seed (deterministic): a from_generator source of n elements
// (whose function may throw at chosen indices), then stages chosen at run time and joined
// through any_source (the public type erasure), plus a few fixed chains built with their
// stage types stacked directly. Each is checked for:
//   1. its first and second epoch against the oracle (errors as events at their place);
//   2. exact resume: save_state at a random position (epoch 0, or epoch 1 after a
//      mid-epoch rewind), pipeline_state bytes restored into a freshly built identical
//      pipeline; the rest equals the uninterrupted run's rest, and the saved one goes on
//      the same way;
//   3. rewind() mid-epoch giving the epoch a fresh pipeline's next epoch gives (where that is
//      a contract: see rewind_point_free), and the oracle's.
// Every case runs under a watchdog and doctest::timeout (map workers, prefetch and
// interleave threads are among the stages drawn).
//
// Shuffle: design.md promises determinism per (seed, epoch), not a permutation, and the
// conformance suite checks the permutation of one shuffle alone. Here the oracle knows only
// what shuffle.hpp's top documents: windows of `buffer` elements, cut short by an error,
// each handed out in some order. So the oracle's events come in groups: a group's positions
// hold its events in any order (checked as multisets). A later stage whose result depends
// on the order inside a group (a take that cuts a window, a batch that spans part of one, a
// shard, an interleave) makes the oracle give up on that pipeline ("inexact"): only the
// exact resume and rewind properties (which compare pipelines with pipelines) are checked.
// The parameters are drawn so that most pipelines stay exact (batch and take sizes that are
// multiples of the shuffle's window); the count is printed.
//
// Joins and ragged tails (the cases at the end, seeds printed as "<what> seed <n>"):
// concatenate(a, b), zip(a, b) (sides cut to one length, without errors: zip's sticky
// error has its own case) and sample_from(a, b[, c]) of short random chains over their own
// generators, under a random outer chain; the oracle is epoch-aware, since sample_from's
// order is documented per (seed, epoch): its draws are recomputed from sample_from.hpp's
// formula (SplitMix64 over mix_seed({seed, epoch}), 53 bits, a draw meeting an end used
// up), and a repeat(n) above plays epochs e*n ... e*n+n-1. Ragged tails: a random chain,
// x -> x%a values x*8+j, then padded_batch, pack or bucket_by_sequence_length, then take,
// skip, shuffle or prefetch of the batches, flattened (L, rows, lengths, padded rows; pack:
// rows, L, then each row's length, tokens, segment ids, positions). Their oracles follow
// the headers (batch()'s grouping, pack's cut into rows of L, a bucket's batch when full,
// overdue after max_wait rows, the partial ones oldest first at the end); where the order
// is not known (a shuffled group upstream) each batch is still checked for the documented
// invariants (L, padding, row contents, bucket bounds and sizes, segment ids and
// positions) and, without errors or drops, the epoch's tokens as a multiset.
//
// Reproduce one pipeline: FERRY_COMPOSE_SEED=<seed> ./test_compose (its description is
// printed on any failure).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/doubles.hpp"
#include "ferry/any_source.hpp"
#include "ferry/ferry.hpp"
#include "ferry/stages/interleave.hpp"

namespace {

using u64 = std::uint64_t;
using batch_t = ferry::batch_of<u64>;
using namespace std::chrono_literals;

// ---- events ------------------------------------------------------------------------------

// One thing a pipeline hands out: an element (flattened to numbers) or an error. `bag`
// (oracle side only): the numbers' order is unknown (a batch of shuffled elements); v is
// then kept sorted.
struct ev {
  bool error = false;
  std::vector<u64> v;
  bool bag = false;
  std::string what;  // an error's message (not compared: see lost_context)
};
bool operator==(const ev& a, const ev& b) { return a.error == b.error && a.v == b.v; }
using events = std::vector<ev>;

ev val(u64 x) { return ev{false, {x}, false, {}}; }
ev err() { return ev{true, {}, false, {}}; }

std::string describe(const events& es, std::size_t max = 80) {
  std::string s = "[";
  for (std::size_t i = 0; i < es.size() && i < max; ++i) {
    if (es[i].error) {
      s += "E ";
      continue;
    }
    if (es[i].v.size() == 1) {
      s += std::to_string(es[i].v[0]) + " ";
      continue;
    }
    s += "(";
    for (u64 x : es[i].v) s += std::to_string(x) + " ";
    s += ") ";
  }
  if (es.size() > max) s += "... (" + std::to_string(es.size()) + " events)";
  return s + "]";
}

std::vector<u64> flat(u64 x) { return {x}; }
std::vector<u64> flat(const batch_t& b) {
  auto f = b.field<0>();
  return {f.begin(), f.end()};
}
std::vector<u64> flat(const std::vector<u64>& v) { return v; }

template <class P>
std::optional<ev> pull(P& p) {
  try {
    auto e = p.next();
    if (!e) return std::nullopt;
    return ev{false, flat(*e), false, {}};
  } catch (const ferry::config_error&) {
    throw;  // a misuse or a refused state, never data: the test fails
  } catch (const std::exception& e) {
    ev x = err();
    x.what = e.what();
    return x;
  }
}

// Every error here comes from user code (the generator's or a stage's function, all of
// whose messages say "failed at"): one whose message lost that (replaced on its way
// through the stages) is counted.
std::size_t lost_context(const events& es) {
  std::size_t n = 0;
  for (const ev& e : es) n += e.error && e.what.find("failed at") == std::string::npos;
  return n;
}
template <class P>
events rest(P& p, std::size_t cap = 50000) {
  events out;
  while (out.size() < cap)
    if (auto e = pull(p))
      out.push_back(std::move(*e));
    else
      break;
  return out;
}
template <class P>
events take_n(P& p, std::size_t k) {
  events out;
  for (std::size_t i = 0; i < k; ++i)
    if (auto e = pull(p))
      out.push_back(std::move(*e));
    else
      break;
  return out;
}
events slice(const events& e, std::size_t b, std::size_t end) {
  b = std::min(b, e.size());
  end = std::min(end, e.size());
  return events(e.begin() + static_cast<std::ptrdiff_t>(b), e.begin() + static_cast<std::ptrdiff_t>(end));
}

// ---- drawing pipelines -------------------------------------------------------------------

struct rng {
  u64 s;
  u64 next() {  // SplitMix64
    u64 z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  u64 below(u64 n) { return n == 0 ? 0 : next() % n; }
  bool chance(u64 num, u64 den) { return below(den) < num; }
  template <class T>
  T pick(std::initializer_list<T> l) {
    return *(l.begin() + static_cast<std::ptrdiff_t>(below(l.size())));
  }
};

// The stages drawn. Over elements (u64): all but bfilter and unbatch; over batches
// (batch_of<u64>): take, skip, repeat, shuffle, prefetch, bfilter, unbatch (cache() in
// memory needs copyable elements; a batch is not).
enum class kind { map, map_workers, filter, flat_map, take, skip, repeat, shuffle, prefetch, cache, shard, interleave, batch, bfilter, unbatch };

struct spec {
  kind k;
  u64 a = 0, b = 0, c = 0;
  u64 fail_mod = 0, fail_rem = 0;  // user code throws on x % fail_mod == fail_rem (0: never)
  bool fails(u64 x) const { return fail_mod != 0 && x % fail_mod == fail_rem; }
  std::string text() const {
    auto n = [](u64 x) { return std::to_string(x); };
    std::string f = fail_mod ? ", throws at x%" + n(fail_mod) + "==" + n(fail_rem) : "";
    switch (k) {
      case kind::map: return "map(x*2+" + n(a) + f + ")";
      case kind::map_workers: return "map(x*2+" + n(a) + f + ", {.workers=" + n(b) + ", .window=" + n(c) + "})";
      case kind::filter: return "filter(x%" + n(a) + "!=" + n(b) + f + ")";
      case kind::flat_map: return "flat_map(x -> x*3+j for j<x%" + n(a) + f + ")";
      case kind::take: return "take(" + n(a) + ")";
      case kind::skip: return "skip(" + n(a) + ")";
      case kind::repeat: return "repeat(" + n(a) + ")";
      case kind::shuffle: return "shuffle(" + n(a) + ", " + n(b) + ")";
      case kind::prefetch: return "prefetch(" + n(a) + ")";
      case kind::cache: return "cache()";
      case kind::shard: return "shard(" + n(a) + ", " + n(b) + ")";
      case kind::interleave:
        return "interleave(x -> x%4 elements x*100+j, {.workers=" + n(a) + ", .block=" + n(b) + ", .buffer=3, .cycle=" +
               n(c) + "})";
      case kind::batch: return "batch(" + n(a) + (b ? ", {.drop_remainder=true}" : "") + ")";
      case kind::bfilter: return "filter(batch: sum%3!=" + n(a) + ")";
      case kind::unbatch: return "flat_map(batch -> its elements)";
    }
    return "?";
  }
};

// Joins (the pipeline's source is two or three side chains joined) and ragged tails (the
// chain's elements made into vectors, then padded_batch, pack or bucket_by_sequence_length,
// then a few stages over its batches).
enum class join_kind { none, concatenate, zip, sample_from };
enum class ragged_kind { none, padded_batch, pack, bucket };

struct ragged_spec {
  ragged_kind k = ragged_kind::none;
  spec to_vec{kind::map};  // x -> x % a values x*8+j (a in 2..8), throwing as to_vec.fails
  u64 n = 1, L = 0, multiple_of = 1, pad = 0, max_wait = 0;
  bool truncate = false, drop = false, to_boundary = false;
  std::vector<std::size_t> bounds, sizes;
  std::vector<spec> post;  // take, skip, shuffle, prefetch over its batches
  std::string text() const {
    auto n_ = [](u64 x) { return std::to_string(x); };
    std::string s = " | map(x -> x%" + n_(to_vec.a) + " values x*8+j" +
                    (to_vec.fail_mod ? ", throws at x%" + n_(to_vec.fail_mod) + "==" + n_(to_vec.fail_rem) : "") + ")";
    std::string d = drop ? ", .drop_remainder=true" : "";
    switch (k) {
      case ragged_kind::none: return "";
      case ragged_kind::padded_batch:
        s += " | padded_batch(" + n_(n) + ", {.length=" + (L ? n_(L) : "longest_row") + ", .multiple_of=" + n_(multiple_of) +
             (truncate ? ", .truncate=true" : "") + ", .pad_value=" + n_(pad) + d + "})";
        break;
      case ragged_kind::pack: s += " | pack(" + n_(L) + ", " + n_(n) + ", {.pad_value=" + n_(pad) + d + "})"; break;
      case ragged_kind::bucket: {
        std::string b, z;
        for (auto x : bounds) b += n_(x) + " ";
        for (auto x : sizes) z += n_(x) + " ";
        s += " | bucket_by_sequence_length(size, {" + b + "}, {" + z + "}, {" + (to_boundary ? ".pad_to_bucket_boundary=true, " : "") +
             ".multiple_of=" + n_(multiple_of) + ", .pad_value=" + n_(pad) + d + ", .max_wait=" + n_(max_wait) + "})";
        break;
      }
    }
    for (const spec& st : post) s += " | " + st.text();
    return s;
  }
};

struct pipeline_spec {
  u64 n = 0;
  u64 offset = 0;        // the generator's numbers: i*7+3+offset
  std::vector<u64> bad;  // from_generator's function throws at these indices
  join_kind join = join_kind::none;  // not none: the source is this join of `sides`
  std::vector<pipeline_spec> sides;  // each a chain over its own generator, ending on elements
  std::vector<double> weights;       // sample_from's (empty: equal)
  u64 mix = 0;                       // sample_from's seed
  bool stop_on_empty = false;
  std::vector<spec> stages;
  ragged_spec ragged;
  std::string text() const {
    std::string s;
    if (join == join_kind::none) {
      s = "from_generator(" + std::to_string(n) + ", i*7+3+" + std::to_string(offset);
      if (!bad.empty()) {
        s += ", throws at i in {";
        for (u64 b : bad) s += std::to_string(b) + " ";
        s += "}";
      }
      s += ")";
    } else {
      s = join == join_kind::concatenate ? "concatenate(" : join == join_kind::zip ? "zip(" : "sample_from({.weights={";
      if (join == join_kind::sample_from) {
        for (double w : weights) s += std::to_string(w) + " ";
        s += "}, .seed=" + std::to_string(mix) + (stop_on_empty ? ", .stop_on_empty=true" : "") + "}, ";
      }
      for (std::size_t i = 0; i < sides.size(); ++i) s += (i ? ", " : "") + sides[i].text();
      s += ")";
      if (join == join_kind::zip) s += " | map((a, b) -> a*4096+b)";
    }
    for (const spec& st : stages) s += " | " + st.text();
    return s + ragged.text();
  }
};

bool batch_lane_after(const std::vector<spec>& st) {
  bool batched = false;
  for (const spec& s : st)
    if (s.k == kind::batch)
      batched = true;
    else if (s.k == kind::unbatch)
      batched = false;
  return batched;
}

// The parameters of one stage of kind k, given the stages before it.
spec draw_params(rng& r, kind k, const std::vector<spec>& before) {
  spec s{k};
  u64 window = 0;  // the last shuffle's buffer, to draw aligned sizes
  for (const spec& b : before)
    if (b.k == kind::shuffle) window = b.a;
  auto maybe_fail = [&] {
    if (r.chance(1, 4)) {
      s.fail_mod = 5 + r.below(8);
      s.fail_rem = r.below(s.fail_mod);
    }
  };
  auto count = [&] {
    if (window > 0 && r.chance(1, 2)) return window * r.below(5);
    return r.below(40);
  };
  switch (k) {
    case kind::map: s.a = r.below(5), maybe_fail(); break;
    case kind::map_workers: s.a = r.below(5), s.b = 1 + r.below(3), s.c = 1 + r.below(16), maybe_fail(); break;
    case kind::filter: s.a = 2 + r.below(3), s.b = r.below(s.a), maybe_fail(); break;
    case kind::flat_map: s.a = 2 + r.below(3), maybe_fail(); break;
    case kind::take:
    case kind::skip: s.a = count(); break;
    case kind::repeat: s.a = 1 + r.below(3); break;
    case kind::shuffle: s.a = r.pick<u64>({1, 2, 3, 4, 4, 8, 8, 16}), s.b = r.below(1000); break;
    case kind::prefetch: s.a = 1 + r.below(3); break;
    case kind::cache: break;
    case kind::shard: s.a = 1 + r.below(3), s.b = r.below(s.a); break;
    case kind::interleave: s.a = r.pick<u64>({0, 2}), s.b = 1 + r.below(2), s.c = 1 + r.below(3); break;
    case kind::batch:
      s.a = window > 0 && r.chance(2, 3) ? window * r.pick<u64>({1, 1, 2}) : r.pick<u64>({1, 2, 3, 4, 8});
      s.b = r.chance(1, 4);
      break;
    case kind::bfilter: s.a = r.below(3); break;
    case kind::unbatch: break;
  }
  return s;
}

struct draw_opts {
  bool errors = true, shuffle = true, cache = true;
};
void draw_stages(rng& r, pipeline_spec& p, u64 len, draw_opts d = {}) {
  u64 repeat_product = 1, interleaves = 0;
  while (p.stages.size() < len) {
    const bool batched = batch_lane_after(p.stages);
    kind k = batched ? r.pick({kind::take, kind::skip, kind::repeat, kind::shuffle, kind::prefetch, kind::bfilter,
                               kind::unbatch, kind::unbatch})
                     : r.pick({kind::map, kind::map_workers, kind::map_workers, kind::filter, kind::flat_map, kind::take,
                               kind::skip, kind::repeat, kind::shuffle, kind::shuffle, kind::prefetch, kind::prefetch,
                               kind::cache, kind::shard, kind::interleave, kind::batch, kind::batch});
    if (k == kind::interleave && interleaves++ > 0) continue;
    if ((k == kind::shuffle && !d.shuffle) || (k == kind::cache && !d.cache)) continue;
    spec s = draw_params(r, k, p.stages);
    if (!d.errors) s.fail_mod = 0;
    if (k == kind::repeat) {
      if (repeat_product * s.a > 4) continue;
      repeat_product *= s.a;
    }
    p.stages.push_back(s);
  }
}

pipeline_spec draw(u64 seed) {
  rng r{seed * 0x2545f4914f6cdd1dull + 17};
  pipeline_spec p;
  p.n = r.below(65);
  if (p.n > 0 && r.chance(1, 2))
    for (u64 i = 0, m = 1 + r.below(2); i < m; ++i) p.bad.push_back(r.below(p.n));
  draw_stages(r, p, 2 + r.below(5));
  return p;
}

// The sides of a join: short chains over their own generators (offsets apart), ending on
// elements. zip's: no errors and no shuffle, then each cut to the shorter one's length by
// a take (zip of unequal lengths is an error that sticks: zip.hpp), which
// finish_zip() adds once the oracle is defined.
pipeline_spec draw_side(rng& r, u64 offset, draw_opts d) {
  pipeline_spec p;
  p.n = r.below(33);
  p.offset = offset;
  if (d.errors && p.n > 0 && r.chance(1, 3)) p.bad.push_back(r.below(p.n));
  draw_stages(r, p, r.below(4), d);
  if (batch_lane_after(p.stages)) p.stages.push_back(spec{kind::unbatch});
  return p;
}

pipeline_spec draw_join(u64 seed, join_kind j) {
  rng r{seed * 0x9e3779b97f4a7c15ull + 1234567};
  pipeline_spec p;
  p.join = j;
  const std::size_t sides = j == join_kind::sample_from ? 2 + r.below(2) : 2;
  draw_opts d;
  if (j == join_kind::zip) d.errors = false, d.shuffle = false;
  if (j == join_kind::sample_from) d.shuffle = r.chance(1, 4);  // a shuffled side: no exact oracle
  for (std::size_t i = 0; i < sides; ++i) p.sides.push_back(draw_side(r, 500 * i, d));
  if (j == join_kind::sample_from) {
    if (r.chance(2, 3)) {
      for (std::size_t i = 0; i < sides; ++i) p.weights.push_back(r.pick<double>({0, 0.25, 1, 1, 2, 3.5}));
      if (std::all_of(p.weights.begin(), p.weights.end(), [](double w) { return w == 0; })) p.weights[0] = 1;
    }
    p.mix = r.below(1000);
    p.stop_on_empty = r.chance(1, 4);
  }
  // The outer chain: no cache over a sample_from (its epochs differ; a cache replays one).
  draw_stages(r, p, r.below(5), {.errors = true, .shuffle = true, .cache = j != join_kind::sample_from});
  return p;
}

pipeline_spec draw_ragged(u64 seed, ragged_kind k) {
  rng r{seed * 0xd1342543de82ef95ull + 99};
  pipeline_spec p;
  p.n = r.below(49);
  if (p.n > 0 && r.chance(1, 3)) p.bad.push_back(r.below(p.n));
  draw_stages(r, p, r.below(4), {.errors = true, .shuffle = r.chance(1, 3), .cache = true});
  if (batch_lane_after(p.stages)) p.stages.push_back(spec{kind::unbatch});
  ragged_spec& g = p.ragged;
  g.k = k;
  g.to_vec.a = 2 + r.below(7);
  if (r.chance(1, 5)) g.to_vec.fail_mod = 5 + r.below(8), g.to_vec.fail_rem = r.below(g.to_vec.fail_mod);
  g.pad = r.chance(1, 2) ? 0 : 1 + r.below(1000);
  g.drop = r.chance(1, 4);
  switch (k) {
    case ragged_kind::none: break;
    case ragged_kind::padded_batch:
      g.n = 1 + r.below(5);
      if (r.chance(1, 3)) {
        g.L = 1 + r.below(7);
        g.truncate = g.L < g.to_vec.a - 1 || r.chance(1, 2);  // else a longer row is a config_error
      } else {
        g.multiple_of = 1 + r.below(3);
      }
      break;
    case ragged_kind::pack:
      g.L = 1 + r.below(8);
      g.n = 1 + r.below(4);
      break;
    case ragged_kind::bucket:
      for (std::size_t b = 1 + r.below(3), at = 0; g.bounds.size() < b;) g.bounds.push_back(at += 1 + r.below(3));
      for (std::size_t i = 0; i <= g.bounds.size(); ++i) g.sizes.push_back(1 + r.below(4));
      g.to_boundary = r.chance(1, 3);
      g.multiple_of = 1 + r.below(3);
      g.max_wait = r.chance(1, 2) ? 0 : 1 + r.below(10);
      break;
  }
  for (u64 i = 0, m = r.below(3); i < m; ++i) {
    spec s{r.pick({kind::take, kind::skip, kind::shuffle, kind::prefetch})};
    s.a = s.k == kind::shuffle ? 1 + r.below(4) : s.k == kind::prefetch ? 1 + r.below(2) : r.below(7);
    s.b = r.below(1000);
    g.post.push_back(s);
  }
  return p;
}

// ---- user functions (fixed types, parameters captured) -----------------------------------

struct user_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct gen_fn {
  std::vector<u64> bad;
  u64 operator()(u64 i) const {
    if (std::find(bad.begin(), bad.end(), i) != bad.end()) throw user_error("generator failed at " + std::to_string(i));
    return i * 7 + 3 + offset;
  }
  u64 offset = 0;
};
struct map_fn {
  spec s;
  u64 operator()(u64 x) const {
    if (s.fails(x)) throw user_error("map failed at " + std::to_string(x));
    return x * 2 + s.a;
  }
};
struct filter_fn {
  spec s;
  bool operator()(u64 x) const {
    if (s.fails(x)) throw user_error("filter failed at " + std::to_string(x));
    return x % s.a != s.b;
  }
};
struct flat_fn {
  spec s;
  std::vector<u64> operator()(u64 x) const {
    if (s.fails(x)) throw user_error("flat_map failed at " + std::to_string(x));
    std::vector<u64> out;
    for (u64 j = 0; j < x % s.a; ++j) out.push_back(x * 3 + j);
    return out;
  }
};
struct inner_fn {
  u64 x;
  u64 operator()(u64 j) const { return x * 100 + j; }
};
struct interleave_fn {
  auto operator()(u64 x) const { return ferry::from_generator(x % 4, inner_fn{x}); }
};
u64 sum(const std::vector<u64>& v) {
  u64 s = 0;
  for (u64 x : v) s += x;
  return s;
}
struct bfilter_fn {
  spec s;
  bool operator()(const batch_t& b) const { return sum(flat(b)) % 3 != s.a; }
};
struct unbatch_fn {
  std::vector<u64> operator()(const batch_t& b) const { return flat(b); }
};
struct zip_fn {
  u64 operator()(const std::pair<u64, u64>& ab) const { return ab.first * 4096 + ab.second; }
};
struct vec_fn {  // a ragged tail's elements: x % a values x*8+j (so every row names its x)
  spec s;
  std::vector<u64> operator()(u64 x) const {
    if (s.fails(x)) throw user_error("to_vec failed at " + std::to_string(x));
    std::vector<u64> v;
    for (u64 j = 0; j < x % s.a; ++j) v.push_back(x * 8 + j);
    return v;
  }
};
struct len_fn {
  std::size_t operator()(const std::vector<u64>& v) const { return v.size(); }
};

using vec_src = ferry::any_source<std::vector<u64>>;
using padded_b = typename decltype(std::declval<vec_src>() | ferry::padded_batch(1))::value_type;
using pack_b = typename decltype(std::declval<vec_src>() | ferry::pack(1, 1))::value_type;
using bucket_b =
    typename decltype(std::declval<vec_src>() | ferry::bucket_by_sequence_length(len_fn{}, {1}, {1, 1}))::value_type;

// A padded batch as numbers: L, rows, each row's length, then the rows (L values each).
std::vector<u64> flat_padded(const ferry::padded_view<u64>& t) {
  std::vector<u64> v{t.width, t.size()};
  v.insert(v.end(), t.lengths.begin(), t.lengths.end());
  v.insert(v.end(), t.values.begin(), t.values.end());
  if (t.values.size() != t.width * t.size()) v.push_back(~u64{0});  // (never a row's value)
  return v;
}
// pack's batch: rows, L, then per row its length, its L tokens, segment ids, positions.
std::vector<u64> flat_pack(const pack_b& b) {
  auto tok = b.field<0>();
  auto seg = b.field<1>();
  auto pos = b.field<2>();
  std::vector<u64> v{tok.size(), tok.width};
  const bool same = seg.size() == tok.size() && pos.size() == tok.size() && seg.width == tok.width &&
                    pos.width == tok.width && std::equal(tok.lengths.begin(), tok.lengths.end(), seg.lengths.begin()) &&
                    std::equal(tok.lengths.begin(), tok.lengths.end(), pos.lengths.begin());
  if (!same) return {~u64{0}};
  for (std::size_t i = 0; i < tok.size(); ++i) {
    v.push_back(tok.lengths[i]);
    for (auto x : tok[i]) v.push_back(x);
    for (auto x : seg[i]) v.push_back(x);
    for (auto x : pos[i]) v.push_back(x);
  }
  return v;
}

// ---- building: one function per kind, used by the erased and the typed builders ----------

auto source(const pipeline_spec& p) { return ferry::from_generator(p.n, gen_fn{p.bad, p.offset}); }

template <kind K, class Up>
auto apply(Up up, const spec& s) {
  if constexpr (K == kind::map) return std::move(up) | ferry::map(map_fn{s});
  else if constexpr (K == kind::map_workers)
    return std::move(up) | ferry::map(map_fn{s}, {.workers = s.b, .window = s.c});
  else if constexpr (K == kind::filter) return std::move(up) | ferry::filter(filter_fn{s});
  else if constexpr (K == kind::flat_map) return std::move(up) | ferry::flat_map(flat_fn{s});
  else if constexpr (K == kind::take) return std::move(up) | ferry::take(static_cast<std::int64_t>(s.a));
  else if constexpr (K == kind::skip) return std::move(up) | ferry::skip(static_cast<std::int64_t>(s.a));
  else if constexpr (K == kind::repeat) return std::move(up) | ferry::repeat(static_cast<std::int64_t>(s.a));
  else if constexpr (K == kind::shuffle) return std::move(up) | ferry::shuffle(s.a, s.b);
  else if constexpr (K == kind::prefetch) return std::move(up) | ferry::prefetch(s.a);
  else if constexpr (K == kind::cache) return std::move(up) | ferry::cache();
  else if constexpr (K == kind::shard) return std::move(up) | ferry::shard(s.a, s.b);
  else if constexpr (K == kind::interleave)
    return std::move(up) | ferry::interleave(interleave_fn{}, {.workers = s.a, .block = s.b, .buffer = 3, .cycle = s.c});
  else if constexpr (K == kind::batch) return std::move(up) | ferry::batch(s.a, {.drop_remainder = s.b != 0});
  else if constexpr (K == kind::bfilter) return std::move(up) | ferry::filter(bfilter_fn{s});
  else if constexpr (K == kind::unbatch) return std::move(up) | ferry::flat_map(unbatch_fn{});
}

// A pipeline chosen at run time: each stage over the previous one's any_source.
class erased_pipe {
 public:
  explicit erased_pipe(const pipeline_spec& p) : e_(base(p)) {
    for (const spec& s : p.stages) add(s);
    const ragged_spec& r = p.ragged;
    if (r.k == ragged_kind::none) return;
    REQUIRE(e_);
    vec_src v = std::move(*e_) | ferry::map(vec_fn{r.to_vec});
    e_.reset();
    switch (r.k) {
      case ragged_kind::none: break;
      case ragged_kind::padded_batch:
        pb_ = std::move(v) | ferry::padded_batch(r.n, {.length = r.L ? r.L : ferry::longest_row,
                                                       .multiple_of = r.multiple_of,
                                                       .truncate = r.truncate,
                                                       .pad_value = static_cast<double>(r.pad),
                                                       .drop_remainder = r.drop});
        for (const spec& s : r.post) pb_ = generic(std::move(*pb_), s);
        break;
      case ragged_kind::pack:
        pk_ = std::move(v) | ferry::pack(r.L, r.n, {.pad_value = static_cast<double>(r.pad), .drop_remainder = r.drop});
        for (const spec& s : r.post) pk_ = generic(std::move(*pk_), s);
        break;
      case ragged_kind::bucket:
        bk_ = std::move(v) | ferry::bucket_by_sequence_length(len_fn{}, r.bounds, r.sizes,
                                                              {.pad_to_bucket_boundary = r.to_boundary,
                                                               .multiple_of = r.multiple_of,
                                                               .pad_value = static_cast<double>(r.pad),
                                                               .drop_remainder = r.drop,
                                                               .max_wait = r.max_wait});
        for (const spec& s : r.post) bk_ = generic(std::move(*bk_), s);
        break;
    }
  }
  // A side of a join: its chain over its own generator (draw ends it on elements).
  static ferry::any_source<u64> side(const pipeline_spec& p) {
    erased_pipe e(p);
    REQUIRE(e.e_);
    return std::move(*e.e_);
  }
  static ferry::any_source<u64> base(const pipeline_spec& p) {
    switch (p.join) {
      case join_kind::none: return source(p);
      case join_kind::concatenate: return ferry::concatenate(side(p.sides[0]), side(p.sides[1]));
      case join_kind::zip: return ferry::zip(side(p.sides[0]), side(p.sides[1])) | ferry::map(zip_fn{});
      case join_kind::sample_from: {
        ferry::sample_from_options o{.weights = p.weights, .seed = p.mix, .stop_on_empty = p.stop_on_empty};
        if (p.sides.size() == 2) return ferry::sample_from(o, side(p.sides[0]), side(p.sides[1]));  // the pack form
        std::vector<ferry::any_source<u64>> v;
        for (const pipeline_spec& sd : p.sides) v.push_back(side(sd));
        return ferry::sample_from(o, std::move(v));
      }
    }
    return source(p);
  }
  std::optional<std::vector<u64>> next() {
    if (e_) return flat_opt(*e_);
    if (b_) return flat_opt(*b_);
    if (pb_) return flat_opt(*pb_);
    if (pk_) return flat_opt(*pk_);
    return flat_opt(*bk_);
  }
  void rewind() { visit([](auto& s) { s.rewind(); }); }
  ferry::pipeline_state save() {
    ferry::pipeline_state st;
    visit([&](auto& s) { st = ferry::save_state(s); });
    return st;
  }
  void restore(const ferry::pipeline_state& st) { visit([&](auto& s) { ferry::restore_state(s, st); }); }

 private:
  template <class F>
  void visit(F f) {
    if (e_) return f(*e_);
    if (b_) return f(*b_);
    if (pb_) return f(*pb_);
    if (pk_) return f(*pk_);
    f(*bk_);
  }
  template <class T>
  static std::optional<std::vector<u64>> flat_opt(ferry::any_source<T>& s) {
    auto x = s.next();
    if (!x) return std::nullopt;
    if constexpr (std::is_same_v<T, pack_b>)
      return flat_pack(*x);
    else if constexpr (std::is_same_v<T, padded_b> || std::is_same_v<T, bucket_b>)
      return flat_padded(x->template field<0>());
    else
      return flat(*x);
  }
  template <class T>
  static ferry::any_source<T> generic(ferry::any_source<T> up, const spec& s) {
    switch (s.k) {
      case kind::take: return apply<kind::take>(std::move(up), s);
      case kind::skip: return apply<kind::skip>(std::move(up), s);
      case kind::repeat: return apply<kind::repeat>(std::move(up), s);
      case kind::shuffle: return apply<kind::shuffle>(std::move(up), s);
      case kind::prefetch: return apply<kind::prefetch>(std::move(up), s);
      default: FAIL("not a stage of both lanes: " << s.text()); return up;
    }
  }
  void add(const spec& s) {
    if (e_) {
      ferry::any_source<u64> up = std::move(*e_);
      switch (s.k) {
        case kind::map: e_ = apply<kind::map>(std::move(up), s); break;
        case kind::map_workers: e_ = apply<kind::map_workers>(std::move(up), s); break;
        case kind::filter: e_ = apply<kind::filter>(std::move(up), s); break;
        case kind::flat_map: e_ = apply<kind::flat_map>(std::move(up), s); break;
        case kind::shard: e_ = apply<kind::shard>(std::move(up), s); break;
        case kind::interleave: e_ = apply<kind::interleave>(std::move(up), s); break;
        case kind::cache: e_ = apply<kind::cache>(std::move(up), s); break;  // copyable elements only
        case kind::batch:
          e_.reset();
          b_ = apply<kind::batch>(std::move(up), s);
          break;
        default: e_ = generic(std::move(up), s);
      }
    } else {
      ferry::any_source<batch_t> up = std::move(*b_);
      switch (s.k) {
        case kind::bfilter: b_ = apply<kind::bfilter>(std::move(up), s); break;
        case kind::unbatch:
          b_.reset();
          e_ = apply<kind::unbatch>(std::move(up), s);
          break;
        default: b_ = generic(std::move(up), s);
      }
    }
  }
  std::optional<ferry::any_source<u64>> e_;
  std::optional<ferry::any_source<batch_t>> b_;
  std::optional<ferry::any_source<padded_b>> pb_;
  std::optional<ferry::any_source<pack_b>> pk_;
  std::optional<ferry::any_source<bucket_b>> bk_;
};

// A chain with its stage types stacked directly (no any_source between them).
template <kind... Ks>
struct typed {
  static std::vector<kind> kinds() { return {Ks...}; }
  template <std::size_t I = 0, class Up>
  static auto build_from(Up up, const pipeline_spec& p) {
    constexpr kind ks[] = {Ks...};
    if constexpr (I == sizeof...(Ks))
      return up;
    else
      return build_from<I + 1>(apply<ks[I]>(std::move(up), p.stages[I]), p);
  }
  static auto build(const pipeline_spec& p) { return build_from(source(p), p); }
};

ferry::pipeline_state save(erased_pipe& p) { return p.save(); }
void restore(erased_pipe& p, const ferry::pipeline_state& s) { p.restore(s); }
template <class P>
ferry::pipeline_state save(P& p) {
  return ferry::save_state(p);
}
template <class P>
void restore(P& p, const ferry::pipeline_state& s) {
  ferry::restore_state(p, s);
}

// ---- the oracle --------------------------------------------------------------------------

// Events with groups: g[i] == -1 is an exact position; a run of one group id >= 0 holds its
// events in an order the oracle does not know. exact == false: the oracle gave up (why).
struct oseq {
  events e;
  std::vector<long> g;
  long next_group = 0;
  bool exact = true;
  std::string why;
  // A ragged tail's: the multiset (sorted) of the real tokens of an epoch's rows, where
  // known whatever the order (no error, nothing dropped or truncated).
  bool tokens_known = false;
  std::vector<u64> tokens;
  void push(ev x, long grp) {
    e.push_back(std::move(x));
    g.push_back(grp);
  }
  void give_up(const std::string& w) {
    if (exact) exact = false, why = w;
  }
};
struct seg {
  std::size_t b, e;
  bool group;
};
std::vector<seg> segments(const oseq& o) {
  std::vector<seg> out;
  for (std::size_t i = 0; i < o.e.size();) {
    std::size_t j = i + 1;
    if (o.g[i] >= 0)
      while (j < o.e.size() && o.g[j] == o.g[i]) ++j;
    out.push_back({i, j, o.g[i] >= 0});
    i = j;
  }
  return out;
}
std::size_t values_in(const oseq& o, seg s) {
  std::size_t n = 0;
  for (std::size_t i = s.b; i < s.e; ++i) n += !o.e[i].error;
  return n;
}
std::size_t errors_in(const oseq& o, seg s) { return (s.e - s.b) - values_in(o, s); }

oseq source_oracle(const pipeline_spec& p) {
  oseq o;
  for (u64 i = 0; i < p.n; ++i) {
    bool bad = std::find(p.bad.begin(), p.bad.end(), i) != p.bad.end();
    o.push(bad ? err() : val(i * 7 + 3 + p.offset), -1);
  }
  return o;
}

// Element by element (map, filter, flat_map, over batches too): f(event) -> its outputs,
// which keep the input's group (several outputs of an exact position are exact positions).
template <class F>
oseq each(const oseq& in, F f) {
  oseq out;
  out.next_group = in.next_group;
  out.exact = in.exact, out.why = in.why;
  for (std::size_t i = 0; i < in.e.size(); ++i) {
    if (in.e[i].error) {
      out.push(in.e[i], in.g[i]);
      continue;
    }
    for (ev& x : f(in.e[i])) out.push(std::move(x), in.g[i]);
  }
  return out;
}
oseq copy_head(const oseq& in) {
  oseq out;
  out.next_group = in.next_group;
  out.exact = in.exact, out.why = in.why;
  return out;
}
void push_seg(oseq& out, const oseq& in, seg s) {
  for (std::size_t i = s.b; i < s.e; ++i) out.push(in.e[i], in.g[i]);
}

oseq take_oracle(const oseq& in, u64 k) {  // errors do not count; none seen after k values
  oseq out = copy_head(in);
  u64 got = 0;
  for (seg s : segments(in)) {
    if (got == k) break;
    const u64 v = values_in(in, s);
    if (got + v > k) {
      out.give_up("take(" + std::to_string(k) + ") cuts a shuffled group");
      break;
    }
    if (got + v == k && s.group && errors_in(in, s) > 0) out.give_up("take ends in a group holding an error");
    push_seg(out, in, s);
    got += v;
  }
  return out;
}
oseq skip_oracle(const oseq& in, u64 k) {  // errors do not count and reach the consumer
  oseq out = copy_head(in);
  u64 dropped = 0;
  for (seg s : segments(in)) {
    const u64 v = values_in(in, s);
    if (dropped == k) {
      push_seg(out, in, s);
    } else if (dropped + v <= k) {
      for (std::size_t i = s.b; i < s.e; ++i)
        if (in.e[i].error) out.push(in.e[i], in.g[i]);
      dropped += v;
    } else {
      out.give_up("skip(" + std::to_string(k) + ") cuts a shuffled group");
      push_seg(out, in, s);
      dropped = k;
    }
  }
  return out;
}
// Windows of `buffer` values; an error ends its window (handed out first), then the error.
oseq shuffle_oracle(const oseq& in, u64 buffer) {
  oseq out = copy_head(in);
  events win;
  u64 vals = 0;
  auto flush = [&] {
    const long g = win.size() > 1 ? out.next_group++ : -1;
    for (ev& x : win) out.push(std::move(x), g);
    win.clear();
    vals = 0;
  };
  for (seg s : segments(in)) {
    const u64 v = values_in(in, s);
    if (s.group && errors_in(in, s) > 0) out.give_up("shuffle over a group holding an error");
    if (!s.group && in.e[s.b].error) {
      flush();
      out.push(in.e[s.b], -1);
      continue;
    }
    if (vals + v > buffer) out.give_up("a shuffle window cuts an upstream shuffled group");
    for (std::size_t i = s.b; i < s.e; ++i) win.push_back(in.e[i]);
    vals += v;
    if (vals >= buffer) flush();
  }
  flush();
  return out;
}
// Element k of the values to shard k % count; errors to every shard.
oseq shard_oracle(const oseq& in, u64 count, u64 index) {
  oseq out = copy_head(in);
  u64 k = 0;
  for (seg s : segments(in)) {
    if (s.group && count > 1 && values_in(in, s) > 1) out.give_up("shard over a shuffled group");
    for (std::size_t i = s.b; i < s.e; ++i) {
      if (in.e[i].error) {
        out.push(in.e[i], in.g[i]);
        continue;
      }
      if (k++ % count == index) out.push(in.e[i], in.g[i]);
    }
  }
  return out;
}
// tf.data's order (as test_conformance's case_interleave_fn): at its turn a slot takes up to
// `block` elements of its source; an empty slot opens the next upstream element's source
// (an upstream error keeps the turn).
oseq interleave_oracle(const oseq& in, std::size_t block, std::size_t cycle) {
  oseq out = copy_head(in);
  for (long g : in.g)
    if (g >= 0) out.give_up("interleave over a shuffled group");
  std::size_t next_in = 0, cur = 0, taken = 0;
  std::vector<std::optional<events>> slots(cycle);
  auto advance = [&] {
    taken = 0;
    cur = (cur + 1) % cycle;
  };
  for (;;) {
    if (slots[cur]) {
      if (!slots[cur]->empty()) {
        out.push(slots[cur]->front(), -1);
        slots[cur]->erase(slots[cur]->begin());
        if (++taken >= block) advance();
      } else {
        slots[cur].reset();
        advance();
      }
    } else if (next_in < in.e.size()) {
      const ev& x = in.e[next_in++];
      if (x.error) {
        out.push(x, -1);
        continue;
      }
      events inner;
      for (u64 j = 0; j < x.v[0] % 4; ++j) inner.push_back(val(x.v[0] * 100 + j));
      slots[cur] = inner;
    } else {
      if (std::none_of(slots.begin(), slots.end(), [](const auto& o) { return o.has_value(); })) break;
      advance();
    }
  }
  return out;
}
// Batches of n; an error drops the batch being built and takes its place.
oseq batch_oracle(const oseq& in, u64 n, bool drop_remainder) {
  oseq out = copy_head(in);
  ev cur;
  auto emit = [&] {
    if (cur.bag) std::sort(cur.v.begin(), cur.v.end());
    out.push(cur, -1);
    cur = ev{};
  };
  for (seg s : segments(in)) {
    if (s.group && errors_in(in, s) > 0) out.give_up("batch over a group holding an error");
    if (!s.group && in.e[s.b].error) {
      cur = ev{};
      out.push(in.e[s.b], -1);
      continue;
    }
    const u64 v = values_in(in, s);
    if (cur.v.size() + v > n) out.give_up("a batch cuts a shuffled group");
    if (s.group && v > 1) cur.bag = true;
    for (std::size_t i = s.b; i < s.e; ++i) {
      if (in.e[i].error) continue;
      cur.v.push_back(in.e[i].v[0]);
      if (cur.v.size() == n) emit();
    }
  }
  if (!cur.v.empty() && !drop_remainder) emit();
  return out;
}
// A batch's elements, in the batch's order; a batch of unknown order becomes a group.
oseq unbatch_oracle(const oseq& in) {
  oseq out = copy_head(in);
  for (std::size_t i = 0; i < in.e.size(); ++i) {
    const ev& x = in.e[i];
    if (x.error) {
      out.push(x, in.g[i]);
      continue;
    }
    long g = in.g[i];
    if (g < 0 && x.bag && x.v.size() > 1) g = out.next_group++;
    for (u64 y : x.v) out.push(val(y), g);
  }
  return out;
}

bool driven_in_bulk(const std::vector<spec>& st, std::size_t i) {
  for (std::size_t j = i + 1; j < st.size(); ++j) {
    const kind k = st[j].k;
    if (k == kind::batch) return true;
    const bool inline_map = k == kind::map || (k == kind::map_workers && st[j].b == 1);  // workers = 1: inline
    if (!inline_map && k != kind::take && k != kind::skip) return false;
  }
  return false;
}
bool any_error(const events& e, std::size_t end) {
  return std::any_of(e.begin(), e.begin() + static_cast<std::ptrdiff_t>(std::min(end, e.size())),
                     [](const ev& x) { return x.error; });
}
// The position just after the k-th value (or the end).
std::size_t position_of_value(const oseq& o, u64 k) {
  u64 seen = 0;
  for (std::size_t i = 0; i < o.e.size(); ++i)
    if (!o.e[i].error && ++seen == k) return i + 1;
  return o.e.size();
}

oseq base_oracle(const pipeline_spec& p, u64 epoch, const std::vector<spec>& after);

// Appends b to a (b's groups renumbered after a's).
void append(oseq& a, const oseq& b) {
  const long base = a.next_group;
  for (std::size_t i = 0; i < b.e.size(); ++i) a.push(b.e[i], b.g[i] < 0 ? -1 : base + b.g[i]);
  a.next_group = base + b.next_group;
  if (!b.exact) a.give_up(b.why);
}

// The first `upto` stages of p's chain in epoch `epoch` (an epoch of that stage's output:
// a repeat(n) plays its upstream's epochs epoch*n ... epoch*n+n-1, which differ under a
// sample_from); `after`: the stages below the chain (a side's: the join's outer chain).
oseq chain_oracle(const pipeline_spec& p, std::size_t upto, u64 epoch, const std::vector<spec>& after) {
  if (upto == 0) return base_oracle(p, epoch, after);
  const std::size_t i = upto - 1;
  const spec& s = p.stages[i];
  if (s.k == kind::repeat) {
    oseq out;
    for (u64 j = 0; j < s.a; ++j) append(out, chain_oracle(p, i, epoch * s.a + j, after));
    return out;
  }
  oseq o = chain_oracle(p, i, epoch, after);
  std::vector<spec> below = p.stages;
  below.insert(below.end(), after.begin(), after.end());
  {
    // Pulled in bulk by a batch() below (through inline maps, takes and skips, which pass
    // next_bulk on): a take or skip whose run meets an error counts all (take) or none
    // (skip) of it (documented: take.hpp, skip.hpp); an inline map whose fn throws loses
    // the whole run, the elements after the failing one too (documented: map.hpp; the case at
    // the end).
    const bool bulk_below = driven_in_bulk(below, i);
    switch (s.k) {
      case kind::map:
      case kind::map_workers:
        if ((s.k == kind::map || s.b == 1) && bulk_below && std::any_of(o.e.begin(), o.e.end(), [&](const ev& x) { return !x.error && s.fails(x.v[0]); }))
          o.give_up("an inline map's fn throws in a run batch() pulls in bulk (map.hpp)");
        o = each(o, [&](const ev& x) { return events{s.fails(x.v[0]) ? err() : val(x.v[0] * 2 + s.a)}; });
        break;
      case kind::filter:
        o = each(o, [&](const ev& x) {
          if (s.fails(x.v[0])) return events{err()};
          return x.v[0] % s.a != s.b ? events{x} : events{};
        });
        break;
      case kind::flat_map:
        o = each(o, [&](const ev& x) {
          if (s.fails(x.v[0])) return events{err()};
          events out;
          for (u64 j = 0; j < x.v[0] % s.a; ++j) out.push_back(val(x.v[0] * 3 + j));
          return out;
        });
        break;
      case kind::take:
        o = take_oracle(o, s.a);
        if (bulk_below && any_error(o.e, o.e.size())) o.give_up("take's bulk run under batch met an error (documented)");
        break;
      case kind::skip:
        if (bulk_below && any_error(o.e, position_of_value(o, s.a)))
          o.give_up("skip's bulk run under batch met an error (documented)");
        o = skip_oracle(o, s.a);
        break;
      case kind::repeat: break;  // above
      case kind::shuffle: o = shuffle_oracle(o, s.a); break;
      case kind::prefetch:
      case kind::cache: break;
      case kind::shard: o = shard_oracle(o, s.a, s.b); break;
      case kind::interleave: o = interleave_oracle(o, s.b, s.c); break;
      case kind::batch: o = batch_oracle(o, s.a, s.b != 0); break;
      case kind::bfilter:
        o = each(o, [&](const ev& x) { return sum(x.v) % 3 != s.a ? events{x} : events{}; });
        break;
      case kind::unbatch: o = unbatch_oracle(o); break;
    }
  }
  return o;
}

// sample_from's draws as its header documents them: draw d of epoch e is u in [0, 1) from
// SplitMix64 seeded with mix_seed({seed, e}) + d * gamma (its d-th output, 53 bits), and
// picks the first active source whose cumulative weight exceeds u * (their sum); a draw
// that meets a source's end is used up too.
u64 mix_seed(std::initializer_list<u64> words) {
  u64 h = 0x6a09e667f3bcc909ull;
  for (u64 w : words) h = rng{h ^ w}.next();
  return h;
}
double sample_u(u64 key, u64 d) {
  return static_cast<double>(rng{key + d * 0x9e3779b97f4a7c15ull}.next() >> 11) * 0x1.0p-53;
}

oseq sample_from_oracle(const pipeline_spec& p, std::vector<oseq> in, u64 epoch) {
  oseq out;
  for (const oseq& o : in) {
    if (!o.exact) out.give_up(o.why);
    for (long g : o.g)
      if (g >= 0) out.give_up("sample_from over a shuffled group (its elements' order decides the mix)");
  }
  std::vector<double> w = p.weights;
  if (w.empty()) w.assign(in.size(), 1.0);
  std::vector<std::size_t> active, at(in.size(), 0);
  for (std::size_t i = 0; i < in.size(); ++i)
    if (w[i] > 0) active.push_back(i);
  const u64 key = mix_seed({p.mix, epoch});
  for (u64 d = 0; !active.empty(); ++d) {
    double total = 0;
    for (std::size_t i : active) total += w[i];
    const double x = sample_u(key, d) * total;
    double acc = 0;
    std::size_t j = active.size() - 1;
    for (std::size_t k = 0; k + 1 < active.size(); ++k)
      if (x < (acc += w[active[k]])) {
        j = k;
        break;
      }
    const std::size_t i = active[j];
    if (at[i] < in[i].e.size()) {
      out.push(in[i].e[at[i]++], -1);
      continue;
    }
    if (p.stop_on_empty) break;
    active.erase(active.begin() + static_cast<std::ptrdiff_t>(j));
  }
  return out;
}

oseq base_oracle(const pipeline_spec& p, u64 epoch, const std::vector<spec>& after) {
  if (p.join == join_kind::none) return source_oracle(p);
  std::vector<spec> below = p.stages;  // for the sides: what pulls them
  below.insert(below.end(), after.begin(), after.end());
  std::vector<oseq> in;
  for (const pipeline_spec& sd : p.sides) in.push_back(chain_oracle(sd, sd.stages.size(), epoch, below));
  oseq out;
  switch (p.join) {
    case join_kind::none: break;
    case join_kind::concatenate:  // a's epoch, then b's; errors at their places
      append(out, in[0]);
      append(out, in[1]);
      break;
    case join_kind::zip:  // sides drawn without errors and cut to one length (draw_join)
      for (const oseq& o : in) {
        if (!o.exact) out.give_up(o.why);
        for (long g : o.g)
          if (g >= 0) out.give_up("zip of a shuffled group (its order decides the pairs)");
      }
      if (in[0].e.size() != in[1].e.size()) out.give_up("zip of sides the oracle finds of other lengths");
      for (std::size_t i = 0; i < std::min(in[0].e.size(), in[1].e.size()); ++i) {
        if (in[0].e[i].error || in[1].e[i].error) out.give_up("zip meets an error");
        if (!out.exact) break;
        out.push(val(zip_fn{}({in[0].e[i].v[0], in[1].e[i].v[0]})), -1);
      }
      break;
    case join_kind::sample_from: out = sample_from_oracle(p, std::move(in), epoch); break;
  }
  return out;
}

// ---- the ragged tails' oracles ---------------------------------------------------------

u64 round_up(u64 x, u64 m) { return (x + m - 1) / m * m; }

// One padded batch as flat_padded writes it (rows: the elements' vectors).
ev padded_event(const std::vector<std::vector<u64>>& rows, u64 L, u64 pad) {
  ev x;
  x.v = {L, rows.size()};
  for (const auto& r : rows) x.v.push_back(std::min<u64>(r.size(), L));
  for (const auto& r : rows)
    for (u64 j = 0; j < L; ++j) x.v.push_back(j < r.size() ? r[j] : pad);
  return x;
}
u64 padded_width(const ragged_spec& r, const std::vector<std::vector<u64>>& rows) {
  if (r.L) return r.L;
  u64 longest = 0;
  for (const auto& v : rows) longest = std::max<u64>(longest, v.size());
  return round_up(longest, r.multiple_of);
}
// padded_batch: batch()'s grouping (an error drops the batch being built and takes its
// place); a batch holding a shuffled group is compared as a multiset of its numbers.
oseq padded_batch_oracle(const oseq& in, const ragged_spec& r) {
  oseq out = copy_head(in);
  std::vector<std::vector<u64>> rows;
  bool bag = false;
  auto emit = [&] {
    ev x = padded_event(rows, padded_width(r, rows), r.pad);
    if (bag) std::sort(x.v.begin(), x.v.end()), x.bag = true;
    out.push(x, -1);
    rows.clear();
    bag = false;
  };
  for (seg s : segments(in)) {
    if (s.group && errors_in(in, s) > 0) out.give_up("padded_batch over a group holding an error");
    if (!s.group && in.e[s.b].error) {
      rows.clear();
      bag = false;
      out.push(in.e[s.b], -1);
      continue;
    }
    if (rows.size() + values_in(in, s) > r.n) out.give_up("a padded batch cuts a shuffled group");
    if (s.group && values_in(in, s) > 1) bag = true;
    for (std::size_t i = s.b; i < s.e; ++i) {
      if (in.e[i].error) continue;
      rows.push_back(in.e[i].v);
      if (rows.size() == r.n) emit();
    }
  }
  if (!rows.empty() && !r.drop) emit();
  return out;
}
// pack: the sequences' tokens in order, cut into rows of L, n rows a batch, each piece of a
// sequence in a row a segment (ids from 1, positions from 0); an error drops the batch being
// built (its partial row too); the epoch's last row is padded (pad, segment 0, position 0).
oseq pack_oracle(const oseq& in, const ragged_spec& r) {
  oseq out = copy_head(in);
  for (long g : in.g)
    if (g >= 0) out.give_up("pack over a shuffled group");
  const u64 L = r.L;
  std::vector<u64> rows;  // the flat rows of the batch being built: len, L tokens, L seg, L pos each
  u64 nrows = 0, used = 0, segment = 0;
  std::vector<u64> tok, sg, ps;
  auto finish_row = [&] {
    rows.push_back(used);
    for (u64 j = used; j < L; ++j) tok.push_back(r.pad), sg.push_back(0), ps.push_back(0);
    rows.insert(rows.end(), tok.begin(), tok.end());
    rows.insert(rows.end(), sg.begin(), sg.end());
    rows.insert(rows.end(), ps.begin(), ps.end());
    tok.clear(), sg.clear(), ps.clear();
    ++nrows, used = 0, segment = 0;
  };
  auto emit = [&] {
    ev x;
    x.v = {nrows, L};
    x.v.insert(x.v.end(), rows.begin(), rows.end());
    out.push(x, -1);
    rows.clear();
    nrows = 0;
  };
  for (const ev& e : in.e) {
    if (e.error) {
      rows.clear(), tok.clear(), sg.clear(), ps.clear();
      nrows = used = segment = 0;
      out.push(e, -1);
      continue;
    }
    for (std::size_t off = 0; off < e.v.size();) {
      const u64 take = std::min<u64>(L - used, e.v.size() - off);
      ++segment;
      for (u64 j = 0; j < take; ++j) tok.push_back(e.v[off + j]), sg.push_back(segment), ps.push_back(j);
      used += take, off += take;
      if (used == L) {
        finish_row();
        if (nrows == r.n) emit();
      }
    }
  }
  const bool partial = used > 0;
  if (partial) finish_row();
  if (nrows > 0 && !(r.drop && (nrows < r.n || partial))) emit();
  return out;
}
std::size_t bucket_index(const ragged_spec& r, std::size_t len) {
  std::size_t b = 0;
  while (b < r.bounds.size() && len >= r.bounds[b]) ++b;
  return b;
}
u64 bucket_width(const ragged_spec& r, std::size_t b, u64 longest) {
  if (r.to_boundary && b < r.bounds.size()) return r.bounds[b] - 1;
  return round_up(longest, r.multiple_of);
}
// bucket_by_sequence_length, as its top tells: a bucket's batch goes when it holds its
// size; a partial one whose first row came more than max_wait rows (errors count) ago goes
// before the next pull; at the end the partial ones go, oldest first (unless
// drop_remainder); an error arrives at its place and the buckets keep their rows.
oseq bucket_oracle(const oseq& in, const ragged_spec& r) {
  oseq out = copy_head(in);
  for (long g : in.g)
    if (g >= 0) out.give_up("bucket_by_sequence_length over a shuffled group");
  u64 max_wait = r.max_wait;
  if (max_wait == 0)
    for (auto z : r.sizes) max_wait += 8 * z;
  struct bucket {
    std::vector<std::vector<u64>> rows;
    std::vector<u64> index;
  };
  std::vector<bucket> bs(r.sizes.size());
  u64 pulled = 0;
  auto emit = [&](std::size_t b) {
    u64 longest = 0;
    for (const auto& v : bs[b].rows) longest = std::max<u64>(longest, v.size());
    out.push(padded_event(bs[b].rows, bucket_width(r, b, longest), r.pad), -1);
    bs[b] = {};
  };
  auto oldest = [&] {
    std::size_t best = bs.size();
    for (std::size_t b = 0; b < bs.size(); ++b)
      if (!bs[b].index.empty() && (best == bs.size() || bs[b].index[0] < bs[best].index[0])) best = b;
    return best;
  };
  auto overdue = [&] {
    for (;;) {
      const std::size_t b = oldest();
      if (b == bs.size() || pulled - bs[b].index[0] <= max_wait) return;
      emit(b);
    }
  };
  for (const ev& e : in.e) {
    overdue();
    ++pulled;
    if (e.error) {
      out.push(e, -1);
      continue;
    }
    const std::size_t b = bucket_index(r, e.v.size());
    bs[b].rows.push_back(e.v);
    bs[b].index.push_back(pulled - 1);
    if (bs[b].rows.size() == r.sizes[b]) emit(b);
  }
  overdue();
  if (!r.drop)
    for (std::size_t b = oldest(); b != bs.size(); b = oldest()) emit(b);
  return out;
}

oseq oracle(const pipeline_spec& p, u64 epoch) {
  oseq o = chain_oracle(p, p.stages.size(), epoch, {});
  const ragged_spec& r = p.ragged;
  if (r.k == ragged_kind::none) return o;
  o = each(o, [&](const ev& x) {
    if (r.to_vec.fails(x.v[0])) return events{err()};
    ev y;
    for (u64 j = 0; j < x.v[0] % r.to_vec.a; ++j) y.v.push_back(x.v[0] * 8 + j);
    return events{y};
  });
  std::vector<u64> tokens;
  bool tokens_known = o.exact && !r.drop && !(r.k == ragged_kind::padded_batch && r.L != 0);
  for (const ev& x : o.e) {
    tokens_known = tokens_known && !x.error;
    tokens.insert(tokens.end(), x.v.begin(), x.v.end());
  }
  for (const spec& s : r.post) tokens_known = tokens_known && (s.k == kind::shuffle || s.k == kind::prefetch);
  std::sort(tokens.begin(), tokens.end());
  switch (r.k) {
    case ragged_kind::none: break;
    case ragged_kind::padded_batch: o = padded_batch_oracle(o, r); break;
    case ragged_kind::pack: o = pack_oracle(o, r); break;
    case ragged_kind::bucket: o = bucket_oracle(o, r); break;
  }
  for (const spec& s : r.post) switch (s.k) {
      case kind::take: o = take_oracle(o, s.a); break;
      case kind::skip: o = skip_oracle(o, s.a); break;
      case kind::shuffle: o = shuffle_oracle(o, s.a); break;
      default: break;  // prefetch
    }
  o.tokens_known = tokens_known;
  o.tokens = std::move(tokens);
  return o;
}

// zip's sides cut to one length (the shorter side's, as the oracle finds it).
void finish_zip(pipeline_spec& p) {
  if (p.join != join_kind::zip) return;
  u64 m = ~u64{0};
  for (const pipeline_spec& sd : p.sides) {
    const oseq o = chain_oracle(sd, sd.stages.size(), 0, {});
    REQUIRE_MESSAGE(o.exact, o.why);
    m = std::min<u64>(m, o.e.size());
  }
  for (pipeline_spec& sd : p.sides) sd.stages.push_back(spec{kind::take, m});
}

// ---- a ragged tail's invariants, on what a pipeline handed out (any order) --------------

// A row's real values as vec_fn makes them: x*8, x*8+1, ... (len of them; x % a of them when
// not cut to L).
bool row_ok(const ragged_spec& r, const u64* v, u64 len, u64 L, std::string& why) {
  if (len > L) return why = "a length over L", false;
  if (len == 0) return true;
  const u64 x = v[0] / 8;
  if (v[0] % 8 != 0 || (len != x % r.to_vec.a && !(len == L && x % r.to_vec.a > L)))
    return why = "a row that is not an element's values", false;
  for (u64 j = 0; j < L; ++j)
    if (v[j] != (j < len ? v[0] + j : r.pad)) return why = "a row's value or padding at " + std::to_string(j), false;
  return true;
}
bool padded_ok(const ragged_spec& r, const std::vector<u64>& v, std::string& why) {
  if (v.size() < 2 || v.size() != 2 + v[1] + v[0] * v[1]) return why = "a padded batch's shape", false;
  const u64 L = v[0], n = v[1];
  if (n == 0) return why = "an empty batch", false;
  u64 longest = 0;
  const std::size_t b = bucket_index(r, v[2]);
  for (u64 i = 0; i < n; ++i) {
    longest = std::max(longest, v[2 + i]);
    if (!row_ok(r, &v[2 + n + i * L], v[2 + i], L, why)) return false;
    if (r.k == ragged_kind::bucket && bucket_index(r, v[2 + i]) != b) return why = "rows of two buckets", false;
  }
  if (r.k == ragged_kind::padded_batch) {
    if (n > r.n || (r.drop && n != r.n)) return why = "a batch of " + std::to_string(n) + " rows", false;
    if (L != (r.L ? r.L : round_up(longest, r.multiple_of))) return why = "L " + std::to_string(L), false;
  } else {
    if (n > r.sizes[b]) return why = "a bucket's batch of " + std::to_string(n) + " rows", false;
    if (L != bucket_width(r, b, longest)) return why = "a bucket's L " + std::to_string(L), false;
  }
  return true;
}
bool pack_ok(const ragged_spec& r, const std::vector<u64>& v, std::string& why) {
  if (v.size() < 2 || v[1] != r.L || v.size() != 2 + v[0] * (1 + 3 * r.L)) return why = "a packed batch's shape", false;
  const u64 n = v[0], L = r.L;
  if (n == 0 || n > r.n) return why = "a packed batch of " + std::to_string(n) + " rows", false;
  for (u64 i = 0; i < n; ++i) {
    const u64* row = &v[2 + i * (1 + 3 * L)];
    const u64 len = row[0];
    const u64 *tok = row + 1, *sg = tok + L, *ps = sg + L;
    if (len == 0 || len > L || (len < L && i + 1 != n)) return why = "a packed row of " + std::to_string(len), false;
    if (r.drop && (n != r.n || len != L)) return why = "a short last batch under drop_remainder", false;
    for (u64 j = 0; j < L; ++j) {
      if (j >= len) {
        if (tok[j] != r.pad || sg[j] != 0 || ps[j] != 0) return why = "a packed row's padding", false;
        continue;
      }
      const bool starts = j == 0 || ps[j] == 0;
      if (starts ? (sg[j] != (j == 0 ? 1 : sg[j - 1] + 1) || ps[j] != 0 || (j > 0 && tok[j] % 8 != 0))
                 : (sg[j] != sg[j - 1] || ps[j] != ps[j - 1] + 1 || tok[j] != tok[j - 1] + 1))
        return why = "segment ids, positions or tokens at row " + std::to_string(i) + ", " + std::to_string(j), false;
    }
  }
  return true;
}
bool ragged_invariants(const ragged_spec& r, const events& es, std::string& why) {
  for (std::size_t i = 0; i < es.size(); ++i) {
    if (es[i].error) continue;
    const bool ok = r.k == ragged_kind::pack ? pack_ok(r, es[i].v, why) : padded_ok(r, es[i].v, why);
    if (!ok) return why += " (event " + std::to_string(i) + ": " + describe(slice(es, i, i + 1)) + ")", false;
  }
  return true;
}
// The real tokens of all rows, sorted (events that pass ragged_invariants).
std::vector<u64> ragged_tokens(const ragged_spec& r, const events& es) {
  std::vector<u64> out;
  for (const ev& e : es) {
    if (e.error) continue;
    const std::vector<u64>& v = e.v;
    if (r.k == ragged_kind::pack) {
      for (u64 i = 0; i < v[0]; ++i) {
        const u64* row = &v[2 + i * (1 + 3 * r.L)];
        out.insert(out.end(), row + 1, row + 1 + row[0]);
      }
    } else {
      for (u64 i = 0; i < v[1]; ++i) out.insert(out.end(), &v[2 + v[1] + i * v[0]], &v[2 + v[1] + i * v[0]] + v[2 + i]);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Whether rewind() at any point of an epoch starts the same next epoch as at its end: not
// with a cache (a pass it saw whole is replayed, a cut one is read again: cache.hpp).
// A shuffle under a repeat is no exception: repeat(n) rewinds its upstream for the passes
// it did not reach (repeat.hpp), also when a thread above read passes ahead.
bool rewind_point_free(const pipeline_spec& p) {
  for (const spec& s : p.stages)
    if (s.k == kind::cache) return false;
  for (const pipeline_spec& sd : p.sides)
    if (!rewind_point_free(sd)) return false;
  return true;
}

ev normal(ev x) {
  std::sort(x.v.begin(), x.v.end());
  x.bag = false;
  return x;
}
bool ev_less(const ev& a, const ev& b) { return std::tie(a.error, a.v) < std::tie(b.error, b.v); }

// got against the oracle: exact positions exactly (a bag's numbers as a multiset), groups as
// multisets.
bool matches(const events& got, const oseq& o, std::string& where) {
  if (got.size() != o.e.size()) {
    where = "size " + std::to_string(got.size()) + " vs the oracle's " + std::to_string(o.e.size());
    return false;
  }
  for (seg s : segments(o)) {
    events a, b;
    for (std::size_t i = s.b; i < s.e; ++i) {
      const bool bag = s.group || o.e[i].bag;
      a.push_back(bag ? normal(got[i]) : got[i]);
      b.push_back(bag ? normal(o.e[i]) : o.e[i]);
    }
    std::sort(a.begin(), a.end(), ev_less);
    std::sort(b.begin(), b.end(), ev_less);
    if (a != b) {
      where = "positions [" + std::to_string(s.b) + ", " + std::to_string(s.e) + "): " + describe(a) + " vs " +
              describe(b);
      return false;
    }
  }
  return true;
}

std::string describe(const oseq& o) {
  std::string s;
  for (seg g : segments(o)) {
    const std::string part = describe(slice(o.e, g.b, g.e));
    s += g.group ? "{" + part.substr(1, part.size() - 3) + "} " : part.substr(1, part.size() - 2);
  }
  return "[" + s + "]";
}

// ---- the properties ----------------------------------------------------------------------

struct tally {
  std::size_t pipelines = 0, exact = 0, events = 0;
};

template <class Make>
void check_pipeline(const pipeline_spec& ps, Make make, u64 seed, tally& t) {
  rng r{seed ^ 0xc0ffeeull};
  const oseq o = oracle(ps, 0), o1 = oracle(ps, 1);  // differ under a sample_from only
  const std::string want = describe(o);
  INFO("oracle ({...}: any order): " << (o.exact ? want : "inexact (" + o.why + ")"));
  ++t.pipelines;
  t.exact += o.exact && o1.exact;
  std::string where;

  // 1. Two epochs against the oracle.
  auto p0 = make(ps);
  const events e0 = rest(p0);
  p0.rewind();
  const events e1 = rest(p0);
  t.events += e0.size() + e1.size();
  INFO("epoch 0: " << describe(e0));
  CHECK_MESSAGE(lost_context(e0) + lost_context(e1) == 0, "an error lost its message on the way");
  if (o.exact) {
    CHECK_MESSAGE(matches(e0, o, where), "epoch 0 differs from the oracle at " << where);
  }
  if (o1.exact) {
    CHECK_MESSAGE(matches(e1, o1, where), "epoch 1 differs from the oracle at " << where << "; epoch 1: " << describe(e1));
  }

  if (ps.ragged.k != ragged_kind::none) {
    const bool ok0 = ragged_invariants(ps.ragged, e0, where);
    CHECK_MESSAGE(ok0, "epoch 0: " << where);
    const bool ok1 = ragged_invariants(ps.ragged, e1, where);
    CHECK_MESSAGE(ok1, "epoch 1: " << where);
    if (ok0 && o.tokens_known) CHECK_MESSAGE(ragged_tokens(ps.ragged, e0) == o.tokens, "epoch 0's tokens are not the elements' values");
    if (ok1 && o1.tokens_known) CHECK_MESSAGE(ragged_tokens(ps.ragged, e1) == o1.tokens, "epoch 1's tokens are not the elements' values");
  }

  // 3. rewind() mid-epoch.
  const std::size_t k0 = r.below(e0.size() + 1);
  auto p1 = make(ps);
  const events head0 = take_n(p1, k0);
  CHECK_MESSAGE(head0 == slice(e0, 0, k0), "a second pipeline's first " << k0 << " events differ: " << describe(head0));
  p1.rewind();
  const events r1 = rest(p1);
  if (rewind_point_free(ps))
    CHECK_MESSAGE(r1 == e1, "rewind() after " << k0 << " events: " << describe(r1) << " vs after the whole epoch: "
                                              << describe(e1));
  if (o1.exact) CHECK_MESSAGE(matches(r1, o1, where), "rewind() after " << k0 << " events: differs at " << where);

  // 2. Exact resume in epoch 0 (at three random positions), then rewind() of the restored one.
  for (int trial = 0; trial < 3; ++trial) {
    const std::size_t k = r.below(e0.size() + 1);
    CAPTURE(k);
    auto p = make(ps);
    const events head = take_n(p, k);
    REQUIRE_MESSAGE(head == slice(e0, 0, k), describe(head));
    const std::string bytes = save(p).to_bytes();
    auto q = make(ps);
    restore(q, ferry::pipeline_state::from_bytes(bytes));
    const events tail = rest(q);
    CHECK_MESSAGE(tail == slice(e0, k, e0.size()), "resumed at " << k << ": " << describe(tail) << " vs "
                                                                  << describe(slice(e0, k, e0.size())));
    CHECK_MESSAGE(rest(p) == tail, "the saved pipeline went on otherwise");
    q.rewind();
    const events q1 = rest(q);
    if (rewind_point_free(ps)) CHECK_MESSAGE(q1 == e1, "the restored one's next epoch: " << describe(q1));
    if (o1.exact) CHECK_MESSAGE(matches(q1, o1, where), "the restored one's next epoch differs at " << where);
  }
  // 2'. Exact resume in the epoch after a mid-epoch rewind (r1's; compared with r1 only
  // where a rewind's epoch is a contract: not with a cache).
  {
    const std::size_t k = r.below(r1.size() + 1);
    CAPTURE(k);
    auto p = make(ps);
    take_n(p, k0);
    p.rewind();
    const events head = take_n(p, k);
    if (rewind_point_free(ps)) REQUIRE_MESSAGE(head == slice(r1, 0, k), describe(head));
    const std::string bytes = save(p).to_bytes();
    auto q = make(ps);
    restore(q, ferry::pipeline_state::from_bytes(bytes));
    const events tail = rest(q), rest_p = rest(p);
    CHECK_MESSAGE(tail == rest_p, "resumed in epoch 1 at " << k << ": " << describe(tail) << " vs the saved one's "
                                                           << describe(rest_p));
    if (o1.exact) {
      events all = head;
      all.insert(all.end(), tail.begin(), tail.end());
      CHECK_MESSAGE(matches(all, o1, where), "epoch 1, resumed at " << k << ", differs at " << where);
    }
  }
}

u64 env_u64(const char* name, u64 fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

constexpr u64 seeds_per_case = 150;

void run_erased(u64 from, u64 to) {
  ferry_test::watchdog w(150s, "test_compose");
  tally t;
  const u64 only = env_u64("FERRY_COMPOSE_SEED", ~u64{0});
  for (u64 seed = from; seed < to; ++seed) {
    if (only != ~u64{0} && seed != only) continue;
    const pipeline_spec ps = draw(seed);
    INFO("seed " << seed << ": " << ps.text());
    check_pipeline(ps, [](const pipeline_spec& p) { return erased_pipe(p); }, seed, t);
  }
  MESSAGE("seeds [" << from << ", " << to << "): " << t.pipelines << " pipelines, " << t.exact
                    << " with an exact oracle, " << t.events << " events");
}

// A typed chain: kinds fixed, parameters drawn from the seed.
template <class Chain>
void run_typed(u64 seeds) {
  ferry_test::watchdog w(150s, "test_compose (typed)");
  tally t;
  for (u64 seed = 0; seed < seeds; ++seed) {
    rng r{seed * 31 + 7};
    pipeline_spec ps;
    ps.n = r.below(41);
    if (ps.n > 0 && r.chance(1, 2)) ps.bad.push_back(r.below(ps.n));
    for (kind k : Chain::kinds()) ps.stages.push_back(draw_params(r, k, ps.stages));
    if (std::any_of(ps.stages.begin(), ps.stages.end(), [](const spec& s) { return s.k == kind::repeat && s.a > 2; }))
      for (spec& s : ps.stages)
        if (s.k == kind::repeat) s.a = 2;
    INFO("typed seed " << seed << ": " << ps.text());
    check_pipeline(ps, [](const pipeline_spec& p) { return Chain::build(p); }, seed, t);
  }
  MESSAGE(t.pipelines << " typed pipelines, " << t.exact << " with an exact oracle");
}

// Pipelines drawn by `draw` (a join or a ragged tail), seeds [from, to).
template <class Draw>
void run_drawn(const char* what, u64 from, u64 to, Draw draw_one) {
  ferry_test::watchdog w(150s, what);
  tally t;
  const u64 only = env_u64("FERRY_COMPOSE_SEED", ~u64{0});
  for (u64 seed = from; seed < to; ++seed) {
    if (only != ~u64{0} && seed != only) continue;
    pipeline_spec ps = draw_one(seed);
    finish_zip(ps);
    INFO(what << " seed " << seed << ": " << ps.text());
    check_pipeline(ps, [](const pipeline_spec& p) { return erased_pipe(p); }, seed, t);
  }
  MESSAGE(std::string(what) << ": " << t.pipelines << " pipelines, " << t.exact << " with an exact oracle, " << t.events << " events");
}

}  // namespace

TEST_CASE("compose: random chains, seeds 0-149" * doctest::timeout(120)) { run_erased(0, seeds_per_case); }
TEST_CASE("compose: random chains, seeds 150-299" * doctest::timeout(120)) {
  run_erased(seeds_per_case, 2 * seeds_per_case);
}
TEST_CASE("compose: random chains, seeds 300-449" * doctest::timeout(120)) {
  run_erased(2 * seeds_per_case, 3 * seeds_per_case);
}
TEST_CASE("compose: random chains, seeds 450-599" * doctest::timeout(120)) {
  run_erased(3 * seeds_per_case, 4 * seeds_per_case);
}

using K = kind;
TEST_CASE_TEMPLATE("compose: typed chains" * doctest::timeout(120), Chain,
                   typed<K::map_workers, K::shuffle, K::batch, K::prefetch, K::take>,
                   typed<K::shuffle, K::take, K::repeat>,
                   typed<K::skip, K::shuffle, K::repeat, K::take>,
                   typed<K::interleave, K::map_workers, K::batch, K::unbatch, K::shuffle>,
                   typed<K::filter, K::prefetch, K::cache, K::shuffle, K::batch, K::repeat>,
                   typed<K::flat_map, K::shard, K::map, K::take, K::prefetch>,
                   typed<K::map, K::batch, K::shuffle, K::skip, K::unbatch, K::batch>,
                   typed<K::cache, K::shuffle, K::map_workers, K::take, K::repeat>) {
  run_typed<Chain>(25);
}

// An inline map that batch() drives in bulk over a bulk source loses the elements after
// the one its fn threw on, up to the end of the run (the batch's size); a parallel map
// hands them on (map.hpp documents this one difference, which the helper that wrote this
// file found documented for contiguous sources only).
TEST_CASE("compose: an inline map under batch loses a run's elements after a throw, as map.hpp says" *
          doctest::timeout(30)) {
  auto fn = [](u64 x) -> u64 {
    if (x == 3) throw user_error("map failed at 3");
    return x;
  };
  auto make = [&](std::size_t workers) {
    return ferry::from_generator(12, [](u64 i) { return i; }) | ferry::map(fn, {.workers = workers}) | ferry::batch(8);
  };
  auto inline_map = make(1);
  auto parallel = make(2);
  CHECK(rest(parallel) == events{err(), ev{false, {4, 5, 6, 7, 8, 9, 10, 11}, false, {}}});
  CHECK(rest(inline_map) == events{err(), ev{false, {8, 9, 10, 11}, false, {}}});
}

// ---- joins and ragged tails --------------------------------------------------------------

TEST_CASE("compose: concatenate(random chain, random chain) | random chain" * doctest::timeout(120)) {
  run_drawn("concatenate", 0, 120, [](u64 s) { return draw_join(s, join_kind::concatenate); });
}
TEST_CASE("compose: zip(random chain, random chain) | random chain" * doctest::timeout(120)) {
  run_drawn("zip", 0, 120, [](u64 s) { return draw_join(s, join_kind::zip); });
}
TEST_CASE("compose: sample_from(random chains) | random chain: the documented draws" * doctest::timeout(120)) {
  run_drawn("sample_from", 0, 150, [](u64 s) { return draw_join(s, join_kind::sample_from); });
}
TEST_CASE("compose: random chain | padded_batch | random batch stages" * doctest::timeout(120)) {
  run_drawn("padded_batch", 0, 120, [](u64 s) { return draw_ragged(s, ragged_kind::padded_batch); });
}
TEST_CASE("compose: random chain | pack | random batch stages" * doctest::timeout(120)) {
  run_drawn("pack", 0, 120, [](u64 s) { return draw_ragged(s, ragged_kind::pack); });
}
TEST_CASE("compose: random chain | bucket_by_sequence_length | random batch stages" * doctest::timeout(120)) {
  run_drawn("bucket_by_sequence_length", 0, 120, [](u64 s) { return draw_ragged(s, ragged_kind::bucket); });
}

// zip's errors, as zip.hpp documents them (the random zips above have none): a side's error
// arrives unchanged, then every next() and save() throws ferry::error (out of step) until
// rewind(); sides of unequal lengths are an error at the shorter one's end, not a cut.
TEST_CASE("compose: zip after an error or of unequal lengths stays out of step until rewind" * doctest::timeout(30)) {
  auto a = [](std::vector<u64> bad, u64 n) {
    return ferry::from_generator(n, gen_fn{std::move(bad), 0}) | ferry::map(map_fn{spec{kind::map, 1}});
  };
  auto z = ferry::zip(a({2}, 6), a({}, 6) | ferry::prefetch(2)) | ferry::map(zip_fn{});
  for (int epoch = 0; epoch < 2; ++epoch) {
    CHECK(z.next() == zip_fn{}({7, 7}));
    CHECK(z.next() == zip_fn{}({21, 21}));
    CHECK_THROWS_WITH(z.next(), doctest::Contains("generator failed at 2"));  // from_generator adds context
    for (int i = 0; i < 3; ++i) CHECK_THROWS_AS(z.next(), ferry::error);
    CHECK_THROWS_AS(ferry::save_state(z), ferry::error);
    z.rewind();
  }
  auto u = ferry::zip(a({}, 5), a({}, 3));
  for (int i = 0; i < 3; ++i) CHECK(u.next().has_value());
  CHECK_THROWS_AS(u.next(), ferry::error);
  CHECK_THROWS_AS(u.next(), ferry::error);
  u.rewind();
  CHECK(u.next() == std::pair<u64, u64>{7, 7});
}
