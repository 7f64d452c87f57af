// diffusion_loss: denoising diffusion training (DDPM), the math in train/diffusion.hpp.
// Schema: schemas/diffusion_loss.yaml. Test: tests/nodes/diffusion_test.cpp.
#include "train/losses.hpp"

namespace flowrun {

DiffusionLoss::DiffusionLoss(diffusion::Options o)
    : o_(std::move(o)), schedule_(diffusion::NoiseSchedule::make(o_.schedule, o_.beta_start, o_.beta_end, o_.timesteps)) {
  type = "diffusion_loss";
}

static diffusion::Options options_of(const Params& p) {
  diffusion::Options o;
  o.schedule = diffusion::parse_schedule(p.get<std::string>("schedule"));
  o.beta_start = p.get<double>("beta_start");
  o.beta_end = p.get<double>("beta_end");
  o.timesteps = p.get<int64_t>("timesteps");
  o.prediction = diffusion::parse_prediction(p.get<std::string>("prediction"));
  o.noise_offset = p.get<double>("noise_offset");
  o.x_key = p.get<std::string>("x_key");
  o.cond_drop = p.get<double>("cond_drop");
  if (p.has("cond_drop_t5")) o.cond_drop_t5 = p.get<double>("cond_drop_t5");  // null: with the first stream
  return o;
}

DiffusionLoss::DiffusionLoss(SetupContext& ctx) : DiffusionLoss(options_of(ctx.params())) {}

torch::Tensor DiffusionLoss::loss(ModelState& model, const TensorMap& batch) const {
  return diffusion::loss(model, batch, o_);
}

int64_t DiffusionLoss::targets(const TensorMap& batch) const { return batch.at(o_.x_key).size(0); }

}  // namespace flowrun

FLOWRUN_OBJECTIVE(diffusion_loss, flowrun::DiffusionLoss)
