// A HunyuanDiT diffusion transformer as a libtorch module: diffusers' HunyuanDiT2DModel with its
// parameter names, so a diffusers-format checkpoint loads by name with every tensor accounted
// for (tests/nodes/dit_diffusers_test.cpp lists diffusers' tensors and transcribes its forward).
// Used by the dit node (dit_node.cpp), the diffusion objective (train/diffusion.hpp), samplers.
//
//   text_embedding_padding [text_len (+ text_len_t5), text_dim]   learned stand-in for padded tokens
//   text_embedder.linear_1 [4*t5_dim, t5_dim], linear_2 [text_dim, 4*t5_dim]   (only t5_dim > 0)
//                                                          projects T5 states to the cross-attention width
//   pos_embed.proj.weight [hidden, C, p, p], .bias        patch embedding (a strided conv)
//   time_extra_emb.timestep_embedder.linear_1 [hidden, 256], linear_2 [hidden, hidden]
//                                                          sinusoidal(t, 256; cos|sin) -> MLP (SiLU)
//   time_extra_emb.pooler.positional_embedding [text_len_t5+1, t5_dim], .{q,k,v}_proj [t5_dim, t5_dim],
//                     .c_proj [pooled_projection_dim, t5_dim]   (only t5_dim > 0)
//                                                          attention pooling of the T5 states (8 heads)
//   time_extra_emb.style_embedder.weight [1, hidden]       (only use_style_cond_and_image_meta_size)
//   time_extra_emb.extra_embedder.linear_1 [4*hidden, E], linear_2 [hidden, 4*hidden]
//                     E = pooled_projection_dim (t5_dim > 0) + 6*256 + hidden (size/style cond)
//   blocks.N.norm1.linear [hidden, hidden], norm1.norm.weight/bias   AdaLayerNormShift:
//                                                          LN(x) + linear(SiLU(temb))
//   blocks.N.attn1.{to_q,to_k,to_v,to_out.0} [hidden, hidden] (+bias), attn1.norm_q / norm_k [head_dim]
//                                                          self-attention, qk LayerNorm, 2-D RoPE on q and k
//   blocks.N.norm2.weight/bias
//   blocks.N.attn2.to_q [hidden, hidden], to_k / to_v [hidden, text_dim], to_out.0, norm_q, norm_k
//                                                          cross-attention to the text; RoPE on q only
//   blocks.N.norm3.weight/bias
//   blocks.N.ff.net.0.proj [int(hidden*mlp_ratio), hidden], ff.net.2 [hidden, inner]   GELU (tanh)
//   blocks.N.skip_norm.weight/bias [2*hidden], skip_linear [hidden, 2*hidden]
//                                                          only blocks N > depth/2 (long skips)
//   norm_out.linear [2*hidden, hidden]                     AdaLayerNormContinuous: LN(x)*(1+scale)+shift
//   proj_out [p*p*C', hidden]                              C' = 2C with learn_sigma, else C; unpatchify
//
// The conditioning vector (diffusers' HunyuanCombinedTimestepTextSizeStyleEmbedding):
//   temb = timestep_embedder(sin256(t)) + extra_embedder(cat(pool(t5), sin256(meta) x 6, style_emb))
// where meta = image_meta_size [B, 6] = (original h, w, target h, w, crop top, left) and each of
// the six numbers gets its own 256 sinusoidal features; the pooled and size/style parts are there
// only when the model has them (no extra_embedder at all when it has neither).
//
// Text (diffusers' forward): the first encoder's states [B, text_len, text_dim] and, with T5,
// text_embedder(T5 states) [B, text_len_t5, text_dim] are concatenated; every token whose mask is
// 0 is replaced by its row of text_embedding_padding; cross-attention then attends to all of them
// (no key mask). The lengths are fixed: text_len must be the tokenizer's max_length. The pooler
// reads the raw T5 states, padded tokens included (so does HunyuanDiT).
//
// Long skips (HunyuanDiT / diffusers): block i with i > depth/2 first replaces its input h by
// skip_linear(skip_norm(cat(h, out_j))) where out_j is the output of block j = depth-1-i; the
// middle block(s) have none. (For even depth exactly diffusers' rule; odd depth extends it.)
//
// 2-D RoPE (diffusers' get_2d_rotary_pos_embed, use_real): a token at patch row r, column c
// rotates the pairs (2k, 2k+1) of the first half of each head's channels by x_c·f_k and those of
// the second half by y_r·f_k, f_k = 10000^(-2k/(head_dim/2)). The positions x, y are as
// HunyuanDiT's pipeline and trainer compute them (rope_base_grid = B, 32 for a 512-px base with
// patch 2): the gh x gw grid resized to fit a B x B grid, keeping its aspect ratio, centered
// (get_resize_crop_region_for_grid: the crop (top, left)-(top + h', left + w'), Python's
// round-half-to-even), then the positions spaced over the crop: y_r = top + r h'/gh, x_c =
// left + c w'/gw (np.linspace without the end point); a 64 x 64 grid gets 0, 0.5, 1, ..., a
// 16 x 16 one 0, 2, 4, ... rope_base_grid 0: the integer patch coordinates 0..gh-1, 0..gw-1.
// Any H, W divisible by patch (aspect-ratio buckets) gets its own table, computed per shape
// and cached.
//
// learn_sigma (HunyuanDiT's checkpoints have it): proj_out predicts 2C channels, the prediction
// and a variance; forward() returns all 2C, the model's forward for objectives and samplers the
// first C (diffusers' pipeline: noise_pred.chunk(2)[0]); nothing here trains the variance half.
// t5_dim 0 (flowrun's one-encoder variant, not in diffusers): no text_embedder, no pooler, the
// padding has text_len rows.
//
// Tensor parallel (Config::tp; Megatron-LM's split, parallel/tensor_parallel.hpp): each rank of
// the group holds heads/tp of both attentions' heads (to_q, to_k, to_v by their output rows,
// to_out.0 by its input columns) and inner/tp of the MLP's units (ff.net.0.proj by rows,
// ff.net.2 by columns), so a block costs one all-reduce forward and one backward per attention
// and per MLP; the text states enter every cross-attention through one copy (their gradient
// summed once, not per block). Whole on every rank: the adaLN modulations (norm1.linear, an
// [hidden, hidden] shift added to the whole stream), the skip linears (their input is the whole
// concatenation; splitting them would cost a collective each for 2/17 of a block's weights),
// the norms, the embedders, the pooler, norm_out and proj_out (tp_split says which is which); the
// per-head q and k norms are whole too, their gradients summed over the ranks (each rank's heads
// use them: layers::NormOptions::tp).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "common/tensor_map.hpp"
#include "models/activation_checkpoint.hpp"
#include "models/family.hpp"
#include "models/layers.hpp"
#include "models/lora.hpp"
#include "models/model_state.hpp"

namespace flowrun::dit {

// Defaults: schemas/dit.yaml's (BuiltinSchemas.ConfigStructsStartAtTheSchemaDefaults keeps them so).
struct Config {
  int64_t patch = 2, in_channels = 4;
  int64_t hidden = 1408, depth = 40, heads = 16;  // DiT-g/2 (HunyuanDiT): head_dim 88
  double mlp_ratio = 4.3637;                        // DiT-g: inner = int(1408 * 4.3637) = 6144
  int64_t text_dim = 1024;                          // width of batch["text_emb"] (CLIP/BERT states)
  int64_t t5_dim = 2048;                            // width of batch["t5_emb"]; 0 = no T5 input
  int64_t text_len = 77, text_len_t5 = 256;         // tokens of text_emb / t5_emb (the tokenizers' lengths)
  int64_t pooled_projection_dim = 1024;             // width of the pooled T5 vector (t5_dim > 0)
  bool use_style_cond_and_image_meta_size = true;   // size and style conditioning (v1.2: false)
  bool learn_sigma = true;                          // proj_out predicts 2C channels (prediction | variance)
  CheckpointPolicy checkpoint;                      // blocks recomputed in backward (activation_checkpoint.hpp)
  int64_t rope_base_grid = 32;                      // RoPE positions fit to a B x B grid (the pipeline's); 0: integer
  std::shared_ptr<parallel::Group> tp;              // tensor parallel (see the top); null: whole
  // Pipeline parallel (run.parallel.pp > 1, models/stages.hpp): the chunks this rank holds; the
  // module then has only their blocks (under their whole model's names), the text, patch and time
  // embeddings with chunk 0 and norm_out and proj_out with the last. Between chunks travel the
  // stream h, the time embedding, the text states and the long skips still to be taken. Null:
  // the whole model.
  std::shared_ptr<const Stages> stages;
  bool staged() const { return stages != nullptr; }
  bool holds_block(int64_t i) const { return !stages || stages->holds_block(static_cast<int>(i)); }
  int64_t out_channels() const { return learn_sigma ? 2 * in_channels : in_channels; }
  // Width of extra_embedder's input; 0: the model has none.
  int64_t extra_in() const {
    return (t5_dim > 0 ? pooled_projection_dim : 0) + (use_style_cond_and_image_meta_size ? 6 * 256 + hidden : 0);
  }
  int64_t head_dim() const { return hidden / heads; }
  // Every parameter the model makes, counted from the sizes before anything is allocated (a
  // config.json with patch_size or text_len absurd is refused by check_model_fits, not torch).
  double parameter_count() const;
  int64_t ff_inner() const { return static_cast<int64_t>(static_cast<double>(hidden) * mlp_ratio); }
  void check() const;  // also: heads and ff_inner() divisible by tp
};
// How whole tensor `name` (diffusers' name, "blocks.3.attn1.to_q.weight") is laid out over the tp group.
parallel::TpSplit tp_split(const std::string& name);
// "patch=2 in_channels=4 hidden=1408 ...", for messages.
std::string describe(const Config& c);

// LayerNorm computed in fp32 (diffusers' FP32LayerNorm), eps 1e-6: LayerNorm(dim, layers::fp32_norm(affine)).
using layers::LayerNorm;

// pos_embed: diffusers' PatchEmbed (proj, a conv with kernel = stride = patch; no position
// table, the positions are the RoPE's) is the shared one.
using layers::PatchEmbed;

// linear_1 -> SiLU -> linear_2 (diffusers' TimestepEmbedding and PixArtAlphaTextProjection): the
// shared MLP, in -> mid -> out.
using TwoLayer = layers::Mlp;
inline layers::MlpOptions two_layer(int64_t out) {
  layers::MlpOptions o{"linear_1", "linear_2", layers::Act::silu};
  o.out = out;
  return o;
}

// HunyuanDiT's attention pooling (diffusers' HunyuanDiTAttentionPool, from CLIP's AttnPool2d): the
// mean token is prepended, positions added, and the mean token alone queries all of them with
// 8 heads; c_proj maps the result to out. x [B, L, dim] (L = positional rows - 1) -> [B, out].
class AttentionPoolImpl : public torch::nn::Cloneable<AttentionPoolImpl> {
 public:
  AttentionPoolImpl(int64_t len, int64_t dim, int64_t heads, int64_t out)
      : len_(len), dim_(dim), heads_(heads), out_(out) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor positional_embedding;
  lora::Linear k_proj{nullptr}, q_proj{nullptr}, v_proj{nullptr}, c_proj{nullptr};

 private:
  int64_t len_, dim_, heads_, out_;
};
TORCH_MODULE(AttentionPool);

// time_extra_emb: the timestep MLP and, when the model has them, the pooled-T5 and size/style
// conditions through extra_embedder (see the top of this file).
class TimeEmbedImpl : public torch::nn::Cloneable<TimeEmbedImpl> {
 public:
  explicit TimeEmbedImpl(const Config& cfg) : cfg_(cfg) { reset(); }
  void reset() override;
  // t [B]; t5 [B, text_len_t5, t5_dim] (t5_dim > 0); meta [B, 6] and style [B] (int) with size/style cond.
  torch::Tensor forward(const torch::Tensor& t, const torch::Tensor& t5, const torch::Tensor& meta,
                        const torch::Tensor& style, torch::ScalarType dtype);
  TwoLayer timestep_embedder{nullptr};
  AttentionPool pooler{nullptr};          // t5_dim > 0
  torch::nn::Embedding style_embedder{nullptr};  // use_style_cond_and_image_meta_size
  TwoLayer extra_embedder{nullptr};       // extra_in() > 0

 private:
  Config cfg_;
};
TORCH_MODULE(TimeEmbed);

// norm1: LN(x) + linear(SiLU(temb)) (diffusers' AdaLayerNormShift).
class AdaNormShiftImpl : public torch::nn::Cloneable<AdaNormShiftImpl> {
 public:
  explicit AdaNormShiftImpl(int64_t dim) : dim_(dim) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& temb);
  lora::Linear linear{nullptr};
  LayerNorm norm{nullptr};

 private:
  int64_t dim_;
};
TORCH_MODULE(AdaNormShift);

// norm_out: LN(x, no affine) * (1 + scale) + shift, [scale | shift] = linear(SiLU(temb)).
class AdaNormContinuousImpl : public torch::nn::Cloneable<AdaNormContinuousImpl> {
 public:
  explicit AdaNormContinuousImpl(int64_t dim) : dim_(dim) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& temb);
  lora::Linear linear{nullptr};
  LayerNorm norm{nullptr};  // no parameters

 private:
  int64_t dim_;
};
TORCH_MODULE(AdaNormContinuous);

class AttentionImpl : public torch::nn::Cloneable<AttentionImpl> {
 public:
  AttentionImpl(int64_t dim, int64_t kv_dim, int64_t heads, bool cross, std::shared_ptr<parallel::Group> tp = nullptr)
      : dim_(dim), kv_dim_(kv_dim), heads_(heads), cross_(cross), tp_(std::move(tp)) { reset(); }
  void reset() override;
  // x [B, N, dim]; ctx [B, L, kv_dim] (cross) or undefined (self); cos/sin [N, head_dim]. Every
  // key is attended to (padded text tokens are learned embeddings, not masked out). With tp
  // this rank's heads; ctx must come through parallel::copy_to_tp (the model's forward does).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& ctx, const torch::Tensor& cos,
                        const torch::Tensor& sin);
  lora::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  LayerNorm norm_q{nullptr}, norm_k{nullptr};
  torch::nn::ModuleList to_out{nullptr};  // [0]: lora::Linear (diffusers' to_out.0; to_out.1 is dropout)

 private:
  int64_t dim_, kv_dim_, heads_;
  bool cross_;
  std::shared_ptr<parallel::Group> tp_;
};
TORCH_MODULE(Attention);

// ff: diffusers' FeedForward (net.0 a GELU(tanh) with its proj, net.1 dropout, net.2 the output
// projection), the shared MLP at those paths.
inline layers::MlpOptions ff_options(std::shared_ptr<parallel::Group> tp = nullptr) {
  layers::MlpOptions o{"net.0.proj", "net.2", layers::Act::gelu_tanh};
  o.tp = std::move(tp);
  return o;
}

class BlockImpl : public torch::nn::Cloneable<BlockImpl> {
 public:
  BlockImpl(const Config& cfg, bool skip) : cfg_(cfg), skip_(skip) { reset(); }
  void reset() override;
  torch::Tensor forward(torch::Tensor h, const torch::Tensor& temb, const torch::Tensor& ctx,
                        const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& skip);
  bool has_skip() const { return skip_; }
  AdaNormShift norm1{nullptr};
  Attention attn1{nullptr};
  LayerNorm norm2{nullptr};
  Attention attn2{nullptr};
  LayerNorm norm3{nullptr};
  layers::Mlp ff{nullptr};  // ff_options()
  LayerNorm skip_norm{nullptr};
  lora::Linear skip_linear{nullptr};

 private:
  Config cfg_;
  bool skip_;
};
TORCH_MODULE(Block);

// The (cos, sin) tables [gh*gw, head_dim] of the 2-D RoPE for a gh x gw patch grid (row-major
// tokens), positions fit to a base_grid x base_grid grid (0: integer positions; see the top of
// this file). float32, CPU.
std::pair<torch::Tensor, torch::Tensor> rope_2d(int64_t head_dim, int64_t gh, int64_t gw, int64_t base_grid = 0);
// Rotate x [..., N, head_dim] by the tables (diffusers' apply_rotary_emb with use_real,
// interleaved pairs): x*cos + rot(x)*sin, rot(x)[2k] = -x[2k+1], rot(x)[2k+1] = x[2k].
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
// Sinusoidal timestep features [B, dim]: [cos(t*f) | sin(t*f)], f_k = 10000^(-k/(dim/2))
// (diffusers' Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)).
torch::Tensor timestep_features(const torch::Tensor& t, int64_t dim = 256);

class DitImpl : public torch::nn::Cloneable<DitImpl> {
 public:
  explicit DitImpl(Config cfg);
  void reset() override;
  // The model's inputs, by diffusers' forward arguments. x [B, C, H, W] (H, W multiples of patch);
  // t [B] or 0-d timesteps (any dtype); text [B, text_len, text_dim] with text_mask [B, text_len]
  // or undefined (= all ones; nonzero = a token, 0 = padding); with t5_dim > 0 t5 [B, text_len_t5,
  // t5_dim] and t5_mask; with size/style conditioning image_meta_size [B, 6] and style [B] (int).
  struct Inputs {
    torch::Tensor x, t, text, text_mask, t5, t5_mask, image_meta_size, style;
  };
  // -> [B, out_channels(), H, W] (with learn_sigma the prediction, then the variance channels).
  torch::Tensor forward(const Inputs& in);
  // From a batch with the same keys as the batch of forward_batch; all out_channels().
  torch::Tensor forward_all(const TensorMap& batch);
  // The prediction [B, C, H, W] from a batch: "x", "t", "text_emb", optional "text_mask", and
  // "t5_emb" / "t5_mask", "image_meta_size" / "style" as the model needs them. With learn_sigma
  // the first C channels. (Classifier-free guidance dropout is the objective's: diffusion_loss.)
  torch::Tensor forward_batch(const TensorMap& batch);
  const Config& config() const { return cfg_; }
  // Pipeline chunk k (Config::stages) of the model on `in`: from chunk k - 1's outputs `prev`
  // (chunk 0: the embeddings of `in`) to chunk k + 1's inputs, or the last chunk's {"output"}.
  TensorMap chunk(int k, const Inputs& in, const TensorMap& prev);


  torch::Tensor text_embedding_padding;  // [text_len (+ text_len_t5), text_dim]
  TwoLayer text_embedder{nullptr};  // only with t5_dim > 0
  PatchEmbed pos_embed{nullptr};
  TimeEmbed time_extra_emb{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  AdaNormContinuous norm_out{nullptr};
  lora::Linear proj_out{nullptr};

 private:
  std::pair<torch::Tensor, torch::Tensor> rope(int64_t gh, int64_t gw, const torch::Device& device);
  // What flows through the blocks: the stream, the time embedding, the text states, and the long
  // skips pushed and not yet taken.
  struct Stream {
    torch::Tensor h, temb, ctx;
    std::vector<torch::Tensor> skips;
  };
  Stream embed(const Inputs& in);  // the inputs checked, the text, patch and time embeddings
  void run_blocks(Stream& s, int64_t first, int64_t last, const Inputs& in);
  torch::Tensor head(const Stream& s, const Inputs& in);  // norm_out, proj_out, unpatchified
  Config cfg_;
  // RoPE tables per (grid, device); shared by clones, thread-safe (several readers at once).
  struct RopeCache {
    std::mutex mu;
    std::map<std::string, std::pair<torch::Tensor, torch::Tensor>> tables;
  };
  std::shared_ptr<RopeCache> rope_cache_;
};
TORCH_MODULE(Dit);

// DiT's init (HunyuanDiT's initialize_weights), drawn from a generator seeded by `seed` alone:
// Linear weights and the patch conv (as [out, in*p*p]) xavier-uniform, biases 0; the timestep
// and extra MLPs N(0, 0.02); LayerNorm gains 1; the adaLN modulations (blocks.N.norm1.linear,
// norm_out.linear) and proj_out zero (so the untrained model outputs 0); as diffusers'
// constructor: text_embedding_padding and style_embedder N(0, 1), the pooler's positions
// N(0, 1/t5_dim). Adapters untouched.
void init_weights(DitImpl& model, uint64_t seed);
// What init_weights does to one parameter, by its name (whole tensors), drawing from `g`: a split
// or staged model inits tensor by tensor (family.hpp init_declared).
void init_parameter(const std::string& name, torch::Tensor& p, at::Generator& g);
at::Generator init_generator(uint64_t seed);  // init_weights' generator

// Copy a state dict in by name (any float dtype, converted). Every parameter that is not a LoRA
// adapter must be given with its shape; adapters (lora_A / lora_B) are optional (a base model's
// file has none; a LoRA run's checkpoint has them). Missing, unexpected and mis-shaped tensors
// are all listed in one error that starts with `source`. With tp the tensors are whole, each
// rank taking its parts (tp_split).
void load_state_dict(DitImpl& model, const std::map<std::string, torch::Tensor>& tensors, const std::string& source);
void load_safetensors(DitImpl& model, const std::string& path);

// The ModelState of the dit node: forward(batch) = forward_batch(batch).
std::shared_ptr<ModelState> make_state(Dit model);
// The whole model's parameters of config `c`, in its init order (reset()'s), with their shapes on
// this rank: a staged model's init draws them all (family.hpp init_declared).
ParamOrder whole_order(const Config& c);
// The DiT as its node's layout machinery reads it (models/family.hpp): tp_split, blocks of about
// (4 + 2 mlp_ratio) hidden^2 products a token, init_parameter's init tensor by tensor.
Family family(const Config& c);

}  // namespace flowrun::dit
