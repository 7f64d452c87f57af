// T5 encoder (see t5_encoder.hpp).
#include "models/t5_encoder.hpp"

#include <cmath>
#include <limits>
#include <stdexcept>

#include "common/safetensors.hpp"
#include "common/seed.hpp"
#include "common/tensor_map.hpp"
#include "models/attention.hpp"
#include "models/load_by_name.hpp"

namespace flowrun::t5 {
namespace {

std::string describe(const Config& c) {
  return "t5 encoder (layers=" + std::to_string(c.layers) + " dim=" + std::to_string(c.dim) +
         " heads=" + std::to_string(c.heads) + " d_kv=" + std::to_string(c.d_kv) + " ffn=" + std::to_string(c.ffn) +
         " vocab=" + std::to_string(c.vocab) + " buckets=" + std::to_string(c.buckets) +
         " max_distance=" + std::to_string(c.max_distance) + (c.gated ? " gated-gelu" : " relu") + ")";
}

double lowest_of(torch::ScalarType t) {  // torch.finfo(t).min
  switch (t) {
    case torch::kBFloat16: return -3.3895313892515355e38;
    case torch::kHalf: return -65504.0;
    case torch::kDouble: return std::numeric_limits<double>::lowest();
    default: return static_cast<double>(std::numeric_limits<float>::lowest());
  }
}

}  // namespace

void Config::check() const {
  if (vocab < 1 || dim < 1 || d_kv < 1 || ffn < 1 || layers < 1 || heads < 1 || buckets < 2 || max_distance < 1)
    throw std::invalid_argument("t5: every size must be positive, buckets at least 2 (" + describe(*this) + ")");
}

torch::Tensor relative_position_bucket(const torch::Tensor& relative_position, bool bidirectional,
                                       int64_t num_buckets, int64_t max_distance) {
  torch::Tensor rp = relative_position.to(torch::kLong);
  torch::Tensor buckets = torch::zeros_like(rp);
  if (bidirectional) {
    num_buckets /= 2;
    buckets = buckets + (rp > 0).to(torch::kLong) * num_buckets;
    rp = rp.abs();
  } else {
    rp = -torch::min(rp, torch::zeros_like(rp));
  }
  const int64_t max_exact = num_buckets / 2;
  torch::Tensor is_small = rp < max_exact;
  torch::Tensor large =
      (torch::log(rp.to(torch::kFloat) / static_cast<double>(max_exact)) /
       std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) *
       static_cast<double>(num_buckets - max_exact))
          .to(torch::kLong) +
      max_exact;
  large = torch::min(large, torch::full_like(large, num_buckets - 1));
  return buckets + torch::where(is_small, rp, large);
}

void AttentionImpl::reset() {
  const int64_t inner = c_.heads * c_.d_kv;
  auto lin = [](int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); };
  q = register_module("q", lin(c_.dim, inner));
  k = register_module("k", lin(c_.dim, inner));
  v = register_module("v", lin(c_.dim, inner));
  o = register_module("o", lin(inner, c_.dim));
  if (has_bias_)
    relative_attention_bias = register_module("relative_attention_bias", torch::nn::Embedding(c_.buckets, c_.heads));
}

torch::Tensor AttentionImpl::compute_bias(int64_t L) {
  if (!has_bias_) throw std::logic_error("t5: compute_bias on a block without relative_attention_bias");
  const auto opts = relative_attention_bias->weight.options().dtype(torch::kLong);
  torch::Tensor ctx = torch::arange(L, opts).unsqueeze(1), mem = torch::arange(L, opts).unsqueeze(0);
  torch::Tensor b = relative_position_bucket(mem - ctx, /*bidirectional=*/true, c_.buckets, c_.max_distance);
  return relative_attention_bias(b).permute({2, 0, 1}).unsqueeze(0);  // [1, heads, L, L]
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& bias) {
  const int64_t B = x.size(0), L = x.size(1);
  auto split = [&](const torch::Tensor& t) { return t.view({B, L, c_.heads, c_.d_kv}).transpose(1, 2); };
  torch::Tensor qh = split(q(x)), kh = split(k(x)), vh = split(v(x));
  AttentionOptions opts;
  opts.bias = bias;
  opts.scale = 1.0;  // no 1/sqrt(d_kv) in T5
  opts.fp32_softmax = true;
  return o(attention(qh, kh, vh, opts));
}

void LayerSelfAttentionImpl::reset() {
  SelfAttention = register_module("SelfAttention", Attention(c_, has_bias_));
  layer_norm = register_module("layer_norm", RmsNorm(c_.dim, c_.eps));
}

void LayerFFImpl::reset() {
  DenseReluDense = register_module("DenseReluDense", layers::Mlp(c_.dim, c_.ffn, ff_options(c_)));
  layer_norm = register_module("layer_norm", RmsNorm(c_.dim, c_.eps));
}

void BlockImpl::reset() {
  layer = register_module("layer", torch::nn::ModuleList());
  layer->push_back(LayerSelfAttention(c_, has_bias_));
  layer->push_back(LayerFF(c_));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& bias) {
  torch::Tensor h = layer->ptr<LayerSelfAttentionImpl>(0)->forward(x, bias);
  return layer->ptr<LayerFFImpl>(1)->forward(h);
}

void StackImpl::reset() {
  block = register_module("block", torch::nn::ModuleList());
  for (int64_t i = 0; i < c_.layers; ++i) block->push_back(Block(c_, /*has_bias=*/i == 0));
  final_layer_norm = register_module("final_layer_norm", RmsNorm(c_.dim, c_.eps));
}

T5EncoderImpl::T5EncoderImpl(Config c) : cfg_(c) {
  cfg_.check();
  reset();
}

void T5EncoderImpl::reset() {
  shared = register_module("shared", torch::nn::Embedding(cfg_.vocab, cfg_.dim));
  encoder = register_module("encoder", Stack(cfg_));
}

torch::Tensor T5EncoderImpl::forward(const torch::Tensor& input_ids, const torch::Tensor& attention_mask) {
  if (input_ids.dim() != 2 || !at::isIntegralType(input_ids.scalar_type(), false))
    throw std::runtime_error("t5: input_ids must be integer [batch, length], got " +
                             std::string(c10::toString(input_ids.scalar_type())) + " " + shape_str(input_ids));
  if (input_ids.is_cpu() && input_ids.numel() > 0) {
    const int64_t lo = input_ids.min().item<int64_t>(), hi = input_ids.max().item<int64_t>();
    if (lo < 0 || hi >= cfg_.vocab)
      throw std::runtime_error("t5: token ids must be in [0, " + std::to_string(cfg_.vocab) + "), got [" +
                               std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  const int64_t B = input_ids.size(0), L = input_ids.size(1);
  torch::Tensor x = shared(input_ids.to(torch::kLong));
  torch::Tensor bias = encoder->block->ptr<BlockImpl>(0)->attention().SelfAttention->compute_bias(L);
  if (attention_mask.defined()) {
    if (!attention_mask.sizes().equals(input_ids.sizes()))
      throw std::runtime_error("t5: attention_mask " + shape_str(attention_mask) + " does not match input_ids " +
                               shape_str(input_ids));
    torch::Tensor m = (attention_mask == 0).to(x.scalar_type()).mul(lowest_of(x.scalar_type())).view({B, 1, 1, L});
    bias = bias + m;
  }
  for (size_t i = 0; i < encoder->block->size(); ++i) x = encoder->block->ptr<BlockImpl>(i)->forward(x, bias);
  return encoder->final_layer_norm(x);
}

void init_weights(T5EncoderImpl& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  const Config& c = model.config();
  at::Generator g = make_cpu_generator(seed);
  auto ends_with = [](const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  for (auto& item : model.named_parameters(true)) {
    const std::string& n = item.key();
    torch::Tensor& p = item.value();
    double sd = 0;
    if (ends_with(n, "layer_norm.weight")) {
      p.fill_(1.0);
      continue;
    } else if (n == "shared.weight") {
      sd = 1.0;
    } else if (ends_with(n, "SelfAttention.q.weight")) {
      sd = 1.0 / std::sqrt(static_cast<double>(c.dim * c.d_kv));
    } else if (ends_with(n, "SelfAttention.o.weight")) {
      sd = 1.0 / std::sqrt(static_cast<double>(c.heads * c.d_kv));
    } else if (ends_with(n, "DenseReluDense.wo.weight")) {
      sd = 1.0 / std::sqrt(static_cast<double>(c.ffn));
    } else {  // k, v, wi, wi_0, wi_1, relative_attention_bias
      sd = 1.0 / std::sqrt(static_cast<double>(c.dim));
    }
    p.copy_(torch::randn(p.sizes(), g, torch::TensorOptions().dtype(torch::kFloat)).mul_(sd));
  }
}

void load_hf_state_dict(T5EncoderImpl& model, const std::map<std::string, torch::Tensor>& tensors,
                        const std::string& source) {
  std::map<std::string, torch::Tensor> t = tensors;
  auto embed = t.find("encoder.embed_tokens.weight");
  if (embed != t.end()) {
    if (!t.count("shared.weight")) t["shared.weight"] = embed->second;
    t.erase("encoder.embed_tokens.weight");  // HF ties it to shared.weight
  }
  LoadByNameOptions o;
  o.model = describe(model.config());
  o.ignore = [](const std::string& n) { return n.rfind("decoder.", 0) == 0 || n.rfind("lm_head.", 0) == 0; };
  load_by_name(model, t, source, o);
}

void load_hf_safetensors(T5EncoderImpl& model, const std::string& path) {
  load_hf_state_dict(model, safetensors::load(path).tensors, path);
}

}  // namespace flowrun::t5
