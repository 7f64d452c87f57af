// A HunyuanDiT-style diffusion transformer as a libtorch module (diffusers HunyuanDiT2DModel
// names), its init, loader and state. Names and math: dit.hpp. The node type dit: dit_node.cpp.
// Test: tests/nodes/dit_test.cpp.
#include "models/dit.hpp"

#include <cmath>
#include <regex>
#include <sstream>

#include "common/safetensors.hpp"
#include "common/seed.hpp"
#include "models/attention.hpp"
#include "models/load_by_name.hpp"

namespace flowrun::dit {

namespace {

bool ends_with(const std::string& s, const std::string& e) {
  return s.size() >= e.size() && s.compare(s.size() - e.size(), e.size(), e) == 0;
}

bool is_adapter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

// Additive attention bias from a key mask [B, L] (nonzero = attend): 0 or -1e4, [B, 1, 1, L].
// -1e4 rather than -inf: a row whose keys are all masked attends uniformly instead of giving
// NaN, and the value fits fp16; with qk-normed scores (|s| ~ sqrt(head_dim)) exp(-1e4) is 0.
torch::Tensor mask_bias(const torch::Tensor& mask) {
  torch::Tensor keep = mask.to(torch::kBool);
  return torch::zeros(keep.sizes(), torch::TensorOptions().device(mask.device()))
      .masked_fill(keep.logical_not(), -1e4)
      .view({mask.size(0), 1, 1, mask.size(1)});
}

}  // namespace

std::string describe(const Config& c) {
  std::ostringstream s;
  s << "patch=" << c.patch << " in_channels=" << c.in_channels << " hidden=" << c.hidden << " depth=" << c.depth
    << " heads=" << c.heads << " mlp_ratio=" << c.mlp_ratio << " text_dim=" << c.text_dim << " t5_dim=" << c.t5_dim;
  return s.str();
}

void Config::check() const {
  if (patch < 1 || in_channels < 1 || hidden < 1 || depth < 1 || heads < 1 || text_dim < 1 || t5_dim < 0)
    throw std::runtime_error("dit: sizes must be >= 1 (t5_dim >= 0): " + describe(*this));
  if (hidden % heads != 0)
    throw std::runtime_error("dit: hidden " + std::to_string(hidden) + " is not a multiple of heads " +
                             std::to_string(heads));
  if (head_dim() % 4 != 0)
    throw std::runtime_error("dit: the head width hidden/heads = " + std::to_string(head_dim()) +
                             " must be a multiple of 4 (2-D RoPE rotates pairs in two halves)");
  if (!(mlp_ratio > 0) || ff_inner() < 1) throw std::runtime_error("dit: mlp_ratio must be > 0");
}

// ---- leaf modules and blocks

void LayerNormImpl::reset() {
  if (affine_) {
    weight = register_parameter("weight", torch::ones({dim_}));
    bias = register_parameter("bias", torch::zeros({dim_}));
  }
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  torch::Tensor w = weight.defined() ? weight.to(torch::kFloat) : torch::Tensor();
  torch::Tensor b = bias.defined() ? bias.to(torch::kFloat) : torch::Tensor();
  return torch::layer_norm(x.to(torch::kFloat), {dim_}, w, b, 1e-6).to(x.scalar_type());
}

void PatchConvImpl::reset() {
  weight = register_parameter("weight", torch::empty({out_, in_, patch_, patch_}));
  bias = register_parameter("bias", torch::zeros({out_}));
}

void TwoLayerImpl::reset() {
  linear_1 = register_module("linear_1", lora::Linear(in_, mid_));
  linear_2 = register_module("linear_2", lora::Linear(mid_, out_));
}

void AdaNormShiftImpl::reset() {
  linear = register_module("linear", lora::Linear(dim_, dim_));
  norm = register_module("norm", LayerNorm(dim_));
}

torch::Tensor AdaNormShiftImpl::forward(const torch::Tensor& x, const torch::Tensor& temb) {
  torch::Tensor shift = linear(torch::silu(temb));
  return norm(x) + shift.unsqueeze(1);
}

void AdaNormContinuousImpl::reset() {
  linear = register_module("linear", lora::Linear(dim_, 2 * dim_));
  norm = register_module("norm", LayerNorm(dim_, /*affine=*/false));
}

torch::Tensor AdaNormContinuousImpl::forward(const torch::Tensor& x, const torch::Tensor& temb) {
  std::vector<torch::Tensor> ss = linear(torch::silu(temb)).chunk(2, 1);  // scale | shift
  return norm(x) * (1 + ss[0]).unsqueeze(1) + ss[1].unsqueeze(1);
}

void AttentionImpl::reset() {
  const int64_t D = dim_ / heads_;
  to_q = register_module("to_q", lora::Linear(dim_, dim_));
  to_k = register_module("to_k", lora::Linear(kv_dim_, dim_));
  to_v = register_module("to_v", lora::Linear(kv_dim_, dim_));
  norm_q = register_module("norm_q", LayerNorm(D));
  norm_k = register_module("norm_k", LayerNorm(D));
  to_out = register_module("to_out", torch::nn::ModuleList());
  to_out->push_back(lora::Linear(dim_, dim_));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& ctx, const torch::Tensor& cos,
                                     const torch::Tensor& sin, const torch::Tensor& bias) {
  const int64_t B = x.size(0), N = x.size(1), H = heads_, D = dim_ / heads_;
  const torch::Tensor& kv = cross_ ? ctx : x;
  const int64_t L = kv.size(1);
  torch::Tensor q = norm_q(to_q(x).view({B, N, H, D}).transpose(1, 2));  // [B, H, N, D]
  torch::Tensor k = norm_k(to_k(kv).view({B, L, H, D}).transpose(1, 2));
  torch::Tensor v = to_v(kv).view({B, L, H, D}).transpose(1, 2);
  q = apply_rope(q, cos, sin);
  if (!cross_) k = apply_rope(k, cos, sin);  // HunyuanDiT: the text keys are not rotated
  if (fused_attention_available(q)) {
    torch::Tensor y = fused_attention(q, k, v, bias, /*causal=*/false, 1.0 / std::sqrt(static_cast<double>(D)));
    return to_out[0]->as<lora::LinearImpl>()->forward(y.transpose(1, 2).reshape({B, N, dim_}));
  }
  torch::Tensor s = torch::matmul(q, k.transpose(-1, -2)) * (1.0 / std::sqrt(static_cast<double>(D)));
  if (bias.defined()) s = s + bias.to(s.scalar_type());
  torch::Tensor y = torch::matmul(torch::softmax(s, -1), v);  // [B, H, N, D]
  y = y.transpose(1, 2).reshape({B, N, dim_});
  return to_out[0]->as<lora::LinearImpl>()->forward(y);
}

void FeedForwardImpl::reset() {
  net = register_module("net", torch::nn::ModuleList());
  net->push_back(GeluProj(dim_, inner_));
  net->push_back(torch::nn::Identity());  // diffusers' dropout slot (no parameters)
  net->push_back(lora::Linear(inner_, dim_));
}

torch::Tensor FeedForwardImpl::forward(const torch::Tensor& x) {
  return net[2]->as<lora::LinearImpl>()->forward(net[0]->as<GeluProjImpl>()->forward(x));
}

void BlockImpl::reset() {
  norm1 = register_module("norm1", AdaNormShift(cfg_.hidden));
  attn1 = register_module("attn1", Attention(cfg_.hidden, cfg_.hidden, cfg_.heads, false));
  norm2 = register_module("norm2", LayerNorm(cfg_.hidden));
  attn2 = register_module("attn2", Attention(cfg_.hidden, cfg_.text_dim, cfg_.heads, true));
  norm3 = register_module("norm3", LayerNorm(cfg_.hidden));
  ff = register_module("ff", FeedForward(cfg_.hidden, cfg_.ff_inner()));
  if (skip_) {
    skip_norm = register_module("skip_norm", LayerNorm(2 * cfg_.hidden));
    skip_linear = register_module("skip_linear", lora::Linear(2 * cfg_.hidden, cfg_.hidden));
  }
}

torch::Tensor BlockImpl::forward(torch::Tensor h, const torch::Tensor& temb, const torch::Tensor& ctx,
                                 const torch::Tensor& ctx_bias, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& skip) {
  if (skip_) h = skip_linear(skip_norm(torch::cat({h, skip}, -1)));
  h = h + attn1(norm1(h, temb), torch::Tensor(), cos, sin, torch::Tensor());
  h = h + attn2(norm2(h), ctx, cos, sin, ctx_bias);
  return h + ff(norm3(h));
}

// ---- RoPE and timestep features

std::pair<torch::Tensor, torch::Tensor> rope_2d(int64_t head_dim, int64_t gh, int64_t gw) {
  const int64_t half = head_dim / 2;  // channels per axis
  auto f32 = torch::TensorOptions().dtype(torch::kFloat);
  // f_k = 1 / 10000^(2k / half), k < half/2; each repeated for the pair (2k, 2k+1).
  torch::Tensor freqs = 1.0 / torch::pow(10000.0, torch::arange(0, half, 2, f32) / static_cast<double>(half));
  torch::Tensor rows = torch::arange(gh, f32).repeat_interleave(gw);  // token (r, c) at r*gw + c
  torch::Tensor cols = torch::arange(gw, f32).repeat({gh});
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
  torch::Tensor freqs = torch::exp(torch::arange(half, f32) * (-std::log(10000.0) / static_cast<double>(half)));
  torch::Tensor a = t.to(torch::kFloat).reshape({-1, 1}) * freqs.unsqueeze(0);
  return torch::cat({a.cos(), a.sin()}, 1);
}

// ---- the model

DitImpl::DitImpl(Config cfg) : cfg_(cfg), rope_cache_(std::make_shared<RopeCache>()) {
  cfg_.check();
  reset();
}

void DitImpl::reset() {
  if (cfg_.t5_dim > 0) text_embedder = register_module("text_embedder", TwoLayer(cfg_.t5_dim, 4 * cfg_.t5_dim, cfg_.text_dim));
  pos_embed = register_module("pos_embed", PatchEmbed(cfg_.in_channels, cfg_.hidden, cfg_.patch));
  time_extra_emb = register_module("time_extra_emb", TimeEmbed(cfg_.hidden));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg_.depth; ++i) blocks->push_back(Block(cfg_, i > cfg_.depth / 2));
  norm_out = register_module("norm_out", AdaNormContinuous(cfg_.hidden));
  proj_out = register_module("proj_out", lora::Linear(cfg_.hidden, cfg_.patch * cfg_.patch * cfg_.in_channels));
}

std::pair<torch::Tensor, torch::Tensor> DitImpl::rope(int64_t gh, int64_t gw, const torch::Device& device) {
  const std::string key = std::to_string(gh) + "x" + std::to_string(gw) + "/" + device.str();
  std::lock_guard<std::mutex> lock(rope_cache_->mu);
  auto it = rope_cache_->tables.find(key);
  if (it != rope_cache_->tables.end()) return it->second;
  torch::NoGradGuard no_grad;
  auto [c, s] = rope_2d(cfg_.head_dim(), gh, gw);
  auto v = std::make_pair(c.to(device), s.to(device));
  rope_cache_->tables[key] = v;
  return v;
}

torch::Tensor DitImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text,
                               const torch::Tensor& text_mask, const torch::Tensor& t5, const torch::Tensor& t5_mask) {
  const int64_t p = cfg_.patch, C = cfg_.in_channels;
  if (x.dim() != 4 || x.size(1) != C || x.size(2) % p != 0 || x.size(3) % p != 0 || x.size(2) == 0 || x.size(3) == 0)
    throw std::runtime_error("dit: x must be [batch, " + std::to_string(C) + ", H, W] with H and W multiples of patch " +
                             std::to_string(p) + ", got " + shape_str(x));
  const int64_t B = x.size(0), gh = x.size(2) / p, gw = x.size(3) / p;
  if (!t.defined() || !(t.dim() == 0 || (t.dim() == 1 && (t.size(0) == B || t.size(0) == 1))))
    throw std::runtime_error("dit: t must be [batch] or a scalar, got " + (t.defined() ? shape_str(t) : "nothing"));
  if (!text.defined() || text.dim() != 3 || text.size(0) != B || text.size(2) != cfg_.text_dim)
    throw std::runtime_error("dit: text_emb must be [batch=" + std::to_string(B) + ", L, text_dim=" +
                             std::to_string(cfg_.text_dim) + "], got " + (text.defined() ? shape_str(text) : "nothing"));
  auto check_mask = [&](const torch::Tensor& m, const torch::Tensor& emb, const char* what) {
    if (m.defined() && (m.dim() != 2 || m.size(0) != B || m.size(1) != emb.size(1)))
      throw std::runtime_error(std::string("dit: ") + what + " must be [batch, L] matching its embeddings " +
                               shape_str(emb) + ", got " + shape_str(m));
  };
  check_mask(text_mask, text, "text_mask");

  // Text: the first encoder's states, then the T5 states projected to text_dim.
  torch::Tensor ctx = text, mask = text_mask;
  if (cfg_.t5_dim > 0) {
    if (!t5.defined())
      throw std::runtime_error("dit: the model has t5_dim " + std::to_string(cfg_.t5_dim) +
                               " but the batch has no 't5_emb' (set t5_dim: 0 for a model without T5)");
    if (t5.dim() != 3 || t5.size(0) != B || t5.size(2) != cfg_.t5_dim)
      throw std::runtime_error("dit: t5_emb must be [batch, L5, t5_dim=" + std::to_string(cfg_.t5_dim) + "], got " +
                               shape_str(t5));
    check_mask(t5_mask, t5, "t5_mask");
    torch::Tensor proj = text_embedder(t5.to(text.scalar_type()));
    ctx = torch::cat({text, proj.to(text.scalar_type())}, 1);
    if (text_mask.defined() || t5_mask.defined()) {
      torch::Tensor m1 = text_mask.defined() ? text_mask.to(torch::kFloat) : torch::ones({B, text.size(1)}, text.device());
      torch::Tensor m2 = t5_mask.defined() ? t5_mask.to(torch::kFloat) : torch::ones({B, t5.size(1)}, t5.device());
      mask = torch::cat({m1, m2}, 1);
    }
  } else if (t5.defined()) {
    throw std::runtime_error("dit: the batch has 't5_emb' but the model has t5_dim 0 (set t5_dim to its width)");
  }
  torch::Tensor bias = mask.defined() ? mask_bias(mask) : torch::Tensor();

  torch::Tensor h = pos_embed->proj(x).flatten(2).transpose(1, 2);  // [B, N, hidden], row-major patches
  torch::Tensor tt = t.dim() == 0 ? t.reshape({1}).expand({B}) : (t.size(0) == 1 ? t.expand({B}) : t);
  torch::Tensor temb = time_extra_emb->timestep_embedder(timestep_features(tt, 256).to(h.scalar_type()));
  auto [cos, sin] = rope(gh, gw, x.device());

  const int64_t d = cfg_.depth;
  std::vector<torch::Tensor> skips;
  int64_t i = 0;
  // Iterate the ModuleList itself (clone() replaces its items).
  for (const auto& m : *blocks) {
    auto* blk = m->as<BlockImpl>();
    torch::Tensor skip;
    if (blk->has_skip()) {
      skip = skips.back();  // the output of block depth-1-i
      skips.pop_back();
    }
    h = blk->forward(h, temb, ctx, bias, cos, sin, skip);
    if (i < d - 1 - d / 2) skips.push_back(h);
    ++i;
  }
  h = proj_out(norm_out(h, temb));  // [B, N, p*p*C]
  // Unpatchify: [B, gh, gw, p, p, C] -> [B, C, gh, p, gw, p] -> [B, C, H, W].
  return h.reshape({B, gh, gw, p, p, C}).permute({0, 5, 1, 3, 2, 4}).reshape({B, C, gh * p, gw * p});
}

torch::Tensor DitImpl::forward_batch(const TensorMap& batch) {
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
  torch::Tensor x = get("x", true), t = get("t", true), text = get("text_emb", true);
  torch::Tensor text_mask = get("text_mask", false), t5 = get("t5_emb", false), t5_mask = get("t5_mask", false);
  return forward(x, t, text, text_mask, t5, t5_mask);
}

void init_weights(DitImpl& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator g = make_cpu_generator(mix_seed({seed, kSeedTagInit}));
  for (auto& item : model.named_parameters(true)) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    if (is_adapter(name)) continue;
    torch::Tensor v = torch::zeros(p.sizes());
    const bool zero = name.find("norm1.linear.") != std::string::npos ||
                      name.find("norm_out.linear.") != std::string::npos || name.rfind("proj_out.", 0) == 0;
    if (zero || ends_with(name, ".bias")) {
      // zero (adaLN modulation, final projection, biases)
    } else if (name.find("norm") != std::string::npos && p.dim() == 1) {
      v.fill_(1.0);  // LayerNorm gains (norm2, norm3, norm1.norm, norm_q, norm_k, skip_norm)
    } else if (name.find("timestep_embedder.") != std::string::npos) {
      v.normal_(0.0, 0.02, g);
    } else {
      const int64_t fan_out = p.size(0), fan_in = p.numel() / p.size(0);
      const double a = std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
      v.uniform_(-a, a, g);
    }
    p.copy_(v);
  }
}

void load_state_dict(DitImpl& model, const std::map<std::string, torch::Tensor>& tensors, const std::string& source) {
  LoadByNameOptions o;
  o.model = "dit (" + describe(model.config()) + ")";
  o.optional = is_adapter;  // a base file loads into a LoRA-adapted model; the adapters keep their init
  load_by_name(model, tensors, source, o);
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
  state->exporter = lora::peft_export;  // its adapters, once it has some (checkpoint `exports`)
  return state;
}

}  // namespace flowrun::dit
