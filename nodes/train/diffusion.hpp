// Denoising diffusion (DDPM training, DDIM sampling) as free functions: the diffusion_loss
// objective (train/diffusion_loss.cpp) and the sampler use the same schedule.
//
// Notation: ab_t = alphas_cumprod[t] = prod_{s<=t} (1 - beta_s), t in [0, T).
//   add_noise:  x_t = sqrt(ab_t) x0 + sqrt(1 - ab_t) eps
//   velocity:   v   = sqrt(ab_t) eps - sqrt(1 - ab_t) x0          (Salimans & Ho; diffusers' get_velocity)
//   ddim_step (eta 0): x0^ and eps^ from the model output, then
//               x_prev = sqrt(ab_prev) x0^ + sqrt(1 - ab_prev) eps^   (t_prev < 0: ab_prev = 1, i.e. x0^)
// Betas: linear = linspace(beta_start, beta_end, T); scaled_linear = linspace(sqrt(beta_start),
// sqrt(beta_end), T)^2 (Stable Diffusion's and HunyuanDiT's; HunyuanDiT uses beta_end 0.03 and
// v-prediction, SD 0.012 and eps). The schedule is kept in float64; results come back in the
// dtype of x.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>

#include "common/tensor_map.hpp"
#include "models/model_state.hpp"

namespace flowrun::diffusion {

enum class Schedule { linear, scaled_linear };
enum class Prediction { eps, v };
Schedule parse_schedule(const std::string& s);      // "linear" | "scaled_linear"
Prediction parse_prediction(const std::string& s);  // "eps" | "v"

struct NoiseSchedule {
  // On `device` (the training loss makes it where its batch is, so that no step copies it there).
  static NoiseSchedule make(Schedule kind, double beta_start, double beta_end, int64_t timesteps,
                            const torch::Device& device = torch::kCPU);
  torch::Tensor betas;           // [T] float64
  torch::Tensor alphas_cumprod;  // [T] float64
  int64_t timesteps() const { return alphas_cumprod.size(0); }
  // ab_t for integer timesteps t (any shape), broadcastable against x [B, ...]: [B, 1, ..., 1]
  // in x's dtype and device; t < 0 gives 1.
  torch::Tensor ab(const torch::Tensor& t, const torch::Tensor& x) const;
};

torch::Tensor add_noise(const NoiseSchedule& s, const torch::Tensor& x0, const torch::Tensor& noise,
                        const torch::Tensor& t);
torch::Tensor velocity(const NoiseSchedule& s, const torch::Tensor& x0, const torch::Tensor& noise,
                       const torch::Tensor& t);
// The training target for a prediction type: eps -> noise, v -> velocity.
torch::Tensor target(const NoiseSchedule& s, Prediction p, const torch::Tensor& x0, const torch::Tensor& noise,
                     const torch::Tensor& t);
// The model's clean-sample estimate x0^ from its output at x_t.
torch::Tensor predict_x0(const NoiseSchedule& s, Prediction p, const torch::Tensor& model_out,
                         const torch::Tensor& x_t, const torch::Tensor& t);
// One deterministic DDIM step from t to t_prev (< t; -1 for the last step). t, t_prev: integer
// [B] or 0-d.
torch::Tensor ddim_step(const NoiseSchedule& s, const torch::Tensor& model_out, const torch::Tensor& t,
                        const torch::Tensor& t_prev, const torch::Tensor& x_t, Prediction p);

struct Options {
  Schedule schedule = Schedule::scaled_linear;
  double beta_start = 0.00085, beta_end = 0.012;
  int64_t timesteps = 1000;
  Prediction prediction = Prediction::eps;
  double noise_offset = 0.0;  // noise += noise_offset * N(0, 1) per (row, channel)
  std::string x_key = "latents";
  // Classifier-free guidance training: P(a row's condition is replaced by null_condition's).
  // cond_drop_t5 unset: one draw per row drops every stream (text_emb/text_mask and
  // t5_emb/t5_mask) together with P = cond_drop. Set: cond_drop is the first stream's
  // (BERT/CLIP: text_emb, text_mask) and cond_drop_t5 the T5 stream's, drawn apart, as the
  // HunyuanDiT trainer's uncond_p and uncond_p_t5.
  double cond_drop = 0.0;
  std::optional<double> cond_drop_t5;
};

// The condition of "no text": text_emb and t5_emb (where present) zeroed, text_mask and t5_mask
// all ones. Training with cond_drop swaps it in for dropped rows; a sampler's unconditional
// branch is exactly this.
TensorMap null_condition(const TensorMap& batch);

// The diffusion training loss: x0 = batch[x_key] [B, C, H, W]; t ~ U{0..T-1} per row, eps ~
// N(0, I) (+ offset); the model sees the batch plus "x" = x_t and "t" = t (int64 [B]) and
// predicts eps or v; the loss is the MSE over all elements (in fp32). Randomness: the current
// TrainingScope's generator (forward_backward seeds it by run seed, step, rank, micro-batch),
// drawn in the order t, noise, offset, then the rows whose condition is dropped (cond_drop:
// the batch's text_emb/text_mask/t5_emb/t5_mask of those rows replaced by null_condition's;
// with cond_drop_t5, the first stream's rows, then the T5 stream's);
// outside a scope (evaluators) a fixed seed and no condition dropped, so the value is
// deterministic.
torch::Tensor loss(ModelState& model, const TensorMap& batch, const Options& options);

}  // namespace flowrun::diffusion
