// The built-in objectives (train/objective.hpp), one node type each: mse_loss (mse_loss.cpp),
// lm_loss (lm_loss.cpp), diffusion_loss (diffusion_loss.cpp), caption_loss (caption_loss.cpp),
// vae_loss (vae_loss.cpp). Declared here so that tests and benches can make one without a graph.
#pragma once
#include "common/batch_keys.hpp"
#include "train/diffusion.hpp"
#include "train/objective.hpp"

namespace flowrun {

// Mean squared error between the model's output and the batch's y; targets: rows.
class MseLoss : public Objective {
 public:
  MseLoss() { type = "mse_loss"; }
  explicit MseLoss(SetupContext&) : MseLoss() {}
  std::vector<std::string> needs() const override { return {batch_key::targets}; }
  torch::Tensor loss(ModelState& model, const TensorMap& batch) const override;
  int64_t targets(const TensorMap& batch) const override;
};

// Next-token cross-entropy of a language model: the model maps batch["tokens"] [B, T+1] to
// logits [B, T, vocab] for tokens[:, :-1]; the targets are tokens[:, 1:]; mean over the B*T
// targets. Reports ppl = exp(loss).
class LmLoss : public Objective {
 public:
  LmLoss() { type = "lm_loss"; }
  explicit LmLoss(SetupContext&) : LmLoss() {}
  std::vector<std::string> needs() const override { return {"tokens"}; }
  torch::Tensor loss(ModelState& model, const TensorMap& batch) const override;
  int64_t targets(const TensorMap& batch) const override;
  std::vector<Report> reports() const override;
};

// Denoising diffusion (train/diffusion.hpp: diffusion::loss with these options); targets: rows.
class DiffusionLoss : public Objective, public Denoising {
 public:
  explicit DiffusionLoss(diffusion::Options o);
  explicit DiffusionLoss(SetupContext& ctx);
  std::vector<std::string> needs() const override { return {o_.x_key}; }
  torch::Tensor loss(ModelState& model, const TensorMap& batch) const override;
  int64_t targets(const TensorMap& batch) const override;
  // For samplers: the schedule and prediction the model trains with.
  const Denoising* denoising() const override { return this; }
  const diffusion::NoiseSchedule& noise_schedule() const override { return schedule_; }
  diffusion::Prediction prediction() const override { return o_.prediction; }
  const diffusion::Options& options() const { return o_; }

 private:
  diffusion::Options o_;
  diffusion::NoiseSchedule schedule_;
};

// Captioning (CapPa): teacher-forced cross-entropy over a caption's tokens given the image, with
// parallel prediction on a fraction of the rows. The caption is the batch's input_ids [B, T]
// (attention_mask [B, T]: 1 on tokens, 0 on padding). The targets are the tokens after the
// start token: with start_token unset the caption's first token is the start (WordPiece's
// [CLS]) and the targets are input_ids[:, 1:]; with start_token s every token is a target and s
// is put before them (SentencePiece captions, which have no start token: s = the pad id, as T5
// and big_vision). A target counts where its mask is 1; a caption's loss is the mean over its
// counted targets of
//   (1 - ls) * -log p(y) + ls * mean_k -log p(k)          (label smoothing ls)
// and the batch's the mean over captions (targets() = rows). big_vision divides by the batch's
// token count instead; the mean over captions is what forward_backward's micro-batches and the
// allreduce over ranks (both averaging by rows) reproduce exactly, so N ranks or micro-batches
// train exactly what one process does.
// In training (inside forward_backward's TrainingScope) each row is, with probability
// masked_pred_prob, a parallel-prediction row: its decoder inputs are the targets themselves
// with round-down(masking_ratio * L) positions (chosen at random; all of them with ratio 1)
// replaced by the mask token, and it is decoded without the causal mask; the other rows are
// autoregressive (inputs = start + targets[:-1], causal). Each row draws from a generator of
// its own, seeded by its global row index in the step (TrainingScope::row_seed), so any
// number of ranks and micro-batches draw what one process does: first u ~ U[0, 1) (parallel
// when u < p), then, for ratio < 1, the order of its positions (the first n masked). In an
// evaluator (no scope) every row is autoregressive. The model (models/cappa/cappa.hpp) reads image, decoder_input, decoder_masked,
// parallel.
class CaptionLoss : public Objective, public Captioning {
 public:
  struct Options {
    double masked_pred_prob = 0.75, masking_ratio = 1.0, label_smoothing = 0.0;
    int64_t start_token = -1;  // < 0: the caption's first token is the start token
    std::string image_key = "image";
  };
  explicit CaptionLoss(Options o);
  explicit CaptionLoss(SetupContext& ctx);
  std::vector<std::string> needs() const override { return {o_.image_key, "input_ids"}; }
  torch::Tensor loss(ModelState& model, const TensorMap& batch) const override;
  int64_t targets(const TensorMap& batch) const override;
  std::vector<Report> reports() const override;  // ppl = exp(loss)

  // What one batch becomes: the model's inputs, and the targets with their weights (float [B, L]).
  struct Prepared {
    TensorMap model;  // image, decoder_input [B, L], decoder_masked [B, L], parallel [B]
    torch::Tensor labels, weights;
  };
  // `row_seed(r)`: the seed of local row r's draws (in training: TrainingScope::row_seed);
  // unset: every row autoregressive (evaluation).
  Prepared prepare(const TensorMap& batch, const std::function<uint64_t(int64_t row)>& row_seed) const;
  // For caption evaluators (Captioning):
  const Captioning* captioning() const override { return this; }
  const std::string& image_key() const override { return o_.image_key; }
  // The start token of row b's caption (the evaluator's decoding starts there), int64 [B].
  torch::Tensor start_tokens(const torch::Tensor& input_ids) const override;
  // The targets of a caption and their mask, as prepare() makes them: [B, L] each.
  std::pair<torch::Tensor, torch::Tensor> labels_of(const torch::Tensor& input_ids,
                                                    const torch::Tensor& mask) const override;
  const Options& options() const { return o_; }

 private:
  Options o_;
};

// A KL autoencoder's first-stage objective (latent diffusion's AutoencoderKL, without its
// perceptual and adversarial terms), for a vae node's model. Per batch of images x [B, C, H, W]:
//   (mean, logvar) = encode(x)                       (logvar clamped to [-30, 20])
//   z   = mean + exp(logvar / 2) * eps,  eps ~ N(0, I)   in training with `sample`; mean otherwise
//   rec = mean over b, c, h, w of |x - decode(z)|     (recon l1; mse: squared)
//   kl  = mean over b of 0.5 * sum over latent elements of (mean^2 + exp(logvar) - 1 - logvar)
//   loss = rec + kl_weight * kl / (C * H * W)
// That is LDM's loss (sum of the per-pixel terms over an image + kl_weight * KL, averaged over
// images) divided by the pixels per image, so kl_weight means what it means in LDM and diffusers
// configs (1e-6) while the loss stays per pixel. eps comes from the TrainingScope's generator
// (forward_backward's, seeded per step, rank and micro-batch); in an evaluator (no scope) z is
// the mean, so the loss is deterministic. targets: rows.
class VaeLoss : public Objective {
 public:
  struct Options {
    double kl_weight = 1e-6;
    bool l1 = true;  // false: mse
    bool sample = true;
    std::string image_key = "image";
  };
  explicit VaeLoss(Options o);
  explicit VaeLoss(SetupContext& ctx);
  std::vector<std::string> needs() const override { return {o_.image_key}; }
  torch::Tensor loss(ModelState& model, const TensorMap& batch) const override;
  int64_t targets(const TensorMap& batch) const override;
  const Options& options() const { return o_; }

 private:
  Options o_;
};

}  // namespace flowrun
