// The optimizer's learning-rate schedule (train/optimizer.hpp: LrSchedule): linear warm-up,
// then constant, cosine or linear decay to min_lr.
#include <cmath>
#include <stdexcept>

#include "train/optimizer.hpp"

namespace flowrun {

LrDecay lr_decay(const std::string& name) {
  if (name == "constant") return LrDecay::constant;
  if (name == "cosine") return LrDecay::cosine;
  if (name == "linear") return LrDecay::linear;
  throw std::invalid_argument("unknown lr schedule '" + name + "' (constant, cosine or linear)");
}

double LrSchedule::at(int64_t step, int64_t last_step) const {
  if (warmup > 0 && step <= warmup) return lr * static_cast<double>(step) / static_cast<double>(warmup);
  if (kind == LrDecay::constant || last_step <= warmup) return lr;
  double progress = static_cast<double>(step - warmup) / static_cast<double>(last_step - warmup);
  progress = std::min(1.0, std::max(0.0, progress));
  if (kind == LrDecay::cosine) return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
  return lr - (lr - min_lr) * progress;  // linear
}

}  // namespace flowrun
