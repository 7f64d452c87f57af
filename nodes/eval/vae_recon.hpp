// The computation behind the vae_recon node, usable on its own (tests).
#pragma once
#include <torch/torch.h>

#include "models/model_state.hpp"

namespace flowrun {

// What a reconstruction pass adds up (summed over ranks as they are): pixel errors in the
// images' [-1, 1] units and the posterior means' moments.
struct ReconSums {
  double abs = 0, sq = 0, pixels = 0;      // sum |x - x'|, sum (x - x')^2, pixel values counted
  double z = 0, z2 = 0, latents = 0;       // sum, sum of squares and count of the mean latents' elements
  // Mean absolute error per pixel value (0 = exact; the images span 2).
  double l1() const { return abs / pixels; }
  // PSNR in dB with the peak-to-peak range 2 of [-1, 1]: 10 log10(2^2 / mse), the PSNR of the
  // images in [0, 1].
  double psnr() const;
  // Standard deviation of the unscaled mean latents; a latent diffusion model's scaling_factor
  // is usually 1 / this (SD's 0.18215 came from it).
  double latent_std() const;
};

// images [B, C, H, W] in [-1, 1] -> their reconstructions decode(mean of encode(x)) as float32
// on the images' device (deterministic: the posterior mean), under NoGradGuard; adds the pass's
// errors and latent moments to `sums`. `vae`: an autoencoder's state (ModelState::autoencoder)
// with both parts.
torch::Tensor reconstruct(ModelState& vae, const torch::Tensor& images, ReconSums& sums);

}  // namespace flowrun
