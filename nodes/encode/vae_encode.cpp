// vae_encode node (see vae_encode.hpp and schemas/vae_encode.yaml).
#include "encode/vae_encode.hpp"

#include <spdlog/spdlog.h>

#include <map>
#include <set>
#include <stdexcept>
#include <tuple>

#include "common/device.hpp"
#include "common/pretrained.hpp"
#include "models/vae/vae_config.hpp"
#include "common/seed.hpp"
#include "common/tensor_map.hpp"
#include "node.hpp"
#include "parallel/mesh.hpp"
#include "registry.hpp"

namespace flowrun {

uint64_t vae_latent_seed(uint64_t seed, int64_t step, int64_t row) {
  return mix_seed({seed, kSeedTagLatent, static_cast<uint64_t>(step), static_cast<uint64_t>(row)});
}

torch::Tensor encode_latents(ModelState& state, const torch::Tensor& images, const VaeEncodeOptions& o) {
  torch::NoGradGuard no_grad;
  if (!state.autoencoder || !state.autoencoder->encode)
    throw std::runtime_error("encode_latents: model '" + state.kind + "' is not an autoencoder with an encoder");
  const torch::Tensor w = state.module->parameters().front();
  auto [mean, logvar] = state.autoencoder->encode(state, images.to(w.device(), w.scalar_type()));
  torch::Tensor z = mean.to(torch::kFloat);
  if (o.sample) {
    std::vector<torch::Tensor> eps;
    eps.reserve(static_cast<size_t>(mean.size(0)));
    for (int64_t i = 0; i < mean.size(0); ++i) {
      at::Generator g = make_cpu_generator(vae_latent_seed(o.seed, o.step, o.first_row + i));
      eps.push_back(torch::randn(mean.sizes().slice(1), g, torch::TensorOptions().dtype(torch::kFloat)));
    }
    z = z + torch::exp(0.5 * logvar.to(torch::kFloat)) * torch::stack(eps).to(z.device());
  }
  return z * state.autoencoder->scaling_factor;
}

namespace {

class VaeEncodeNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    std::string pretrained;
    vae::Config c;
    try {
      c = autoencoder_kl_config(p, written_params(ctx.run(), ctx.name()), &pretrained);
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    if (!pretrained.empty() && p.has("weights"))
      throw pretrained_and_weights(ctx.who());
    in_key_ = p.get<std::string>("in_key");
    out_key_ = p.get<std::string>("out_key");
    if (in_key_ == out_key_)
      throw std::runtime_error(ctx.who() + ": in_key and out_key are both '" + in_key_ + "'; name the latents otherwise");
    sample_ = p.get<bool>("sample");
    seed_ = node_seed(ctx);
    const uint64_t init_seed = mix_seed({seed_, name_seed(ctx.name()), kSeedTagInit});
    const std::string weights = p.has("weights") ? p.get<std::string>("weights") : pretrained;
    const std::string dtype = p.get<std::string>("dtype");
    const bool decoder = p.get<bool>("decoder");  // for a sampler that decodes with this VAE

    vae::AutoencoderKL model{nullptr};
    try {
      model = vae::make_autoencoder(c, decoder ? vae::Part::both : vae::Part::encoder, weights, init_seed);
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    model->to(run_device(ctx.run()), dtype == "bfloat16" ? torch::kBFloat16 : torch::kFloat);
    state_ = vae::make_vae_state(model);
    // What readers of the params (the evaluator) add to a batch: this node's latents, the
    // posterior mean (the same at every evaluation).
    state_->condition = [in = in_key_, out = out_key_](ModelState& self, const TensorMap& batch) {
      auto it = batch.find(in);
      if (it == batch.end())
        throw std::runtime_error("the batch has no '" + in + "' for the VAE to encode (vae_encode's in_key); its keys: " +
                                 keys_of(batch));
      VaeEncodeOptions mean;
      mean.sample = false;
      return TensorMap{{out, encode_latents(self, it->second, mean)}};
    };
    factor_ = c.downsample_factor();
    if (ctx.run().rank == 0) {
      int64_t n = 0;
      for (const auto& t : model->parameters()) n += t.numel();
      spdlog::info("{}: frozen {} {} ({:.2f}M parameters, {}, {}), {} -> {} ({} x {}, /{} per side, {})",
                   ctx.who(), vae::describe(c), decoder ? "encoder and decoder" : "encoder", static_cast<double>(n) / 1e6, dtype,
                   weights.empty() ? "random init" : "weights from " + weights, in_key_, out_key_,
                   sample_ ? "sample" : "mean", c.scaling_factor, factor_, sample_ ? "seeded per row" : "no noise");
      if (weights.empty())
        spdlog::warn("{}: weights is null: the VAE encoder is randomly initialised (seed {}), so its latents are "
                     "random features, not a real VAE's; give a diffusers diffusion_pytorch_model.safetensors for "
                     "real ones",
                     ctx.who(), init_seed);
    }
    ctx.own_state("params", std::static_pointer_cast<ModelState>(state_));
  }

  void run(StepContext& ctx) override {
    const TensorMap& batch = ctx.in<TensorMap>("batch");
    auto it = batch.find(in_key_);
    if (it == batch.end())
      throw std::runtime_error(ctx.who() + ": step " + std::to_string(ctx.step()) + ": the batch has no '" + in_key_ +
                               "' (in_key); its keys: " + keys_of(batch));
    if (batch.count(out_key_))
      throw std::runtime_error(ctx.who() + ": the batch already has a key '" + out_key_ +
                               "' (out_key); choose another out_key");
    const torch::Tensor& img = it->second;
    const int64_t in_ch = state_->config.in_channels;
    if (img.dim() != 4 || img.size(1) != in_ch || !img.is_floating_point())
      throw std::runtime_error(ctx.who() + ": '" + in_key_ + "' must be float images [B, " + std::to_string(in_ch) +
                               ", H, W] in [-1, 1], got " + std::string(c10::toString(img.scalar_type())) + " " +
                               shape_str(img));
    if (img.size(2) % factor_ != 0 || img.size(3) % factor_ != 0)
      throw std::runtime_error(ctx.who() + ": '" + in_key_ + "' is " + std::to_string(img.size(2)) + "x" +
                               std::to_string(img.size(3)) + ", not divisible by the VAE's downsampling factor " +
                               std::to_string(factor_) + " (2^(len(block_out_channels)-1)); resize or crop to a multiple");
    VaeEncodeOptions o;
    o.sample = sample_;
    o.seed = seed_;
    o.step = ctx.step();
    // By data-parallel replica: the tp ranks of a replica encode the same rows and draw alike.
    o.first_row = static_cast<int64_t>(parallel::replica_of(ctx.run()).index) * img.size(0);
    TensorMap out;
    for (const auto& [k, v] : batch)
      if (k != in_key_) out[k] = v;
    try {
      out[out_key_] = encode_latents(*state_, img, o);
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": step " + std::to_string(ctx.step()) + ": " + e.what());
    }
    ctx.out("latents", std::move(out));
  }

 private:
  std::shared_ptr<vae::VaeState> state_;
  std::string in_key_, out_key_;  // setup: the schema's (defaults there)
  bool sample_ = false;
  uint64_t seed_ = 0;
  int64_t factor_ = 0;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(vae_encode, flowrun::VaeEncodeNode)
