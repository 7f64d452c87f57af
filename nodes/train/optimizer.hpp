// The computation behind the optimizer node, usable on its own (tests, benches), and the
// object behind its `state` port.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/flat_buffers.hpp"
#include "common/grads.hpp"
#include "train/optimizer_shard.hpp"
#include "models/model_state.hpp"

namespace flowrun {

// The update rule (the schema's `kind`), parsed once at setup.
enum class OptimKind { adamw, sgd, adafactor };
OptimKind optim_kind(const std::string& name);  // "adamw" | "sgd" | "adafactor"; throws for others

// Adafactor (Shazeer & Stern 2018) as big_vision's scale_by_adafactor (the CapPa and ViT-g
// trainers), per parameter p with gradient g (after global-norm clipping), step t = 1, 2, ...:
//   beta2_t = min(beta2_cap, 1 - t^-decay_rate)
//   r = g^2 + eps
//   factored (p has 2+ dims and its second-largest dim >= min_dim_size_to_factor; a = the
//   largest dim, b = the second largest):
//     v_row = beta2_t v_row + (1 - beta2_t) mean_a(r)        (the shape of p without dim a)
//     v_col = beta2_t v_col + (1 - beta2_t) mean_b(r)        (the shape of p without dim b)
//     u = g / sqrt(v_row / mean_b(v_row))  [broadcast over a]  / sqrt(v_col)  [over b]
//   else:
//     v = beta2_t v + (1 - beta2_t) r;   u = g / sqrt(v)
//   update clipping (clipping_threshold d > 0): u = u / max(1, rms(u) / d)
//   momentum m (> 0): m = momentum m + (1 - momentum) u; u = m   (an EMA, not debiased)
//   p = p (1 - lr wd) - lr u            (decay only where decays(p), as AdamW here)
// No relative step size: lr comes from the schedule, like every other kind.
struct AdafactorConfig {
  double decay_rate = 0.8, beta2_cap = 0.999, eps = 1e-30;
  int64_t min_dim_size_to_factor = 32;
  double clipping_threshold = 0.0;  // 0 = off (big_vision's CapPa config)
  double momentum = 0.9;            // 0 = none
};

struct OptimConfig {
  OptimKind kind = OptimKind::adamw;
  double momentum = 0.9;       // sgd; 0 = plain SGD
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adamw
  double weight_decay = 0.0;   // decoupled (p -= lr * wd * p), only where decays(p)
  double clip = 0.0;           // max global grad norm; 0 = off
  // A non-finite grad norm (NaN or inf, e.g. from a diverged loss) either stops the run with
  // the step (false) or skips this update, leaving parameters and moments untouched (true).
  bool skip_nonfinite = false;
  // Leave the stop to the caller: a non-finite step is skipped (as with skip_nonfinite) and
  // counted in OptimizerState::nonfinite, and optimizer_update never throws NonFiniteGrads; the
  // caller reads the count when it logs (the optimizer node on a GPU, so that no step waits
  // for the host: where torch's fused AdamW applies, the skip happens on the device, the flag
  // being its found_inf; other paths read the flag on the host).
  bool defer_nonfinite = false;
  AdafactorConfig adafactor;   // kind adafactor
};

// Thrown by optimizer_update when the grads are not finite and skip_nonfinite is off.
struct NonFiniteGrads : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Weight decay applies to matrices and higher (Linear/conv weights, embeddings), never to
// biases, norm gains or other 1-D / 0-D parameters (the GPT-2 / nanoGPT rule).
inline bool decays(const torch::Tensor& p) { return p.dim() >= 2; }

// Learning rate schedule: linear warmup over `warmup` steps (step/warmup * lr), then constant,
// cosine or linear decay from lr to min_lr at the run's last step.
enum class LrDecay { constant, cosine, linear };
LrDecay lr_decay(const std::string& name);  // the schema's `schedule`; throws for others

struct LrSchedule {
  double lr = 1e-3;
  int64_t warmup = 0;
  LrDecay kind = LrDecay::constant;
  double min_lr = 0.0;
  double at(int64_t step, int64_t last_step) const;
};

// The object behind the optimizer's `state` port (std::shared_ptr<OptimizerState>): per
// trainable parameter (in module order) its moments and update count. The moments are made on
// the first update, zeroed, in flat buffers laid out like the parameters (common/flat_buffers.hpp;
// one buffer per dtype and device for each kind of moment); a slot's tensors are views into them,
// shaped like its parameter.
struct OptimizerState {
  struct Slot {
    std::string name;          // the parameter's name in the model
    torch::Tensor exp_avg;     // adamw: first moment
    torch::Tensor exp_avg_sq;  // adamw: second moment
    torch::Tensor momentum;    // sgd: momentum buffer
    torch::Tensor v_row, v_col, v;  // adafactor: factored second moments, or the full one
    int64_t step = 0;          // updates applied to this parameter (bias correction)
    // Weight decay: -1: as decays() says of the parameter given; 0 / 1: as set (a sharded
    // update's piece of a parameter, a 1-D view, decays as its whole parameter does).
    int decay = -1;
  };
  std::vector<Slot> slots;
  FlatLayout layout;  // of the parameters (and so of the moments' buffers)
  std::vector<torch::Tensor> flat_exp_avg, flat_exp_avg_sq, flat_momentum;
  int64_t updates = 0;  // optimizer steps taken
  // Updates skipped for non-finite grads (a 0-d float32 count on the grads' device; undefined
  // while there was none on the host's count). Read it where a message needs it.
  torch::Tensor nonfinite;
  // The fused GPU path's step (0-d float32 on the device, shared by every slot): it does not
  // advance when the device skips an update. Undefined elsewhere; tensors() reports it as each
  // slot's step.
  torch::Tensor fused_step;
  // Sharded over the ranks (train/optimizer_shard.hpp; world 1: not): the slots are this rank's
  // pieces of the parameters, and tensors() lists what collect_sharded_state() gathered.
  ShardPlan shard;
  std::map<std::string, torch::Tensor> gathered;
  int64_t factor_min_dim = -1;  // sharded Adafactor: its min_dim_size_to_factor (the statistics' shapes)
  std::map<std::string, torch::Tensor> pending;  // load()ed before the first update

  // Every tensor by name, for checkpoints: "NAME.exp_avg", "NAME.exp_avg_sq",
  // "NAME.momentum_buffer", "NAME.v_row", "NAME.v_col", "NAME.v", "NAME.step" (0-d int64),
  // and "updates" (0-d int64). Aliases. (Adafactor's momentum is NAME.exp_avg.)
  std::map<std::string, torch::Tensor> tensors() const;
  // Restore from tensors(); before the first update it is kept and applied then.
  void load(const std::map<std::string, torch::Tensor>& t);
};

// One optimizer step on `params` (the model's trainable parameters, named, in module order)
// with `grads` (aligned with them; undefined entries are skipped) at learning rate lr; runs
// under NoGradGuard. Returns the global L2 norm of the grads before clipping (0-d float32).
// Clipping scales the grads used for the update by min(1, clip / (norm + 1e-6)) without
// modifying the grad tensors (other readers may hold them).
//
// How it runs: on a GPU, torch's fused multi-tensor AdamW where it applies (the grads then come
// back scaled by the clip factor: the kernel stores what it used); on the CPU, fp32
// parameters take one pass over all of them (every tensor's elements as one range split among
// the OpenMP threads, a fused kernel per element: read p, g, moments once, write them once);
// anything else (bf16, old GPUs, CPUs without AVX2) the written-out tensor operations.
// Non-finite grads: see OptimConfig::skip_nonfinite and defer_nonfinite.
// `norm_of_all`, when defined: the global norm to report and clip by (a sharded update passes
// this rank's pieces, and the norm of all the gradients, the same on every rank).
torch::Tensor optimizer_update(OptimizerState& state, const ModelState::Named& params, const Grads& grads,
                               const OptimConfig& cfg, double lr, const torch::Tensor& norm_of_all = {});

// ZeRO stage 1 (train/optimizer_shard.hpp). make_shard_slots: the state's slots for this rank's
// pieces of `params` (the model's trainable parameters, named, module order), moments for its
// slices only, and what a resume left pending, sliced; optimizer_update then runs on the pieces
// (shard_pieces). collect_sharded_state: collective; the whole moments and steps gathered from
// every rank into `gathered`, which tensors() then lists (a checkpoint); nothing when unsharded.
void make_shard_slots(OptimizerState& state, const ShardPlan& plan, const ModelState::Named& params,
                      const OptimConfig& cfg);
void collect_sharded_state(OptimizerState& state, comm::Channel& channel);

// Adafactor's factored dims of a shape: {a, b} = the largest and the second-largest dim (the
// later one first among equals, as numpy's argsort), or {-1, -1} when p is not factored.
std::pair<int64_t, int64_t> adafactor_factored_dims(c10::IntArrayRef shape, int64_t min_dim_size_to_factor);

// The global L2 norm of the defined tensors (0-d float32; 0 if none). fp32 tensors on a GPU
// take torch's multi-tensor norm (a few launches for all of them, as clip_grad_norm_'s foreach
// path), anything else one reduction per tensor.
torch::Tensor global_norm(const Grads& grads);

// The count of skipped non-finite updates (OptimizerState::nonfinite) as a number: 0 while
// there was none; a host read (a device sync on a GPU).
int64_t nonfinite_count(const OptimizerState& state);

}  // namespace flowrun
