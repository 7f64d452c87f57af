// The computation behind the evaluator node, usable on its own (tests, benches).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "data/dataset.hpp"
#include "models/model_state.hpp"
#include "node.hpp"
#include "common/tensor_map.hpp"
#include "train/objective.hpp"
#include "train/precision.hpp"

namespace flowrun {

struct EvalOptions {
  std::string split = "val";
  int64_t batches = 50;  // the first N batches of this rank's shard of the split (all, if fewer)
  int64_t batch = 16;    // rows per batch (per rank)
  int rank = 0, world = 1;
  Precision precision = Precision::fp32;
  // Set: merged into each batch (merge_batches) before the objective runs, e.g. the frozen
  // text encoder's embeddings of the batch's captions (the evaluator node's tokenizer and
  // encoder inputs). Gets the batch index and the batch.
  std::function<TensorMap(int64_t index, const TensorMap& batch)> cond;
};

// What this rank scored. The sums are what ranks add up for the global mean:
// sum(loss_sum) / sum(targets) (the evaluator node all-reduces them).
struct EvalResult {
  double loss = 0;      // loss_sum / targets: mean over all targets of the batches read (token-weighted for lm)
  double loss_sum = 0;  // sum over the batches of (the batch's mean loss * its targets)
  int64_t batches = 0;  // batches read
  int64_t targets = 0;  // targets scored (tokens for lm, rows for mse)
  double seconds = 0;
};

// The objective's mean loss over fixed batches of this rank's shard (options.rank/world), under
// NoGradGuard and in eval mode (outside any TrainingScope: no dropout). Only reads the model.
// Throws when the shard holds no batch.
EvalResult evaluate(ModelState& model, const Dataset& data, const Objective& objective, const EvalOptions& options);

// The held-out pass a node reads, from its `split`, `batches` and `batch` parameters and the run's
// rank and world: what every evaluating node (evaluator, caption_evaluator, vae_recon) states
// the same way.
EvalOptions eval_options(const SetupContext& ctx);

// At setup (on every rank, before any collective): the dataset has options.split and this
// rank's shard of it holds at least one batch; otherwise an error that names `who`, the splits
// there are, and what to change.
void check_eval_split(const Dataset& data, const EvalOptions& options, const std::string& who);

}  // namespace flowrun
