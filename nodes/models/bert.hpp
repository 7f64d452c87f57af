// BERT encoder as a libtorch module, laid out exactly like Hugging Face transformers' BertModel
// (without the pooler), so that its safetensors load by name. Used frozen, as a text encoder
// (bert_encode node; HunyuanDiT's CLIP-BERT is such a BertModel).
//
//   embeddings.word_embeddings.weight [vocab, dim]
//   embeddings.position_embeddings.weight [max_positions, dim]
//   embeddings.token_type_embeddings.weight [type_vocab, dim]      (token type 0 is used)
//   embeddings.LayerNorm.weight/bias [dim]
//   encoder.layer.N.attention.self.{query,key,value}.weight [dim, dim], .bias [dim]
//   encoder.layer.N.attention.output.dense.weight [dim, dim], .bias
//   encoder.layer.N.attention.output.LayerNorm.weight/bias [dim]
//   encoder.layer.N.intermediate.dense.weight [ffn, dim], .bias [ffn]   (GELU, exact erf)
//   encoder.layer.N.output.dense.weight [dim, ffn], .bias [dim]
//   encoder.layer.N.output.LayerNorm.weight/bias [dim]
//
// Linear weights are torch.nn.Linear's [out, in]. Post-LayerNorm blocks, LayerNorm eps 1e-12;
// no dropout (the encoder is used in eval mode only).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>

#include "models/layers.hpp"

namespace flowrun::bert {

struct Config {
  int64_t vocab = 30522, dim = 768, layers = 12, heads = 12, ffn = 3072, max_positions = 512, type_vocab = 2;
  double eps = 1e-12;
  void check() const;  // throws on dim % heads != 0 or non-positive sizes
};

// HF's BertSelfOutput / BertOutput: dense, then LayerNorm(dense(x) + residual).
class DenseNormImpl : public torch::nn::Cloneable<DenseNormImpl> {
 public:
  DenseNormImpl(int64_t in, int64_t out, double eps) : in_(in), out_(out), eps_(eps) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& residual);
  torch::nn::Linear dense{nullptr};
  layers::LayerNorm LayerNorm{nullptr};  // eps 1e-12 (HF's name)

 private:
  int64_t in_, out_;
  double eps_;
};
TORCH_MODULE(DenseNorm);

class SelfAttentionImpl : public torch::nn::Cloneable<SelfAttentionImpl> {
 public:
  SelfAttentionImpl(int64_t dim, int64_t heads) : dim_(dim), heads_(heads) { reset(); }
  void reset() override;
  // x [B, L, dim], bias [B, 1, 1, L] (0 or a large negative) -> [B, L, dim]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias);
  torch::nn::Linear query{nullptr}, key{nullptr}, value{nullptr};

 private:
  int64_t dim_, heads_;
};
TORCH_MODULE(SelfAttention);

class AttentionImpl : public torch::nn::Cloneable<AttentionImpl> {
 public:
  explicit AttentionImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias);
  SelfAttention self{nullptr};
  DenseNorm output{nullptr};

 private:
  Config c_;
};
TORCH_MODULE(Attention);

// HF's BertIntermediate: dense, exact GELU. With the layer's `output` (a DenseNorm) it is the
// feed-forward; not layers::Mlp, since HF splits it over two modules with the post-norm inside.
class IntermediateImpl : public torch::nn::Cloneable<IntermediateImpl> {
 public:
  IntermediateImpl(int64_t dim, int64_t ffn) : dim_(dim), ffn_(ffn) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x) { return torch::gelu(dense(x)); }
  torch::nn::Linear dense{nullptr};

 private:
  int64_t dim_, ffn_;
};
TORCH_MODULE(Intermediate);

class LayerImpl : public torch::nn::Cloneable<LayerImpl> {
 public:
  explicit LayerImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias);
  Attention attention{nullptr};
  Intermediate intermediate{nullptr};
  DenseNorm output{nullptr};

 private:
  Config c_;
};
TORCH_MODULE(Layer);

class EmbeddingsImpl : public torch::nn::Cloneable<EmbeddingsImpl> {
 public:
  explicit EmbeddingsImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& input_ids);  // [B, L] -> [B, L, dim]
  torch::nn::Embedding word_embeddings{nullptr}, position_embeddings{nullptr}, token_type_embeddings{nullptr};
  layers::LayerNorm LayerNorm{nullptr};  // eps 1e-12 (HF's name)

 private:
  Config c_;
};
TORCH_MODULE(Embeddings);

class EncoderImpl : public torch::nn::Cloneable<EncoderImpl> {
 public:
  explicit EncoderImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  torch::nn::ModuleList layer{nullptr};

 private:
  Config c_;
};
TORCH_MODULE(Encoder);

class BertImpl : public torch::nn::Cloneable<BertImpl> {
 public:
  explicit BertImpl(Config c);
  void reset() override;
  // input_ids integer [B, L] (L <= max_positions), attention_mask [B, L] (nonzero = token;
  // undefined = all tokens) -> last_hidden_state [B, L, dim], in the parameters' dtype.
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& attention_mask = {});
  const Config& config() const { return cfg_; }

  Embeddings embeddings{nullptr};
  Encoder encoder{nullptr};

 private:
  Config cfg_;
};
TORCH_MODULE(Bert);

// HF BertPreTrainedModel._init_weights: Linear and Embedding weights ~ N(0, 0.02), biases 0,
// LayerNorm gains 1, from a generator seeded by `seed` alone (parameter order).
void init_weights(BertImpl& model, uint64_t seed);

// Copy a Hugging Face BertModel state dict in by name (converting dtypes). Names may carry a
// "bert." prefix (BertForMaskedLM & co.); the pooler (pooler.*), pre-training heads (cls.*) and
// the embeddings.position_ids buffer are ignored. Every parameter must be given with its shape;
// every problem (missing, unexpected, mis-shaped) is listed in one error starting with `source`.
void load_hf_state_dict(BertImpl& model, const std::map<std::string, torch::Tensor>& tensors,
                        const std::string& source);
void load_hf_safetensors(BertImpl& model, const std::string& path);

}  // namespace flowrun::bert
