// ferry/train/replica.hpp: one replica of the MLP on one backend: its parameters,
// optimizer state, packed gradient buffer and activations, all allocated up front for
// `max_rows` rows, and the forward / backward / update of one step.
//
// Backend-generic: the same code drives host_backend (OpenBLAS + Thrust CPP) and
// gpu_backend (cuBLAS + Thrust CUDA on the replica's stream). The communicator's
// collectives take this replica's buffers, so they must live where the communicator
// expects them (host for threads/MPI, device for NCCL).
//
// CUDA graphs (step(..., graphs = true), backends with capture(): gpu_backend): the step's
// work (forward, backward, all-reduce, update) is captured once per slice shape (rows,
// valid) into a graph whose inputs are two buffers of the replica's own; each step copies
// the slice into them (two device-to-device copies) and launches the graph: 3 calls
// instead of about 25 launches. Up to max_graphs shapes are kept (the oldest is dropped
// for a new one); a training run has one or two (full batches, and a last partial one).
//
// Throws config_error when a slice has more rows than max_rows, more valid rows than rows,
// or a negative count (each its own message); backend errors propagate.
// Used by one thread at a time (the replica's thread in mirrored_trainer).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/collective/communicator.hpp"
#include "ferry/config.hpp"
#include "ferry/error.hpp"
#include "ferry/train/loss.hpp"
#include "ferry/train/mlp.hpp"
#include "ferry/train/optimizer.hpp"

namespace ferry::train {

// One replica's slice of a global batch: `rows` rows of inputs() floats and labels, in the
// backend's memory; rows [valid, rows) are padding and carry no loss or gradient: the
// replica never reads them (whatever they hold, NaN included, the weights are those of
// the `valid` rows alone).
struct replica_input {
  const float* x = nullptr;  // rows x inputs() floats, row-major
  const std::int32_t* y = nullptr;  // rows class labels
  int rows = 0;  // rows in the slice, at most the replica's max_rows
  int valid = 0;  // leading rows that are real data (the rest is padding)
};

// What is wrong with a slice for replicas of max_rows rows, each fault in its own words
// ("" when nothing is): said after "... slice ". Pure, the caller's thread; throws only
// std::bad_alloc.
inline std::string slice_problem(const replica_input& in, int max_rows) {
  const std::string counts = std::to_string(in.rows) + " rows, " + std::to_string(in.valid) + " valid";
  if (in.rows < 0 || in.valid < 0) return "has a negative count (" + counts + ")";
  if (in.valid > in.rows)
    return "has more valid rows than rows (" + counts + "); valid rows are the leading rows of the slice";
  if (in.rows > max_rows)
    return "has " + std::to_string(in.rows) + " rows; at most max_rows = " + std::to_string(max_rows) + " fit";
  return {};
}

// Global figures of one step or evaluation, identical on every replica.
struct step_stats {
  double loss = 0;      // weighted mean loss over the global batch
  double accuracy = 0;  // fraction of valid rows predicted right
  double weight = 0;    // sum of row weights
  double rows = 0;      // valid rows
};

// z = z + b (per column), then ReLU unless this is the last layer; run over (row, column)
// with for_each_2d so the host loops a row at a time (vectorized) and the GPU flat.
struct bias_act {
  float* z;  // the layer's pre-activations, rows x out, updated in place
  const float* b;  // the layer's bias, out floats
  int out;  // the layer's width
  bool relu;  // apply ReLU (every layer but the last)
  // Element (r, c).
  FERRY_HOST_DEVICE void operator()(std::size_t r, std::size_t c) const {
    const std::size_t i = r * std::size_t(out) + c;
    const float v = z[i] + b[c];
    z[i] = (relu && v < 0.0f) ? 0.0f : v;
  }
};

// d = d * (a > 0): the ReLU's backward, from its output (a select, not a branch, so the
// host loop vectorizes).
struct relu_backward {
  float* d;  // the gradient flowing back, updated in place
  const float* a;  // the ReLU's output in the forward pass
  // Element i.
  FERRY_HOST_DEVICE void operator()(std::size_t i) const { d[i] = a[i] > 0.0f ? d[i] : 0.0f; }
};

// One replica of the MLP on one Backend (host_backend, gpu_backend): see the file's top.
template <class Backend>
class replica {
 public:
  // Allocates everything for max_rows rows on the backend built from args, and uploads
  // init (the parameters). Throws config_error for a bad optimizer_config, max_rows < 1 or
  // init of the wrong size; backend errors propagate.
  template <class... BackendArgs>
  replica(const mlp_config& cfg, const optimizer_config& opt, const std::vector<float>& init,
          int max_rows, BackendArgs&&... args)
      : lay_(cfg), opt_(opt), be_(std::forward<BackendArgs>(args)...), max_rows_(max_rows) {
    opt_.validate();
    if (max_rows < 1) throw config_error("replica: max_rows must be at least 1");
    if (init.size() != lay_.params)
      throw config_error("replica: " + std::to_string(init.size()) + " initial parameters for a "
                         "model of " + std::to_string(lay_.params));
    const std::size_t P = lay_.params;
    params_ = be_.alloc(P);
    grads_ = be_.alloc(lay_.grad_floats());
    state_ = be_.alloc(P * opt_.state_per_param());
    for (std::size_t l = 0; l < lay_.layers(); ++l)
      acts_.push_back(be_.alloc(std::size_t(max_rows) * std::size_t(lay_.out(l))));
    d0_ = be_.alloc(std::size_t(max_rows) * std::size_t(lay_.widest()));
    d1_ = be_.alloc(std::size_t(max_rows) * std::size_t(lay_.widest()));
    stats_ = be_.alloc(std::size_t(max_rows) * 4);
    ones_ = be_.alloc(std::size_t(max_rows));
    eval_ = be_.alloc(mlp_layout::extras);
    totals_ = be_.alloc(2 * mlp_layout::extras);  // zeroed: no steps yet
    eval_totals_ = be_.alloc(2 * mlp_layout::extras);
    if (opt_.kind == optimizer_kind::adam) sched_ = be_.alloc(adam_schedule::floats);
    be_.fill(ones_, std::size_t(max_rows), 1.0f);
    be_.upload(params_, init.data(), P * sizeof(float));
    if (!cfg.class_weights.empty()) {
      cw_ = be_.alloc(cfg.class_weights.size());
      be_.upload(cw_, cfg.class_weights.data(), cfg.class_weights.size() * sizeof(float));
    }
    be_.sync();
  }

  // The model's shape and parameter offsets.
  const mlp_layout& layout() const { return lay_; }
  // The backend the replica runs on.
  Backend& backend() { return be_; }
  // The packed gradient buffer (gradients, then the step statistics), backend memory:
  // what the communicator all-reduces.
  std::span<float> gradient_buffer() { return {grads_, lay_.grad_floats()}; }
  // The parameters, backend memory.
  std::span<float> parameters() { return {params_, lay_.params}; }
  // The most rows a slice may have.
  int max_rows() const { return max_rows_; }

  // Forward, loss and backward: the gradient of the SUMMED loss of this slice, and its
  // statistics, land in gradient_buffer(). Only the `valid` leading rows are computed:
  // padding rows cancelled by a weight of 0 would still reach the GEMMs, and 0 * NaN is
  // NaN, so one NaN or Inf in padding would poison every weight.
  void forward_backward(const replica_input& in) {
    check(in);
    const int n = in.valid;
    float* G = grads_;
    if (n == 0) {
      be_.fill(G, lay_.grad_floats(), 0.0f);
      return;
    }
    forward(in.x, n);
    const std::size_t L = lay_.layers();
    be_.for_each(std::size_t(n), softmax_xent_rows{acts_[L - 1], in.y, cw_, d0_, stats_,
                                                   lay_.classes(), n});
    be_.for_each(mlp_layout::extras, sum_stats{stats_, G + lay_.params, n});
    float* d = d0_;
    float* dn = d1_;
    for (std::size_t l = L; l-- > 0;) {
      const int I = lay_.in(l), O = lay_.out(l);
      const float* a_prev = l == 0 ? in.x : acts_[l - 1];
      be_.gemm(true, false, O, I, n, d, O, a_prev, I, 0.0f, G + lay_.w_off[l], I);
      be_.gemv_t(n, O, d, ones_, G + lay_.b_off[l]);
      if (l > 0) {
        be_.gemm(false, false, n, I, O, d, O, params_ + lay_.w_off[l], I, 0.0f, dn, I);
        be_.for_each(std::size_t(n) * std::size_t(I), relu_backward{dn, acts_[l - 1]});
        std::swap(d, dn);
      }
    }
  }

  // Whether the backend has CUDA graphs (a Backend::graph type: gpu_backend).
  static constexpr bool has_graphs = requires { typename Backend::graph; };
  static constexpr std::size_t max_graphs = 4;  // slice shapes whose graphs are kept
  // A training step: forward_backward, then reduce_and_update. With `graphs`, on a backend
  // with CUDA graphs and a slice of at least one valid row, through the slice shape's graph
  // (captured on its first use; see the top of this file); the same work and the same
  // weights either way. Elsewhere `graphs` is ignored.
  template <communicator Comm>
  void step(const replica_input& in, Comm& comm, bool graphs) {
    if constexpr (has_graphs) {
      if (graphs && in.valid > 0) {
        graph_step(in, comm);
        return;
      }
    }
    forward_backward(in);
    reduce_and_update(comm);
  }
  // Graphs captured so far (each a new slice shape, or one dropped and met again).
  std::uint64_t graphs_captured() const { return captured_; }

  // All-reduce (sum) the packed buffer, one call, then update the parameters.
  template <communicator Comm>
  void reduce_and_update(Comm& comm) {
    comm.all_reduce_sum(gradient_buffer());
    update();
  }

  // The optimizer step from the (already reduced) gradient buffer. Adam's step count
  // advances on the backend, only when the weight sum is > 0 (no host round trip).
  void update() {
    const float* wsum = grads_ + lay_.params + mlp_layout::weight_sum;
    if (opt_.kind == optimizer_kind::sgd) {
      be_.for_each(lay_.params, sgd_update{params_, grads_, state_, wsum, opt_.lr, opt_.momentum});
    } else {
      be_.for_each(1, adam_advance{sched_, wsum, opt_.lr, opt_.beta1, opt_.beta2});
      be_.for_each(lay_.params, adam_update{params_, grads_, state_, state_ + lay_.params, wsum,
                                            sched_, opt_.beta1, opt_.beta2, opt_.eps});
    }
  }

  // The statistics part of the gradient buffer, read back to the host (waits for the
  // backend).
  step_stats read_stats() { return to_stats(grads_ + lay_.params); }

  // Adds the statistics part of the (reduced) gradient buffer into the running totals, on
  // the backend: one 4-element op enqueued after the step's work, no wait.
  void add_to_totals() { be_.for_each(mlp_layout::extras, add_stats{grads_ + lay_.params, totals_}); }
  // The running totals since the last take, read back (one wait for the backend), then
  // zeroed on the backend, ordered before any later add_to_totals().
  step_stats take_totals() { return take(totals_); }
  // The same for evaluations: the (reduced) eval buffer added into totals of their own.
  void add_eval_to_totals() { be_.for_each(mlp_layout::extras, add_stats{eval_, eval_totals_}); }
  // The evaluation totals since the last take, as take_totals() does for steps.
  step_stats take_eval_totals() { return take(eval_totals_); }

 private:
  step_stats take(float* totals) {
    float h[2 * mlp_layout::extras];
    be_.download(h, totals, sizeof h);
    be_.fill(totals, 2 * mlp_layout::extras, 0.0f);
    double t[mlp_layout::extras];
    for (std::size_t k = 0; k < mlp_layout::extras; ++k)
      t[k] = double(h[k]) + double(h[mlp_layout::extras + k]);
    return stats_of(t);
  }

 public:
  // Forward and loss only, over the `valid` leading rows (as forward_backward); returns the
  // summed stats of this slice (not reduced) in the backend's 4-float eval buffer, which
  // the caller all-reduces.
  std::span<float> evaluate_local(const replica_input& in) {
    check(in);
    const int n = in.valid;
    if (n == 0) {
      be_.fill(eval_, mlp_layout::extras, 0.0f);
      return {eval_, mlp_layout::extras};
    }
    forward(in.x, n);
    be_.for_each(std::size_t(n),
                 softmax_xent_rows{acts_[lay_.layers() - 1], in.y, cw_, d0_, stats_,
                                   lay_.classes(), n});
    be_.for_each(mlp_layout::extras, sum_stats{stats_, eval_, n});
    return {eval_, mlp_layout::extras};
  }
  // The (reduced) eval buffer, read back to the host (waits for the backend).
  step_stats read_eval() { return to_stats(eval_); }

  // The logits of the last forward pass (its slice's valid rows x classes), backend memory.
  const float* logits() const { return acts_.back(); }

  // The parameters, copied to the host (waits for the backend).
  std::vector<float> download_params() {
    std::vector<float> p(lay_.params);
    be_.download(p.data(), params_, p.size() * sizeof(float));
    return p;
  }
  // Replaces the parameters and clears the optimizer state.
  void upload_params(const std::vector<float>& p) {
    be_.upload(params_, p.data(), p.size() * sizeof(float));
    be_.fill(state_, lay_.params * opt_.state_per_param(), 0.0f);
    if (sched_) be_.fill(sched_, adam_schedule::floats, 0.0f);
    be_.sync();
  }

 private:
  void check(const replica_input& in) const {
    if (std::string why = slice_problem(in, max_rows_); !why.empty())
      throw config_error("replica: a slice " + why);
  }
  void forward(const float* x, int n) {
    const float* a = x;
    for (std::size_t l = 0; l < lay_.layers(); ++l) {
      const int I = lay_.in(l), O = lay_.out(l);
      be_.gemm(false, true, n, O, I, a, I, params_ + lay_.w_off[l], I, 0.0f, acts_[l], O);
      be_.for_each_2d(std::size_t(n), std::size_t(O),
                      bias_act{acts_[l], params_ + lay_.b_off[l], O, l + 1 < lay_.layers()});
      a = acts_[l];
    }
  }
  template <communicator Comm>
  void graph_step(const replica_input& in, Comm& comm) {
    if constexpr (has_graphs) {
      check(in);
      const std::size_t I = std::size_t(lay_.inputs());
      if (!xin_) {  // on the first graph step, outside any capture
        xin_ = be_.alloc(std::size_t(max_rows_) * I);
        yin_ = be_.alloc(std::size_t(max_rows_));  // int32 labels, float-sized slots
      }
      std::size_t k = 0;
      while (k < graphs_.size() && (graphs_[k].rows != in.rows || graphs_[k].valid != in.valid)) ++k;
      if (k == graphs_.size()) {
        const replica_input staged{xin_, reinterpret_cast<const std::int32_t*>(yin_), in.rows, in.valid};
        typename Backend::graph g = be_.capture([&] {
          forward_backward(staged);
          reduce_and_update(comm);
        });
        if (graphs_.size() == max_graphs) graphs_.erase(graphs_.begin());
        graphs_.push_back({in.rows, in.valid, std::move(g)});
        ++captured_;
        k = graphs_.size() - 1;
      }
      // The valid rows only: the graph reads no padding (forward_backward).
      be_.copy(xin_, in.x, std::size_t(in.valid) * I * sizeof(float));
      be_.copy(yin_, in.y, std::size_t(in.valid) * sizeof(std::int32_t));
      be_.launch(graphs_[k].g);
    }
  }
  struct no_graphs {
    struct graph {};
  };
  struct shape_graph {
    int rows = 0, valid = 0;
    typename std::conditional_t<has_graphs, Backend, no_graphs>::graph g;
  };

  step_stats to_stats(const float* ex) {
    float h[mlp_layout::extras];
    be_.download(h, ex, sizeof h);
    const double t[mlp_layout::extras] = {h[0], h[1], h[2], h[3]};
    return stats_of(t);
  }
  static step_stats stats_of(const double* t) {
    step_stats s;
    s.weight = t[mlp_layout::weight_sum];
    s.rows = t[mlp_layout::valid];
    s.loss = s.weight > 0 ? t[mlp_layout::loss_sum] / s.weight : 0.0;
    s.accuracy = s.rows > 0 ? t[mlp_layout::correct] / s.rows : 0.0;
    return s;
  }

  mlp_layout lay_;
  optimizer_config opt_;
  Backend be_;
  int max_rows_;
  float *params_ = nullptr, *grads_ = nullptr, *state_ = nullptr, *cw_ = nullptr;
  float *d0_ = nullptr, *d1_ = nullptr, *stats_ = nullptr, *ones_ = nullptr, *eval_ = nullptr;
  float* totals_ = nullptr;  // running sums of the step statistics and their compensations (add_stats)
  float* eval_totals_ = nullptr;  // the same for evaluations (add_eval_to_totals)
  float* sched_ = nullptr;  // Adam's step count and step sizes (adam_schedule), backend memory
  std::vector<float*> acts_;
  // CUDA graphs (graph_step): declared after be_, so destroyed before it.
  std::vector<shape_graph> graphs_;
  std::uint64_t captured_ = 0;
  float *xin_ = nullptr, *yin_ = nullptr;  // the graphs' inputs: a slice's rows and labels
};

}  // namespace ferry::train
