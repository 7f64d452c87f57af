// A KL autoencoder laid out exactly like diffusers' AutoencoderKL (DownEncoderBlock2D /
// UpDecoderBlock2D, the SD / SDXL / HunyuanDiT VAE), so a diffusers
// `diffusion_pytorch_model.safetensors` loads by name. Trained by the vae node (graphs/vae.yaml,
// objective vae_loss); used frozen: vae_encode turns images into latents, the sampler decodes
// latents into images.
//
//   encoder.conv_in                               3x3, in_channels -> C[0]
//   encoder.down_blocks.I.resnets.J.{norm1,conv1,norm2,conv2,conv_shortcut}   (layers_per_block
//                                                 resnets; conv_shortcut 1x1 only when in != out)
//   encoder.down_blocks.I.downsamplers.0.conv     pad (0,1,0,1), 3x3 stride 2 (not on the last block)
//   encoder.mid_block.attentions.0.{group_norm,to_q,to_k,to_v,to_out.0}   one-head self-attention
//   encoder.mid_block.resnets.{0,1}
//   encoder.conv_norm_out, encoder.conv_out       3x3, C[-1] -> 2 * latent_channels (mean, logvar)
//   decoder.conv_in                               3x3, latent_channels -> C[-1]
//   decoder.up_blocks.I.resnets.J                 layers_per_block + 1 resnets, channels reversed
//   decoder.up_blocks.I.upsamplers.0.conv         nearest 2x, 3x3 (not on the last up block)
//   decoder.mid_block.*                           as the encoder's
//   decoder.conv_norm_out, decoder.conv_out       3x3, C[0] -> out_channels
//   quant_conv                                    1x1, 2*latent -> 2*latent
//   post_quant_conv                               1x1, latent -> latent
//
// (registration order is diffusers': encoder, decoder, quant_conv, post_quant_conv; inside the
// encoder conv_in, down_blocks, mid_block, conv_norm_out, conv_out; inside the decoder conv_in,
// up_blocks, mid_block, ...; inside a mid block attentions before resnets.) GroupNorm
// (norm_num_groups, eps 1e-6), SiLU, attention Linear weights [C, C].
//
// A module is built as the encoder part (encoder.* + quant_conv.*), the decoder part (decoder.* +
// post_quant_conv.*) or both, so encoder-only and decoder-only files load, and a node that only
// encodes holds no decoder.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/tensor_map.hpp"
#include "models/activation_checkpoint.hpp"
#include "models/model_state.hpp"

namespace flowrun::vae {

struct Config {
  int64_t in_channels = 3, out_channels = 3;
  std::vector<int64_t> block_out_channels{128, 256, 512, 512};
  int64_t layers_per_block = 2, latent_channels = 4, norm_num_groups = 32;
  double scaling_factor = 0.18215;  // SD 1.x/2.x; SDXL and HunyuanDiT: 0.13025
  // Training only (the vae node): the down and up blocks and the mid blocks recomputed in
  // backward (models/activation_checkpoint.hpp), counted in that order.
  CheckpointPolicy checkpoint;
  // Throws std::invalid_argument on empty/non-positive sizes or channels not divisible by
  // norm_num_groups.
  void check() const;
  // Spatial factor between images and latents: 2^(len(block_out_channels) - 1).
  int64_t downsample_factor() const { return int64_t{1} << (block_out_channels.size() - 1); }
};

// "vae (block_out_channels=[128, 256, 512, 512] layers_per_block=2 latent_channels=4 ...)"
std::string describe(const Config& c);

enum class Part { encoder, decoder, both };
const char* to_string(Part p);
inline bool has_encoder(Part p) { return p != Part::decoder; }
inline bool has_decoder(Part p) { return p != Part::encoder; }

// What backward keeps of a training forward (forward_backward's memory line; the gpt's, dit's and
// cappa's use the transformer estimate of models/activation_checkpoint.hpp): `rows` images of
// height x width at `bytes` per element, the `part` the module holds, counted op by op (GroupNorm,
// SiLU and each convolution save their input; the mid blocks' attention its projections and,
// without a fused kernel, the float32 scores [HW, HW] of the lowest resolution), plain and with
// the down, mid and up blocks recomputed as `policy` says (each then keeps its input, and the
// largest is live again in backward: recompute_live). Within 25 % of what a forward keeps
// (tests/nodes/activation_checkpoint_test.cpp measures it).
ActivationEstimate estimate_activations(const Config& c, Part part, int64_t rows, int64_t height, int64_t width,
                                        int64_t bytes, bool fused_attention, const CheckpointPolicy& policy);

// diffusers' ResnetBlock2D without a time embedding: x' = shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x)))))).
class ResnetBlockImpl : public torch::nn::Cloneable<ResnetBlockImpl> {
 public:
  ResnetBlockImpl(int64_t in, int64_t out, int64_t groups) : in_(in), out_(out), groups_(groups) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};  // conv_shortcut: in != out only

 private:
  int64_t in_, out_, groups_;
};
TORCH_MODULE(ResnetBlock);

// diffusers' Attention as the VAE's mid block uses it: GroupNorm, one head over the H*W
// positions, to_out.0, plus the input (residual_connection), rescale 1.
class AttentionImpl : public torch::nn::Cloneable<AttentionImpl> {
 public:
  AttentionImpl(int64_t channels, int64_t groups) : c_(channels), groups_(groups) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::GroupNorm group_norm{nullptr};
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  torch::nn::ModuleList to_out{nullptr};  // [Linear] (diffusers' index 1 is a Dropout: no parameters)

 private:
  int64_t c_, groups_;
};
TORCH_MODULE(Attention);

// Downsample2D(use_conv, padding 0): pad right and bottom by one, 3x3 conv with stride 2.
class DownsampleImpl : public torch::nn::Cloneable<DownsampleImpl> {
 public:
  explicit DownsampleImpl(int64_t channels) : c_(channels) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Conv2d conv{nullptr};

 private:
  int64_t c_;
};
TORCH_MODULE(Downsample);

// Upsample2D(use_conv): nearest 2x, 3x3 conv (padding 1).
class UpsampleImpl : public torch::nn::Cloneable<UpsampleImpl> {
 public:
  explicit UpsampleImpl(int64_t channels) : c_(channels) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Conv2d conv{nullptr};

 private:
  int64_t c_;
};
TORCH_MODULE(Upsample);

// UNetMidBlock2D without a time embedding: resnets.0, attentions.0, resnets.1.
class MidBlockImpl : public torch::nn::Cloneable<MidBlockImpl> {
 public:
  MidBlockImpl(int64_t channels, int64_t groups) : c_(channels), groups_(groups) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::ModuleList attentions{nullptr}, resnets{nullptr};

 private:
  int64_t c_, groups_;
};
TORCH_MODULE(MidBlock);

// DownEncoderBlock2D (down: add a downsampler) and UpDecoderBlock2D (up: add an upsampler).
class BlockImpl : public torch::nn::Cloneable<BlockImpl> {
 public:
  enum Kind { down, up };
  BlockImpl(Kind kind, int64_t in, int64_t out, int64_t layers, bool resample, int64_t groups)
      : kind_(kind), in_(in), out_(out), layers_(layers), resample_(resample), groups_(groups) {
    reset();
  }
  void reset() override;
  torch::Tensor forward(torch::Tensor x);
  torch::nn::ModuleList resnets{nullptr};
  torch::nn::ModuleList downsamplers{nullptr}, upsamplers{nullptr};  // at most one, per kind

 private:
  Kind kind_;
  int64_t in_, out_, layers_;
  bool resample_;
  int64_t groups_;
};
TORCH_MODULE(Block);

// diffusers' vae.Encoder (double_z): images [B, in, H, W] -> moments [B, 2*latent, H/f, W/f].
class EncoderImpl : public torch::nn::Cloneable<EncoderImpl> {
 public:
  explicit EncoderImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList down_blocks{nullptr};
  MidBlock mid_block{nullptr};
  torch::nn::GroupNorm conv_norm_out{nullptr};

 private:
  Config c_;
};
TORCH_MODULE(Encoder);

// diffusers' vae.Decoder: latents [B, latent, h, w] -> images [B, out, h*f, w*f].
class DecoderImpl : public torch::nn::Cloneable<DecoderImpl> {
 public:
  explicit DecoderImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& z);
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList up_blocks{nullptr};
  MidBlock mid_block{nullptr};
  torch::nn::GroupNorm conv_norm_out{nullptr};

 private:
  Config c_;
};
TORCH_MODULE(Decoder);

class AutoencoderKLImpl : public torch::nn::Cloneable<AutoencoderKLImpl> {
 public:
  explicit AutoencoderKLImpl(Config c, Part part = Part::both);
  void reset() override;
  const Config& config() const { return cfg_; }
  Part part() const { return part_; }

  // images [B, in, H, W] (H, W multiples of downsample_factor()) -> (mean, logvar), each
  // [B, latent, H/f, W/f], in the parameters' dtype; logvar clamped to [-30, 20] as diffusers'
  // DiagonalGaussianDistribution. Throws without the encoder part.
  std::pair<torch::Tensor, torch::Tensor> encode(const torch::Tensor& images);
  // Unscaled latents [B, latent, h, w] -> images [B, out, h*f, w*f]: decoder(post_quant_conv(z)).
  // Throws without the decoder part.
  torch::Tensor decode(const torch::Tensor& latents);

  Encoder encoder{nullptr};
  Decoder decoder{nullptr};
  torch::nn::Conv2d quant_conv{nullptr}, post_quant_conv{nullptr};

 private:
  Config cfg_;
  Part part_;
};
TORCH_MODULE(AutoencoderKL);

// DiagonalGaussianDistribution.sample(): mean + exp(0.5 logvar) * eps, eps ~ N(0, I) from `gen`
// (a CPU generator; drawn in float32 on the CPU, then moved to mean's device and dtype).
torch::Tensor sample(const torch::Tensor& mean, const torch::Tensor& logvar, at::Generator& gen);

// PyTorch's default init (what diffusers' AutoencoderKL starts from): conv and linear weights and
// biases U(+-1/sqrt(fan_in)), GroupNorm gains 1 and shifts 0, from a generator seeded by `seed`
// alone, in parameter order.
void init_weights(AutoencoderKLImpl& model, uint64_t seed);

// Copy a diffusers AutoencoderKL state dict in by name (converting dtypes). Names may carry a
// "vae." prefix. Tensors of the part the module does not hold are ignored (a full file loads into
// an encoder-only or decoder-only module); every tensor of the part it holds must be there with
// its shape. The deprecated attention names (query, key, value, proj_attn; also 1x1-conv shaped
// [C, C, 1, 1]) are converted to to_q, to_k, to_v, to_out.0 as diffusers does on load. Every
// problem (missing, unexpected, mis-shaped) is listed in one error starting with `source`.
void load_state_dict(AutoencoderKLImpl& model, const std::map<std::string, torch::Tensor>& tensors,
                     const std::string& source);
void load_safetensors(AutoencoderKLImpl& model, const std::string& path);

// How many parameters the `part` of an AutoencoderKL of config `c` has, from the config alone
// (nothing allocated): what the size check below uses.
double parameter_count(const Config& c, Part part);

// The `part` of an AutoencoderKL of config `c`: loaded from `weights` (a safetensors file, as
// load_safetensors), or, with weights empty, initialised from `seed` (init_weights). On the CPU.
// A config whose weights cannot fit in memory is refused first (common/memory.hpp: weights only
// for a frozen part, `trainable`: weights, gradients and AdamW's moments).
AutoencoderKL make_autoencoder(const Config& c, Part part, const std::string& weights, uint64_t seed,
                               bool trainable = false);

// The ModelState of an AutoencoderKL (held as std::shared_ptr<ModelState>; dynamic_pointer_cast
// to this for the config). Frozen (vae_encode's `params`): requires_grad false everywhere, eval
// mode, forward under NoGradGuard. Trainable (the vae node's `params`, trained by vae_loss):
// every parameter trains and copies (clone(): the EMA) keep each parameter's flag.
// forward(batch): with a decoder part and a "latents" key, decode(latents / scaling_factor);
// otherwise the scaled mean latents of batch["image"] (encoder part).
struct VaeState : ModelState {
  Config config;
  Part part = Part::both;
  bool frozen = true;
  using ModelState::ModelState;
  AutoencoderKLImpl& vae() const;
  std::shared_ptr<ModelState> clone() const override;
};

// frozen: freeze(model) first (no parameter trains, eval mode).
std::shared_ptr<VaeState> make_vae_state(AutoencoderKL model, bool frozen = true);

}  // namespace flowrun::vae
