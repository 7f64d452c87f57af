#include "models/llama/llama.hpp"

#include <spdlog/fmt/fmt.h>

#include <regex>
#include <stdexcept>

#include "common/pretrained.hpp"
#include "common/safetensors.hpp"
#include "common/seed.hpp"
#include "common/tensor_map.hpp"
#include "models/attention.hpp"
#include "models/linear.hpp"
#include "models/lm_batch.hpp"
#include "models/load_by_name.hpp"

namespace flowrun::llama {

void Config::check() const {
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) throw std::runtime_error(fmt::format("llama: {} must be positive, got {}", name, v));
  };
  positive("layers", layers), positive("dim", dim), positive("heads", heads), positive("kv_heads", kv_heads);
  positive("mlp_dim", mlp_dim), positive("vocab", vocab), positive("context", context);
  if (heads % kv_heads != 0)
    throw std::runtime_error(fmt::format("llama: heads {} is not a multiple of kv_heads {} (each key/value head serves "
                                         "heads/kv_heads query heads)", heads, kv_heads));
  if (head_dim <= 0 && dim % heads != 0)
    throw std::runtime_error(fmt::format("llama: dim {} is not a multiple of heads {}; set head_dim (transformers' "
                                         "head_dim) when the heads are not dim/heads wide", dim, heads));
  if (head_size() % 2 != 0)
    throw std::runtime_error(fmt::format("llama: the head size {} is odd; rotary positions turn channel pairs", head_size()));
  if (!(rope_theta > 0)) throw std::runtime_error(fmt::format("llama: rope_theta must be > 0, got {}", rope_theta));
  if (!(norm_eps > 0)) throw std::runtime_error(fmt::format("llama: norm_eps must be > 0, got {}", norm_eps));
  rope_scaling.check("llama");
}

double Config::parameter_count() const {
  const double d = static_cast<double>(dim), hd = static_cast<double>(head_size());
  const double q = static_cast<double>(heads) * hd, kv = static_cast<double>(kv_heads) * hd;
  const double attention = d * q + 2 * d * kv + q * d + (qkv_bias ? q + 2 * kv : 0) + (o_bias ? d : 0);
  const double mlp = 3 * d * static_cast<double>(mlp_dim) + (mlp_bias ? 2 * static_cast<double>(mlp_dim) + d : 0);
  const double table = static_cast<double>(vocab) * d;
  return table * (tie_embeddings ? 1 : 2) + static_cast<double>(layers) * (attention + mlp + 2 * d) + d;
}

std::string describe(const Config& c) {
  return fmt::format("layers={} dim={} heads={} kv_heads={} head_dim={} mlp_dim={} vocab={} context={} rope_theta={} "
                     "rope_scaling {}{}",
                     c.layers, c.dim, c.heads, c.kv_heads, c.head_size(), c.mlp_dim, c.vocab, c.context, c.rope_theta,
                     c.rope_scaling.describe(), c.tie_embeddings ? " tied" : "");
}

// ---- blocks ----

void AttentionImpl::reset() {
  const int64_t hd = c_.head_size();
  q_proj = register_module("q_proj", lora::Linear(c_.dim, c_.heads * hd, c_.qkv_bias));
  k_proj = register_module("k_proj", lora::Linear(c_.dim, c_.kv_heads * hd, c_.qkv_bias));
  v_proj = register_module("v_proj", lora::Linear(c_.dim, c_.kv_heads * hd, c_.qkv_bias));
  o_proj = register_module("o_proj", lora::Linear(c_.heads * hd, c_.dim, c_.o_bias));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, int64_t B, int64_t T, const torch::Tensor& cos,
                                     const torch::Tensor& sin) {
  const int64_t hd = c_.head_size(), H = c_.heads, KV = c_.kv_heads;
  auto heads_of = [&](const torch::Tensor& t, int64_t n) { return t.view({B, T, n, hd}).transpose(1, 2); };
  const torch::Tensor q = apply_rope(heads_of(q_proj(x), H), cos, sin);
  torch::Tensor k = apply_rope(heads_of(k_proj(x), KV), cos, sin);
  torch::Tensor v = heads_of(v_proj(x), KV);
  if (KV != H) {  // each kv head read by H/KV query heads in a row (transformers' repeat_kv)
    k = k.unsqueeze(2).expand({B, KV, H / KV, T, hd}).reshape({B, H, T, hd});
    v = v.unsqueeze(2).expand({B, KV, H / KV, T, hd}).reshape({B, H, T, hd});
  }
  AttentionOptions o;
  o.causal = true;
  o.fp32_softmax = true;  // transformers' eager attention softmaxes in float32
  return o_proj(attention(q, k, v, o).reshape({B * T, H * hd}));
}

void BlockImpl::reset() {
  input_layernorm = register_module("input_layernorm", layers::RmsNorm(c_.dim, c_.norm_eps));
  self_attn = register_module("self_attn", Attention(c_));
  post_attention_layernorm = register_module("post_attention_layernorm", layers::RmsNorm(c_.dim, c_.norm_eps));
  layers::MlpOptions mo{"gate_proj", "down_proj", layers::Act::silu, "up_proj", c_.mlp_bias};
  mlp = register_module("mlp", layers::Mlp(c_.dim, c_.mlp_dim, mo));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, int64_t B, int64_t T, const torch::Tensor& cos,
                                 const torch::Tensor& sin) {
  const torch::Tensor h = x + self_attn(input_layernorm(x), B, T, cos, sin);
  return h + mlp(post_attention_layernorm(h));
}

void BodyImpl::reset() {
  embed_tokens = register_module("embed_tokens", layers::Embedding(c_.vocab, c_.dim));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c_.layers; ++i) layers->push_back(Block(c_));
  norm = register_module("norm", layers::RmsNorm(c_.dim, c_.norm_eps));
}

// ---- the model ----

LlamaImpl::LlamaImpl(Config cfg) : cfg_(std::move(cfg)) {
  cfg_.check();
  reset();
}

void LlamaImpl::reset() {
  model = register_module("model", Body(cfg_));
  if (!cfg_.tie_embeddings) lm_head = register_module("lm_head", lora::Linear(cfg_.dim, cfg_.vocab, /*bias=*/false));
  rope_ = Rope(cfg_.head_size(), cfg_.rope_theta, cfg_.rope_scaling);
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& idx) {
  check_token_ids(idx, cfg_.context, cfg_.vocab, "llama");
  const int64_t B = idx.size(0), T = idx.size(1);
  const torch::Tensor& table = model->embed_tokens->weight;
  auto [cos, sin] = rope_.cos_sin(T, table.device());
  // The residual stream is kept as [B*T, dim] so every projection is one addmm.
  torch::Tensor x = torch::embedding(table, idx).view({B * T, cfg_.dim});
  // The ModuleList itself, never a cached vector of blocks: clone() replaces its items.
  for (int64_t i = 0; i < cfg_.layers; ++i) {
    BlockImpl* block = (*model->layers)[static_cast<size_t>(i)]->as<BlockImpl>();
    x = run_block(cfg_.checkpoint, i, *block, {x},
                  [block, B, T, cos = cos, sin = sin](const std::vector<torch::Tensor>& in) {
                    return block->forward(in[0], B, T, cos, sin);
                  });
  }
  x = model->norm(x);
  const torch::Tensor logits = lm_head ? lm_head(x) : flowrun::linear(x, table);
  return logits.view({B, T, cfg_.vocab});
}

void init_weights(LlamaImpl& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator g = make_cpu_generator(mix_seed({seed, kSeedTagInit}));
  for (auto& item : model.named_parameters(true)) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    if (lora::is_adapter(name)) continue;  // apply_lora's init
    if (name.find("norm.weight") != std::string::npos) p.fill_(1.0);
    else if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) p.zero_();
    else p.normal_(0.0, 0.02, g);
  }
}

void load_hf_state_dict(LlamaImpl& model, const std::map<std::string, torch::Tensor>& tensors, const std::string& source) {
  LoadByNameOptions o;
  o.model = "llama (" + describe(model.config()) + ")";
  o.optional = lora::is_adapter;  // a base file loads into a LoRA-adapted model; the adapters keep their init
  const bool tied = model.config().tie_embeddings;
  // Older Llama files carry each layer's rotary inv_freq (a buffer computed from the config).
  static const std::regex kInvFreq(R"(model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq)");
  o.ignore = [tied](const std::string& n) { return (tied && n == "lm_head.weight") || std::regex_match(n, kInvFreq); };
  if (tied)
    o.check = [](const std::map<std::string, torch::Tensor>& file) {
      std::vector<std::string> problems;
      auto head = file.find("lm_head.weight"), table = file.find("model.embed_tokens.weight");
      if (head != file.end() && table != file.end() && table->second.is_floating_point() &&
          !(head->second.sizes().equals(table->second.sizes()) && torch::equal(head->second.to(table->second.dtype()), table->second)))
        problems.push_back("lm_head.weight " + shape_str(head->second) +
                           ": differs from model.embed_tokens.weight, but this model ties its head (tie_embeddings: "
                           "true); set tie_embeddings: false to load an untied head");
      return problems;
    };
  o.describe_file = [](const std::map<std::string, torch::Tensor>& file) -> std::string {
    auto table = file.find("model.embed_tokens.weight");
    if (table == file.end() || table->second.dim() != 2) return "";
    int64_t layers = 0;
    static const std::regex kLayer(R"(model\.layers\.(\d+)\..*)");
    for (const auto& [name, _] : file) {
      std::smatch m;
      if (std::regex_match(name, m, kLayer)) layers = std::max<int64_t>(layers, std::stoll(m[1].str()) + 1);
    }
    std::string s = "the file looks like layers=" + std::to_string(layers) + " dim=" + std::to_string(table->second.size(1)) +
                    " vocab=" + std::to_string(table->second.size(0));
    auto k = file.find("model.layers.0.self_attn.k_proj.weight"), q = file.find("model.layers.0.self_attn.q_proj.weight");
    if (k != file.end() && q != file.end() && k->second.dim() == 2)
      s += " (q_proj " + shape_str(q->second) + ", k_proj " + shape_str(k->second) + ")";
    return s + (file.count("lm_head.weight") ? ", untied head" : ", tied head");
  };
  load_by_name(model, tensors, source, o);  // converts fp16/bf16 files
}

nlohmann::json hf_config(const Config& c) {
  std::string type = c.model_type;
  if (type.empty()) type = c.qkv_bias && !c.o_bias && !c.mlp_bias ? "qwen2" : "llama";
  const bool fits = type == "qwen2"     ? c.qkv_bias && !c.o_bias && !c.mlp_bias
                    : type == "mistral" ? !c.qkv_bias && !c.o_bias && !c.mlp_bias
                                        : c.qkv_bias == c.o_bias;
  if (!fits)
    throw std::runtime_error(fmt::format("llama: no transformers class has q/k/v biases {}, an o bias {} and MLP biases "
                                         "{} ({} puts them otherwise); this model cannot be saved as a Hugging Face "
                                         "folder", c.qkv_bias, c.o_bias, c.mlp_bias, type));
  static const std::map<std::string, std::string> kClass = {
      {"llama", "LlamaForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"}, {"mistral", "MistralForCausalLM"}};
  nlohmann::json j = {{"architectures", {kClass.at(type)}},
                      {"model_type", type},
                      {"vocab_size", c.vocab},
                      {"hidden_size", c.dim},
                      {"intermediate_size", c.mlp_dim},
                      {"num_hidden_layers", c.layers},
                      {"num_attention_heads", c.heads},
                      {"num_key_value_heads", c.kv_heads},
                      {"head_dim", c.head_size()},
                      {"max_position_embeddings", c.context},
                      {"rms_norm_eps", c.norm_eps},
                      {"tie_word_embeddings", c.tie_embeddings},
                      {"hidden_act", "silu"},
                      {"rope_theta", c.rope_theta},
                      {"torch_dtype", "float32"}};
  if (type == "llama") j["attention_bias"] = c.qkv_bias, j["mlp_bias"] = c.mlp_bias;
  if (type == "qwen2") j["use_sliding_window"] = false;
  if (type == "mistral") j["sliding_window"] = nullptr;
  const RopeScaling& s = c.rope_scaling;
  if (s.type == "default") {
    j["rope_scaling"] = nullptr;
  } else {
    j["rope_scaling"] = {{"rope_type", s.type}, {"factor", s.factor}};
    if (s.type == "llama3")
      j["rope_scaling"].update({{"low_freq_factor", s.low_freq_factor},
                                {"high_freq_factor", s.high_freq_factor},
                                {"original_max_position_embeddings", s.original_context}});
  }
  return j;
}

ModelState::ExportWriter hf_export(const ModelState& state, const Config& c, int64_t max_shard_bytes,
                                   const std::string& copy_from) {
  nlohmann::json config = hf_config(c);  // refused here, at the checkpoint's snapshot, not on its writer thread
  // Copies of the whole tensors: a ZeRO-3 model's as the checkpoint's collect gathered them.
  safetensors::Tensors tensors;
  for (const auto& [name, t] : state.gathered.empty() ? state.tensors() : state.gathered)
    tensors[name] = t.detach().to(torch::kCPU, false, /*copy=*/true);
  return [config = std::move(config), tensors = std::move(tensors), max_shard_bytes, copy_from](const std::string& dir) {
    write_pretrained(dir, config, tensors, max_shard_bytes, copy_from);
  };
}

std::shared_ptr<ModelState> make_state(Llama model) {
  ModelState::ForwardFn fwd = [](torch::nn::Module& m, const TensorMap& batch) {
    const torch::Tensor inputs = lm_inputs(batch, "llama");
    auto* llama = m.as<LlamaImpl>();
    if (!llama) throw std::runtime_error("llama: the model's module is not a llama");
    return llama->forward(inputs);
  };
  return std::make_shared<ModelState>(std::static_pointer_cast<torch::nn::Module>(model.ptr()), fwd, "llama");
}

}  // namespace flowrun::llama
