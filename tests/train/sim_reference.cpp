// The host oracle of test_train_sim (see sim_reference.hpp).
#include "sim_reference.hpp"

#include <span>

#include "ferry/sources/from_range.hpp"
#include "ferry/stages/batch.hpp"
#include "ferry/stages/distribute.hpp"
#include "ferry/train/host_trainer.hpp"

namespace sim_ref {

namespace tr = ferry::train;

std::vector<row> rows_of(const blobs& d, std::size_t n) {
  std::vector<row> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    for (int k = 0; k < dim; ++k) std::get<0>(out[i])[k] = d.x[i * dim + k];
    std::get<1>(out[i]) = d.y[i];
  }
  return out;
}

std::vector<float> first_gradient(const tr::mlp_config& cfg, std::uint64_t seed, const blobs& d, int rows,
                                  int valid) {
  const tr::mlp_layout lay(cfg);
  tr::replica<tr::host_backend> h(cfg, {}, tr::init_params(lay, seed), rows, tr::replica_context{});
  h.forward_backward({d.x.data(), d.y.data(), rows, valid});
  return {h.gradient_buffer().begin(), h.gradient_buffer().end()};
}

curve train(const tr::mlp_config& cfg, const tr::trainer_options& o, const blobs& d, int B, int steps,
            int eval_rows) {
  tr::trainer_options ho = o;
  ho.max_rows = std::max(B, eval_rows);
  tr::host_trainer t(cfg, ho, 1);
  curve c;
  for (int s = 0; s < steps; ++s) {
    const std::size_t off = std::size_t(s) * B;
    const tr::replica_input in{d.x.data() + off * dim, d.y.data() + off, B, B};
    const auto st = t.train_step(std::span(&in, 1));
    c.loss.push_back(st.loss);
    c.accuracy.push_back(st.accuracy);
    c.rows.push_back(st.rows);
    c.weight.push_back(st.weight);
  }
  c.params = t.parameters();
  const std::size_t off = std::size_t(steps) * B;
  const tr::replica_input ev{d.x.data() + off * dim, d.y.data() + off, eval_rows, eval_rows};
  c.eval = t.evaluate(std::span(&ev, 1));
  return c;
}

curve train_pipeline(const tr::mlp_config& cfg, const tr::trainer_options& o, const std::vector<row>& rows, int B,
                     int epochs) {
  tr::trainer_options ho = o;
  ho.max_rows = B;
  tr::host_trainer t(cfg, ho, 1);
  auto p = ferry::from_range(rows) | ferry::batch(std::size_t(B)) |
           ferry::distribute(ferry::host_replicas{1}, {.remainder = ferry::remainder_policy::pad});
  curve c;
  for (int e = 0; e < epochs; ++e) {
    for (auto& step : p) {
      const auto st = t.train_step(step);
      c.loss.push_back(st.loss);
      c.accuracy.push_back(st.accuracy);
      c.rows.push_back(st.rows);
      c.weight.push_back(st.weight);
    }
    p.rewind();
  }
  c.params = t.parameters();
  return c;
}

}  // namespace sim_ref
