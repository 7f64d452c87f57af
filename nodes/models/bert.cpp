// BERT encoder (see bert.hpp).
#include "models/bert.hpp"

#include <cmath>
#include <limits>
#include <stdexcept>

#include "common/safetensors.hpp"
#include "common/seed.hpp"
#include "common/tensor_map.hpp"
#include "models/attention.hpp"
#include "models/load_by_name.hpp"

namespace flowrun::bert {
namespace {

std::string describe(const Config& c) {
  return "bert (layers=" + std::to_string(c.layers) + " dim=" + std::to_string(c.dim) +
         " heads=" + std::to_string(c.heads) + " ffn=" + std::to_string(c.ffn) + " vocab=" + std::to_string(c.vocab) +
         " max_positions=" + std::to_string(c.max_positions) + ")";
}

layers::LayerNorm make_norm(int64_t dim, double eps) { return layers::LayerNorm(dim, layers::NormOptions{eps}); }

}  // namespace

void Config::check() const {
  if (vocab < 1 || dim < 1 || layers < 1 || heads < 1 || ffn < 1 || max_positions < 1 || type_vocab < 1)
    throw std::invalid_argument("bert: every size must be positive (" + describe(*this) + ")");
  if (dim % heads != 0)
    throw std::invalid_argument("bert: dim " + std::to_string(dim) + " is not a multiple of heads " +
                                std::to_string(heads));
}

void DenseNormImpl::reset() {
  dense = register_module("dense", torch::nn::Linear(in_, out_));
  LayerNorm = register_module("LayerNorm", make_norm(out_, eps_));
}

torch::Tensor DenseNormImpl::forward(const torch::Tensor& x, const torch::Tensor& residual) {
  return LayerNorm(dense(x) + residual);
}

void SelfAttentionImpl::reset() {
  query = register_module("query", torch::nn::Linear(dim_, dim_));
  key = register_module("key", torch::nn::Linear(dim_, dim_));
  value = register_module("value", torch::nn::Linear(dim_, dim_));
}

torch::Tensor SelfAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& bias) {
  const int64_t B = x.size(0), L = x.size(1), dh = dim_ / heads_;
  auto split = [&](const torch::Tensor& t) { return t.view({B, L, heads_, dh}).transpose(1, 2); };
  torch::Tensor q = split(query(x)), k = split(key(x)), v = split(value(x));
  return attention(q, k, v, {bias});
}

void AttentionImpl::reset() {
  self = register_module("self", SelfAttention(c_.dim, c_.heads));
  output = register_module("output", DenseNorm(c_.dim, c_.dim, c_.eps));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& bias) {
  return output(self(x, bias), x);
}

void IntermediateImpl::reset() { dense = register_module("dense", torch::nn::Linear(dim_, ffn_)); }

void LayerImpl::reset() {
  attention = register_module("attention", Attention(c_));
  intermediate = register_module("intermediate", Intermediate(c_.dim, c_.ffn));
  output = register_module("output", DenseNorm(c_.ffn, c_.dim, c_.eps));
}

torch::Tensor LayerImpl::forward(const torch::Tensor& x, const torch::Tensor& bias) {
  torch::Tensor a = attention(x, bias);
  return output(intermediate(a), a);
}

void EmbeddingsImpl::reset() {
  word_embeddings = register_module("word_embeddings", torch::nn::Embedding(c_.vocab, c_.dim));
  position_embeddings = register_module("position_embeddings", torch::nn::Embedding(c_.max_positions, c_.dim));
  token_type_embeddings = register_module("token_type_embeddings", torch::nn::Embedding(c_.type_vocab, c_.dim));
  LayerNorm = register_module("LayerNorm", make_norm(c_.dim, c_.eps));
}

torch::Tensor EmbeddingsImpl::forward(const torch::Tensor& input_ids) {
  const int64_t L = input_ids.size(1);
  torch::Tensor pos = torch::arange(L, input_ids.options().dtype(torch::kLong));
  torch::Tensor x = word_embeddings(input_ids) + token_type_embeddings->weight[0];
  x = x + position_embeddings(pos).unsqueeze(0);
  return LayerNorm(x);
}

void EncoderImpl::reset() {
  layer = register_module("layer", torch::nn::ModuleList());
  for (int64_t i = 0; i < c_.layers; ++i) layer->push_back(Layer(c_));
}

BertImpl::BertImpl(Config c) : cfg_(c) {
  cfg_.check();
  reset();
}

void BertImpl::reset() {
  embeddings = register_module("embeddings", Embeddings(cfg_));
  encoder = register_module("encoder", Encoder(cfg_));
}

torch::Tensor BertImpl::forward(const torch::Tensor& input_ids, const torch::Tensor& attention_mask) {
  if (input_ids.dim() != 2 || !at::isIntegralType(input_ids.scalar_type(), false))
    throw std::runtime_error("bert: input_ids must be integer [batch, length], got " +
                             std::string(c10::toString(input_ids.scalar_type())) + " " + shape_str(input_ids));
  const int64_t L = input_ids.size(1);
  if (L > cfg_.max_positions)
    throw std::runtime_error("bert: " + std::to_string(L) + " tokens, more than max_positions " +
                             std::to_string(cfg_.max_positions));
  if (input_ids.is_cpu() && input_ids.numel() > 0) {
    const int64_t lo = input_ids.min().item<int64_t>(), hi = input_ids.max().item<int64_t>();
    if (lo < 0 || hi >= cfg_.vocab)
      throw std::runtime_error("bert: token ids must be in [0, " + std::to_string(cfg_.vocab) + "), got [" +
                               std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  torch::Tensor ids = input_ids.to(torch::kLong);
  torch::Tensor x = embeddings(ids);
  torch::Tensor bias;
  if (attention_mask.defined()) {
    if (!attention_mask.sizes().equals(input_ids.sizes()))
      throw std::runtime_error("bert: attention_mask " + shape_str(attention_mask) + " does not match input_ids " +
                               shape_str(input_ids));
    // HF's extended attention mask: (1 - mask) * finfo(dtype).min, added to the scores.
    const double lowest = x.scalar_type() == torch::kBFloat16 ? -3.3895313892515355e38
                          : x.scalar_type() == torch::kHalf   ? -65504.0
                          : x.scalar_type() == torch::kDouble ? std::numeric_limits<double>::lowest()
                                                              : static_cast<double>(std::numeric_limits<float>::lowest());
    bias = (attention_mask == 0).to(x.scalar_type()).mul(lowest).view({x.size(0), 1, 1, L});
  }
  for (size_t i = 0; i < encoder->layer->size(); ++i) x = encoder->layer->ptr<LayerImpl>(i)->forward(x, bias);
  return x;
}

void init_weights(BertImpl& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator g = make_cpu_generator(seed);
  for (auto& item : model.named_parameters(true)) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    const bool is_norm = name.find("LayerNorm") != std::string::npos;
    const bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    if (is_norm) {
      p.fill_(is_bias ? 0.0 : 1.0);
    } else if (is_bias) {
      p.zero_();
    } else {
      p.copy_(torch::randn(p.sizes(), g, torch::TensorOptions().dtype(torch::kFloat)).mul_(0.02));
    }
  }
}

void load_hf_state_dict(BertImpl& model, const std::map<std::string, torch::Tensor>& tensors,
                        const std::string& source) {
  LoadByNameOptions o;
  o.model = describe(model.config());
  o.prefixes = {"bert."};
  o.ignore = [](const std::string& n) {
    return n.rfind("pooler.", 0) == 0 || n.rfind("cls.", 0) == 0 || n == "embeddings.position_ids";
  };
  load_by_name(model, tensors, source, o);
}

void load_hf_safetensors(BertImpl& model, const std::string& path) {
  load_hf_state_dict(model, safetensors::load(path).tensors, path);
}

}  // namespace flowrun::bert
