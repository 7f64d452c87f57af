// The built-in objectives (train/objective.hpp), one node type each: mse_loss (mse_loss.cpp),
// lm_loss (lm_loss.cpp), diffusion_loss (diffusion_loss.cpp). Declared here so that tests and
// benches can make one without a graph.
#pragma once
#include "train/diffusion.hpp"
#include "train/objective.hpp"

namespace flowrun {

// Mean squared error between the model's output and the batch's y; targets: rows.
class MseLoss : public Objective {
 public:
  MseLoss() { type = "mse_loss"; }
  explicit MseLoss(SetupContext&) : MseLoss() {}
  std::vector<std::string> needs() const override { return {"y"}; }
  torch::Tensor loss(ModelState& model, const TensorMap& batch) const override;
  int64_t targets(const TensorMap& batch) const override;
};

// Next-token cross-entropy of a language model: the model maps batch["tokens"] [B, T+1] to
// logits [B, T, vocab] for tokens[:, :-1]; the targets are tokens[:, 1:]; mean over the B*T
// targets. Reports ppl = exp(loss).
class LmLoss : public Objective {
 public:
  LmLoss() { type = "lm_loss"; }
  explicit LmLoss(SetupContext&) : LmLoss() {}
  std::vector<std::string> needs() const override { return {"tokens"}; }
  torch::Tensor loss(ModelState& model, const TensorMap& batch) const override;
  int64_t targets(const TensorMap& batch) const override;
  std::vector<Report> reports() const override;
};

// Denoising diffusion (train/diffusion.hpp: diffusion::loss with these options); targets: rows.
class DiffusionLoss : public Objective {
 public:
  explicit DiffusionLoss(diffusion::Options o);
  explicit DiffusionLoss(SetupContext& ctx);
  std::vector<std::string> needs() const override { return {o_.x_key}; }
  torch::Tensor loss(ModelState& model, const TensorMap& batch) const override;
  int64_t targets(const TensorMap& batch) const override;
  // For samplers: the schedule and prediction the model trains with.
  const diffusion::Options& options() const { return o_; }
  const diffusion::NoiseSchedule& schedule() const { return schedule_; }

 private:
  diffusion::Options o_;
  diffusion::NoiseSchedule schedule_;
};

}  // namespace flowrun
