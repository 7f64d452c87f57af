// cappa: a CapPa image captioner (ViT encoder + parallel-prediction decoder) node; owns its
// parameters (with LoRA adapters when the graph asks: models/model_node.hpp), no per-step
// work. The module: models/cappa/cappa.hpp. Schema: schemas/cappa.yaml. Test: tests/nodes/cappa_test.cpp.
#include <algorithm>

#include "common/memory.hpp"
#include "formats/text_tokenizer.hpp"
#include "models/attention.hpp"
#include "models/cappa/cappa.hpp"
#include "models/model_node.hpp"
#include "registry.hpp"

namespace flowrun::cappa {

namespace {

class CappaNode : public ModelNode {
  Config c_;
  Cappa model_{nullptr};

  Plan configure(SetupContext& ctx) override {
    const Params& p = ctx.params();
    Config& c = c_;
    p.read<int64_t>({{"image_size", &c.image_size}, {"patch", &c.patch}, {"channels", &c.channels},
                     {"width", &c.width}, {"depth", &c.depth}, {"heads", &c.heads}, {"mlp_dim", &c.mlp_dim},
                     {"dec_width", &c.dec_width}, {"dec_depth", &c.dec_depth}, {"dec_heads", &c.dec_heads},
                     {"dec_mlp_dim", &c.dec_mlp_dim}});
    c.posemb = p.get<std::string>("posemb");
    c.decoder_bias = p.get<bool>("decoder_bias");
    c.checkpoint = CheckpointPolicy::parse(p.get<std::string>("checkpoint"));
    // The vocabulary and caption length, stated once: the tokenizer's unless given here.
    const TextTokenizer* tok = ctx.connected("tokenizer") ? &ctx.state_as<TextTokenizer>("tokenizer") : nullptr;
    auto from_tokenizer = [&](const char* key, int64_t tok_value, int64_t* to) {
      if (p.has(key))
        *to = p.get<int64_t>(key);
      else if (tok)
        *to = tok_value;
      else
        throw std::runtime_error(ctx.who() + ": " + key + " is null and no tokenizer is connected; connect one (in: { tokenizer: tok.tokenizer }) or set " + ctx.name() + "." + key);
    };
    from_tokenizer("vocab", tok ? tok->vocab_size() : 0, &c.vocab);
    from_tokenizer("max_len", tok ? tok->max_length() - 1 : 0, &c.max_len);  // inputs: every token but the last
    c.tp = tp_group(ctx);  // run.parallel.tp > 1: this rank's heads and MLP units (cappa.hpp)
    c.stages = cut_into_stages(ctx, family(c));  // run.parallel.pp > 1: this rank's chunks of the blocks
    try {
      c.check();
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    Plan plan{describe(c), c.parameter_count(), c.depth + c.dec_depth, c.checkpoint};
    plan.weights_are = "a cappa graph's checkpoint file (model.safetensors)";
    return plan;
  }

  std::shared_ptr<ModelState> build(uint64_t seed, bool init, std::string& how) override {
    model_ = Cappa(c_);
    if (init) {
      how = "big_vision init, seed " + std::to_string(seed);
      if (c_.tp || c_.staged()) {
        // The whole model's init (big_vision's goes module by module, not parameter by
        // parameter: init_declared cannot draw it), each rank keeping its parts and its stage's
        // tensors: one process's values.
        Config whole_cfg = c_;
        whole_cfg.tp = nullptr;
        whole_cfg.stages = nullptr;
        Cappa whole(whole_cfg);
        init_weights(*whole, seed);
        load_state_dict(*model_, named_tensors(*whole), how);
      } else {
        init_weights(*model_, seed);
      }
    }
    std::shared_ptr<ModelState> state = make_state(model_);
    hold_declared(*state, family(c_), how);
    return state;
  }

  void load_weights(ModelState&, const std::string& path) override { load_safetensors(*model_, path); }

  void finish(SetupContext&, ModelState& state, const std::vector<std::string>&) override {
    // What its evaluator asks of it (ModelState::Captioner), on whichever copy it is given.
    auto cap = std::make_shared<ModelState::Captioner>();
    cap->encode = [](ModelState& self, const torch::Tensor& images) { return module_of(self).encode(images); };
    cap->greedy = [](ModelState& self, const torch::Tensor& encoded, const torch::Tensor& start, int64_t steps, int64_t eos) {
      return greedy_decode(module_of(self), encoded, start, steps, eos);
    };
    cap->parallel = [](ModelState& self, const torch::Tensor& encoded, int64_t steps) {
      return parallel_decode(module_of(self), encoded, steps);
    };
    state.captioner = std::move(cap);
    // For forward_backward's memory estimate: what backward keeps of the encoder's and the
    // decoder's blocks (Korthikanti et al.'s estimate, models/activation_checkpoint.hpp); a
    // decoder block attends the caption and the image's patches (L + P positions).
    // On a GPU (where the model is when the estimate is asked for) attention is fused. Under tp
    // a rank's share.
    state.activations = [c = c_, model = model_](const TensorMap& b, int64_t bytes, const CheckpointPolicy& policy) {
      const auto ids = b.find("input_ids");
      if (ids == b.end()) throw std::runtime_error("no input_ids in the batch");
      const int64_t rows = ids->second.size(0), P = c.tokens();
      const int64_t L = std::min<int64_t>(ids->second.dim() > 1 ? ids->second.size(1) : 1, c.max_len);
      const AttentionKeeps keeps =
          fused_attention_available(model->parameters().front()) ? AttentionKeeps::logsumexp : AttentionKeeps::scores;
      const int64_t tp = c.tp ? c.tp->size() : 1;
      ActivationEstimate e = estimate_activations(c.depth, rows * P, c.width, c.heads, P, bytes, policy, keeps, tp);
      return e.then(estimate_activations(c.dec_depth, rows * L, c.dec_width, c.dec_heads, L + P, bytes, policy, keeps, tp));
    };
  }
};

}  // namespace
}  // namespace flowrun::cappa

FLOWRUN_NODE(cappa, flowrun::cappa::CappaNode)
