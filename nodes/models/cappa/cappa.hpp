// CapPa (Tschannen et al. 2023, "Image Captioners Are Scalable Vision Learners Too") as a
// libtorch module: a ViT encoder and a transformer decoder that cross-attends to the image
// tokens, as big_vision's models/proj/cappa/cappa.py. The node type cappa: cappa_node.cpp; the
// loss: caption_loss (train/caption_loss.cpp). Test: tests/nodes/cappa_test.cpp.
//
// Parameter names (timm's for the ViT, big_vision's decoder in the same style):
//
//   encoder.patch_embed.proj.weight [W, 3, p, p], .bias [W]   patches: a conv, kernel = stride = p
//   encoder.pos_embed [1, N, W]                 learned (posemb learn; sincos2d: a fixed buffer)
//   encoder.blocks.I.norm1.weight/bias [W]      pre-LN blocks:
//   encoder.blocks.I.attn.qkv.weight [3W, W], .bias    x += proj(attn(norm1(x)))
//   encoder.blocks.I.attn.proj.weight [W, W], .bias    x += fc2(gelu(fc1(norm2(x))))
//   encoder.blocks.I.norm2.weight/bias
//   encoder.blocks.I.mlp.fc1.weight [M, W], .bias;  mlp.fc2.weight [W, M], .bias
//   encoder.norm.weight/bias                    the encoded image: every patch token (no class
//                                               token, no MAP head)
//   decoder.embed.weight [V + 1, D]             token embedding; row V is the mask token
//   decoder.pos_embed [1, T, D]                 learned positions of the T = max_len inputs
//   decoder.blocks.I.norm1.weight(.bias)        x += proj(self_attn(norm1(x), causal))
//   decoder.blocks.I.self_attn.{q,k,v,proj}.weight [D, D]        (no biases, as big_vision)
//   decoder.blocks.I.norm2.weight(.bias)        x += proj(cross_attn(norm2(x), encoded))
//   decoder.blocks.I.cross_attn.q.weight [D, D], k/v.weight [D, W], proj.weight [D, D]
//   decoder.blocks.I.norm3.weight(.bias)        x += fc2(gelu(fc1(norm3(x))))
//   decoder.blocks.I.mlp.fc1.weight [Md, D](, .bias), fc2.weight [D, Md](, .bias)
//   decoder.norm.weight/bias [D]
//   decoder.head.weight [V, D], .bias [V]       logits over the vocabulary
//
// The decoder's norms and MLP have biases only with decoder_bias (big_vision's CapPa config:
// none). GELU is exact (erf), LayerNorm eps 1e-6, as flax's. Attention is softmax(q k^T /
// sqrt(head_dim)) v, its heads the even split of the width.
//
// Parallel prediction (the "Pa" of CapPa): a row of a batch may be decoded without the causal
// mask (it sees every position) and with some or all of its inputs replaced by the mask token
// (id V); trained so, the decoder predicts every token of a caption from the image alone in one
// pass. Which rows and positions is the objective's choice (caption_loss); the model only
// applies it (decoder_inputs, self_attention_bias below).
//
// Tensor parallel (Config::tp; Megatron-LM's split, parallel/tensor_parallel.hpp): each rank of
// the group holds heads/tp of every attention's heads (the encoder's fused qkv by its q, k and v
// rows, the decoder's q, k, v by rows; each proj by its input columns) and mlp_dim/tp,
// dec_mlp_dim/tp of the MLPs' units (fc1 by rows, fc2 by columns): a block costs one all-reduce
// forward and one backward per attention and MLP; the encoded image enters every
// cross-attention through one copy (its gradient summed once). Whole on every rank: the patch
// embedding, positions, norms, the token embedding and the head (tp_split says which is which).
//
// Pipeline parallel (Config::stages, models/stages.hpp): the encoder's blocks then the decoder's
// are one run of depth + dec_depth blocks cut into chunks; each rank builds only its chunks' blocks
// (an Identity in the others' places, so that every name is the whole model's), the patch
// embedding and positions with the encoder's first block, encoder.norm with its last, the token
// embedding and positions with the decoder's first block, its norm and head with the last. Between
// chunks travel the encoder's stream "x", then the encoded image "encoded" (every decoder block
// cross-attends to it, so it goes on through every decoder stage, its gradient summed on the way
// back) and the decoder's stream "h". The evaluator's encode and decode run the same chunks in two
// passes (encode: the chunks up to the encoder's end, the encoded image passed on to the last
// stage; decode, once per token in greedy decoding: from the decoder's first chunk, the encoded
// image already on every stage).
//
// Init (big_vision's): the patch conv lecun-normal (truncated normal, std 1/sqrt(fan_in) /
// 0.8796), its bias 0; positions N(0, 1/W) (learned); encoder attention xavier-uniform per q, k,
// v and proj, biases 0; MLP xavier-uniform, biases N(0, 1e-6^2); decoder attention
// lecun-normal; the token embedding N(0, 1); norms 1 and 0; the head 0 (so the first loss is
// log V). Drawn from a generator seeded by `seed` alone, in parameter order.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "common/tensor_map.hpp"
#include "models/activation_checkpoint.hpp"
#include "models/family.hpp"
#include "models/layers.hpp"
#include "models/lora.hpp"
#include "models/model_state.hpp"
#include "models/stages.hpp"

namespace flowrun::cappa {

struct Config {
  // Encoder (ViT): ViT-B/16 by default.
  int64_t image_size = 224, patch = 16, channels = 3;
  int64_t width = 768, depth = 12, heads = 12, mlp_dim = 3072;
  std::string posemb = "learn";  // learn | sincos2d
  // Decoder: big_vision's CapPa config (6 layers of the encoder's width).
  int64_t dec_width = 768, dec_depth = 6, dec_heads = 12, dec_mlp_dim = 3072;
  bool decoder_bias = false;
  int64_t vocab = 32000;  // V; the embedding has V + 1 rows (the mask token)
  int64_t max_len = 64;   // T: decoder inputs per caption at most
  CheckpointPolicy checkpoint;  // encoder and decoder blocks recomputed in backward (activation_checkpoint.hpp)
  std::shared_ptr<parallel::Group> tp;  // tensor parallel (see the top); null: whole
  // Pipeline parallel (see the top): the chunks of the depth + dec_depth blocks this rank holds;
  // null: the whole model.
  std::shared_ptr<const Stages> stages;
  bool staged() const { return stages != nullptr; }
  // Block i of the run (encoder blocks 0 .. depth - 1, then the decoder's) is this rank's.
  bool holds_block(int64_t i) const { return !stages || stages->holds_block(static_cast<int>(i)); }
  int64_t tokens() const { return (image_size / patch) * (image_size / patch); }
  void check() const;  // sizes positive, widths divisible by heads, image_size divisible by patch, heads and MLPs by tp
  double parameter_count() const;
};
// How whole tensor `name` ("decoder.blocks.2.cross_attn.k.weight") is laid out over the tp group.
parallel::TpSplit tp_split(const std::string& name);
// CapPa as its node's layout machinery reads it (models/family.hpp): tp_split, the encoder's then
// the decoder's blocks by their products per image (an encoder block's 4 W^2 + 2 W mlp_dim per
// patch; a decoder block's 6 D^2 + 2 D dec_mlp_dim per caption position and its cross-attention's
// keys and values, 2 D W per patch), the patch embedding's and the head's. Its init goes module by
// module (big_vision's): the node inits a whole model and loads it, so none is declared here.
Family family(const Config& c);
std::string describe(const Config& c);  // "vit 768x12 (patch 16, 224 px), decoder 768x6, vocab 32000"

// LayerNorm over the last dim, eps 1e-6, with or without a bias (flax's): flax_norm(dim, bias).
using Norm = layers::LayerNorm;
inline Norm flax_norm(int64_t dim, bool bias) { return Norm(dim, layers::NormOptions{1e-6, true, bias, false}); }

// fc1 -> exact GELU -> fc2, with or without biases: the shared MLP.
using layers::Mlp;
inline layers::MlpOptions mlp_options(bool bias, std::shared_ptr<parallel::Group> tp = nullptr) {
  layers::MlpOptions o{"fc1", "fc2", layers::Act::gelu, "", bias};
  o.tp = std::move(tp);
  return o;
}

// The ViT block's self-attention: one qkv projection [3W, W] with bias, then proj.
class EncoderAttentionImpl : public torch::nn::Cloneable<EncoderAttentionImpl> {
 public:
  EncoderAttentionImpl(int64_t dim, int64_t heads, std::shared_ptr<parallel::Group> tp = nullptr)
      : dim_(dim), heads_(heads), tp_(std::move(tp)) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);  // [B, N, W]
  lora::Linear qkv{nullptr}, proj{nullptr};

 private:
  int64_t dim_, heads_;
  std::shared_ptr<parallel::Group> tp_;
};
TORCH_MODULE(EncoderAttention);

class EncoderBlockImpl : public torch::nn::Cloneable<EncoderBlockImpl> {
 public:
  EncoderBlockImpl(int64_t dim, int64_t heads, int64_t mlp, std::shared_ptr<parallel::Group> tp = nullptr)
      : dim_(dim), heads_(heads), mlp_(mlp), tp_(std::move(tp)) { reset(); }
  void reset() override;
  torch::Tensor forward(torch::Tensor x);
  Norm norm1{nullptr}, norm2{nullptr};
  EncoderAttention attn{nullptr};
  Mlp mlp{nullptr};

 private:
  int64_t dim_, heads_, mlp_;
  std::shared_ptr<parallel::Group> tp_;
};
TORCH_MODULE(EncoderBlock);

// Decoder attention: q from the decoder [D -> D], k and v from `kv_dim` inputs (the decoder
// itself, or the encoded image), no biases; `bias` is added to the scores ([B, 1, Lq, Lk]).
// With tp this rank's heads; a kv other than x must come through parallel::copy_to_tp (the
// decoder's forward copies the encoded image once).
class DecoderAttentionImpl : public torch::nn::Cloneable<DecoderAttentionImpl> {
 public:
  DecoderAttentionImpl(int64_t dim, int64_t kv_dim, int64_t heads, std::shared_ptr<parallel::Group> tp = nullptr)
      : dim_(dim), kv_dim_(kv_dim), heads_(heads), tp_(std::move(tp)) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& kv, const torch::Tensor& bias);
  lora::Linear q{nullptr}, k{nullptr}, v{nullptr}, proj{nullptr};

 private:
  int64_t dim_, kv_dim_, heads_;
  std::shared_ptr<parallel::Group> tp_;
};
TORCH_MODULE(DecoderAttention);

class DecoderBlockImpl : public torch::nn::Cloneable<DecoderBlockImpl> {
 public:
  explicit DecoderBlockImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& encoded, const torch::Tensor& self_bias);
  Norm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};
  DecoderAttention self_attn{nullptr}, cross_attn{nullptr};
  Mlp mlp{nullptr};

 private:
  Config c_;
};
TORCH_MODULE(DecoderBlock);

// The patch embedding: proj, a conv with kernel = stride = patch (the shared one).
using layers::PatchEmbed;

class EncoderImpl : public torch::nn::Cloneable<EncoderImpl> {
 public:
  explicit EncoderImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& images);  // [B, 3, H, W] in [-1, 1] -> [B, N, W]
  // forward's parts: the patches with their positions; blocks [first, last); the final norm.
  torch::Tensor embed(const torch::Tensor& images);
  torch::Tensor run_blocks(torch::Tensor x, int64_t first, int64_t last);
  PatchEmbed patch_embed{nullptr};
  torch::Tensor pos_embed;                      // parameter (learn) or buffer (sincos2d)
  torch::nn::ModuleList blocks{nullptr};
  Norm norm{nullptr};

 private:
  Config c_;
};
TORCH_MODULE(Encoder);

class DecoderImpl : public torch::nn::Cloneable<DecoderImpl> {
 public:
  explicit DecoderImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  // ids [B, L] (L <= max_len; the mask token is id vocab) -> logits [B, L, vocab]; rows with
  // parallel[b] attend to every position, the others causally (parallel undefined: all causal).
  torch::Tensor forward(const torch::Tensor& encoded, const torch::Tensor& ids, const torch::Tensor& parallel);
  // forward's parts: the inputs' embeddings with their positions; blocks [first, last) on the
  // image `encoded` (copied to the tp ranks once per call) with the self-attention's bias; norm
  // and head.
  torch::Tensor embed_inputs(const torch::Tensor& ids);
  torch::Tensor run_blocks(torch::Tensor x, const torch::Tensor& encoded, const torch::Tensor& bias, int64_t first,
                           int64_t last);
  torch::Tensor output(const torch::Tensor& x) { return head(norm(x)); }
  torch::nn::Embedding embed{nullptr};
  torch::Tensor pos_embed;
  torch::nn::ModuleList blocks{nullptr};
  Norm norm{nullptr};
  lora::Linear head{nullptr};

 private:
  Config c_;
};
TORCH_MODULE(Decoder);

class CappaImpl : public torch::nn::Cloneable<CappaImpl> {
 public:
  explicit CappaImpl(Config c);
  void reset() override;
  const Config& config() const { return c_; }
  // Staged, each runs this rank's chunks (see the top) and returns what the last stage computed,
  // on every stage.
  torch::Tensor encode(const torch::Tensor& images);
  torch::Tensor decode(const torch::Tensor& encoded, const torch::Tensor& ids, const torch::Tensor& parallel = {});
  // The model's forward on a batch: "image" [B, 3, H, W]; "decoder_input" int [B, L];
  // optionally "decoder_masked" bool [B, L] (inputs replaced by the mask token) and "parallel"
  // bool [B] (rows decoded without the causal mask). -> logits [B, L, vocab].
  torch::Tensor forward_batch(const TensorMap& batch);
  Encoder encoder{nullptr};
  Decoder decoder{nullptr};

 private:
  // Pipeline chunk k (Config::stages) of one of three passes: the whole model (images and decoder
  // inputs to logits), encode (images to the encoded image) or decode (the encoded image, on
  // every stage, and decoder inputs to logits); from chunk k - 1's outputs `prev` to chunk k + 1's
  // inputs, the last chunk's {"output": ...}.
  enum class Pass { whole, encode, decode };
  struct Inputs {
    torch::Tensor images, encoded, ids, parallel;
  };
  TensorMap chunk(int k, Pass pass, const Inputs& in, const TensorMap& prev);
  torch::Tensor staged(Pass pass, const Inputs& in, const c10::Device& device);
  Config c_;
};
TORCH_MODULE(Cappa);

// The decoder's inputs: ids with the `masked` positions (bool [B, L], or undefined: none)
// replaced by the mask token id `vocab`.
torch::Tensor decoder_inputs(const torch::Tensor& ids, const torch::Tensor& masked, int64_t vocab);
// The self-attention's additive bias [B, 1, L, L]: 0 where a position may look, -inf after the
// diagonal in causal rows; all 0 in rows with parallel[b] (bool [B]; undefined: all causal).
torch::Tensor self_attention_bias(const torch::Tensor& parallel, int64_t B, int64_t L, const torch::TensorOptions& o);

// big_vision's init (see the top of this file), from a generator seeded by `seed` alone.
void init_weights(CappaImpl& model, uint64_t seed);
// The model's own names (a flowrun checkpoint's model.params.safetensors, or one converted to
// them), every tensor checked (load_by_name); with tp whole tensors, each rank taking its parts.
void load_state_dict(CappaImpl& model, const std::map<std::string, torch::Tensor>& tensors, const std::string& source);
void load_safetensors(CappaImpl& model, const std::string& path);

// The state behind the cappa node's `params` port: forward(batch) = forward_batch.
std::shared_ptr<ModelState> make_state(Cappa model);
CappaImpl& module_of(ModelState& state);  // throws if the state is not a CapPa

// Both decoders take the image tokens, `model.encode(images)`, so one encoding serves both.
// Greedy autoregressive decoding: from `start` (int64 [B]) each next token is the argmax of
// the logits at the last position, for `steps` tokens; rows that produced `eos` keep producing
// it. -> [B, steps] (the tokens after the start). No gradients.
torch::Tensor greedy_decode(CappaImpl& model, const torch::Tensor& encoded, const torch::Tensor& start, int64_t steps,
                            int64_t eos);
// Parallel decoding: one pass over `steps` mask tokens without the causal mask. -> [B, steps].
torch::Tensor parallel_decode(CappaImpl& model, const torch::Tensor& encoded, int64_t steps);

}  // namespace flowrun::cappa
