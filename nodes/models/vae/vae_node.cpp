// vae: a trainable diffusers AutoencoderKL (the module: models/vae/vae.hpp), the model of
// graphs/vae.yaml; objective vae_loss trains it, vae_recon shows and scores its reconstructions,
// and the checkpoint's files load by name into vae_encode and the sampler's `vae`.
// Schema: schemas/vae.yaml. Test: tests/nodes/vae_loss_test.cpp, graph_vae_test.cpp.
#include "common/pretrained.hpp"
#include "models/vae/vae_config.hpp"
#include "models/model_node.hpp"
#include "models/vae/vae.hpp"
#include "registry.hpp"

namespace flowrun::vae {
namespace {

class VaeNode : public ModelNode {
  Config cfg_;
  AutoencoderKL model_{nullptr};
  std::string pretrained_;  // the pretrained folder's weights file, when `pretrained` is set

  Plan configure(SetupContext& ctx) override {
    const Params& p = ctx.params();
    try {
      cfg_ = autoencoder_kl_config(p, written_params(ctx.run(), ctx.name()), &pretrained_);
      cfg_.checkpoint = CheckpointPolicy::parse(p.get<std::string>("checkpoint"));
      cfg_.check();
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    Plan plan{describe(cfg_) + ", /" + std::to_string(cfg_.downsample_factor()) + " per side",
              parameter_count(cfg_, Part::both), cfg_.layers_per_block * static_cast<int64_t>(cfg_.block_out_channels.size()),
              cfg_.checkpoint, !pretrained_.empty()};
    plan.weights_are = "a diffusers AutoencoderKL safetensors file, e.g. a vae graph's checkpoint (graphs/vae.yaml)";
    return plan;
  }

  std::shared_ptr<ModelState> build(uint64_t seed, bool init, std::string& how) override {
    model_ = AutoencoderKL(cfg_, Part::both);
    if (init) {
      init_weights(*model_, seed);
      how = "init, seed " + std::to_string(seed);
    }
    return make_vae_state(model_, /*frozen=*/false);
  }

  void load_weights(ModelState&, const std::string& path) override { load_safetensors(*model_, path); }

  std::string load_pretrained(ModelState& state) override {
    load_weights(state, pretrained_);
    return pretrained_;
  }
};

}  // namespace
}  // namespace flowrun::vae

FLOWRUN_NODE(vae, flowrun::vae::VaeNode)
