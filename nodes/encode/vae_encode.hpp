// vae_encode node: images -> latents with a frozen diffusers AutoencoderKL encoder
// (models/vae/vae.hpp). Schema: schemas/vae_encode.yaml. Test: tests/nodes/vae_encode_test.cpp.
//
// Like the text encoders (bert_encode, t5_encode), the encoder never trains (requires_grad false, eval mode) and runs under
// torch::NoGradGuard (not InferenceMode: the latents feed a trainable model). The latent-sampling
// noise of a row is drawn from its own generator, seeded by (seed, step, global row index), so a
// resumed run, any prefetch order and any number of ranks (rank r holds global rows
// [r*B, (r+1)*B)) give the same latents.
#pragma once
#include <torch/torch.h>
#include <yaml-cpp/yaml.h>

#include <cstdint>

#include "models/vae/vae.hpp"
#include "node.hpp"

namespace flowrun {

struct VaeEncodeOptions {
  bool sample = true;     // false: the posterior mean
  uint64_t seed = 0;      // the node's seed (or run.seed)
  int64_t step = 1;       // the training step
  int64_t first_row = 0;  // global index of the first row (replica * rows per replica)
};

// Seed of the sampling noise of global row `row` at `step`.
uint64_t vae_latent_seed(uint64_t seed, int64_t step, int64_t row);

// images [B, in_channels, H, W] in [-1, 1] (H, W multiples of the downsampling factor) ->
// float32 latents [B, latent_channels, H/f, W/f] = (sample or mean) * scaling_factor, on the
// VAE's device, under NoGradGuard. The images are cast to the VAE's dtype and device. `vae`: an
// autoencoder's state with an encoder (ModelState::autoencoder).
torch::Tensor encode_latents(ModelState& vae, const torch::Tensor& images, const VaeEncodeOptions& o);

}  // namespace flowrun
