// The encoder of T5 (T5 v1.0, v1.1, mT5) as a libtorch module, laid out exactly like Hugging
// Face transformers' T5EncoderModel, so that its safetensors load by name. Used frozen, as a
// text encoder (t5_encode node; HunyuanDiT's mT5 is such an encoder).
//
//   shared.weight [vocab, dim]                                   token embedding
//   encoder.block.N.layer.0.layer_norm.weight [dim]              T5 RMS norm (no bias, no mean)
//   encoder.block.N.layer.0.SelfAttention.{q,k,v}.weight [heads*d_kv, dim]   (no biases)
//   encoder.block.N.layer.0.SelfAttention.o.weight [dim, heads*d_kv]
//   encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight [buckets, heads]
//                                        (block 0 only; its bias is shared by every block)
//   encoder.block.N.layer.1.layer_norm.weight [dim]
//   encoder.block.N.layer.1.DenseReluDense.wi_0.weight, .wi_1.weight [ffn, dim]  (gated-gelu:
//        wo(gelu_tanh(wi_0 x) * wi_1 x); T5 v1.1, mT5)
//   or   encoder.block.N.layer.1.DenseReluDense.wi.weight [ffn, dim]  (relu: wo(relu(wi x)); T5 v1.0)
//   encoder.block.N.layer.1.DenseReluDense.wo.weight [dim, ffn]
//   encoder.final_layer_norm.weight [dim]
//
// Pre-norm residual blocks; attention scores are q·k without 1/sqrt(d_kv) scaling plus the
// relative position bias; softmax in float32; RMS norm eps 1e-6 with the variance in float32.
// No dropout (eval only).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>

#include "models/layers.hpp"

namespace flowrun::t5 {

struct Config {
  // Defaults: schemas/t5_encode.yaml's (T5 v1.1 base; BuiltinSchemas.ConfigStructsStartAtTheSchemaDefaults).
  int64_t vocab = 32128, dim = 768, d_kv = 64, ffn = 2048, layers = 12, heads = 12;
  int64_t buckets = 32, max_distance = 128;  // relative_attention_num_buckets / _max_distance
  bool gated = true;                         // gated-gelu (v1.1, mT5) or relu (v1.0)
  double eps = 1e-6;
  void check() const;
};

// HF T5Attention._relative_position_bucket: relative_position = key position - query position
// (any integer tensor) -> bucket ids in [0, num_buckets).
torch::Tensor relative_position_bucket(const torch::Tensor& relative_position, bool bidirectional,
                                       int64_t num_buckets, int64_t max_distance);

// T5LayerNorm: the shared RMS norm (no mean, no bias; the mean square in float32).
using layers::RmsNorm;

class AttentionImpl : public torch::nn::Cloneable<AttentionImpl> {
 public:
  AttentionImpl(const Config& c, bool has_bias) : c_(c), has_bias_(has_bias) { reset(); }
  void reset() override;
  // x [B, L, dim], bias [B or 1, heads, L, L] (position bias + mask) -> [B, L, dim]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias);
  // The position bias [1, heads, L, L] (block 0 only).
  torch::Tensor compute_bias(int64_t L);
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  torch::nn::Embedding relative_attention_bias{nullptr};

 private:
  Config c_;
  bool has_bias_;
};
TORCH_MODULE(Attention);

class LayerSelfAttentionImpl : public torch::nn::Cloneable<LayerSelfAttentionImpl> {
 public:
  LayerSelfAttentionImpl(const Config& c, bool has_bias) : c_(c), has_bias_(has_bias) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias) {
    return x + SelfAttention(layer_norm(x), bias);
  }
  Attention SelfAttention{nullptr};
  RmsNorm layer_norm{nullptr};

 private:
  Config c_;
  bool has_bias_;
};
TORCH_MODULE(LayerSelfAttention);

// DenseReluDense (HF's name for both kinds), the shared MLP without biases: gated-gelu
// wo(gelu_tanh(wi_0 x) * wi_1 x) (v1.1, mT5) or wo(relu(wi x)) (v1.0).
inline layers::MlpOptions ff_options(const Config& c) {
  if (c.gated) return {"wi_0", "wo", layers::Act::gelu_tanh, "wi_1", /*bias=*/false};
  return {"wi", "wo", layers::Act::relu, "", /*bias=*/false};
}

class LayerFFImpl : public torch::nn::Cloneable<LayerFFImpl> {
 public:
  explicit LayerFFImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x) { return x + DenseReluDense(layer_norm(x)); }
  layers::Mlp DenseReluDense{nullptr};  // ff_options(c)
  RmsNorm layer_norm{nullptr};

 private:
  Config c_;
};
TORCH_MODULE(LayerFF);

class BlockImpl : public torch::nn::Cloneable<BlockImpl> {
 public:
  BlockImpl(const Config& c, bool has_bias) : c_(c), has_bias_(has_bias) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias);
  LayerSelfAttentionImpl& attention() { return *layer->ptr<LayerSelfAttentionImpl>(0); }
  torch::nn::ModuleList layer{nullptr};  // [LayerSelfAttention, LayerFF]

 private:
  Config c_;
  bool has_bias_;
};
TORCH_MODULE(Block);

class StackImpl : public torch::nn::Cloneable<StackImpl> {
 public:
  explicit StackImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  torch::nn::ModuleList block{nullptr};
  RmsNorm final_layer_norm{nullptr};

 private:
  Config c_;
};
TORCH_MODULE(Stack);

class T5EncoderImpl : public torch::nn::Cloneable<T5EncoderImpl> {
 public:
  explicit T5EncoderImpl(Config c);
  void reset() override;
  // input_ids integer [B, L], attention_mask [B, L] (nonzero = token; undefined = all) ->
  // last_hidden_state [B, L, dim] in the parameters' dtype.
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& attention_mask = {});
  const Config& config() const { return cfg_; }

  torch::nn::Embedding shared{nullptr};
  Stack encoder{nullptr};

 private:
  Config cfg_;
};
TORCH_MODULE(T5Encoder);

// HF T5PreTrainedModel._init_weights (factor 1): shared ~ N(0, 1); q ~ N(0, (dim*d_kv)^-1/2);
// k, v, wi* and relative_attention_bias ~ N(0, dim^-1/2); o ~ N(0, (heads*d_kv)^-1/2);
// wo ~ N(0, ffn^-1/2); norms 1. From a generator seeded by `seed` alone.
void init_weights(T5EncoderImpl& model, uint64_t seed);

// Copy a Hugging Face T5EncoderModel (or T5 / MT5 model: decoder.* and lm_head.* are ignored)
// state dict in by name. encoder.embed_tokens.weight is the same tensor as shared.weight in HF:
// ignored when shared.weight is given, used as it otherwise. Every problem is listed in one
// error starting with `source`.
void load_hf_state_dict(T5EncoderImpl& model, const std::map<std::string, torch::Tensor>& tensors,
                        const std::string& source);
void load_hf_safetensors(T5EncoderImpl& model, const std::string& path);

}  // namespace flowrun::t5
