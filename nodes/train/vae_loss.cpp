// vae_loss: a KL autoencoder's reconstruction + KL objective (the math in train/losses.hpp).
// Schema: schemas/vae_loss.yaml. Test: tests/nodes/vae_loss_test.cpp.
#include "models/dropout.hpp"
#include "models/model_state.hpp"
#include "train/losses.hpp"

namespace flowrun {

VaeLoss::VaeLoss(Options o) : o_(std::move(o)) { type = "vae_loss"; }

static VaeLoss::Options vae_options(const Params& p) {
  VaeLoss::Options o;
  o.kl_weight = p.get<double>("kl_weight");
  o.l1 = p.get<std::string>("recon") == "l1";
  o.sample = p.get<bool>("sample");
  o.image_key = p.get<std::string>("image_key");
  return o;
}

VaeLoss::VaeLoss(SetupContext& ctx) : VaeLoss(vae_options(ctx.params())) {}

torch::Tensor VaeLoss::loss(ModelState& model, const TensorMap& batch) const {
  const ModelState::Autoencoder* vae = model.autoencoder.get();
  if (!vae || !vae->encode || !vae->decode)
    throw std::runtime_error("objective " + type + ": the model is '" + model.kind +
                             "', not an AutoencoderKL with encoder and decoder (connect a vae node's params)");
  const torch::Tensor& images = batch.at(o_.image_key);
  const int64_t f = vae->downsample;
  if (images.dim() != 4 || images.size(1) != vae->in_channels || images.size(2) % f != 0 || images.size(3) % f != 0)
    throw std::runtime_error("objective " + type + ": '" + o_.image_key + "' must be images [B, " +
                             std::to_string(vae->in_channels) + ", H, W] with H and W multiples of " +
                             std::to_string(f) + " (the VAE's downsampling), got " + shape_str(images));
  const torch::Tensor w = model.module->parameters().front();
  const torch::Tensor x = images.to(w.device(), w.scalar_type());

  auto [mean, logvar] = vae->encode(model, x);
  torch::Tensor z = mean;
  if (at::Generator* g = o_.sample ? TrainingScope::current_on(mean.device()) : nullptr) {
    torch::Tensor eps;
    {
      torch::NoGradGuard no_grad;
      eps = torch::randn(mean.sizes(), *g, mean.options().requires_grad(false));
    }
    z = mean + torch::exp(0.5 * logvar) * eps;
  }
  const torch::Tensor err = vae->decode(model, z).to(torch::kFloat) - images.to(x.device(), torch::kFloat);
  const torch::Tensor rec = o_.l1 ? err.abs().mean() : err.pow(2).mean();
  const torch::Tensor m = mean.to(torch::kFloat), lv = logvar.to(torch::kFloat);
  const torch::Tensor kl = (0.5 * (m.pow(2) + lv.exp() - 1.0 - lv)).sum({1, 2, 3}).mean();
  return rec + (o_.kl_weight / static_cast<double>(images[0].numel())) * kl;
}

int64_t VaeLoss::targets(const TensorMap& batch) const { return batch.at(o_.image_key).size(0); }

}  // namespace flowrun

FLOWRUN_OBJECTIVE(vae_loss, flowrun::VaeLoss)
