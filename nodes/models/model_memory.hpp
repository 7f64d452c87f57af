// ModelMemory: what a model's training holds in memory beyond its parameters, one part of its
// ModelState (models/model_state.hpp), for forward_backward's estimate before its first step
// (train/step_memory.hpp; common/memory.hpp's TrainingMemory) and its refusal of a step that
// cannot fit.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "common/memory.hpp"
#include "common/tensor_map.hpp"
#include "models/activation_checkpoint.hpp"

namespace flowrun {

struct ModelMemory {
  // Set by a model that can tell (gpt, dit, cappa, a trained vae): what backward keeps of
  // `micro_batch`'s activations at `bytes` per element, without recomputing (plain) and
  // recomputing blocks as `policy` says (checkpointed). Unset: not estimated.
  std::function<ActivationEstimate(const TensorMap& micro_batch, int64_t bytes, const CheckpointPolicy& policy)>
      activations;
  // The model's own activation checkpointing policy (its `checkpoint` parameter).
  CheckpointPolicy checkpoint;
  // What other nodes keep per rank for this model (an optimizer's state, an EMA's copy), noted
  // in their setup, which runs in file order before any step. A copy (clone()) starts without.
  std::vector<MemoryItem> kept;
};

}  // namespace flowrun
