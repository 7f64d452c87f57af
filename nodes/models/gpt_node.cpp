// gpt: a GPT-2 language model node (owns its parameters; no per-step work), with LoRA adapters
// when the graph asks (models/model_node.hpp). The module, its init and its loader are
// models/gpt.hpp. Schema: schemas/gpt.yaml. Test: tests/nodes/gpt_test.cpp.
#include <spdlog/spdlog.h>

#include "common/memory.hpp"
#include "models/attention.hpp"
#include "models/gpt.hpp"
#include "models/model_node.hpp"
#include "registry.hpp"

namespace flowrun::gpt {

namespace {

class GptNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    Config cfg;
    p.read<int64_t>({{"layers", &cfg.layers}, {"dim", &cfg.dim}, {"heads", &cfg.heads}, {"vocab", &cfg.vocab},
                     {"context", &cfg.context}});
    cfg.dropout = p.get<double>("dropout");
    cfg.checkpoint = CheckpointPolicy::parse(p.get<std::string>("checkpoint"));
    const uint64_t seed = node_seed(ctx);

    {  // GPT-2's parameters: embeddings, per block 12 d^2 + 13 d (attention, MLP, two norms), final norm
      const double d = static_cast<double>(cfg.dim);
      check_model_fits(ctx.who(), describe(cfg),
                       static_cast<double>(cfg.vocab + cfg.context) * d + cfg.layers * (12 * d * d + 13 * d) + 2 * d,
                       /*frozen=*/false, cfg.layers);
    }
    Gpt model(cfg);
    std::string from = init_lora_load(
        ctx, *model, seed, [&] { init_weights(*model, seed); return "GPT-2 init, seed " + std::to_string(seed); },
        [&](const std::string& path) { load_hf_safetensors(*model, path); });
    if (ctx.run().rank == 0) {
      // What backward keeps per sequence of `context` tokens, in fp32 (half that in bf16).
      const ActivationEstimate a = estimate_activations(cfg.layers, cfg.context, cfg.dim, cfg.heads, cfg.context, 4,
                                                        cfg.checkpoint.every ? cfg.checkpoint : CheckpointPolicy::parse("blocks"));
      spdlog::info("{}: activations kept for backward, per sequence of {} tokens in fp32: about {:.1f} MB without "
                   "checkpointing, {:.1f} MB with checkpoint: {}{}",
                   ctx.who(), cfg.context, a.plain / 1e6, a.checkpointed / 1e6,
                   cfg.checkpoint.every ? cfg.checkpoint.str() : "blocks",
                   cfg.checkpoint.every ? " (on)" : " (off: checkpoint: none)");
    }
    auto state = make_state(model);
    from += load_adapters_param(ctx, *state, seed);
    // Backward keeps the blocks' activations (Korthikanti et al.'s estimate) and the LM head's
    // logits with their gradient (rows x T x vocab, twice).
    state->checkpoint = cfg.checkpoint;
    // On a GPU (where the model is when the estimate is asked for) attention is fused, unless
    // attention dropout trains (models/gpt.cpp).
    state->activations = [cfg, model](const TensorMap& b, int64_t bytes, const CheckpointPolicy& policy) {
      const torch::Tensor& tokens = b.at("tokens");  // [rows, T + 1]: inputs and the shifted targets
      const int64_t seq = std::max<int64_t>(1, std::min<int64_t>(tokens.size(1) - 1, cfg.context));
      const int64_t n = tokens.size(0) * seq;
      ActivationEstimate e = estimate_activations(cfg.layers, n, cfg.dim, cfg.heads, seq, bytes, policy,
                                                  cfg.dropout == 0.0 && fused_attention_available(model->wte->weight));
      const double logits = 2.0 * static_cast<double>(n) * static_cast<double>(cfg.vocab) * static_cast<double>(bytes);
      e.plain += logits;
      e.checkpointed += logits;
      return e;
    };
    own_model(ctx, state, describe(cfg), from);
  }

  void run(StepContext&) override {}  // parameters change only through the optimizer
};

}  // namespace
}  // namespace flowrun::gpt

FLOWRUN_NODE(gpt, flowrun::gpt::GptNode)
