// A HunyuanDiT-style diffusion transformer as a libtorch module (diffusers HunyuanDiT2DModel
// names), its init, loader and state. Names and math: dit.hpp. The node type dit: dit_node.cpp.
// Test: tests/nodes/dit_test.cpp.
#include "models/dit/dit.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <regex>
#include <set>
#include <sstream>

#include "common/batch_keys.hpp"
#include "common/safetensors.hpp"
#include "common/seed.hpp"
#include "models/attention.hpp"
#include "models/load_by_name.hpp"

namespace flowrun::dit {

namespace {

constexpr int64_t kPoolHeads = 8;  // diffusers' HunyuanDiTAttentionPool(num_heads=8)

bool ends_with(const std::string& s, const std::string& e) {
  return s.size() >= e.size() && s.compare(s.size() - e.size(), e.size(), e) == 0;
}

}  // namespace

std::string describe(const Config& c) {
  std::ostringstream s;
  s << "patch=" << c.patch << " in_channels=" << c.in_channels << " hidden=" << c.hidden << " depth=" << c.depth
    << " heads=" << c.heads << " mlp_ratio=" << c.mlp_ratio << " text_dim=" << c.text_dim << " t5_dim=" << c.t5_dim << " text_len=" << c.text_len;
  if (c.t5_dim > 0) s << " text_len_t5=" << c.text_len_t5 << " pooled_projection_dim=" << c.pooled_projection_dim;
  s << " use_style_cond_and_image_meta_size=" << (c.use_style_cond_and_image_meta_size ? "true" : "false")
    << " learn_sigma=" << (c.learn_sigma ? "true" : "false") << " rope_base_grid=" << c.rope_base_grid;
  return s.str();
}

void Config::check() const {
  if (patch < 1 || in_channels < 1 || hidden < 1 || depth < 1 || heads < 1 || text_dim < 1 || t5_dim < 0 ||
      text_len < 1 || (t5_dim > 0 && (text_len_t5 < 1 || pooled_projection_dim < 1)))
    throw std::runtime_error("dit: sizes must be >= 1 (t5_dim >= 0): " + describe(*this));
  if (stages) stages->check(depth, "dit");
  if (t5_dim % kPoolHeads != 0)
    throw std::runtime_error("dit: t5_dim " + std::to_string(t5_dim) + " must be a multiple of " +
                             std::to_string(kPoolHeads) + " (the T5 pooler's heads)");
  if (hidden % heads != 0)
    throw std::runtime_error("dit: hidden " + std::to_string(hidden) + " is not a multiple of heads " +
                             std::to_string(heads));
  if (head_dim() % 4 != 0)
    throw std::runtime_error("dit: the head width hidden/heads = " + std::to_string(head_dim()) +
                             " must be a multiple of 4 (2-D RoPE rotates pairs in two halves)");
  if (!(mlp_ratio > 0) || ff_inner() < 1) throw std::runtime_error("dit: mlp_ratio must be > 0");
  if (tp && (heads % tp->size() != 0 || ff_inner() % tp->size() != 0))
    throw std::runtime_error("dit: heads " + std::to_string(heads) + " and the MLP's width " + std::to_string(ff_inner()) +
                             " (int(hidden x mlp_ratio)) do not both split into " + std::to_string(tp->size()) +
                             " tensor-parallel parts; choose run.parallel.tp dividing both");
}

parallel::TpSplit tp_split(const std::string& name) {
  if (lora::is_adapter(name)) return lora::adapter_tp_split(name, tp_split, /*fan_in_fan_out=*/false);
  if (name.rfind("blocks.", 0) != 0) return {};  // embedders, pooler, norm_out, proj_out: whole
  for (const char* column : {".to_q.weight", ".to_q.bias", ".to_k.weight", ".to_k.bias", ".to_v.weight", ".to_v.bias",
                             ".ff.net.0.proj.weight", ".ff.net.0.proj.bias"})
    if (ends_with(name, column)) return {0, 1};  // [out, in]: this rank's heads' / units' rows
  if (ends_with(name, ".to_out.0.weight") || ends_with(name, ".ff.net.2.weight")) return {1, 1};  // by input columns
  return {};  // norms, modulations, skip linears, the row-split layers' biases
}

// ---- leaf modules and blocks

void AttentionPoolImpl::reset() {
  positional_embedding = register_parameter("positional_embedding", torch::zeros({len_ + 1, dim_}));
  k_proj = register_module("k_proj", lora::Linear(dim_, dim_));
  q_proj = register_module("q_proj", lora::Linear(dim_, dim_));
  v_proj = register_module("v_proj", lora::Linear(dim_, dim_));
  c_proj = register_module("c_proj", lora::Linear(dim_, out_));
}

torch::Tensor AttentionPoolImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), L = x.size(1) + 1, H = heads_, D = dim_ / heads_;
  torch::Tensor seq = torch::cat({x.mean(1, /*keepdim=*/true), x}, 1) + positional_embedding.to(x.scalar_type());
  torch::Tensor q = q_proj(seq.narrow(1, 0, 1)).view({B, 1, H, D}).transpose(1, 2);  // the mean token asks
  torch::Tensor k = k_proj(seq).view({B, L, H, D}).transpose(1, 2);
  torch::Tensor v = v_proj(seq).view({B, L, H, D}).transpose(1, 2);
  return c_proj(attention(q, k, v).reshape({B, dim_}));
}

void TimeEmbedImpl::reset() {
  timestep_embedder = register_module("timestep_embedder", TwoLayer(256, cfg_.hidden, two_layer(cfg_.hidden)));
  if (cfg_.t5_dim > 0)
    pooler = register_module("pooler", AttentionPool(cfg_.text_len_t5, cfg_.t5_dim, kPoolHeads, cfg_.pooled_projection_dim));
  if (cfg_.use_style_cond_and_image_meta_size)
    style_embedder = register_module("style_embedder", torch::nn::Embedding(1, cfg_.hidden));
  if (cfg_.extra_in() > 0)
    extra_embedder = register_module("extra_embedder", TwoLayer(cfg_.extra_in(), 4 * cfg_.hidden, two_layer(cfg_.hidden)));
}

torch::Tensor TimeEmbedImpl::forward(const torch::Tensor& t, const torch::Tensor& t5, const torch::Tensor& meta,
                                     const torch::Tensor& style, torch::ScalarType dtype) {
  torch::Tensor temb = timestep_embedder(timestep_features(t, 256).to(dtype));
  std::vector<torch::Tensor> extra;
  if (pooler) extra.push_back(pooler(t5.to(dtype)));
  if (style_embedder) {
    // Six numbers, 256 sinusoidal features each, side by side: [B, 1536].
    extra.push_back(timestep_features(meta.reshape({-1}), 256).to(dtype).view({meta.size(0), 6 * 256}));
    extra.push_back(style_embedder(style.to(torch::kLong)).to(dtype));
  }
  if (extra_embedder) temb = temb + extra_embedder(torch::cat(extra, 1));
  return temb;
}

void AdaNormShiftImpl::reset() {
  linear = register_module("linear", lora::Linear(dim_, dim_));
  norm = register_module("norm", LayerNorm(dim_, layers::fp32_norm()));
}

torch::Tensor AdaNormShiftImpl::forward(const torch::Tensor& x, const torch::Tensor& temb) {
  torch::Tensor shift = linear(torch::silu(temb));
  return norm(x) + shift.unsqueeze(1);
}

void AdaNormContinuousImpl::reset() {
  linear = register_module("linear", lora::Linear(dim_, 2 * dim_));
  norm = register_module("norm", LayerNorm(dim_, layers::fp32_norm(/*affine=*/false)));
}

torch::Tensor AdaNormContinuousImpl::forward(const torch::Tensor& x, const torch::Tensor& temb) {
  std::vector<torch::Tensor> ss = linear(torch::silu(temb)).chunk(2, 1);  // scale | shift
  return norm(x) * (1 + ss[0]).unsqueeze(1) + ss[1].unsqueeze(1);
}

void AttentionImpl::reset() {
  const int64_t D = dim_ / heads_;
  const int64_t width = layers::tp_share(dim_, tp_, "dit: the attention's width");  // this rank's heads' channels
  to_q = register_module("to_q", lora::split(lora::Linear(dim_, width), tp_, lora::TpRole::outputs));
  to_k = register_module("to_k", lora::split(lora::Linear(kv_dim_, width), tp_, lora::TpRole::outputs));
  to_v = register_module("to_v", lora::split(lora::Linear(kv_dim_, width), tp_, lora::TpRole::outputs));
  layers::NormOptions per_head = layers::fp32_norm();
  per_head.tp = tp_;  // shared by the heads, which tp splits: their gradients summed over the ranks
  norm_q = register_module("norm_q", LayerNorm(D, per_head));
  norm_k = register_module("norm_k", LayerNorm(D, per_head));
  to_out = register_module("to_out", torch::nn::ModuleList());
  to_out->push_back(lora::split(lora::Linear(width, dim_), tp_, lora::TpRole::inputs));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& ctx, const torch::Tensor& cos,
                                     const torch::Tensor& sin) {
  // With tp this rank's heads only: its q, k, v rows in, its columns of to_out.0 out, summed.
  const int64_t B = x.size(0), N = x.size(1), H = heads_ / (tp_ ? tp_->size() : 1), D = dim_ / heads_;
  const torch::Tensor xs = parallel::copy_to_tp(x, tp_);
  const torch::Tensor& kv = cross_ ? ctx : xs;
  const int64_t L = kv.size(1);
  torch::Tensor q = norm_q(to_q(xs).view({B, N, H, D}).transpose(1, 2));  // [B, H, N, D]
  torch::Tensor k = norm_k(to_k(kv).view({B, L, H, D}).transpose(1, 2));
  torch::Tensor v = to_v(kv).view({B, L, H, D}).transpose(1, 2);
  q = apply_rope(q, cos, sin);
  if (!cross_) k = apply_rope(k, cos, sin);  // HunyuanDiT: the text keys are not rotated
  return layers::row_parallel(*to_out[0]->as<lora::LinearImpl>(), attention(q, k, v), tp_);  // [B, N, dim]
}

void BlockImpl::reset() {
  norm1 = register_module("norm1", AdaNormShift(cfg_.hidden));
  attn1 = register_module("attn1", Attention(cfg_.hidden, cfg_.hidden, cfg_.heads, false, cfg_.tp));
  norm2 = register_module("norm2", LayerNorm(cfg_.hidden, layers::fp32_norm()));
  attn2 = register_module("attn2", Attention(cfg_.hidden, cfg_.text_dim, cfg_.heads, true, cfg_.tp));
  norm3 = register_module("norm3", LayerNorm(cfg_.hidden, layers::fp32_norm()));
  ff = register_module("ff", layers::Mlp(cfg_.hidden, cfg_.ff_inner(), ff_options(cfg_.tp)));
  if (skip_) {
    skip_norm = register_module("skip_norm", LayerNorm(2 * cfg_.hidden, layers::fp32_norm()));
    skip_linear = register_module("skip_linear", lora::Linear(2 * cfg_.hidden, cfg_.hidden));
  }
}

torch::Tensor BlockImpl::forward(torch::Tensor h, const torch::Tensor& temb, const torch::Tensor& ctx,
                                 const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& skip) {
  if (skip_) h = skip_linear(skip_norm(torch::cat({h, skip}, -1)));
  h = h + attn1(norm1(h, temb), torch::Tensor(), cos, sin);
  h = h + attn2(norm2(h), ctx, cos, sin);
  return h + ff(norm3(h));
}

// ---- RoPE and timestep features

std::pair<torch::Tensor, torch::Tensor> rope_2d(int64_t head_dim, int64_t gh, int64_t gw, int64_t base_grid) {
  const int64_t half = head_dim / 2;  // channels per axis
  auto f32 = torch::TensorOptions().dtype(torch::kFloat);
  // f_k = 1 / 10000^(2k / half), k < half/2; each repeated for the pair (2k, 2k+1).
  torch::Tensor freqs = 1.0 / torch::pow(10000.0, torch::arange(0, half, 2, f32) / static_cast<double>(half));
  // Positions along each axis: n of them from `start`, `span` / n apart (computed in double,
  // then float32, as numpy's linspace(start, start + span, n, endpoint=False, dtype=float32)).
  auto axis = [&](int64_t n, double start, double span) {
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t k = 0; k < n; ++k) v[static_cast<size_t>(k)] = static_cast<float>(k * (span / n) + start);
    return torch::tensor(v, f32);
  };
  torch::Tensor ys = torch::arange(gh, f32), xs = torch::arange(gw, f32);
  if (base_grid > 0) {  // diffusers' get_resize_crop_region_for_grid((gh, gw), base_grid)
    const double b = static_cast<double>(base_grid), h = static_cast<double>(gh), w = static_cast<double>(gw);
    double rh = b, rw = b;
    if (h / w > 1)
      rw = std::nearbyint(b / h * w);  // Python's round(): half to even, as nearbyint by default
    else
      rh = std::nearbyint(b / w * h);
    ys = axis(gh, std::nearbyint((b - rh) / 2.0), rh);
    xs = axis(gw, std::nearbyint((b - rw) / 2.0), rw);
  }
  torch::Tensor rows = ys.repeat_interleave(gw);  // token (r, c) at r*gw + c
  torch::Tensor cols = xs.repeat({gh});
  torch::Tensor aw = torch::outer(cols, freqs).repeat_interleave(2, 1);  // first half: column
  torch::Tensor ah = torch::outer(rows, freqs).repeat_interleave(2, 1);  // second half: row
  torch::Tensor a = torch::cat({aw, ah}, 1);                             // [gh*gw, head_dim]
  return {a.cos(), a.sin()};
}

torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  torch::Tensor xf = x.to(torch::kFloat);
  auto sizes = xf.sizes().vec();
  sizes.back() /= 2;
  sizes.push_back(2);
  torch::Tensor pairs = xf.reshape(sizes);
  torch::Tensor re = pairs.select(-1, 0), im = pairs.select(-1, 1);
  torch::Tensor rot = torch::stack({-im, re}, -1).flatten(-2);
  return (xf * cos + rot * sin).to(x.scalar_type());
}

torch::Tensor timestep_features(const torch::Tensor& t, int64_t dim) {
  const int64_t half = dim / 2;
  auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(t.device());
  // diffusers' get_timestep_embedding, in its order of float32 operations (the image sizes of
  // the size conditioning, ~1000, make a different rounding of f visible in sin(v f)).
  torch::Tensor freqs = torch::exp(-std::log(10000.0) * torch::arange(half, f32) / static_cast<double>(half));
  torch::Tensor a = t.to(torch::kFloat).reshape({-1, 1}) * freqs.unsqueeze(0);
  return torch::cat({a.cos(), a.sin()}, 1);
}

// ---- the model

double Config::parameter_count() const {
  const double h = static_cast<double>(hidden), td = static_cast<double>(text_dim), t5 = static_cast<double>(t5_dim);
  const double inner = static_cast<double>(ff_inner()), p2 = static_cast<double>(patch * patch);
  double n = static_cast<double>(text_len + (t5_dim > 0 ? text_len_t5 : 0)) * td;  // text_embedding_padding
  n += static_cast<double>(in_channels) * p2 * h + h;                               // pos_embed
  n += 256 * h + h * h + 2 * h;                                                     // the timestep's two layers
  if (t5_dim > 0) {
    n += t5 * 4 * t5 + 4 * t5 * td;                                                 // text_embedder (T5 -> text width)
    n += static_cast<double>(text_len_t5 + 1) * t5 + 3 * t5 * t5 +                  // the T5 pooler
         t5 * static_cast<double>(pooled_projection_dim);
  }
  n += static_cast<double>(extra_in()) * 4 * h + 4 * h * h;                          // size/style/pooled embedder
  // Per block: its modulation (h x h), self-attention (4 h^2), cross-attention (q, out: 2 h^2;
  // k, v from the text: 2 td h), the MLP (2 h inner); the later half's skip (2h x h).
  n += static_cast<double>(depth) * (h * h + 4 * h * h + 2 * h * h + 2 * td * h + 2 * h * inner);
  n += static_cast<double>(depth / 2) * 2 * h * h;
  n += 2 * h * h + h * p2 * static_cast<double>(out_channels());                    // norm_out, proj_out
  return n;
}

DitImpl::DitImpl(Config cfg) : cfg_(cfg), rope_cache_(std::make_shared<RopeCache>()) {
  cfg_.check();
  reset();
}

// Staged (pipeline parallel): the embeddings with chunk 0, the blocks this rank holds (an empty
// placeholder in the others' places, so that every name is the whole model's), the output layers
// with the last chunk. whole_order() lists the same in the same order: keep them alike.
void DitImpl::reset() {
  const bool first = !cfg_.stages || cfg_.stages->first(), last = !cfg_.stages || cfg_.stages->last();
  const int64_t tokens = cfg_.text_len + (cfg_.t5_dim > 0 ? cfg_.text_len_t5 : 0);
  if (first) {
    text_embedding_padding = register_parameter("text_embedding_padding", torch::zeros({tokens, cfg_.text_dim}));
    if (cfg_.t5_dim > 0) text_embedder = register_module("text_embedder", TwoLayer(cfg_.t5_dim, 4 * cfg_.t5_dim, two_layer(cfg_.text_dim)));
    pos_embed = register_module("pos_embed", PatchEmbed(cfg_.in_channels, cfg_.hidden, cfg_.patch));
    time_extra_emb = register_module("time_extra_emb", TimeEmbed(cfg_));
  }
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg_.depth; ++i) {
    if (cfg_.holds_block(i)) blocks->push_back(Block(cfg_, i > cfg_.depth / 2));
    else blocks->push_back(torch::nn::Identity());
  }
  if (last) {
    norm_out = register_module("norm_out", AdaNormContinuous(cfg_.hidden));
    proj_out = register_module("proj_out", lora::Linear(cfg_.hidden, cfg_.patch * cfg_.patch * cfg_.out_channels()));
  }
}

Family family(const Config& c) {
  Family f;
  f.tp = c.tp, f.stages = c.stages;
  f.tp_split = tp_split;
  f.order = [c] { return whole_order(c); };
  // A block's products a token: attention and MLP, about 4 + 2 mlp_ratio hidden^2 (the
  // cross-attention's on the text aside).
  const double h = static_cast<double>(c.hidden);
  f.block_costs.assign(static_cast<size_t>(c.depth), (4 + 2 * c.mlp_ratio) * h * h);
  f.generator = init_generator;
  f.init_one = init_parameter;
  return f;
}

ParamOrder whole_order(const Config& c) {
  Config one = c;
  one.stages = nullptr;
  std::vector<std::pair<std::string, std::vector<int64_t>>> order;
  auto add = [&](const std::string& prefix, torch::nn::Module& m) {
    for (const auto& p : m.named_parameters(true)) order.emplace_back(prefix + p.key(), p.value().sizes().vec());
  };
  const int64_t tokens = c.text_len + (c.t5_dim > 0 ? c.text_len_t5 : 0);
  order.emplace_back("text_embedding_padding", std::vector<int64_t>{tokens, c.text_dim});
  if (c.t5_dim > 0) add("text_embedder.", *TwoLayer(c.t5_dim, 4 * c.t5_dim, two_layer(c.text_dim)));
  add("pos_embed.", *PatchEmbed(c.in_channels, c.hidden, c.patch));
  add("time_extra_emb.", *TimeEmbed(one));
  for (int64_t i = 0; i < c.depth; ++i) add("blocks." + std::to_string(i) + ".", *Block(one, i > c.depth / 2));
  add("norm_out.", *AdaNormContinuous(c.hidden));
  add("proj_out.", *lora::Linear(c.hidden, c.patch * c.patch * c.out_channels()));
  return order;
}

std::pair<torch::Tensor, torch::Tensor> DitImpl::rope(int64_t gh, int64_t gw, const torch::Device& device) {
  const std::string key = std::to_string(gh) + "x" + std::to_string(gw) + "/" + device.str();
  std::lock_guard<std::mutex> lock(rope_cache_->mu);
  auto it = rope_cache_->tables.find(key);
  if (it != rope_cache_->tables.end()) return it->second;
  torch::NoGradGuard no_grad;
  auto [c, s] = rope_2d(cfg_.head_dim(), gh, gw, cfg_.rope_base_grid);
  auto v = std::make_pair(c.to(device), s.to(device));
  rope_cache_->tables[key] = v;
  return v;
}

DitImpl::Stream DitImpl::embed(const Inputs& in) {
  const torch::Tensor& x = in.x;
  const int64_t p = cfg_.patch, C = cfg_.in_channels;
  if (!x.defined() || x.dim() != 4 || x.size(1) != C || x.size(2) % p != 0 || x.size(3) % p != 0 || x.size(2) == 0 ||
      x.size(3) == 0)
    throw std::runtime_error("dit: x must be [batch, " + std::to_string(C) + ", H, W] with H and W multiples of patch " +
                             std::to_string(p) + ", got " + (x.defined() ? shape_str(x) : "nothing"));
  const int64_t B = x.size(0), gh = x.size(2) / p, gw = x.size(3) / p;
  const torch::Tensor& t = in.t;
  if (!t.defined() || !(t.dim() == 0 || (t.dim() == 1 && (t.size(0) == B || t.size(0) == 1))))
    throw std::runtime_error("dit: t must be [batch] or a scalar, got " + (t.defined() ? shape_str(t) : "nothing"));
  // Fixed-length text, as the padding table has a row per token position.
  auto check_text = [&](const torch::Tensor& emb, const torch::Tensor& mask, const char* key, int64_t len, int64_t dim,
                        const char* len_param) {
    if (!emb.defined() || emb.dim() != 3 || emb.size(0) != B || emb.size(2) != dim)
      throw std::runtime_error("dit: " + std::string(key) + " must be [batch=" + std::to_string(B) + ", " + len_param +
                               "=" + std::to_string(len) + ", " + std::to_string(dim) + "], got " +
                               (emb.defined() ? shape_str(emb) : "nothing"));
    if (emb.size(1) != len)
      throw std::runtime_error("dit: " + std::string(key) + " has " + std::to_string(emb.size(1)) +
                               " tokens but the model's " + len_param + " is " + std::to_string(len) +
                               " (HunyuanDiT's text is fixed-length: set the dit's " + len_param +
                               " to the tokenizer's max_length)");
    if (mask.defined() && (mask.dim() != 2 || mask.size(0) != B || mask.size(1) != len))
      throw std::runtime_error("dit: the mask of " + std::string(key) + " must be [batch, " + std::to_string(len) +
                               "], got " + shape_str(mask));
  };
  check_text(in.text, in.text_mask, batch_key::text_emb, cfg_.text_len, cfg_.text_dim, "text_len");
  if (cfg_.t5_dim > 0) {
    if (!in.t5.defined())
      throw std::runtime_error("dit: the model has t5_dim " + std::to_string(cfg_.t5_dim) +
                               " but the batch has no 't5_emb' (set t5_dim: 0 for a model without T5)");
    check_text(in.t5, in.t5_mask, batch_key::t5_emb, cfg_.text_len_t5, cfg_.t5_dim, "text_len_t5");
  } else if (in.t5.defined()) {
    throw std::runtime_error("dit: the batch has 't5_emb' but the model has t5_dim 0 (set t5_dim to its width)");
  }
  if (cfg_.use_style_cond_and_image_meta_size) {
    if (!in.image_meta_size.defined() || !in.style.defined())
      throw std::runtime_error(
          "dit: the model has size and style conditioning (use_style_cond_and_image_meta_size) but the batch has no "
          "'image_meta_size' [batch, 6] and 'style' [batch] (image_text_shards and sampler give them; or set "
          "use_style_cond_and_image_meta_size: false)");
    if (!in.image_meta_size.sizes().equals({B, 6}) || !in.style.sizes().equals({B}))
      throw std::runtime_error("dit: image_meta_size must be [batch, 6] and style [batch], got " +
                               shape_str(in.image_meta_size) + " and " + shape_str(in.style));
    // (On the CPU only: on a GPU the check would wait for the device every step.)
    if (!in.style.is_cuda() && in.style.numel() > 0 && (in.style.min().item<int64_t>() != 0 || in.style.max().item<int64_t>() != 0))
      throw std::runtime_error("dit: style must be 0 (the model has one style embedding, as diffusers')");
  }

  // Text: the first encoder's states, then the T5 states projected to text_dim; padded tokens
  // (mask 0) become their learned rows of text_embedding_padding.
  const auto dtype = in.text.scalar_type();
  torch::Tensor ctx = in.text, keep = in.text_mask.defined() ? in.text_mask : torch::ones({B, cfg_.text_len}, x.device());
  if (cfg_.t5_dim > 0) {
    ctx = torch::cat({ctx, text_embedder(in.t5.to(dtype)).to(dtype)}, 1);
    keep = torch::cat({keep.to(torch::kFloat),
                       (in.t5_mask.defined() ? in.t5_mask : torch::ones({B, cfg_.text_len_t5}, x.device())).to(torch::kFloat)},
                      1);
  }
  ctx = torch::where(keep.to(torch::kBool).unsqueeze(2), ctx, text_embedding_padding.to(dtype));
  // Under tp every cross-attention reads its heads' keys and values of the text: one copy, so
  // the text's gradient (into the T5 projection and the padding rows) is summed over the ranks
  // once for all blocks.
  ctx = parallel::copy_to_tp(ctx, cfg_.tp);

  Stream s;
  s.h = pos_embed(x);  // [B, N, hidden], row-major patches
  torch::Tensor tt = t.dim() == 0 ? t.reshape({1}).expand({B}) : (t.size(0) == 1 ? t.expand({B}) : t);
  s.temb = time_extra_emb->forward(tt, in.t5, in.image_meta_size, in.style, s.h.scalar_type());
  s.ctx = ctx;
  (void)gh;
  (void)gw;
  return s;
}

void DitImpl::run_blocks(Stream& s, int64_t first, int64_t last, const Inputs& in) {
  const int64_t p = cfg_.patch, gh = in.x.size(2) / p, gw = in.x.size(3) / p;
  auto [cos, sin] = rope(gh, gw, in.x.device());
  const int64_t d = cfg_.depth;
  // The ModuleList itself (clone() replaces its items). Block i > depth / 2 adds the output of
  // block depth - 1 - i (a long skip): the skips are a stack.
  for (int64_t i = first; i < last; ++i) {
    auto* blk = (*blocks)[static_cast<size_t>(i)]->as<BlockImpl>();
    if (!blk) throw std::logic_error("dit: block " + std::to_string(i) + " is another pipeline stage's");
    torch::Tensor skip;
    if (blk->has_skip()) {
      skip = s.skips.back();  // the output of block depth-1-i
      s.skips.pop_back();
    }
    s.h = run_block(cfg_.checkpoint, i, *blk, {s.h, s.temb, s.ctx, cos, sin, skip}, [blk](const std::vector<torch::Tensor>& a) {
      return blk->forward(a[0], a[1], a[2], a[3], a[4], a[5]);
    });
    if (i < d - 1 - d / 2) s.skips.push_back(s.h);
  }
}

torch::Tensor DitImpl::head(const Stream& s, const Inputs& in) {
  const int64_t p = cfg_.patch, B = in.x.size(0), gh = in.x.size(2) / p, gw = in.x.size(3) / p;
  const torch::Tensor h = proj_out(norm_out(s.h, s.temb));  // [B, N, p*p*C']
  // Unpatchify: [B, gh, gw, p, p, C'] -> [B, C', gh, p, gw, p] -> [B, C', H, W].
  const int64_t Co = cfg_.out_channels();
  return h.reshape({B, gh, gw, p, p, Co}).permute({0, 5, 1, 3, 2, 4}).reshape({B, Co, gh * p, gw * p});
}

torch::Tensor DitImpl::forward(const Inputs& in) {
  if (cfg_.staged())
    throw std::runtime_error("dit: this rank holds pipeline chunks of the model only (run.parallel.pp); it runs chunk by "
                             "chunk (models/stages.hpp), not as a whole");
  Stream s = embed(in);
  run_blocks(s, 0, cfg_.depth, in);
  return head(s, in);
}

TensorMap DitImpl::chunk(int k, const Inputs& in, const TensorMap& prev) {
  if (!cfg_.stages || !cfg_.stages->holds(k)) throw std::logic_error("dit: pipeline chunk " + std::to_string(k) + " is another rank's");
  Stream s;
  if (k == 0) {
    s = embed(in);
  } else {
    s.h = prev.at("h");
    s.temb = prev.at("temb");
    s.ctx = prev.at("ctx");
    for (size_t i = 0;; ++i) {  // "skip.000", "skip.001", ... bottom of the stack first
      char key[32];
      std::snprintf(key, sizeof key, "skip.%03zu", i);
      auto it = prev.find(key);
      if (it == prev.end()) break;
      s.skips.push_back(it->second);
    }
  }
  const auto [first, last] = cfg_.stages->blocks.at(static_cast<size_t>(k));
  run_blocks(s, first, last, in);
  if (k + 1 == cfg_.stages->chunks()) return {{"output", head(s, in)}};
  TensorMap out{{"h", s.h}, {"temb", s.temb}, {"ctx", s.ctx}};
  for (size_t i = 0; i < s.skips.size(); ++i) {
    char key[32];
    std::snprintf(key, sizeof key, "skip.%03zu", i);
    out[key] = s.skips[i];
  }
  return out;
}


torch::Tensor DitImpl::forward_all(const TensorMap& batch) {
  auto get = [&](const char* k, bool required) {
    auto it = batch.find(k);
    if (it == batch.end()) {
      if (!required) return torch::Tensor();
      std::string have;
      for (const auto& [key, _] : batch) have += (have.empty() ? "" : ", ") + key;
      throw std::runtime_error(std::string("dit: the batch has no '") + k + "' (it has {" + have + "})");
    }
    return it->second;
  };
  Inputs in;
  in.x = get(batch_key::noisy, true);
  in.t = get(batch_key::timestep, true);
  in.text = get(batch_key::text_emb, true);
  in.text_mask = get(batch_key::text_mask, false);
  in.t5 = get(batch_key::t5_emb, false);
  in.t5_mask = get(batch_key::t5_mask, false);
  in.image_meta_size = get(batch_key::image_meta_size, false);
  in.style = get(batch_key::style, false);
  if (cfg_.stages)  // pipeline parallel: this rank's chunks (models/stages.hpp)
    return staged_forward(*cfg_.stages, in.x.device(), [&](int k, const TensorMap& prev) { return chunk(k, in, prev); });
  return forward(in);
}

torch::Tensor DitImpl::forward_batch(const TensorMap& batch) {
  torch::Tensor y = forward_all(batch);
  return cfg_.learn_sigma ? y.narrow(1, 0, cfg_.in_channels) : y;
}

at::Generator init_generator(uint64_t seed) { return make_cpu_generator(mix_seed({seed, kSeedTagInit})); }

void init_weights(DitImpl& model, uint64_t seed) {
  at::Generator g = init_generator(seed);
  for (auto& item : model.named_parameters(true))
    if (!lora::is_adapter(item.key())) init_parameter(item.key(), item.value(), g);
}

void init_parameter(const std::string& name, torch::Tensor& p, at::Generator& g) {
  torch::NoGradGuard no_grad;
  torch::Tensor v = torch::zeros(p.sizes());
  const bool zero = name.find("norm1.linear.") != std::string::npos ||
                    name.find("norm_out.linear.") != std::string::npos || name.rfind("proj_out.", 0) == 0;
  if (zero || ends_with(name, ".bias")) {
    // zero (adaLN modulation, final projection, biases)
  } else if (name.find("norm") != std::string::npos && p.dim() == 1) {
    v.fill_(1.0);  // LayerNorm gains (norm2, norm3, norm1.norm, norm_q, norm_k, skip_norm)
  } else if (name.find("timestep_embedder.") != std::string::npos || name.find("extra_embedder.") != std::string::npos) {
    v.normal_(0.0, 0.02, g);
  } else if (name == "text_embedding_padding" || name.find("style_embedder.") != std::string::npos) {
    v.normal_(0.0, 1.0, g);  // diffusers' constructor: torch.randn / nn.Embedding's default
  } else if (name.find("pooler.positional_embedding") != std::string::npos) {
    v.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(p.size(1))), g);
  } else {
    const int64_t fan_out = p.size(0), fan_in = p.numel() / p.size(0);
    const double a = std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
    v.uniform_(-a, a, g);
  }
  p.copy_(v);
}

void load_state_dict(DitImpl& model, const std::map<std::string, torch::Tensor>& tensors, const std::string& source) {
  LoadByNameOptions o;
  o.model = "dit (" + describe(model.config()) + ")";
  o.optional = lora::is_adapter;  // a base file loads into a LoRA-adapted model; the adapters keep their init
  load_declared(model, family(model.config()), tensors, source, o);  // a stage's tensors, a tp rank's parts
}

void load_safetensors(DitImpl& model, const std::string& path) {
  safetensors::File f = safetensors::load(path);
  load_state_dict(model, f.tensors, path);
}

std::shared_ptr<ModelState> make_state(Dit model) {
  ModelState::ForwardFn fwd = [](torch::nn::Module& m, const TensorMap& batch) {
    auto* dit = m.as<DitImpl>();
    if (!dit) throw std::runtime_error("dit: the model's module is not a DiT");
    return dit->forward_batch(batch);
  };
  auto state = std::make_shared<ModelState>(std::static_pointer_cast<torch::nn::Module>(model.ptr()), fwd, "dit");
  state->stages = model->config().stages;
  state->exporter = lora::peft_export;  // its adapters, once it has some (checkpoint `exports`)
  return state;
}

}  // namespace flowrun::dit
