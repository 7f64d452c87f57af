// The computation behind the ema node, usable on its own (tests, benches).
#pragma once
#include <torch/torch.h>

#include <memory>
#include <utility>
#include <vector>

#include "models/model_state.hpp"

namespace flowrun {

// An exponential moving average of a model's parameters: a deep copy of the model (same
// forward, so it can be evaluated like the model), updated ema = decay*ema + (1-decay)*p.
class EmaModel {
 public:
  // Copies `source` now (its current parameters are the average's start). The copy's
  // parameters do not require grad.
  explicit EmaModel(const ModelState& source);
  // One update from the source's current parameters (trainable ones; frozen ones never
  // change) and buffers (copied). Only reads the source. Runs under NoGradGuard.
  void update(const ModelState& source, double decay);
  const std::shared_ptr<ModelState>& model() const { return ema_; }

 private:
  std::shared_ptr<ModelState> ema_;
  std::vector<torch::Tensor> params_;   // aligned with source.trainable_parameters()
  std::vector<torch::Tensor> buffers_;  // aligned with source.named_buffers()
  FlatParams flat_;                     // params_ in flat buffers, once the source's are
};

// The decay of the update made at step `step` (1-based). Fixed: `max_decay`. With warm-up
// (HunyuanDiT's trainer, diffusers' EMAModel with inv_gamma 1): 1 - (1 + n)^-power for the
// n-th update (n = step - 1, so the first update copies the model), capped at `max_decay`:
// early averages forget the random initialization quickly, later ones average long.
double ema_decay(int64_t step, double max_decay, bool warmup, double power);

}  // namespace flowrun
