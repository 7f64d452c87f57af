#include "models/llama/llama.hpp"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <map>
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

bool MoeConfig::sparse(int64_t layer) const {
  if (!on() || std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return (layer + 1) % sparse_step == 0;
}

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
  const int64_t t = tp_size();
  auto divides = [t](const char* what, int64_t n, const char* fix) {
    if (n % t != 0)
      throw std::runtime_error(fmt::format("llama: {} {} does not split into {} tensor-parallel parts; {}", what, n, t, fix));
  };
  divides("heads", heads, "choose run.parallel.tp dividing it");
  divides("mlp_dim", mlp_dim, "choose run.parallel.tp dividing it");
  divides("vocab", vocab, "pad the vocabulary to a multiple of tp or choose run.parallel.tp dividing it");
  if (stages) stages->check(layers, "llama");
  if (moe.z_loss_coef > 0 && !moe.on())
    throw std::runtime_error(fmt::format("llama: router_z_loss is {}, and this model has no router (moe.experts is 0); "
                                         "set router_z_loss: 0", moe.z_loss_coef));
  if (ep && ep->size() > 1 && !moe.on())
    throw std::runtime_error(fmt::format("llama: run.parallel.ep is {}, and this model has no experts to split (moe.experts "
                                         "is 0); set run.parallel.ep: 1", ep->size()));
  if (moe.on()) {
    if (moe.top_k < 1 || moe.top_k > moe.experts || moe.expert_dim <= 0 || moe.sparse_step < 1)
      throw std::runtime_error(fmt::format("llama: a mixture of {} experts needs 1 <= top_k ({}) <= experts, expert_dim "
                                           "({}) > 0 and sparse_step ({}) >= 1", moe.experts, moe.top_k, moe.expert_dim,
                                           moe.sparse_step));
    if (t > 1)
      throw std::runtime_error("llama: a mixture of experts under tensor parallel (run.parallel.tp) is not built yet; "
                               "use expert parallel (run.parallel.ep), dp, ZeRO or pp");
    if (ep && moe.experts % ep->size() != 0)
      throw std::runtime_error(fmt::format("llama: {} experts do not split over run.parallel.ep {}; choose an ep dividing "
                                           "the experts", moe.experts, ep->size()));
    if (moe.aux_loss && stages)
      throw std::runtime_error("llama: the router's load-balancing loss (aux_loss, output_router_logits) with pipeline "
                               "parallel (run.parallel.pp) is not built yet; set aux_loss: false or pp 1");
    if (moe.z_loss_coef > 0 && (stages || checkpoint.every > 0))
      throw std::runtime_error("llama: the router's z-loss (router_z_loss) with pipeline parallel or activation "
                               "checkpointing is not built yet; set router_z_loss: 0, or pp 1 and checkpoint: none");
    if (moe.aux_loss && checkpoint.every > 0)
      throw std::runtime_error("llama: the router's load-balancing loss (aux_loss, output_router_logits) with activation "
                               "checkpointing is not built yet (the recompute would route twice); set checkpoint: none "
                               "or aux_loss: false");
  }
}

parallel::TpSplit tp_split(const Config& c, const std::string& name) {
  if (lora::is_adapter(name))
    return lora::adapter_tp_split(name, [c](const std::string& n) { return tp_split(c, n); }, /*fan_in_fan_out=*/false);
  auto ends_with = [&](const std::string& end) {
    return name.size() >= end.size() && name.compare(name.size() - end.size(), end.size(), end) == 0;
  };
  // torch's layout, weight [out, in]: column-split layers by their output rows (dim 0, bias too),
  // row-split ones by their input columns (dim 1; the bias, added once after the sum, whole).
  // A mixture of experts' experts by their dim 0 over the ep ranks (whole over tp).
  if (ends_with("mlp.experts.gate_up_proj") || ends_with("mlp.experts.down_proj")) return {0, 1, /*experts=*/true};
  for (const char* column : {"self_attn.q_proj.", "mlp.gate_proj.", "mlp.up_proj."})
    if (name.find(column) != std::string::npos) return {0, 1};
  if (name.find("self_attn.k_proj.") != std::string::npos || name.find("self_attn.v_proj.") != std::string::npos)
    return c.kv_split() ? parallel::TpSplit{0, 1} : parallel::TpSplit{};  // whole where tp > kv_heads
  if (ends_with("self_attn.o_proj.weight") || ends_with("mlp.down_proj.weight")) return {1, 1};
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return {0, 1};  // by vocabulary rows
  return {};  // norms, the row-split layers' biases
}

Family family(const Config& c) {
  Family f;
  f.tp = c.tp, f.stages = c.stages, f.ep = c.ep;
  if (c.moe.on()) f.experts = c.moe.experts, f.top_k = c.moe.top_k;
  f.tp_split = [c](const std::string& n) { return tp_split(c, n); };
  f.order = [c] { return whole_order(c); };
  // A block's products a token: q and o over the query heads, k and v over the kv heads, the MLP's three.
  const double d = static_cast<double>(c.dim), hd = static_cast<double>(c.head_size());
  const double attention = 2 * d * static_cast<double>(c.heads) * hd + 2 * d * static_cast<double>(c.kv_heads) * hd;
  f.block_costs.assign(static_cast<size_t>(c.layers), attention + 3 * d * static_cast<double>(c.mlp_dim));
  for (int64_t i = 0; i < c.layers; ++i)  // a sparse layer: the router, and each token's top_k experts
    if (c.moe.sparse(i))
      f.block_costs[static_cast<size_t>(i)] =
          attention + d * static_cast<double>(c.moe.experts) + 3 * d * static_cast<double>(c.moe.top_k * c.moe.expert_dim);
  f.head_cost = static_cast<double>(c.vocab) * d;
  if (c.tie_embeddings) f.tied = {"model.embed_tokens.weight"};
  f.vocab_split_logits = true;  // the head by vocabulary rows
  f.generator = init_generator;
  f.init_one = init_parameter;
  return f;
}

double Config::parameter_count() const {
  const double d = static_cast<double>(dim), hd = static_cast<double>(head_size());
  const double q = static_cast<double>(heads) * hd, kv = static_cast<double>(kv_heads) * hd;
  const double attention = d * q + 2 * d * kv + q * d + (qkv_bias ? q + 2 * kv : 0) + (o_bias ? d : 0);
  const double mlp = 3 * d * static_cast<double>(mlp_dim) + (mlp_bias ? 2 * static_cast<double>(mlp_dim) + d : 0);
  const double experts = static_cast<double>(moe.experts) * d * (1 + 3 * static_cast<double>(moe.expert_dim));
  const double table = static_cast<double>(vocab) * d;
  double blocks = 0;
  for (int64_t i = 0; i < layers; ++i) blocks += attention + (moe.sparse(i) ? experts : mlp) + 2 * d;
  return table * (tie_embeddings ? 1 : 2) + blocks + d;
}

std::string describe(const Config& c) {
  return fmt::format("layers={} dim={} heads={} kv_heads={} head_dim={} mlp_dim={} vocab={} context={} rope_theta={} "
                     "rope_scaling {}{}",
                     c.layers, c.dim, c.heads, c.kv_heads, c.head_size(), c.mlp_dim, c.vocab, c.context, c.rope_theta,
                     c.rope_scaling.describe(), c.tie_embeddings ? " tied" : "") +
         (c.moe.on() ? fmt::format(" moe: {} experts top {} of {} each{}", c.moe.experts, c.moe.top_k, c.moe.expert_dim,
                                   (c.moe.aux_loss ? fmt::format(", aux loss {}", c.moe.aux_loss_coef) : "") +
                                       (c.moe.z_loss_coef > 0 ? fmt::format(", z-loss {}", c.moe.z_loss_coef) : ""))
                     : "");
}

// ---- blocks ----

void AttentionImpl::reset() {
  const int64_t hd = c_.head_size(), tp = c_.tp_size();
  const int64_t H = c_.heads / tp, KV = c_.kv_split() ? c_.kv_heads / tp : c_.kv_heads;  // this rank's
  const lora::TpRole kv_role = c_.kv_split() ? lora::TpRole::outputs : lora::TpRole::whole;
  q_proj = register_module("q_proj", lora::split(lora::Linear(c_.dim, H * hd, c_.qkv_bias), c_.tp, lora::TpRole::outputs));
  k_proj = register_module("k_proj", lora::split(lora::Linear(c_.dim, KV * hd, c_.qkv_bias), c_.tp, kv_role));
  v_proj = register_module("v_proj", lora::split(lora::Linear(c_.dim, KV * hd, c_.qkv_bias), c_.tp, kv_role));
  o_proj = register_module("o_proj", lora::split(lora::Linear(H * hd, c_.dim, c_.o_bias), c_.tp, lora::TpRole::inputs));
  // Qwen 3's norms, whole on every rank. q_norm sees this rank's query heads: its gradient summed
  // over tp. k_norm the same where the kv heads split; where they are whole it sees all of them,
  // before the copy that sums their gradient (forward), so its own is whole already.
  if (c_.qk_norm) {
    q_norm = register_module("q_norm", layers::RmsNorm(hd, c_.norm_eps, c_.tp));
    k_norm = register_module("k_norm", layers::RmsNorm(hd, c_.norm_eps, c_.kv_split() ? c_.tp : nullptr));
  }
  if (!c_.kv_split()) {  // query head g (of the whole model) reads kv head g / (heads / kv_heads)
    const int64_t first = c_.tp->rank() * H, per_kv = c_.heads / c_.kv_heads;
    kv_of_head_ = torch::arange(first, first + H, torch::kLong).div(per_kv, "floor");
  }
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& input, int64_t B, int64_t T, const torch::Tensor& cos,
                                     const torch::Tensor& sin, const torch::Tensor& mask,
                                     std::pair<torch::Tensor, torch::Tensor>* cache) {
  const int64_t hd = c_.head_size(), tp = c_.tp_size();
  const int64_t H = c_.heads / tp, KV = c_.kv_split() ? c_.kv_heads / tp : c_.kv_heads;  // this rank's
  auto heads_of = [&](const torch::Tensor& t, int64_t n, layers::RmsNorm& norm) {
    const torch::Tensor h = t.view({B, T, n, hd});
    return (norm ? norm(h) : h).transpose(1, 2);
  };
  layers::RmsNorm none{nullptr};
  // This rank's query heads from x, whose gradient the ranks' parts sum (Megatron's f); split kv
  // heads the same. Whole kv heads: computed alike on every rank from x itself, their gradient
  // summed over the ranks whose query heads read them, so that x's and the weights' are whole.
  const torch::Tensor x = parallel::copy_to_tp(input, c_.tp);
  const torch::Tensor q = apply_rope(heads_of(q_proj(x), H, q_norm), cos, sin);
  const torch::Tensor kv_in = c_.kv_split() ? x : input;
  torch::Tensor k = apply_rope(heads_of(k_proj(kv_in), KV, k_norm), cos, sin);
  torch::Tensor v = heads_of(v_proj(kv_in), KV, none);
  int64_t L = T;  // the keys
  if (cache) {  // generation: the keys and values so far, then these
    if (cache->first.defined()) k = torch::cat({cache->first, k}, 2), v = torch::cat({cache->second, v}, 2);
    *cache = {k, v};
    L = k.size(2);
  }
  if (!c_.kv_split()) {  // this rank's query heads' kv heads (tp > kv_heads), the gradients summed
    const torch::Tensor idx = kv_of_head_.to(k.device());
    k = parallel::copy_to_tp(k, c_.tp).index_select(1, idx), v = parallel::copy_to_tp(v, c_.tp).index_select(1, idx);
  } else if (KV != H) {  // each kv head read by H/KV query heads in a row (transformers' repeat_kv)
    k = k.unsqueeze(2).expand({B, KV, H / KV, L, hd}).reshape({B, H, L, hd});
    v = v.unsqueeze(2).expand({B, KV, H / KV, L, hd}).reshape({B, H, L, hd});
  }
  AttentionOptions o;
  o.causal = cache == nullptr;
  o.bias = mask;
  o.fp32_softmax = true;  // transformers' eager attention softmaxes in float32
  return layers::row_parallel(*o_proj, attention(q, k, v, o).reshape({B * T, H * hd}), c_.tp);
}

void BlockImpl::reset() {
  input_layernorm = register_module("input_layernorm", layers::RmsNorm(c_.dim, c_.norm_eps));
  self_attn = register_module("self_attn", Attention(c_));
  post_attention_layernorm = register_module("post_attention_layernorm", layers::RmsNorm(c_.dim, c_.norm_eps));
  if (c_.moe.sparse(index_)) {
    experts = register_module("mlp", moe::Moe(moe::Options{c_.dim, c_.moe.expert_dim, c_.moe.experts, c_.moe.top_k,
                                                           c_.moe.norm_topk_prob, c_.ep}));
    return;
  }
  layers::MlpOptions mo{"gate_proj", "down_proj", layers::Act::silu, "up_proj", c_.mlp_bias, false, 0, c_.tp};
  mlp = register_module("mlp", layers::Mlp(c_.dim, c_.mlp_dim, mo));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, int64_t B, int64_t T, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& mask, std::pair<torch::Tensor, torch::Tensor>* cache,
                                 moe::Routing* routing) {
  const torch::Tensor h = x + self_attn(input_layernorm(x), B, T, cos, sin, mask, cache);
  return h + (experts ? experts->forward(post_attention_layernorm(h), routing) : mlp(post_attention_layernorm(h)));
}

void BodyImpl::reset() {
  // Staged (pipeline parallel): this rank's blocks only, an empty placeholder in the others'
  // places so that every parameter keeps its whole model's name.
  if (c_.holds_embedding())
    embed_tokens = register_module("embed_tokens", layers::Embedding(c_.vocab / c_.tp_size(), c_.dim));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c_.layers; ++i) {
    if (c_.holds_block(i)) layers->push_back(Block(c_, i));
    else layers->push_back(torch::nn::Identity());
  }
  if (c_.holds_head()) norm = register_module("norm", layers::RmsNorm(c_.dim, c_.norm_eps));
}

// ---- the model ----

LlamaImpl::LlamaImpl(Config cfg) : cfg_(std::move(cfg)) {
  cfg_.check();
  reset();
}

void LlamaImpl::reset() {
  model = register_module("model", Body(cfg_));
  if (!cfg_.tie_embeddings && cfg_.holds_head())  // by vocabulary rows under tp
    lm_head = register_module("lm_head", lora::split(lora::Linear(cfg_.dim, cfg_.vocab / cfg_.tp_size(), /*bias=*/false),
                                                     cfg_.tp, lora::TpRole::outputs));
  rope_ = Rope(cfg_.head_size(), cfg_.rope_theta, cfg_.rope_scaling);
}

torch::Tensor LlamaImpl::embed(const torch::Tensor& idx) {
  check_token_ids(idx, cfg_.context, cfg_.vocab, "llama");
  // The residual stream is kept as [B*T, dim] so every projection is one addmm.
  return parallel::vocab_parallel_embedding(idx, model->embed_tokens->weight, cfg_.tp).view({idx.numel(), cfg_.dim});
}

torch::Tensor LlamaImpl::blocks(torch::Tensor x, int64_t first, int64_t last, int64_t B, int64_t T, const LmPacking& packing) {
  auto [cos, sin] = rope_.cos_sin(T, x.device());
  torch::Tensor mask;
  if (packing.packed()) {  // each document as if alone: its own positions, attention within it
    const torch::Tensor pos = packing.positions.to(x.device()).reshape({B * T});
    cos = cos.index_select(0, pos).view({B, 1, T, cos.size(-1)}), sin = sin.index_select(0, pos).view({B, 1, T, sin.size(-1)});
    const torch::Tensor seg = packing.segments.to(x.device());
    mask = torch::zeros({B, 1, T, T}, x.options().dtype(torch::kFloat))
               .masked_fill_((seg.unsqueeze(2) != seg.unsqueeze(1)).unsqueeze(1), -std::numeric_limits<float>::infinity());
  }
  // The ModuleList itself, never a cached vector of blocks: clone() replaces its items.
  // A mixture of experts: each sparse layer's routing, for the load-balancing loss and the counts.
  // (Shared with the body: a recomputed block runs it again in backward, after this returned.)
  std::vector<std::pair<int64_t, std::shared_ptr<moe::Routing>>> routed;  // sparse layer -> its routing
  for (int64_t i = first; i < last; ++i) {
    BlockImpl* block = (*model->layers)[static_cast<size_t>(i)]->as<BlockImpl>();
    if (!block) throw std::logic_error("llama: block " + std::to_string(i) + " is another pipeline stage's");
    std::shared_ptr<moe::Routing> routing =
        block->experts ? routed.emplace_back(i, std::make_shared<moe::Routing>()).second : nullptr;
    x = run_block(cfg_.checkpoint, i, *block, {x},
                  [block, B, T, cos = cos, sin = sin, mask, routing](const std::vector<torch::Tensor>& in) {
                    return block->forward(in[0], B, T, cos, sin, mask, nullptr, routing.get());
                  });
  }
  // Kept for the training forward only (grad mode): an evaluator or a sampler reading the same
  // model at the same time (a no-grad forward) leaves them alone.
  if (!routed.empty() && torch::GradMode::is_enabled()) {
    std::vector<torch::Tensor> logits, counts;
    for (const auto& [layer, r] : routed) {
      logits.push_back(r->logits), counts.push_back(r->counts.to(torch::kCPU));
      torch::Tensor& since = counts_since_[layer];  // a step's forwards (micro-batches, pipeline chunks), by layer
      since = since.defined() ? since + counts.back() : counts.back().clone();
    }
    counts_ = torch::stack(counts);
    aux_loss_ = cfg_.moe.aux_loss ? cfg_.moe.aux_loss_coef * moe::load_balancing_loss(logits, cfg_.moe.experts, cfg_.moe.top_k)
                                  : torch::Tensor();
    if (cfg_.moe.z_loss_coef > 0) {
      const torch::Tensor z = cfg_.moe.z_loss_coef * moe::router_z_loss(logits);
      aux_loss_ = aux_loss_.defined() ? aux_loss_ + z : z;
    }
  }
  return x;
}

torch::Tensor LlamaImpl::head(const torch::Tensor& input, int64_t B, int64_t T, const torch::Tensor& rows) {
  // Under tp this rank's vocabulary columns (parallel::vocab_parallel_cross_entropy scores them).
  const torch::Tensor x = parallel::copy_to_tp(model->norm(rows.defined() ? input.index_select(0, rows) : input), cfg_.tp);
  const torch::Tensor logits = lm_head ? lm_head(x) : flowrun::linear(x, model->embed_tokens->weight);
  return rows.defined() ? logits : logits.view({B, T, logits.size(-1)});
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& idx, const LmPacking& packing, const torch::Tensor& rows) {
  if (cfg_.staged())
    throw std::runtime_error("llama: this rank holds pipeline chunks of the model only (run.parallel.pp); it runs chunk "
                             "by chunk in forward_backward's schedule, not as a whole");
  const int64_t B = idx.size(0), T = idx.size(1);
  return head(blocks(embed(idx), 0, cfg_.layers, B, T, packing), B, T, rows);
}

torch::Tensor LlamaImpl::decode(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& mask,
                                KvCache& cache) {
  if (cfg_.staged()) throw std::runtime_error("llama: generation runs on the whole model, not on pipeline stages");
  const int64_t B = ids.size(0), t = ids.size(1);
  torch::Tensor x = embed(ids);
  const int64_t reach = positions.max().item<int64_t>() + 1;
  auto [cos, sin] = rope_.cos_sin(reach, x.device());
  const torch::Tensor pos = positions.to(x.device()).reshape({B * t});
  cos = cos.index_select(0, pos).view({B, 1, t, cos.size(-1)}), sin = sin.index_select(0, pos).view({B, 1, t, sin.size(-1)});
  cache.layers.resize(static_cast<size_t>(cfg_.layers));
  for (int64_t i = 0; i < cfg_.layers; ++i)
    x = (*model->layers)[static_cast<size_t>(i)]->as<BlockImpl>()->forward(x, B, t, cos, sin, mask, &cache.layers[static_cast<size_t>(i)]);
  return parallel::gather_vocab_logits(head(x, B, t), cfg_.tp);  // under tp: every rank the whole row
}

TensorMap LlamaImpl::chunk(int k, const torch::Tensor& idx, const TensorMap& in, const LmPacking& packing) {
  if (!cfg_.stages || !cfg_.stages->holds(k)) throw std::logic_error("llama: pipeline chunk " + std::to_string(k) + " is another rank's");
  const int64_t B = idx.size(0), T = idx.size(1);
  const auto [first, last] = cfg_.stages->blocks.at(static_cast<size_t>(k));
  torch::Tensor x = blocks(k == 0 ? embed(idx) : in.at("x"), first, last, B, T, packing);
  if (k + 1 == cfg_.stages->chunks()) return {{"output", head(x, B, T)}};
  return {{"x", x}};
}

std::vector<std::pair<std::string, double>> LlamaImpl::take_routing_metrics() {
  std::vector<int64_t> sparse;
  std::vector<torch::Tensor> counts;
  for (int64_t i = 0; i < cfg_.layers; ++i)
    if (cfg_.moe.sparse(i) && cfg_.holds_block(i)) {
      sparse.push_back(i);
      const auto it = counts_since_.find(i);
      counts.push_back(it != counts_since_.end() ? it->second : torch::zeros({cfg_.moe.experts}, torch::kLong));
    }
  counts_since_.clear();
  // Pipeline stages hold different layers, and the metrics node wants the same names on every
  // rank: not reported there yet.
  if (sparse.empty() || cfg_.stages) return {};
  return moe::load_metrics(torch::stack(counts), sparse);
}

ParamOrder whole_order(const Config& c) {
  Config one = c;
  one.stages = nullptr;
  const int64_t rows = c.vocab / c.tp_size();
  ParamOrder order{{"model.embed_tokens.weight", {rows, c.dim}}};
  std::map<bool, Block> kinds;  // a dense block's names and shapes, a sparse one's
  for (int64_t i = 0; i < c.layers; ++i) {
    auto kind = kinds.find(c.moe.sparse(i));
    if (kind == kinds.end()) kind = kinds.emplace(c.moe.sparse(i), Block(one, i)).first;
    for (const auto& p : kind->second->named_parameters(true))
      order.emplace_back("model.layers." + std::to_string(i) + "." + p.key(), p.value().sizes().vec());
  }
  order.emplace_back("model.norm.weight", std::vector<int64_t>{c.dim});
  if (!c.tie_embeddings) order.emplace_back("lm_head.weight", std::vector<int64_t>{rows, c.dim});
  return order;
}

BlockUnits block_units(const Config& c) {
  const double d = static_cast<double>(c.dim);
  const double q_width = static_cast<double>(c.heads * c.head_size());
  // A sparse layer keeps each token's top_k experts' SwiGLU (the larger of the two kinds counted).
  const double mlp = static_cast<double>(std::max(c.mlp_dim, c.moe.on() ? c.moe.top_k * c.moe.expert_dim : 0));
  return {8.0, 8.0 * q_width / d + 8.0 * mlp / d};
}

at::Generator init_generator(uint64_t seed) { return make_cpu_generator(mix_seed({seed, kSeedTagInit})); }

void init_parameter(const std::string& name, torch::Tensor& p, at::Generator& g) {
  torch::NoGradGuard no_grad;
  if (name.find("norm.weight") != std::string::npos) p.fill_(1.0);
  else if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) p.zero_();
  else p.normal_(0.0, 0.02, g);
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
  // A mixture of experts saved per expert (the Hub's files; save_pretrained's original format):
  // fused into the module's tensors as transformers 5 does (Mixtral's under its own names).
  const MoeConfig& moe = model.config().moe;
  if (moe.on()) {
    load_declared(model, family(model.config()), moe::fuse_experts(tensors, expert_file_names(model.config())), source, o);
    return;
  }
  load_declared(model, family(model.config()), tensors, source, o);  // a stage's tensors, a tp rank's parts
}

moe::PerExpertNames expert_file_names(const Config& c) {
  return c.model_type == "mixtral" ? moe::PerExpertNames{"block_sparse_moe", "w1", "w3", "w2"}
                                   : moe::PerExpertNames{"mlp", "gate_proj", "up_proj", "down_proj"};
}

nlohmann::json hf_config(const Config& c) {
  std::string type = c.model_type;
  const MoeConfig& moe = c.moe;
  if (type.empty() && moe.on()) type = c.qk_norm ? "qwen3_moe" : "mixtral";
  if (type.empty()) type = c.qk_norm ? "qwen3" : c.qkv_bias && !c.o_bias && !c.mlp_bias ? "qwen2" : "llama";
  const bool qwen3 = type == "qwen3" || type == "qwen3_moe";
  // Mixtral: every layer sparse, always renormalised, its experts the only MLP.
  const bool mixtral_moe = moe.sparse_step == 1 && moe.mlp_only_layers.empty() && moe.norm_topk_prob;
  const bool fits = qwen3 == c.qk_norm && (type == "qwen3_moe" || type == "mixtral") == moe.on() &&
                    (type == "qwen2"                        ? c.qkv_bias && !c.o_bias && !c.mlp_bias
                     : type == "mistral" || type == "mixtral" ? !c.qkv_bias && !c.o_bias && !c.mlp_bias
                     : qwen3                                ? c.qkv_bias == c.o_bias && !c.mlp_bias
                                                            : c.qkv_bias == c.o_bias) &&
                    (type != "mixtral" || mixtral_moe);
  if (!fits)
    throw std::runtime_error(fmt::format("llama: no transformers class has q/k/v biases {}, an o bias {}, MLP biases {}, "
                                         "q/k norms {} and {} ({} puts them otherwise); this model cannot be saved as a "
                                         "Hugging Face folder", c.qkv_bias, c.o_bias, c.mlp_bias, c.qk_norm,
                                         moe.on() ? "these experts" : "no experts", type));
  static const std::map<std::string, std::string> kClass = {{"llama", "LlamaForCausalLM"},
                                                            {"qwen2", "Qwen2ForCausalLM"},
                                                            {"qwen3", "Qwen3ForCausalLM"},
                                                            {"mistral", "MistralForCausalLM"},
                                                            {"qwen3_moe", "Qwen3MoeForCausalLM"},
                                                            {"mixtral", "MixtralForCausalLM"}};
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
  if (qwen3) j["attention_bias"] = c.qkv_bias;
  if (type == "qwen2" || qwen3) j["use_sliding_window"] = false;
  if (type == "mistral" || type == "mixtral") j["sliding_window"] = nullptr;
  if (moe.on()) {
    j["num_experts_per_tok"] = moe.top_k;
    j["output_router_logits"] = moe.aux_loss;
    j["router_aux_loss_coef"] = moe.aux_loss_coef;
  }
  if (type == "qwen3_moe") {
    j["num_experts"] = moe.experts;
    j["moe_intermediate_size"] = moe.expert_dim;
    j["norm_topk_prob"] = moe.norm_topk_prob;
    j["decoder_sparse_step"] = moe.sparse_step;
    j["mlp_only_layers"] = moe.mlp_only_layers;
  }
  if (type == "mixtral") {
    j["num_local_experts"] = moe.experts;
    j["intermediate_size"] = moe.expert_dim;  // Mixtral's experts are its MLP
    j["router_jitter_noise"] = 0.0;
  }
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

std::shared_ptr<ModelState> make_state(Llama model) {
  ModelState::ForwardFn fwd = [](torch::nn::Module& m, const TensorMap& batch) {
    const torch::Tensor inputs = lm_inputs(batch, "llama");
    const LmPacking packing = lm_packing(batch, inputs, "llama");
    auto* llama = m.as<LlamaImpl>();
    if (!llama) throw std::runtime_error("llama: the model's module is not a llama");
    if (const auto& stages = llama->config().stages)  // pipeline parallel: this rank's chunks (models/stages.hpp)
      return staged_forward(*stages, inputs.device(),
                            [&](int k, const TensorMap& in) { return llama->chunk(k, inputs, in, packing); });
    return llama->forward(inputs, packing, lm_loss_rows(batch));
  };
  auto state = std::make_shared<ModelState>(std::static_pointer_cast<torch::nn::Module>(model.ptr()), fwd, "llama");
  state->stages = model->config().stages;
  auto lm = std::make_shared<ModelState::CausalLm>();
  lm->context = model->config().context;
  lm->decode = [](ModelState& self, const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& mask,
                  KvCache& cache) { return self.module->as<LlamaImpl>()->decode(ids, positions, mask, cache); };
  state->causal_lm = lm;
  if (model->config().moe.router_loss())
    state->extra_loss = [](torch::nn::Module& m) { return m.as<LlamaImpl>()->aux_loss(); };
  if (model->config().moe.on())
    state->take_routing_metrics = [](torch::nn::Module& m) { return m.as<LlamaImpl>()->take_routing_metrics(); };
  return state;
}

}  // namespace flowrun::llama
