// The computation behind the evaluator node, usable on its own (tests, benches).
#pragma once
#include <cstdint>
#include <string>

#include "data/dataset.hpp"
#include "models/model_state.hpp"
#include "train/forward_backward.hpp"
#include "train/precision.hpp"

namespace flowrun {

struct EvalOptions {
  std::string split = "val";
  int64_t batches = 50;  // the first N batches of the split's fixed order (all, if it has fewer)
  int64_t batch = 16;    // rows per batch
  int rank = 0, world = 1;
  Precision precision = Precision::fp32;
};

struct EvalResult {
  double loss = 0;      // mean over all targets of the batches read (token-weighted for lm)
  int64_t batches = 0;  // batches read
  int64_t targets = 0;  // targets scored (tokens for lm, rows for mse)
  double seconds = 0;
};

// The objective's mean loss over fixed batches, under NoGradGuard and in eval mode (outside
// any TrainingScope: no dropout). Only reads the model.
EvalResult evaluate(ModelState& model, const Dataset& data, const ObjectiveDef& objective, const EvalOptions& options);

}  // namespace flowrun
