// dit: a HunyuanDiT-style diffusion transformer node (owns its parameters; optional LoRA
// adapters, base weights and PEFT adapters loaded by name). The module: models/dit/dit.hpp.
// Schema: schemas/dit.yaml. Test: tests/nodes/dit_test.cpp, lora_test.cpp.
#include <spdlog/spdlog.h>

#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "common/memory.hpp"
#include "common/pretrained.hpp"
#include "formats/text_tokenizer.hpp"
#include "models/attention.hpp"
#include "models/dit/dit.hpp"
#include "models/model_node.hpp"
#include "registry.hpp"

namespace flowrun::dit {

namespace {

// HunyuanDiT2DModel's config.json (diffusers v0.30) into the config: each key that sets a size
// of this DiT, the value diffusers' __init__ defaults to where an older file lacks it. `given`:
// the node's `with:` as written; a parameter given there must agree with the file.
void apply_pretrained(const std::string& who, const PretrainedFolder& f, const YAML::Node& given, Config& cfg) {
  cfg.depth = config_agreed<int64_t>(f, given, "depth", "num_layers", 28);
  cfg.heads = config_agreed<int64_t>(f, given, "heads", "num_attention_heads", 16);
  cfg.hidden = config_agreed<int64_t>(f, given, "hidden", "hidden_size", 1152);
  cfg.patch = config_agreed<int64_t>(f, given, "patch", "patch_size", 2);
  cfg.in_channels = config_agreed<int64_t>(f, given, "in_channels", "in_channels", 4);
  cfg.text_dim = config_agreed<int64_t>(f, given, "text_dim", "cross_attention_dim", 1024);
  cfg.t5_dim = config_agreed<int64_t>(f, given, "t5_dim", "cross_attention_dim_t5", 2048);
  cfg.pooled_projection_dim = config_agreed<int64_t>(f, given, "pooled_projection_dim", "pooled_projection_dim", 1024);
  cfg.text_len = config_agreed<int64_t>(f, given, "text_len", "text_len", 77);
  cfg.text_len_t5 = config_agreed<int64_t>(f, given, "text_len_t5", "text_len_t5", 256);
  cfg.mlp_ratio = config_agreed<double>(f, given, "mlp_ratio", "mlp_ratio", 4.0);
  cfg.learn_sigma = config_agreed<bool>(f, given, "learn_sigma", "learn_sigma", true);
  cfg.use_style_cond_and_image_meta_size = config_agreed<bool>(f, given, "use_style_cond_and_image_meta_size",
                                                               "use_style_cond_and_image_meta_size", true);
  const int64_t head_dim = config_value<int64_t>(f, "attention_head_dim", 88);
  if (cfg.heads * head_dim != cfg.hidden)
    throw std::runtime_error(who + ": " + f.config_path + ": num_attention_heads x attention_head_dim = " +
                             std::to_string(cfg.heads * head_dim) + " is not hidden_size " + std::to_string(cfg.hidden) +
                             " (this DiT's attention is hidden_size wide)");
  // Keys that change the math, with the one value this DiT computes; keys that do not.
  const std::map<std::string, nlohmann::json> fixed = {{"activation_fn", "gelu-approximate"}, {"norm_type", "layer_norm"}};
  const std::set<std::string> known = {"num_layers", "num_attention_heads", "hidden_size", "patch_size", "in_channels",
                                       "cross_attention_dim", "cross_attention_dim_t5", "pooled_projection_dim",
                                       "text_len", "text_len_t5", "mlp_ratio", "learn_sigma",
                                       "use_style_cond_and_image_meta_size", "attention_head_dim",
                                       "sample_size"};  // sample_size: the default output size, not a weight
  check_config_keys(f, known, fixed, "HunyuanDiT2DModel", "this DiT");
}

class DitNode : public ModelNode {
  Config cfg_;
  Dit model_{nullptr};
  std::optional<PretrainedFolder> pretrained_;

  Plan configure(SetupContext& ctx) override {
    const Params& p = ctx.params();
    Config& cfg = cfg_;
    p.read<int64_t>({{"patch", &cfg.patch}, {"in_channels", &cfg.in_channels}, {"hidden", &cfg.hidden},
                     {"depth", &cfg.depth}, {"heads", &cfg.heads}, {"text_dim", &cfg.text_dim}, {"t5_dim", &cfg.t5_dim},
                     {"pooled_projection_dim", &cfg.pooled_projection_dim}});
    // The text lengths, stated once: the tokenizers' max_length unless given here.
    auto from_tokenizer = [&](const char* key, const char* port, int64_t hunyuan, int64_t* to) {
      if (p.has(key))
        *to = p.get<int64_t>(key);
      else if (ctx.connected(port))
        *to = ctx.state_as<TextTokenizer>(port).max_length();
      else
        throw std::runtime_error(ctx.who() + ": " + key + " is null and no " + port + " is connected; connect the " +
                                 "prompts' tokenizer (in: { " + port + ": tok.tokenizer }) or set " + ctx.name() + "." +
                                 key + " (HunyuanDiT: " + std::to_string(hunyuan) + ")");
    };
    cfg.mlp_ratio = p.get<double>("mlp_ratio");
    cfg.use_style_cond_and_image_meta_size = p.get<bool>("use_style_cond_and_image_meta_size");
    cfg.learn_sigma = p.get<bool>("learn_sigma");
    if (p.has("pretrained")) {
      try {
        pretrained_ = open_pretrained(p.get<std::string>("pretrained"),
                                      {"transformer", "HunyuanDiT2DModel", "diffusion_pytorch_model"});
        apply_pretrained(ctx.who(), *pretrained_, written_params(ctx.run(), ctx.name()), cfg);
      } catch (const std::exception& e) {
        const std::string what = e.what();
        throw std::runtime_error(what.rfind(ctx.who(), 0) == 0 ? what : ctx.who() + ": " + what);
      }
    } else {
      from_tokenizer("text_len", "tokenizer", 77, &cfg.text_len);
      if (cfg.t5_dim > 0) from_tokenizer("text_len_t5", "t5_tokenizer", 256, &cfg.text_len_t5);
    }
    cfg.checkpoint = CheckpointPolicy::parse(p.get<std::string>("checkpoint"));
    cfg.rope_base_grid = p.has("rope_base_grid") ? p.get<int64_t>("rope_base_grid") : 0;  // null: integer positions
    cfg.tp = tp_group(ctx);  // run.parallel.tp > 1: this rank's heads and MLP units (dit.hpp)
    cfg.stages = cut_into_stages(ctx, family(cfg));  // run.parallel.pp > 1: this rank's chunks of the blocks
    try {
      cfg.check();
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    Plan plan{describe(cfg), cfg.parameter_count(), cfg.depth, cfg.checkpoint, pretrained_.has_value()};
    plan.weights_are = "a dit graph's checkpoint file: train the base first, e.g. flowrun graphs/dit_base.yaml";
    return plan;
  }

  std::shared_ptr<ModelState> build(uint64_t seed, bool init, std::string& how) override {
    model_ = Dit(cfg_);  // this rank's parts and chunks
    return declared_state(make_state(model_), family(cfg_), seed, init, "DiT init", how);
  }

  void load_weights(ModelState&, const std::string& path) override { load_safetensors(*model_, path); }

  std::string load_pretrained(ModelState&) override {
    load_state_dict(*model_, load_pretrained_weights(*pretrained_), weights_source(*pretrained_));
    return pretrained_->dir;
  }

  void finish(SetupContext& ctx, ModelState& state, const std::vector<std::string>& adapted) override {
    // diffusers' HunyuanAttentionPool computes with q_proj.weight (and k, v, c) directly, not
    // through the module, so peft's adapters there do nothing in diffusers unless merged.
    std::vector<std::string> pooled;
    for (const auto& n : adapted)
      if (n.find(".pooler.") != std::string::npos) pooled.push_back(n);
    if (!pooled.empty() && ctx.run().rank == 0)
      spdlog::warn("{}: lora.targets reach the T5 pooler ({} layers, e.g. {}): diffusers' attention pool reads "
                   "their weights directly, so with diffusers + peft those adapters have no effect unless merged "
                   "into the weights; leave the pooler out of lora.targets to train what diffusers will use",
                   ctx.who(), pooled.size(), pooled.front());
    // Backward keeps the blocks' activations (Korthikanti et al.'s estimate) over the image's
    // patch tokens: the batch's 4-D tensor (pixels or latents, [rows, C, H, W]). On a GPU (where
    // the model is when the estimate is asked for) attention is fused. Under tp a rank's share.
    state.activations = [cfg = cfg_, model = model_](const TensorMap& b, int64_t bytes, const CheckpointPolicy& policy) {
      const AttentionKeeps keeps =
          fused_attention_available(model->parameters().front()) ? AttentionKeeps::logsumexp : AttentionKeeps::scores;
      for (const auto& [key, t] : b)
        if (t.dim() == 4 && t.is_floating_point()) {
          const int64_t tokens = (t.size(2) / cfg.patch) * (t.size(3) / cfg.patch);
          return estimate_activations(cfg.depth, t.size(0) * tokens, cfg.hidden, cfg.heads, tokens, bytes, policy, keeps,
                                      cfg.tp ? cfg.tp->size() : 1);
        }
      throw std::runtime_error("the batch has no image (a 4-D tensor)");
    };
  }
};

}  // namespace
}  // namespace flowrun::dit

FLOWRUN_NODE(dit, flowrun::dit::DitNode)
