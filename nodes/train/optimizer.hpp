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
#include "models/model_state.hpp"
#include "parallel/tensor_parallel.hpp"
#include "train/optimizer_shard.hpp"
#include "train/update_rule.hpp"

namespace flowrun {

// The settings every update rule shares; the rule itself (AdamW, SGD, Adafactor, a plugin's)
// is a component of its own (train/update_rule.hpp), made from the schema's group of its kind.
struct OptimConfig {
  std::shared_ptr<const UpdateRule> rule = make_update_rule("adamw");
  double weight_decay = 0.0;   // decoupled (p -= lr * wd * p), only where decays(p)
  double clip = 0.0;           // max global grad norm; 0 = off
  // A non-finite grad norm (NaN or inf, e.g. from a diverged loss) either stops the run with
  // the step (false) or skips this update, leaving parameters and moments untouched (true).
  bool skip_nonfinite = false;
  // Leave the stop to the caller: a non-finite step is skipped (as with skip_nonfinite) and
  // counted in OptimizerState::nonfinite, and optimizer_update never throws NonFiniteGrads; the
  // caller reads the count when it logs (the optimizer node on a GPU, so that no step waits
  // for the host: where the rule updates on the device (UpdateRule::on_device, torch's fused
  // AdamW), the skip happens there, the flag being its found_inf; other paths read the flag on
  // the host).
  bool defer_nonfinite = false;
};

// Thrown by optimizer_update when the grads are not finite and skip_nonfinite is off.
struct NonFiniteGrads : std::runtime_error {
  using std::runtime_error::runtime_error;
};

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
// trainable parameter (in module order) its moments, named by the rule, and update count. The
// moments shaped like the parameters (UpdateRule::moments) are made on the first update, zeroed,
// in flat buffers laid out like the parameters (common/flat_buffers.hpp; one buffer per dtype
// and device for each moment); a slot's tensors are views into them, shaped like its parameter.
struct OptimizerState {
  struct Slot {
    std::string name;                // the parameter's name in the model
    std::vector<torch::Tensor> m;    // the rule's moments(), then its own_moments() of this parameter
    std::vector<std::string> names;  // theirs ("exp_avg", ...), aligned with m
    int64_t step = 0;                // updates applied to this parameter (bias correction)
    // Weight decay: -1: as decays() says of the parameter given; 0 / 1: as set (a sharded
    // update's piece of a parameter, a 1-D view, decays as its whole parameter does).
    int decay = -1;
    bool decays(const torch::Tensor& p) const { return decay >= 0 ? decay != 0 : flowrun::decays(p); }
    // The moment of that name (undefined if the rule keeps none).
    torch::Tensor moment(const std::string& name) const;
  };
  std::shared_ptr<const UpdateRule> rule;  // the rule the slots were made for
  std::vector<Slot> slots;
  FlatLayout layout;  // of the parameters (and so of the moments' buffers)
  std::vector<std::vector<torch::Tensor>> flat;  // per rule->moments() entry: its buffers
  int64_t updates = 0;  // optimizer steps taken
  // Updates skipped for non-finite grads (a 0-d float32 count on the grads' device; undefined
  // while there was none on the host's count). Read it where a message needs it.
  torch::Tensor nonfinite;
  // The on-device path's step (0-d float32 on the device, shared by every slot): it does not
  // advance when the device skips an update. Undefined elsewhere; tensors() reports it as each
  // slot's step.
  torch::Tensor fused_step;
  // Sharded over the ranks (train/optimizer_shard.hpp; world 1: not): the slots are this rank's
  // pieces of the parameters (what a checkpoint writes), and tensors() lists what
  // collect_sharded_state() gathered (an exports: true checkpoint's collect).
  ShardPlan shard;
  std::map<std::string, torch::Tensor> gathered;
  // The model's tensor-parallel layout (ModelState::tp): the moments are split as their
  // parameters, a rule's own ones as it says (split_of); a checkpoint writes each rank's parts,
  // placed in the whole tensors, and a load reads them back (an exports: true checkpoint's collect
  // gathers them whole into `gathered`).
  std::shared_ptr<const parallel::TpLayout> tp;
  // Under tp, each split trainable parameter as a part of its whole (set by expect()): what a
  // rule that is not element-wise shapes its own moments by and sums over (UpdateRule::Part).
  std::map<std::string, UpdateRule::Part> parts;
  // Pipeline parallel: the moments of this stage's parameters only; a checkpoint writes them from
  // this stage's ranks, and a load reads this stage's names (expected) out of the whole state.
  bool staged = false;
  std::map<std::string, torch::Tensor> pending;  // load()ed before the first update

  // Every tensor by name, for checkpoints: "NAME.MOMENT" for each of the rule's moments (AdamW:
  // exp_avg, exp_avg_sq; SGD: momentum_buffer; Adafactor: v_row and v_col, or v, and exp_avg for
  // its momentum), "NAME.step" (0-d int64), and "updates" (0-d int64). Aliases.
  std::map<std::string, torch::Tensor> tensors() const;
  // A tensor of tensors() split over tp, by its name: a moment as its parameter, a rule's own
  // moment as the rule says (UpdateRule::own_moment_dim); none without tp.
  parallel::TpSplit split_of(const std::string& name) const;
  // The rule's own moments of parameter `param` (this rank's `shape`): under tp shaped by the
  // whole parameter and cut as the rule says.
  std::vector<std::pair<std::string, std::vector<int64_t>>> own_moments(const UpdateRule& rule, const std::string& param,
                                                                        c10::IntArrayRef shape) const;
  // Restore from tensors(); before the first update it is kept and applied then. Checked first
  // against expect()'s list when there is one: a tensor missing, one it does not list, one of
  // another shape (a transposed moment) or holding NaN/inf is refused, naming the tensor, and
  // nothing is loaded.
  void load(const std::map<std::string, torch::Tensor>& t);
  // What tensors() of a state for these parameters (named, trainable) under `rule` lists: set
  // by the optimizer node at setup, so that a damaged checkpoint is refused where it is read
  // (under tp, after `tp`: it sets `parts`).
  void expect(const std::vector<std::pair<std::string, torch::Tensor>>& params, const UpdateRule& rule);
  std::map<std::string, std::vector<int64_t>> expected;  // tensor name -> shape; empty: unchecked
};

// One optimizer step on `params` (the model's trainable parameters, named, in module order)
// with `grads` (aligned with them; undefined entries are skipped) at learning rate lr; runs
// under NoGradGuard. Returns the global L2 norm of the grads before clipping (0-d float32).
// Clipping scales the grads used for the update by min(1, clip / (norm + 1e-6)) without
// modifying the grad tensors (other readers may hold them).
//
// How it runs: the rule's update_many() first where it has one (AdamW on a GPU: torch's fused
// multi-tensor kernel, the grads then coming back scaled by the clip factor; AdamW and SGD on
// the CPU, fp32: one pass over all parameters, a fused kernel per element), then its update()
// per parameter for the rest (bf16, old GPUs, CPUs without AVX2, rules without a fast path).
// Non-finite grads: see OptimConfig::skip_nonfinite and defer_nonfinite.
// `norm_of_all`, when defined: the global norm to report and clip by (a sharded update passes
// this rank's pieces, and the norm of all the gradients, the same on every rank).
torch::Tensor optimizer_update(OptimizerState& state, const ModelState::Named& params, const Grads& grads,
                               const OptimConfig& cfg, double lr, const torch::Tensor& norm_of_all = {});

// ZeRO stage 1 (train/optimizer_shard.hpp). make_shard_slots: the state's slots for this rank's
// pieces of `params` (the model's trainable parameters, named, module order), moments for its
// slices only, and what a resume left pending, sliced; optimizer_update then runs on the pieces
// (shard_pieces). collect_sharded_state: collective; the whole moments and steps gathered from
// every rank into `gathered`, which tensors() then lists (StateIO::collect, which only a checkpoint
// with exports: true calls; a checkpoint writes the slices themselves); nothing when unsharded.
void make_shard_slots(OptimizerState& state, const ShardPlan& plan, const ModelState::Named& params,
                      const OptimConfig& cfg);
void collect_sharded_state(OptimizerState& state, parallel::Group& group);

// The parameter an optimizer state's tensor belongs to: "h.0.mlp.c_fc.weight.exp_avg" ->
// "h.0.mlp.c_fc.weight" (tensors() names them NAME.MOMENT and NAME.step; "updates" has none).
inline std::string moment_parameter(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(0, dot);
}

// The global L2 norm of the defined tensors (0-d float32; 0 if none). fp32 tensors on a GPU
// take torch's multi-tensor norm (a few launches for all of them, as clip_grad_norm_'s foreach
// path), anything else one reduction per tensor.
torch::Tensor global_norm(const Grads& grads);

// The count of skipped non-finite updates (OptimizerState::nonfinite) as a number: 0 while
// there was none; a host read (a device sync on a GPU).
int64_t nonfinite_count(const OptimizerState& state);

}  // namespace flowrun
