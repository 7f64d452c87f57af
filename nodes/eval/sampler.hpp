// The computation behind the sampler node, usable on its own (tests, scripts).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "common/tensor_map.hpp"
#include "formats/image_io.hpp"
#include "models/model_state.hpp"
#include "train/diffusion.hpp"

namespace flowrun {

struct SampleOptions {
  diffusion::NoiseSchedule schedule;  // the one the model was trained with
  diffusion::Prediction prediction = diffusion::Prediction::eps;
  int64_t steps = 50;     // DDIM steps
  double guidance = 4.0;  // classifier-free guidance scale; 1 = conditional only (one forward a step)
  torch::Tensor noise;    // x_T [N, C, H, W]
};

// DDIM timesteps, "leading" spacing as diffusers' DDIMScheduler: (steps-1)*r, ..., r, 0 with
// r = train_timesteps / steps.
std::vector<int64_t> ddim_timesteps(int64_t train_timesteps, int64_t steps);

// Denoise o.noise conditioned on `cond` ({"text_emb", "text_mask", ...}, one row per noise
// row) with classifier-free guidance against the null condition (zero states, all-ones masks).
// Returns x_0 [N, C, H, W] on the model's device.
torch::Tensor sample_ddim(ModelState& model, const TensorMap& cond, const SampleOptions& o);

// Samples [N, C, H, W] as an RGB grid of `cols` columns (image_grid): C = 3 maps [-1, 1] to
// [0, 255]; other C (latents) show the first three channels stretched per image.
Image sample_grid(const torch::Tensor& samples, int64_t cols);

// Scaled latents [N, latent, h, w] -> float32 images [N, 3, h*f, w*f] (about [-1, 1]):
// vae.decode(latents / scaling_factor), one image at a time (bounded memory), on the VAE's
// device and dtype, under NoGradGuard. The VAE needs its decoder part.
torch::Tensor decode_latents(ModelState& vae, const torch::Tensor& latents);

}  // namespace flowrun
