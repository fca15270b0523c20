// ferry/sources/global_shuffle.hpp: one global order of a random-access dataset, the same
// for any number of ranks and replicas, and a resume at another rank count that continues
// it exactly (tf.data's global_shuffle; MosaicML Streaming's "elastic determinism", for any
// dataset with an index).
//
//   auto rows = ferry::row_files({"train.npy"}, ferry::npy{});     // or a vector, a span,
//                                                                  // tfrecord / webdataset files
//   auto src = ferry::global_shuffle(rows, {.seed = 7, .global_batch = 256,
//                                           .ranks = world, .rank = me, .resume = saved});
//   const std::uint64_t order = src.order();   // the seed's fingerprint, checked on resume
//   auto steps = std::move(src) | ferry::map(decode, {.workers = 4}) | ferry::batch(256 / world)
//              | ferry::distribute(devices);
//   ... after k global steps of epoch e: save ferry::global_position{e, k, rows.size(), 256, order}
//
// The order: epoch e's element at global position p is dataset[perm_e(p)], perm_e a
// permutation of [0, n) drawn from (seed, e) (a Feistel network: no table, any n), or the
// identity with .shuffle = false. Global step s is positions [s * G, (s + 1) * G); rank w of
// W reads its contiguous part [s * G + w * G / W, s * G + (w + 1) * G / W), which batch(G / W)
// and distribute then split among its replicas in order. So the sequence of global batches
// depends on (seed, epoch, G) alone: W ranks x R replicas each see their slice of the same
// global batch, for any W and R with W x R dividing G. An epoch has floor(n / G) steps on
// every rank (equal steps, no collective needed); the n mod G elements left at an epoch's end
// are a new draw each epoch when shuffled (the same last ones without shuffling).
// rewind() starts the next epoch. Records (row_files') are handed out with this epoch as
// their origin's (record::set_epoch), so a random crop keyed on it changes every epoch.
//
// Resuming at another rank count: the consumer counts the global steps it trained on, and
// saves global_position{epoch, step, dataset size, G, order} (five words; position() gives
// them for the step read next; order() alone is the fingerprint of the seed and shuffle). A pipeline built at any
// W' with .resume = that position starts at that step: over the epoch every element is
// seen exactly once, whatever the rank counts before and after (tests/mpi: 2 -> 4 -> 3).
// pipeline_state (save_state) also works, at the same rank count and rank.
//
// Threads: runs on the thread calling next() (a map or prefetch worker downstream); calls
// the dataset's size() and operator[] there, nothing else of the user's.
//
// Errors: config_error for a global batch of 0, a rank count that does not divide it, a
// rank past the count, a dataset of more than 2^62 elements, a resume position saved over
// a dataset of another size, with another global batch or order, or past the epoch's steps; a
// pipeline_state saved with another dataset size, batch, rank count, rank, seed or
// shuffle. What the dataset's operator[] throws propagates (row_files: io_error).
//
// Memory: the dataset (moved or copied in: a span views the caller's memory) and a few
// words; nothing per element.
//
// Checkpoints: save() records the dataset size, G, W, w, the seed and shuffle (checked at
// restore), then the epoch, the step and the place in this rank's part of it.
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "ferry/detail/permutation.hpp"
#include "ferry/detail/random.hpp"
#include "ferry/error.hpp"
#include "ferry/sources/record.hpp"
#include "ferry/stage.hpp"

namespace ferry {

// A random-access dataset: size() elements, element i by d[i] (a vector, a span,
// ferry::row_files).
template <class D>
concept indexed_dataset = requires(const D& d, std::uint64_t i) {
  { d.size() } -> std::convertible_to<std::uint64_t>;
  d[i];
};

// Where a resumed global_shuffle starts: `step` global steps of `epoch` were trained on.
// dataset_size, global_batch and order (0: not checked) say what the position was counted
// over; position() fills them.
struct global_position {
  std::uint64_t epoch = 0;         // the epoch to resume in
  std::uint64_t step = 0;          // global steps of it already trained on
  std::uint64_t dataset_size = 0;  // the dataset's size when saved
  std::uint64_t global_batch = 0;  // G when saved
  std::uint64_t order = 0;         // the order's fingerprint (its seed and shuffle) when saved
};

namespace detail {
// global_position::order for an order drawn from (seed, shuffle) by the stage named by
// `kind` (global_shuffle's and cache_on_device's orders differ for one seed): never 0.
constexpr std::uint64_t order_fingerprint(std::uint64_t kind, std::uint64_t seed, bool shuffle) {
  return mix_seed({0x6f72646572ull /* "order" */, kind, seed, shuffle ? 1u : 0u}) | 1;
}
// The config_error of a resume position saved over another order.
inline config_error order_mismatch(const char* stage) {
  return config_error(std::string(stage) +
                      ": the resume position was saved over another order (another seed or shuffle; "
                      "global_position::order): resuming would see some elements twice and others never");
}
}  // namespace detail

// global_shuffle's options (see the file's top).
struct global_shuffle_options {
  std::uint64_t seed = 0;          // with the epoch, fixes the order
  bool shuffle = true;             // false: the dataset's own order, still cut into global steps
  std::uint64_t global_batch = 0;  // G: elements per global step, over all ranks (required)
  std::uint64_t ranks = 1;         // W: processes sharing each global step (W divides G)
  std::uint64_t rank = 0;          // w: this process
  std::optional<global_position> resume = std::nullopt;  // start there instead of epoch 0, step 0
};

namespace detail {

template <indexed_dataset D>
class global_shuffle_source
    : public source_base<global_shuffle_source<D>,
                         std::remove_cvref_t<decltype(std::declval<const D&>()[std::uint64_t{}])>> {
  using T = std::remove_cvref_t<decltype(std::declval<const D&>()[std::uint64_t{}])>;
  friend source_base<global_shuffle_source, T>;

 public:
  static constexpr char name[] = "global_shuffle";

  global_shuffle_source(D d, global_shuffle_options o) : d_(std::move(d)), o_(std::move(o)), n_(d_.size()) {
    if (o_.global_batch == 0) throw config_error("global_shuffle: global_batch must be at least 1");
    if (o_.ranks == 0 || o_.global_batch % o_.ranks != 0)
      throw config_error("global_shuffle: " + std::to_string(o_.ranks) + " ranks do not divide the global batch of " +
                         std::to_string(o_.global_batch));
    if (o_.rank >= o_.ranks)
      throw config_error("global_shuffle: rank " + std::to_string(o_.rank) + " of " + std::to_string(o_.ranks));
    if (n_ > (std::uint64_t(1) << 62))
      throw config_error("global_shuffle: a dataset of " + std::to_string(n_) + " elements (at most 2^62)");
    part_ = o_.global_batch / o_.ranks;
    if (o_.resume) {
      const global_position& p = *o_.resume;
      if (p.dataset_size != 0 && p.dataset_size != n_)
        throw config_error("global_shuffle: the resume position was saved over a dataset of " +
                           std::to_string(p.dataset_size) + " elements; this one has " + std::to_string(n_));
      if (p.global_batch != 0 && p.global_batch != o_.global_batch)
        throw config_error("global_shuffle: the resume position counts global steps of " +
                           std::to_string(p.global_batch) + " elements; this pipeline's are " +
                           std::to_string(o_.global_batch));
      if (p.order != 0 && p.order != order()) throw order_mismatch(name);
      if (p.step > steps())
        throw config_error("global_shuffle: the resume position is at step " + std::to_string(p.step) +
                           ", past the epoch's " + std::to_string(steps()));
      epoch_ = p.epoch;
      step_ = p.step;
    }
    draw();
  }

  // Global steps in an epoch: floor(size / G), the same on every rank.
  std::uint64_t steps() const noexcept { return n_ / o_.global_batch; }
  // The dataset's size.
  std::uint64_t size() const noexcept { return n_; }
  // The epoch being read.
  std::uint64_t epoch() const noexcept { return epoch_; }
  // The global position of the step this rank reads next (where a resume would start if
  // the consumer had trained on everything read so far: count consumed steps instead when
  // prefetch or distribute read ahead).
  global_position position() const noexcept { return {epoch_, step_, n_, o_.global_batch, order()}; }
  // The fingerprint of this order (seed, shuffle), as position() fills it.
  std::uint64_t order() const noexcept { return order_fingerprint(0x676c6f62616cull /* "global" */, o_.seed, o_.shuffle); }
  // The element at global position p of this epoch (p < size()): the order itself.
  std::uint64_t index_at(std::uint64_t p) const noexcept { return o_.shuffle ? perm_(p) : p; }

 private:
  std::optional<T> pull() {
    if (step_ >= steps()) return std::nullopt;
    const std::uint64_t p = step_ * o_.global_batch + o_.rank * part_ + j_;
    std::optional<T> out(std::in_place, d_[index_at(p)]);
    if constexpr (std::is_same_v<T, record>) out->set_epoch(epoch_);  // row_files reads with none
    if (++j_ == part_) {
      j_ = 0;
      ++step_;
    }
    return out;
  }
  void draw() {
    if (o_.shuffle && n_ > 0) perm_ = feistel_permutation(n_, mix_seed({0x676c6f62616cull /* "global" */, o_.seed, epoch_}));
  }
  void start_epoch() {
    ++epoch_;
    step_ = j_ = 0;
    draw();
  }
  void save_words(state_writer& w) const {
    for (std::uint64_t v : {n_, o_.global_batch, o_.ranks, o_.rank, o_.seed, std::uint64_t(o_.shuffle)}) w.put(v);
    w.put(epoch_);
    w.put(step_);
    w.put(j_);
  }
  // Throws config_error naming what differs (resume across rank counts: global_position).
  void restore_words(state_reader& r) {
    static constexpr const char* what[] = {"dataset size", "global batch", "rank count", "rank", "seed", "shuffle"};
    const std::uint64_t mine[] = {n_, o_.global_batch, o_.ranks, o_.rank, o_.seed, std::uint64_t(o_.shuffle)};
    for (int k = 0; k < 6; ++k) {
      const std::uint64_t v = r.get();
      if (v != mine[k])
        throw config_error("restore_state: global_shuffle: the state was saved with " + std::string(what[k]) + " " +
                           std::to_string(v) + "; this pipeline has " + std::to_string(mine[k]) +
                           (k == 2 || k == 3 ? " (resume across rank counts with global_shuffle_options::resume)" : ""));
    }
    const std::uint64_t e = r.get(), s = r.get(), j = r.get();
    if (s > steps() || j >= part_ || (s == steps() && j != 0))
      throw config_error("restore_state: global_shuffle: a damaged state (step " + std::to_string(s) + " of " +
                         std::to_string(steps()) + ")");
    epoch_ = e;
    step_ = s;
    j_ = j;
    draw();
  }

  D d_;
  global_shuffle_options o_;
  std::uint64_t n_ = 0, part_ = 1;
  std::uint64_t epoch_ = 0, step_ = 0, j_ = 0;  // the step being read, and the place in this rank's part
  feistel_permutation perm_;
};

}  // namespace detail

// The type of ferry::global_shuffle.
struct global_shuffle_t {
  // A source over dataset d in one global order (see the file's top). Throws config_error.
  template <indexed_dataset D>
  auto operator()(D&& d, global_shuffle_options o) const {
    return detail::global_shuffle_source<std::remove_cvref_t<D>>(std::forward<D>(d), std::move(o));
  }
};
// global_shuffle(dataset, options): one global order for any number of ranks (see above).
inline constexpr global_shuffle_t global_shuffle{};

}  // namespace ferry
