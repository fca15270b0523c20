// ferry/any_source.hpp: any_source<T>, a pipeline of elements T whose type is erased (what
// tf.data's Dataset is to Python): pipelines chosen at run time, returned from a function
// in a .cpp file, or kept as a class member, without spelling their type.
//
//   ferry::any_source<sample> make_input(const config& c) {
//     auto p = ferry::from_files(c.files, c.format) | ferry::map(decode);
//     if (c.train) return std::move(p) | ferry::shuffle(c.buffer, c.seed);  // another type,
//     return p;                                                             // same any_source
//   }
//   auto batches = make_input(cfg) | ferry::batch(256) | ferry::prefetch(2);
//   src | ferry::erase_type()        // the same, as a stage
//
// An any_source is the pipeline it holds, seen through one virtual call per next():
// - next_bulk() forwards to the held pipeline's (or pulls element by element inside the
//   held object), so batch() over an any_source of plain values costs one virtual call per
//   batch, not per element; any_source<record> lends records to batch() without a
//   reference each (next_borrowed) when the held pipeline does, else in one block per call.
// - save()/restore() write and read exactly the held pipeline's state, nothing of their
//   own: a checkpoint of a typed pipeline restores into the erased one and back.
// - report()/trace see the held pipeline's stages (any_source itself is not a stage).
// - distribute() finds batch()'s size and its buffer hook through it, so batches still
//   collate into pinned memory.
// Capabilities the held pipeline lacks become run-time errors instead of compile errors:
// rewind() (so repeat() at the end of its first epoch) throws config_error when the held
// pipeline is not rewindable, save()/restore() when it is not resumable; can_rewind() and
// can_save() tell beforehand. A default-constructed or moved-from any_source is empty:
// next() and the rest throw config_error.
// Threads: none of its own; everything runs on the thread calling next(), as the held
// pipeline would. Throws what the held pipeline throws, unchanged, plus config_error as
// above and std::bad_alloc (construction; the record fallback's block). A run pulled
// element by element for next_bulk() loses its elements before an error with it, as bulk
// sources do (batch() drops the batch it was building on any error either way).
#pragma once

#include <concepts>
#include <cstddef>
#include <memory>
#include <memory_resource>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/memory/buffer.hpp"
#include "ferry/observe/hooks.hpp"
#include "ferry/source.hpp"
#include "ferry/stage.hpp"
#include "ferry/sources/record.hpp"
#include "ferry/state.hpp"

namespace ferry {

// A pipeline of elements T, its type erased (see the file's top).
template <class T>
class any_source : public source_interface<any_source<T>> {
  struct iface {
    virtual ~iface() = default;
    // Fills `out` (empty on entry) field by field, not a returned optional: GCC returns an
    // optional<small T> in a register assembled on the stack from two narrow stores and
    // read back with one wide load, which stalls store forwarding (13 ns instead of 2 per
    // element, measured).
    virtual void next(std::optional<T>& out) = 0;
    virtual std::size_t next_bulk(std::span<T> out) = 0;
    virtual std::size_t next_borrowed(borrowed_records& out, std::size_t max) = 0;
    virtual bool can_rewind() const noexcept = 0;
    virtual void rewind() = 0;
    virtual bool can_save() const noexcept = 0;
    virtual void save(state_writer& w) const = 0;
    virtual void restore(state_reader& r) = 0;
    virtual void mark_restore_failed() noexcept = 0;
    virtual bool restore_failed() const noexcept = 0;
    virtual void refused_pull() = 0;
    virtual std::size_t batch_size() const = 0;
    virtual bool joins_collectives() const noexcept = 0;
    virtual bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) = 0;
    virtual void visit_stages(observe::stage_visitor& v) const = 0;
  };

  template <class S>
  struct holder final : iface {
    S s;
    [[no_unique_address]] observe::upstream_probe<S> probe;
    explicit holder(S&& x) : s(detail::live_or_throw(std::move(x))) {}

    // A ferry stage's check of a failed restore, once a call: the probe's pull skips it (a
    // stage's own check covers its upstream; nothing covers the held pipeline but this),
    // and once per element cost the erased batch path 40% (bench_overhead).
    void check_usable() {
      if constexpr (observe::observable<S>)
        if (detail::restore_failed_in(s)) [[unlikely]] {
          if (detail::joins_collectives_now(s)) detail::tell_refused_pull(s);  // lockstep: see stage.hpp
          if constexpr (requires { S::name; })
            detail::throw_unusable(S::name, detail::stage_state::restore_failed);
          else
            detail::throw_unusable("any_source", detail::stage_state::restore_failed);
        }
    }
    void next(std::optional<T>& out) override {
      check_usable();
      std::optional<T> e = probe.pull(s);
      if (e) out.emplace(std::move(*e));  // field by field (see iface::next)
    }
    std::size_t next_bulk(std::span<T> out) override {
      if constexpr (bulk_source<S>) {
        return probe.pull_bulk(s, out);  // s.next_bulk() checks
      } else if constexpr (std::is_move_assignable_v<T>) {
        check_usable();
        std::size_t k = 0;
        for (; k < out.size(); ++k) {
          std::optional<T> e = probe.pull(s);
          if (!e) break;
          out[k] = std::move(*e);
        }
        return k;
      } else {
        return 0;  // not reached: any_source::next_bulk needs a trivially copyable T
      }
    }
    std::size_t next_borrowed(borrowed_records& out, std::size_t max) override {
      if constexpr (borrowing_source<S>) {
        return probe.pull_borrowed(s, out, max);  // s.next_borrowed() checks
      } else if constexpr (std::same_as<T, record>) {
        // The records themselves keep their bytes alive: one block holds them for the
        // views, instead of a reference per record.
        check_usable();
        auto block = std::make_shared<std::vector<record>>();
        block->reserve(max);
        while (block->size() < max) {
          std::optional<record> e = probe.pull(s);
          if (!e) break;
          block->push_back(std::move(*e));
        }
        const std::size_t n = block->size();  // appended: `out` may hold views already
        if (n == 0) return 0;
        for (const record& x : *block) out.views.push_back(x.bytes());
        out.owners.push_back(std::move(block));
        return n;
      } else {
        return 0;  // not reached: any_source::next_borrowed needs T = record
      }
    }
    bool can_rewind() const noexcept override { return rewindable_source<S>; }
    void rewind() override {
      if constexpr (rewindable_source<S>)
        s.rewind();
      else
        throw config_error("any_source: the pipeline it holds cannot rewind (a source or stage "
                           "without rewind(), e.g. a from_generator over a callable that is "
                           "not rewindable), so repeat() over it cannot start a second epoch");
    }
    bool can_save() const noexcept override { return resumable_source<S>; }
    void save(state_writer& w) const override {
      if constexpr (resumable_source<S>)
        s.save(w);
      else
        throw config_error("any_source: the pipeline it holds cannot be checkpointed (a source "
                           "or stage without save()/restore())");
    }
    void restore(state_reader& r) override {
      if constexpr (resumable_source<S>)
        s.restore(r);
      else
        throw config_error("any_source: the pipeline it holds cannot be restored (a source or "
                           "stage without save()/restore())");
    }
    void mark_restore_failed() noexcept override {
      if constexpr (requires { ferry_mark_restore_failed(s); }) ferry_mark_restore_failed(s);
    }
    bool restore_failed() const noexcept override { return detail::restore_failed_in(s); }
    void refused_pull() override { detail::tell_refused_pull(s); }
    std::size_t batch_size() const override {
      if constexpr (sized_batches<S>)
        return s.batch_size();
      else
        return 0;
    }
    bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) override {
      return detail::forward_buffer_resource(s, r);
    }
    bool joins_collectives() const noexcept override { return detail::joins_collectives_now(s); }
    void visit_stages(observe::stage_visitor& v) const override { probe.visit(s, v); }
  };

 public:
  using value_type = T;  // the element type

  any_source() = default;
  // Takes the pipeline by value (move it in). Throws std::bad_alloc, and config_error when
  // the pipeline was moved from.
  // (any_source itself is ruled out first: asking whether it is a source would ask whether
  // it is movable, which asks this constructor again; clang recurses.)
  template <class S>
    requires(!std::same_as<std::remove_cvref_t<S>, any_source> && source<S> && std::same_as<value_t<S>, T>)
  any_source(S&& s)  // NOLINT: implicit, so a function can return differently typed pipelines
      : p_(std::make_unique<holder<std::remove_cvref_t<S>>>(std::move(s))) {
    detail::require_rvalue_source<S>();
  }

  // False when default-constructed or moved from.
  explicit operator bool() const noexcept { return p_ != nullptr; }

  // The held pipeline's next(); throws config_error when empty.
  std::optional<T> next() {
    std::optional<T> out;
    held().next(out);
    return out;
  }
  // The held pipeline's next_bulk(), or next() element by element inside the holder: one
  // virtual call per run.
  std::size_t next_bulk(std::span<T> out)
    requires std::is_trivially_copyable_v<T>
  {
    return held().next_bulk(out);
  }
  // Records lent as views: the held pipeline's next_borrowed(), or its records held in one
  // block per call.
  std::size_t next_borrowed(borrowed_records& out, std::size_t max)
    requires std::same_as<T, record>
  {
    return held().next_borrowed(out, max);
  }
  // Whether rewind() will work (the held pipeline is rewindable).
  bool can_rewind() const noexcept { return p_ && p_->can_rewind(); }
  // The held pipeline's rewind(); throws config_error when it has none (or when empty).
  void rewind() { held().rewind(); }
  // Whether save() and restore() will work (the held pipeline is resumable).
  bool can_save() const noexcept { return p_ && p_->can_save(); }
  // Writes exactly the held pipeline's state; throws config_error when it cannot save.
  void save(state_writer& w) const { held().save(w); }
  // Reads exactly the held pipeline's state; throws config_error when it cannot restore.
  // A restore that throws leaves the held pipeline marked as it leaves a typed one
  // (stage.hpp): next() throws config_error until rewind() or a good restore.
  void restore(state_reader& r) { held().restore(r); }
  // restore_state's hook, found by argument-dependent lookup (not for users): marks the
  // held pipeline as after a failed restore (stage.hpp).
  friend void ferry_mark_restore_failed(any_source& a) noexcept {
    if (a.p_) a.p_->mark_restore_failed();
  }
  // Whether a restore into the held pipeline failed part way (not for users; a stage built
  // over this any_source asks it).
  friend bool ferry_restore_failed(const any_source& a) noexcept { return a.p_ && a.p_->restore_failed(); }
  // tell_refused_pull's walk through the held pipeline (not for users; stage.hpp).
  friend void ferry_refused_pull(any_source& a) {
    if (a.p_) a.p_->refused_pull();
  }
  // The held batch()'s size, 0 when no batch() is visible in the held pipeline (then
  // distribute() infers it from the first batch, as for any unsized pipeline).
  std::size_t batch_size() const
    requires detail::is_batch_of<T>::value
  {
    return held().batch_size();
  }
  // Hands r to the held pipeline's batch() (distribute's pinned pool); false when none took it.
  bool set_buffer_resource(const std::shared_ptr<std::pmr::memory_resource>& r) {
    return held().set_buffer_resource(r);
  }
  // Whether the held pipeline joins a collective on each next() (lockstep, cache_on_device
  // across ranks): its type is erased, so prefetch and map's workers ask this at run time
  // and refuse it (config_error) as they refuse such a typed pipeline at compile time.
  bool joins_collectives_at_run_time() const noexcept { return p_ && p_->joins_collectives(); }
  // The held pipeline's report() rows; none when empty.
  void visit_stages(observe::stage_visitor& v) const {
    if (p_) p_->visit_stages(v);
  }

 private:
  iface& held() const {
    if (!p_) throw config_error("any_source: empty (default-constructed or moved from)");
    return *p_;
  }

  std::unique_ptr<iface> p_;
};

// src | erase_type(): src as an any_source<value_t<src>>.
struct erase_type_t {
  // erase_type(src): src (moved in) as an any_source.
  template <source S>
  auto operator()(S&& s) const {
    detail::require_rvalue_source<S>();
    return any_source<value_t<S>>(std::move(s));
  }
  // erase_type(): the closure, for `src | erase_type()`.
  auto operator()() const {
    return make_closure([]<class S>(S&& s) { return erase_type_t{}(std::forward<S>(s)); });
  }
};
// erase_type(): a pipeline's type erased into an any_source, as a stage.
inline constexpr erase_type_t erase_type{};

}  // namespace ferry
