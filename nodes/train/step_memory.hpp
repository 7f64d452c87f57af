// forward_backward's memory model (schemas/forward_backward.yaml `memory_check`): a training
// step's memory per rank, estimated before its first step, checked against what the device has,
// with the settings that would reduce it. Its parts, per rank:
//   - weights: the model's parameters (ZeRO-3: this rank's slice and what a step gathers, the
//     cost model's rule: zero3_gathered_bytes);
//   - gradients: as the grad layout and the ZeRO stage hold them (autograd's, the all-reduce's
//     buffers, ZeRO stage gradients' 1/dp);
//   - what other nodes keep per parameter (ModelState::kept: the optimizer's moments, an EMA);
//   - the activations of one micro-batch under the model's checkpointing (the model's own
//     estimate: Korthikanti et al., models/activation_checkpoint.hpp), and under a pipeline the
//     share of them this stage's schedule holds at once.
// The settings offered, each alone with the total it gives: checkpointing every block, the
// nodes' own fixes (MemoryItem::fix), more accumulation, more tensor parallel ranks (as far as
// the model's sizes divide: parallel::tp_divides), ZeRO stage params. One memory model with the
// cost model's (parallel/cost_model.hpp: zero3_gathered, activations_held), so that the advice
// and `flowrun plan` agree. Tests: tests/nodes/forward_backward_test.cpp (memory cases).
#pragma once
#include <string>
#include <vector>

#include "common/tensor_map.hpp"
#include "models/model_state.hpp"
#include "parallel/mesh.hpp"
#include "train/precision.hpp"

namespace flowrun {

struct GraphSpec;
struct PipelineRun;
struct StepProfile;
struct ZeroPlan;

// What forward_backward's settings and layout make of a step.
struct StepMemorySetup {
  std::string who, node, model_node;  // "node 'fb' (forward_backward)", "fb", the model node's name
  int rank = 0, world = 1;
  const GraphSpec* graph = nullptr;
  parallel::Replica dp;                 // ZeRO shards over the replicas
  const ZeroPlan* zero = nullptr;       // the zero node's plan, if connected
  std::vector<std::string> zero_refs;   // its ref as written ("zero.plan"), if connected
  bool fresh = true;                    // grad_layout fresh: autograd's own gradient tensors
  int grad_buffers = 2;                 // the all-reduce's gradient buffers (the node's pool)
  int64_t accumulate = 1;
  Precision precision = Precision::fp32;
  const PipelineRun* pipeline = nullptr;  // run.parallel.pp > 1: this stage's
};

struct StepMemoryCheck {
  std::string advice;  // the estimate and the settings that reduce it (named again when a step runs out)
  std::string over;    // not empty: the step needs more than is available, and by how much
};

// The estimate for `model` and the step's `batch`, logged on rank 0. `profile` (flowrun plan's,
// forward_backward's `profile` state) is filled when given.
StepMemoryCheck check_step_memory(const StepMemorySetup& setup, const ModelState& model, const TensorMap& batch,
                                  StepProfile* profile);

}  // namespace flowrun
