// vae: a trainable diffusers AutoencoderKL (the module: models/vae.hpp), the model of
// graphs/vae.yaml; objective vae_loss trains it, vae_recon shows and scores its reconstructions,
// and the checkpoint's files load by name into vae_encode and the sampler's `vae`.
// Schema: schemas/vae.yaml. Test: tests/nodes/vae_loss_test.cpp, graph_vae_test.cpp.
#include <filesystem>

#include "formats/files.hpp"
#include "common/pretrained.hpp"
#include "models/vae_config.hpp"
#include "models/model_node.hpp"
#include "models/vae.hpp"
#include "registry.hpp"

namespace flowrun::vae {
namespace {

class VaeNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    std::string weights;
    Config cfg;
    try {
      cfg = autoencoder_kl_config(p, written_params(ctx.run(), ctx.name()), &weights);
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    cfg.checkpoint = CheckpointPolicy::parse(p.get<std::string>("checkpoint"));
    const uint64_t seed = node_seed(ctx);
    if (!weights.empty() && p.has("weights"))
      throw pretrained_and_weights(ctx.who());
    if (p.has("weights")) {
      weights = resolve_latest(p.get<std::string>("weights"));
      if (!std::filesystem::is_regular_file(weights))
        throw std::runtime_error(ctx.who() + ": weights: " + weights + " does not exist (set " + ctx.name() +
                                 ".weights=PATH to a diffusers AutoencoderKL safetensors file, or null to start from a " +
                                 "seeded init)");
    }
    AutoencoderKL model{nullptr};
    try {
      model = make_autoencoder(cfg, Part::both, weights, seed, /*trainable=*/true);  // checks cfg and its size
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    own_model(ctx, make_vae_state(model, /*frozen=*/false),
              describe(cfg) + ", /" + std::to_string(cfg.downsample_factor()) + " per side",
              weights.empty() ? "init, seed " + std::to_string(seed) : "weights from " + weights);
  }

  void run(StepContext&) override {}  // parameters change only through the optimizer
};

}  // namespace
}  // namespace flowrun::vae

FLOWRUN_NODE(vae, flowrun::vae::VaeNode)
