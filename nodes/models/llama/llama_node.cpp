// llama: the decoder-only language model node (Llama 3 / 3.1 / 3.2, Qwen 2 / 2.5, Mistral), owning
// its parameters (no per-step work), with LoRA adapters when the graph asks (models/model_node.hpp).
// The module, its init and its loader are llama.hpp. Schema: schemas/llama.yaml. Test:
// tests/nodes/llama_test.cpp (parity with transformers on folders it saved).
#include <spdlog/spdlog.h>

#include <optional>
#include <set>

#include "common/pretrained.hpp"
#include "models/attention.hpp"
#include "models/llama/llama.hpp"
#include "models/model_node.hpp"
#include "registry.hpp"

namespace flowrun::llama {

namespace {

// The architectures a folder may hold: transformers' model_type and what it fixes beyond the keys
// every one of them writes (Qwen 2's q/k/v bias; Qwen 3's q/k norms; the sliding windows, off).
const std::map<std::string, std::string> kModelTypes = {{"llama", "LlamaForCausalLM"},
                                                        {"qwen2", "Qwen2ForCausalLM"},
                                                        {"qwen3", "Qwen3ForCausalLM"},
                                                        {"mistral", "MistralForCausalLM"},
                                                        {"qwen3_moe", "Qwen3MoeForCausalLM"},
                                                        {"mixtral", "MixtralForCausalLM"}};

// A mixture of experts' keys (Qwen 3 MoE's, Mixtral's) into c.moe. transformers 5 writes
// num_local_experts where 4 wrote num_experts; Mixtral's experts are intermediate_size wide and
// every layer is sparse.
void apply_moe(const PretrainedFolder& f, const std::string& type, Config& c, std::vector<std::string>& problems) {
  MoeConfig& m = c.moe;
  m.experts = config_value<int64_t>(f, "num_experts", config_value<int64_t>(f, "num_local_experts", 0));
  m.top_k = config_value<int64_t>(f, "num_experts_per_tok", 2);
  m.aux_loss = config_value<bool>(f, "output_router_logits", false);
  m.aux_loss_coef = config_value<double>(f, "router_aux_loss_coef", 0.001);
  if (type == "mixtral") {
    m.expert_dim = c.mlp_dim;  // Mixtral has no dense MLP: intermediate_size is each expert's
    m.norm_topk_prob = true;
    if (config_value<double>(f, "router_jitter_noise", 0.0) != 0.0)
      problems.push_back("router_jitter_noise = " + f.config["router_jitter_noise"].dump() + " is not built (set it to 0)");
  } else {
    m.expert_dim = config_value<int64_t>(f, "moe_intermediate_size", 0);
    m.norm_topk_prob = config_value<bool>(f, "norm_topk_prob", false);
    m.sparse_step = config_value<int64_t>(f, "decoder_sparse_step", 1);
    if (f.config.contains("mlp_only_layers") && f.config["mlp_only_layers"].is_array())
      m.mlp_only_layers = f.config["mlp_only_layers"].get<std::vector<int64_t>>();
  }
  if (m.experts <= 0) problems.push_back(type + ": num_experts (or num_local_experts) is missing or not positive");
}

// A folder's config.json into the config (transformers 4's rope_theta + rope_scaling, or 5's
// rope_parameters); `given`: the node's `with:` as written, which must agree with the file. Every
// problem in one error.
void apply_pretrained(const PretrainedFolder& f, const YAML::Node& given, Config& c) {
  std::vector<std::string> problems;
  const std::string type = config_value<std::string>(f, "model_type", "");
  auto known_type = kModelTypes.find(type);
  if (known_type == kModelTypes.end())
    throw std::runtime_error(f.config_path + ": model_type is '" + type +
                             "'; the llama node reads llama, qwen2, qwen3, mistral, qwen3_moe and mixtral "
                             "(LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, "
                             "Qwen3MoeForCausalLM, MixtralForCausalLM)");
  auto agreed = [&](auto* to, const char* param, const char* key, auto fallback) {
    try {
      *to = config_agreed<std::decay_t<decltype(*to)>>(f, given, param, key, fallback);
    } catch (const std::exception& e) {
      problems.push_back(e.what());
    }
  };
  // Settings the folder's config.json gives in its own terms: written in the graph too, one of
  // them would be silently replaced.
  for (const char* key : {"rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                          "rope_original_context", "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "moe"})
    if (given && given[key])
      problems.push_back(std::string(key) + " is written in the graph, but the folder's config.json sets it (" +
                         "rope_theta, rope_scaling or rope_parameters; attention_bias, mlp_bias and model_type for " +
                         "the biases; num_experts and the other router keys for moe); drop it from the graph");
  agreed(&c.layers, "layers", "num_hidden_layers", int64_t{32});
  agreed(&c.dim, "dim", "hidden_size", int64_t{4096});
  agreed(&c.heads, "heads", "num_attention_heads", int64_t{32});
  agreed(&c.kv_heads, "kv_heads", "num_key_value_heads", c.heads);
  agreed(&c.mlp_dim, "mlp_dim", "intermediate_size", int64_t{11008});
  agreed(&c.vocab, "vocab", "vocab_size", int64_t{32000});
  agreed(&c.context, "context", "max_position_embeddings", int64_t{2048});
  agreed(&c.norm_eps, "norm_eps", "rms_norm_eps", 1e-6);
  agreed(&c.tie_embeddings, "tie_embeddings", "tie_word_embeddings", false);
  // head_dim: written by transformers 5 always; older files only where it is not hidden/heads.
  c.head_dim = config_value<int64_t>(f, "head_dim", 0);
  if (c.head_dim > 0 && c.heads > 0 && c.head_dim * c.heads == c.dim) c.head_dim = 0;  // the default: say it as 0
  if (given && given["head_dim"] && !given["head_dim"].IsNull() && given["head_dim"].as<int64_t>() != 0 &&
      given["head_dim"].as<int64_t>() != c.head_size())
    problems.push_back("head_dim is " + given["head_dim"].Scalar() + " in the graph, the folder's heads are " +
                       std::to_string(c.head_size()) + " wide; drop head_dim from the graph (the folder sets it)");
  c.model_type = type;
  // The biases: Llama's (and Qwen 3's) attention_bias puts one on q, k, v and o, mlp_bias on the
  // MLP's three; Qwen 2's q, k and v always have one. Qwen 3 norms each query and key head.
  c.qk_norm = type == "qwen3" || type == "qwen3_moe";
  c.moe = MoeConfig{};
  if (type == "qwen3_moe" || type == "mixtral") apply_moe(f, type, c, problems);
  if (type == "qwen2") {
    c.qkv_bias = true, c.o_bias = false, c.mlp_bias = false;
  } else {
    c.qkv_bias = c.o_bias = config_value<bool>(f, "attention_bias", false);
    c.mlp_bias = config_value<bool>(f, "mlp_bias", false);
  }
  // Rotary positions.
  nlohmann::json rope = f.config.contains("rope_parameters") && f.config["rope_parameters"].is_object()
                            ? f.config["rope_parameters"]
                        : f.config.contains("rope_scaling") && f.config["rope_scaling"].is_object() ? f.config["rope_scaling"]
                                                                                                    : nlohmann::json::object();
  c.rope_theta = rope.contains("rope_theta") ? rope["rope_theta"].get<double>() : config_value<double>(f, "rope_theta", 10000.0);
  const std::string rope_type = rope.value("rope_type", rope.value("type", std::string("default")));
  c.rope_scaling = RopeScaling{};
  c.rope_scaling.type = rope_type;
  if (rope_type == "linear" || rope_type == "llama3") c.rope_scaling.factor = rope.value("factor", 1.0);
  if (rope_type == "llama3") {
    c.rope_scaling.low_freq_factor = rope.value("low_freq_factor", 1.0);
    c.rope_scaling.high_freq_factor = rope.value("high_freq_factor", 4.0);
    c.rope_scaling.original_context = rope.value("original_max_position_embeddings", int64_t{0});
  }
  try {
    c.rope_scaling.check("rope_scaling");
  } catch (const std::exception& e) {
    problems.push_back(e.what());
  }
  for (const auto& [key, value] : rope.items())
    if (key != "rope_type" && key != "type" && key != "rope_theta" && key != "factor" && key != "low_freq_factor" &&
        key != "high_freq_factor" && key != "original_max_position_embeddings")
      problems.push_back("rope scaling key " + key + " = " + value.dump() + " is not built");
  // Attention over every earlier position: a sliding window is refused where it would act.
  if ((type == "qwen2" || type == "qwen3" || type == "qwen3_moe") && config_value<bool>(f, "use_sliding_window", false))
    problems.push_back("use_sliding_window = true is not built (this model attends to every earlier position)");
  if ((type == "mistral" || type == "mixtral") && !f.config.value("sliding_window", nlohmann::json()).is_null() &&
      f.config["sliding_window"].get<int64_t>() < c.context)
    problems.push_back("sliding_window = " + f.config["sliding_window"].dump() +
                       " is not built (this model attends to every earlier position; the window is below context " +
                       std::to_string(c.context) + ")");
  if (f.config.contains("layer_types"))
    for (const auto& t : f.config["layer_types"])
      if (t != "full_attention") {
        problems.push_back("layer_types has " + t.dump() + " (only full_attention layers are built)");
        break;
      }
  // Keys this node reads above, keys that change nothing it computes, and keys that change the
  // math with the one value it computes with.
  std::set<std::string> known = {
      "model_type", "architectures", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
      "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "head_dim",
      "attention_bias", "mlp_bias", "rope_theta", "rope_scaling", "rope_parameters", "use_sliding_window",
      "sliding_window", "max_window_layers", "layer_types",
      // not the math: token ids, saving, init and generation settings
      "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype", "transformers_version", "use_cache",
      "initializer_range", "tokenizer_class", "output_attentions", "output_hidden_states", "return_dict"};
  // A mixture of experts' (apply_moe), for those types only: elsewhere they are refused.
  if (type == "qwen3_moe" || type == "mixtral")
    for (const char* key : {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "output_router_logits",
                            "router_aux_loss_coef", "router_jitter_noise"})
      known.insert(key);
  const std::map<std::string, nlohmann::json> fixed = {
      {"hidden_act", "silu"}, {"attention_dropout", 0.0}, {"pretraining_tp", 1}, {"use_mrope", false}};
  for (const std::string& p : config_key_problems(f, known, fixed, known_type->second, "this llama node"))
    problems.push_back(p);
  if (!problems.empty()) throw config_error(f, problems);
}

class LlamaNode : public ModelNode {
  Config cfg_;
  Llama model_{nullptr};
  std::optional<PretrainedFolder> pretrained_;

  Plan configure(SetupContext& ctx) override {
    const Params& p = ctx.params();
    Config& c = cfg_;
    p.read<int64_t>({{"layers", &c.layers}, {"dim", &c.dim}, {"heads", &c.heads}, {"kv_heads", &c.kv_heads},
                     {"head_dim", &c.head_dim}, {"mlp_dim", &c.mlp_dim}, {"vocab", &c.vocab}, {"context", &c.context}});
    c.rope_theta = p.get<double>("rope_theta");
    c.rope_scaling.type = p.get<std::string>("rope_scaling");
    if (c.rope_scaling.type == "none") c.rope_scaling.type = "default";
    c.rope_scaling.factor = p.get<double>("rope_factor");
    c.rope_scaling.low_freq_factor = p.get<double>("rope_low_freq_factor");
    c.rope_scaling.high_freq_factor = p.get<double>("rope_high_freq_factor");
    c.rope_scaling.original_context = p.get<int64_t>("rope_original_context");
    c.norm_eps = p.get<double>("norm_eps");
    c.tie_embeddings = p.get<bool>("tie_embeddings");
    c.qkv_bias = p.get<bool>("qkv_bias");
    c.o_bias = p.get<bool>("o_bias");
    c.mlp_bias = p.get<bool>("mlp_bias");
    c.qk_norm = p.get<bool>("qk_norm");
    c.checkpoint = CheckpointPolicy::parse(p.get<std::string>("checkpoint"));
    if (p.has("moe")) {
      const Params m = p.sub("moe");
      c.moe.experts = m.get<int64_t>("experts");
      c.moe.top_k = m.get<int64_t>("top_k");
      c.moe.expert_dim = m.get<int64_t>("expert_dim");
      c.moe.norm_topk_prob = m.get<bool>("norm_topk_prob");
      c.moe.sparse_step = m.get<int64_t>("sparse_step");
      c.moe.mlp_only_layers = m.get<std::vector<int64_t>>("mlp_only_layers");
      c.moe.aux_loss = m.get<bool>("aux_loss");
      c.moe.aux_loss_coef = m.get<double>("aux_loss_coef");
    }
    try {
      if (p.has("pretrained")) {
        pretrained_ = open_pretrained(p.get<std::string>("pretrained"), {"", "", "model"});
        apply_pretrained(*pretrained_, written_params(ctx.run(), ctx.name()), c);
      }
      c.moe.z_loss_coef = p.get<double>("router_z_loss");  // a training setting: beside a folder's config too
      c.check();
    } catch (const std::exception& e) {
      const std::string what = e.what();
      throw std::runtime_error(what.rfind(ctx.who(), 0) == 0 ? what : ctx.who() + ": " + what);
    }
    c.tp = tp_group(ctx);                              // run.parallel.tp > 1: this rank's heads, units, vocabulary rows
    c.ep = ep_group(ctx);                              // run.parallel.ep > 1: this rank's experts
    c.stages = cut_into_stages(ctx, family(c));        // run.parallel.pp > 1: this rank's chunks of the blocks
    try {
      c.check();  // what tp must divide, named
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    if (c.tp && !c.kv_split() && ctx.run().rank == 0)
      spdlog::info("{}: kv_heads {} do not split over tp {}: k_proj and v_proj are whole on every tp rank (each reads "
                   "the kv heads its query heads use; their gradients are summed over the tp ranks), as Megatron does "
                   "when tp exceeds the kv heads", ctx.who(), c.kv_heads, c.tp->size());
    Plan plan{describe(c), c.parameter_count(), c.layers, c.checkpoint, pretrained_.has_value()};
    plan.weights_are = "a Hugging Face model.safetensors of this architecture, or a llama graph's checkpoint file";
    return plan;
  }

  std::shared_ptr<ModelState> build(uint64_t seed, bool init, std::string& how) override {
    model_ = Llama(cfg_);  // this rank's parts and chunks
    return declared_state(make_state(model_), family(cfg_), seed, init, "transformers' init (N(0, 0.02))", how);
  }

  void load_weights(ModelState&, const std::string& path) override {
    load_hf_state_dict(*model_, safetensors::load(path).tensors, path);
  }

  std::string load_pretrained(ModelState&) override {
    load_hf_state_dict(*model_, load_pretrained_weights(*pretrained_), weights_source(*pretrained_));
    return pretrained_->dir;
  }

  void finish(SetupContext& ctx, ModelState& state, const std::vector<std::string>& adapted) override {
    estimate_activations_of(ctx, state);
    export_as_hf(ctx, state, adapted);
  }

  // What backward keeps (forward_backward's memory estimate and refusal, `flowrun plan`): the
  // blocks' activations as Korthikanti et al. count them, for this block's shape (block_units),
  // with the attention's scores (a GPU's fused attention: a logsumexp) over this rank's heads,
  // and the head's logits with their gradient (rows x T x vocab/tp, twice).
  void estimate_activations_of(SetupContext& ctx, ModelState& state) {
    const Config c = cfg_;
    const BlockUnits units = block_units(c);
    auto keeps = [](const torch::Tensor& w) {
      return fused_attention_available(w) ? AttentionKeeps::logsumexp : AttentionKeeps::scores;
    };
    if (ctx.run().rank == 0) {
      const CheckpointPolicy every = c.checkpoint.every ? c.checkpoint : CheckpointPolicy::parse("blocks");
      const ActivationEstimate a = estimate_activations(c.layers, c.context, c.dim, c.heads, c.context, 4, every,
                                                        keeps(model_->parameters().front()), 1, units);
      spdlog::info("{}: activations kept for backward, per sequence of {} tokens in fp32: about {:.1f} MB without "
                   "checkpointing, {:.1f} MB with checkpoint: {}{}", ctx.who(), c.context, a.plain / 1e6,
                   a.checkpointed / 1e6, every.str(), c.checkpoint.every ? " (on)" : " (off: checkpoint: none)");
    }
    state.activations = [c, units, keeps, model = model_](const TensorMap& b, int64_t bytes, const CheckpointPolicy& policy) {
      const torch::Tensor& tokens = b.at("tokens");  // [rows, T + 1]: inputs and the shifted targets
      const int64_t seq = std::max<int64_t>(1, std::min<int64_t>(tokens.size(1) - 1, c.context));
      const int64_t n = tokens.size(0) * seq, tp = c.tp_size();
      ActivationEstimate e = estimate_activations(c.layers, n, c.dim, c.heads, seq, bytes, policy,
                                                  keeps(model->parameters().front()), tp, units);
      const double logits = 2.0 * static_cast<double>(n) * static_cast<double>(c.vocab / tp) * static_cast<double>(bytes);
      e.plain += logits;
      e.checkpointed += logits;
      return e;
    };
  }

  // Without adapters the checkpoint's `exports` writes the model as a Hugging Face folder (with
  // them, the base's ModelNode makes it PEFT's adapters).
  void export_as_hf(SetupContext& ctx, ModelState& state, const std::vector<std::string>& adapted) {
    nlohmann::json config;
    try {
      config = hf_config(cfg_);
    } catch (const std::exception& e) {  // trainable still; a checkpoint's `exports` finds nothing to write
      if (adapted.empty()) spdlog::warn("{}: {}", ctx.who(), e.what());
      return;
    }
    // A mixture of experts written one by one, as the Hub's files (and save_pretrained) have them.
    Rename rename;
    if (cfg_.moe.on()) rename = [names = expert_file_names(cfg_)](const auto& t) { return moe::split_experts(t, names); };
    offer_hf_export(ctx, state, adapted, std::move(config), "", pretrained_ ? pretrained_->dir : std::string(), rename);
  }
};

}  // namespace
}  // namespace flowrun::llama

FLOWRUN_NODE(llama, flowrun::llama::LlamaNode)
