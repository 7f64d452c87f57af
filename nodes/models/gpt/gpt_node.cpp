// gpt: a GPT-2 language model node (owns its parameters; no per-step work), with LoRA adapters
// when the graph asks (models/model_node.hpp). The module, its init and its loader are
// models/gpt/gpt.hpp. Schema: schemas/gpt.yaml. Test: tests/nodes/gpt_test.cpp.
#include <spdlog/spdlog.h>

#include "common/memory.hpp"
#include "common/pretrained.hpp"
#include "models/attention.hpp"
#include "models/gpt/gpt.hpp"
#include "models/model_node.hpp"
#include "parallel/tensor_parallel.hpp"
#include "registry.hpp"

#include <optional>
#include <set>

namespace flowrun::gpt {

namespace {

// A folder transformers' GPT2LMHeadModel.save_pretrained wrote: its config.json's sizes into the
// config (`given`: the node's `with:` as written, which must agree), every key that would change
// the math checked against what this model computes, every problem in one error. The dropout is
// the graph's (`dropout`), not the config's pdrops: a training choice, off by default here.
void apply_pretrained(const PretrainedFolder& f, const YAML::Node& given, Config& c) {
  std::vector<std::string> problems;
  const std::string type = config_value<std::string>(f, "model_type", "");
  if (type != "gpt2")
    throw std::runtime_error(f.config_path + ": model_type is '" + type + "'; the gpt node reads gpt2 (GPT2LMHeadModel)");
  auto agreed = [&](int64_t* to, const char* param, const char* key, int64_t fallback) {
    try {
      *to = config_agreed<int64_t>(f, given, param, key, fallback);
    } catch (const std::exception& e) {
      problems.push_back(e.what());
    }
  };
  agreed(&c.layers, "layers", "n_layer", 12);
  agreed(&c.dim, "dim", "n_embd", 768);
  agreed(&c.heads, "heads", "n_head", 12);
  agreed(&c.vocab, "vocab", "vocab_size", 50257);
  agreed(&c.context, "context", "n_positions", 1024);
  if (f.config.contains("n_inner") && !f.config["n_inner"].is_null() && f.config["n_inner"] != 4 * c.dim)
    problems.push_back("n_inner = " + f.config["n_inner"].dump() + " is not built (the MLP is 4 x n_embd = " +
                       std::to_string(4 * c.dim) + " wide)");
  const std::set<std::string> known = {
      "model_type", "architectures", "n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "n_ctx", "n_inner",
      // the training's dropout (the graph's `dropout`), the sequence-classification head's, token ids, saving
      "attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_type", "summary_use_proj", "summary_activation",
      "summary_proj_to_labels", "summary_first_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
      "dtype", "transformers_version", "use_cache", "initializer_range", "task_specific_params", "tokenizer_class",
      "output_attentions", "output_hidden_states", "return_dict"};
  const std::map<std::string, nlohmann::json> fixed = {
      {"activation_function", "gelu_new"}, {"layer_norm_epsilon", 1e-5},        {"scale_attn_weights", true},
      {"scale_attn_by_inverse_layer_idx", false}, {"reorder_and_upcast_attn", false}, {"add_cross_attention", false},
      {"tie_word_embeddings", true}};
  for (const std::string& p : config_key_problems(f, known, fixed, "GPT2LMHeadModel", "this gpt node")) problems.push_back(p);
  if (!problems.empty()) throw config_error(f, problems);
}

// What the model's attention keeps for backward (models/gpt/gpt.cpp): unless attention dropout trains,
// it is fused — torch's on a GPU (where the weights `w` are), flowrun's on the CPU in float32.
AttentionKeeps attention_keeps(const Config& cfg, const torch::Tensor& w, int64_t bytes) {
  if (cfg.dropout != 0.0) return AttentionKeeps::scores;
  if (fused_attention_available(w)) return AttentionKeeps::logsumexp;
  return bytes == 4 && cpu_attention_kernel_applies(w, {}) ? AttentionKeeps::probabilities : AttentionKeeps::scores;
}

class GptNode : public ModelNode {
  Config cfg_;
  Gpt model_{nullptr};
  std::optional<PretrainedFolder> pretrained_;

  Plan configure(SetupContext& ctx) override {
    const Params& p = ctx.params();
    p.read<int64_t>({{"layers", &cfg_.layers}, {"dim", &cfg_.dim}, {"heads", &cfg_.heads}, {"vocab", &cfg_.vocab},
                     {"context", &cfg_.context}});
    cfg_.dropout = p.get<double>("dropout");
    cfg_.checkpoint = CheckpointPolicy::parse(p.get<std::string>("checkpoint"));
    if (p.has("pretrained")) {
      try {
        pretrained_ = open_pretrained(p.get<std::string>("pretrained"), {"", "", "model"});
        apply_pretrained(*pretrained_, written_params(ctx.run(), ctx.name()), cfg_);
      } catch (const std::exception& e) {
        const std::string what = e.what();
        throw std::runtime_error(what.rfind(ctx.who(), 0) == 0 ? what : ctx.who() + ": " + what);
      }
    }
    split_over_tp(ctx);
    cfg_.stages = cut_into_stages(ctx, family(cfg_));  // run.parallel.pp > 1: this rank's chunks of the blocks
    // GPT-2's parameters: embeddings, per block 12 d^2 + 13 d (attention, MLP, two norms), final norm
    const double d = static_cast<double>(cfg_.dim);
    Plan plan{describe(cfg_), static_cast<double>(cfg_.vocab + cfg_.context) * d + cfg_.layers * (12 * d * d + 13 * d) + 2 * d,
              cfg_.layers, cfg_.checkpoint, pretrained_.has_value()};
    plan.weights_are = "a Hugging Face GPT-2 model.safetensors, or a gpt graph's checkpoint file";
    return plan;
  }

  // run.parallel.tp > 1: this rank's heads, MLP units and vocabulary rows (gpt.hpp, Config::tp).
  void split_over_tp(SetupContext& ctx) {
    cfg_.tp = tp_group(ctx);
    if (!cfg_.tp) return;
    try {
      cfg_.check();  // heads and vocabulary divisible by tp, named
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
  }

  std::shared_ptr<ModelState> build(uint64_t seed, bool init, std::string& how) override {
    model_ = Gpt(cfg_);  // this rank's parts and chunks
    return declared_state(make_state(model_), family(cfg_), seed, init, "GPT-2 init", how);
  }

  torch::Tensor any_weight() const { return model_->parameters().front(); }  // where the model is (a stage may lack wte)

  void load_weights(ModelState&, const std::string& path) override { load_hf_safetensors(*model_, path); }

  std::string load_pretrained(ModelState&) override {
    load_hf_state_dict(*model_, load_pretrained_weights(*pretrained_), weights_source(*pretrained_));
    return pretrained_->dir;
  }

  void finish(SetupContext& ctx, ModelState& state, const std::vector<std::string>& adapted) override {
    // Saving back (a checkpoint's `exports`): a GPT2LMHeadModel folder, its pretrained folder's
    // token ids and tokenizer files kept; with adapters, ModelNode's PEFT export.
    nlohmann::json config = hf_config(cfg_);
    if (pretrained_)
      for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
        if (pretrained_->config.contains(key)) config[key] = pretrained_->config[key];
    offer_hf_export(ctx, state, adapted, std::move(config), "transformer.", pretrained_ ? pretrained_->dir : std::string());
    const Config cfg = cfg_;
    if (ctx.run().rank == 0) {
      // What backward keeps per sequence of `context` tokens, in fp32 (half that in bf16).
      const ActivationEstimate a = estimate_activations(cfg.layers, cfg.context, cfg.dim, cfg.heads, cfg.context, 4,
                                                        cfg.checkpoint.every ? cfg.checkpoint : CheckpointPolicy::parse("blocks"),
                                                        attention_keeps(cfg, any_weight(), 4));
      spdlog::info("{}: activations kept for backward, per sequence of {} tokens in fp32: about {:.1f} MB without "
                   "checkpointing, {:.1f} MB with checkpoint: {}{}",
                   ctx.who(), cfg.context, a.plain / 1e6, a.checkpointed / 1e6,
                   cfg.checkpoint.every ? cfg.checkpoint.str() : "blocks",
                   cfg.checkpoint.every ? " (on)" : " (off: checkpoint: none)");
    }
    // Backward keeps the blocks' activations (Korthikanti et al.'s estimate) and the LM head's
    // logits with their gradient (rows x T x vocab, twice), the attention's as attention_keeps says;
    // under tp this rank's share (its heads, MLP units and vocabulary columns).
    state.activations = [cfg, model = model_](const TensorMap& b, int64_t bytes, const CheckpointPolicy& policy) {
      const torch::Tensor& tokens = b.at("tokens");  // [rows, T + 1]: inputs and the shifted targets
      const int64_t seq = std::max<int64_t>(1, std::min<int64_t>(tokens.size(1) - 1, cfg.context));
      const int64_t n = tokens.size(0) * seq;
      const int64_t tp = cfg.tp ? cfg.tp->size() : 1;
      ActivationEstimate e = estimate_activations(cfg.layers, n, cfg.dim, cfg.heads, seq, bytes, policy,
                                                  attention_keeps(cfg, model->parameters().front(), bytes), tp);
      const double logits = 2.0 * static_cast<double>(n) * static_cast<double>(cfg.vocab / tp) * static_cast<double>(bytes);
      e.plain += logits;
      e.checkpointed += logits;
      return e;
    };
  }
};

}  // namespace
}  // namespace flowrun::gpt

FLOWRUN_NODE(gpt, flowrun::gpt::GptNode)
