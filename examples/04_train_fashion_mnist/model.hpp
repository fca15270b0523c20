// model.hpp: the example's trainer behind one small virtual interface, so the program's
// loop (g++) drives either the host trainer (OpenBLAS replicas, this TU) or the GPU trainer
// (cuBLAS + NCCL, built by nvcc in gpu_model.cu) without compiling CUDA code itself.
//
// Errors: what the wrapped mirrored_trainer throws (config_error for a step that does not
// fit; backend errors). Used from one thread; the trainer runs its replicas on its own.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ferry/stages/cache_on_device.hpp"
#include "ferry/train/mirrored_trainer.hpp"

namespace fmnist {

namespace tr = ferry::train;

class model {
 public:
  virtual ~model() = default;
  virtual int replicas() const = 0;
  virtual int inputs() const = 0;
  virtual tr::step_stats train_step(std::span<const tr::replica_input> in) = 0;
  // The step without reading its statistics back (no host wait on a GPU); take_stats()
  // returns those of every step since the last take, with one wait.
  virtual void train_step_async(std::span<const tr::replica_input> in) = 0;
  virtual tr::step_stats take_stats() = 0;
  virtual tr::step_stats evaluate(std::span<const tr::replica_input> in) = 0;
  // The evaluation without reading back (no host wait on a GPU); take_eval() returns those
  // of every evaluation since the last take, with one wait.
  virtual void evaluate_async(std::span<const tr::replica_input> in) = 0;
  virtual tr::step_stats take_eval() = 0;
  virtual void save(const std::string& path) = 0;
  virtual void load(const std::string& path) = 0;
  // One compute stream per replica (cudaStream_t; nullptr for host replicas): give these to
  // distribute(cuda::devices{ordinals, streams}) so each slice is ready on the stream the
  // replica's GEMMs and all-reduce run on.
  virtual std::vector<ferry::cuda_stream> streams() = 0;

  // A step as distribute() hands it out.
  template <class Step>
  tr::step_stats train(Step& s) {
    tr::step_inputs(s, std::size_t(replicas()), inputs(), in_);
    return train_step(in_);
  }
  // Needs the step on this model's streams(), as distribute(cuda::devices(ordinals,
  // streams())) hands it out: the trainer's work then orders the step's release after it.
  template <class Step>
  void train_async(Step& s) {
    tr::step_inputs(s, std::size_t(replicas()), inputs(), in_);
    train_step_async(in_);
  }
  template <class Step>
  tr::step_stats eval(Step& s) {
    tr::step_inputs(s, std::size_t(replicas()), inputs(), in_);
    return evaluate(in_);
  }
  // Needs the step on this model's streams(), as train_async does.
  template <class Step>
  void eval_async(Step& s) {
    tr::step_inputs(s, std::size_t(replicas()), inputs(), in_);
    evaluate_async(in_);
  }

 private:
  std::vector<tr::replica_input> in_;
};

template <class Trainer>
class trainer_model final : public model {
 public:
  template <class... A>
  explicit trainer_model(A&&... a) : t_(std::forward<A>(a)...) {}
  int replicas() const override { return t_.replicas(); }
  int inputs() const override { return t_.layout().inputs(); }
  tr::step_stats train_step(std::span<const tr::replica_input> in) override { return t_.train_step(in); }
  void train_step_async(std::span<const tr::replica_input> in) override { t_.train_step_async(in); }
  tr::step_stats take_stats() override { return t_.take_stats(); }
  tr::step_stats evaluate(std::span<const tr::replica_input> in) override { return t_.evaluate(in); }
  void evaluate_async(std::span<const tr::replica_input> in) override { t_.evaluate_async(in); }
  tr::step_stats take_eval() override { return t_.take_eval(); }
  void save(const std::string& p) override { t_.save(p); }
  void load(const std::string& p) override { t_.load(p); }
  std::vector<ferry::cuda_stream> streams() override {
    std::vector<ferry::cuda_stream> s;
    for (int r = 0; r < t_.replicas(); ++r) s.push_back(t_.replica_at(r).backend().stream());
    return s;
  }
  Trainer& trainer() { return t_; }

 private:
  Trainer t_;
};

// Built by gpu_model.cu (nvcc) when the example has a GPU path (FERRY_EXAMPLE_GPU):
// mirrored_trainer<gpu_backend, nccl_communicator>, one replica per listed device, each on
// a compute stream of its own. Throws ferry::error when CUDA, cuBLAS or NCCL fail.
std::unique_ptr<model> make_gpu_model(const tr::mlp_config& cfg, const tr::trainer_options& o,
                                      const std::vector<int>& devices);
// "NVIDIA H100 80GB HBM3" etc., for the log line.
std::string gpu_name(int device);
// cache_on_device's gather kernels for GPU replicas, launched from gpu_model.cu (nvcc):
// this file is compiled by g++ (ferry::cache_on_device_with<gpu_gather>).
struct gpu_gather {
  static void launch(const ferry::cache_gather_args& a, ferry::cuda_stream s);
  static void launch_global(const ferry::cache_global_gather_args& a, ferry::cuda_stream s);
};

}  // namespace fmnist
