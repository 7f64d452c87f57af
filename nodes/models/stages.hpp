// Pipeline parallel's view of a model (run.parallel.pp > 1; docs/parallel.md "Pipeline parallel"):
// the model's blocks cut into chunks (parallel/pipeline_schedule.hpp), each rank building and
// holding only its chunks' blocks, the embedding with chunk 0 and the head with the last. Set by a
// family that cuts (its declaration: models/family.hpp) on ModelState::stages.
//
// A staged model's forward (the family calls staged_forward) runs one of two ways:
//  - inside a schedule (train/pipeline.cpp): forward_backward opens a StageCall around the
//    objective's loss for one chunk and micro-batch, on every stage, so that whatever the objective
//    makes of the batch before the model (diffusion's noised latents and timesteps, drawn alike on
//    every stage) is the model's input on the first. The forward runs that chunk from the previous
//    chunk's outputs; the last chunk's output goes back to the objective, which scores it; a chunk
//    before the last keeps its outputs in the call and ends the objective there (StageCall::Done).
//  - outside one (an evaluator's batch, a sampler's denoising step): the node opens a
//    StageChannel over its pp ranks around its work, and each forward runs this rank's chunks in
//    order, from the previous stage's outputs to the next's, the last stage's output reaching
//    every stage (so each computes what comes next alike).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>

#include "common/tensor_map.hpp"

namespace flowrun {

namespace parallel {
class Group;
}

struct Stages {
  int stages = 1;                           // run.parallel.pp
  std::vector<std::pair<int, int>> blocks;  // per chunk: its blocks [first, last); chunk k on pp rank k % stages
  std::vector<int> mine;                    // the chunks this rank holds, in order
  // Parameters this rank holds as a copy of another chunk's (GPT's tied token table on the last
  // chunk, beside the first chunk's), on both ranks: their gradients are summed every step (so
  // both update alike), and the gradient norm counts the first stage's only.
  std::vector<std::string> tied;

  int chunks() const { return static_cast<int>(blocks.size()); }
  // Throws (naming `model`) unless the chunks cover blocks 0 .. `count` - 1 in order and this
  // rank's are among them.
  void check(int64_t count, const std::string& model) const;
  bool holds(int chunk) const;
  bool holds_block(int block) const;
  bool first() const { return holds(0); }
  bool last() const { return holds(chunks() - 1); }
};

// One chunk's forward inside a schedule. Thread-local (forward runs on the calling thread).
class StageCall {
 public:
  StageCall(int chunk, const TensorMap& in);
  ~StageCall();
  StageCall(const StageCall&) = delete;
  StageCall& operator=(const StageCall&) = delete;
  static StageCall* current();
  struct Done {};  // thrown by a chunk before the last, its outputs in `out`
  const int chunk;
  const TensorMap& in;
  TensorMap out;

 private:
  StageCall* previous_;
};

// A node's channel over its pp ranks for forwards outside a schedule. Thread-local; nests.
class StageChannel {
 public:
  explicit StageChannel(parallel::Group* group);
  ~StageChannel();
  StageChannel(const StageChannel&) = delete;
  StageChannel& operator=(const StageChannel&) = delete;
  static parallel::Group* current();

 private:
  parallel::Group* previous_;
};

// A staged model's forward (above): `chunk(k, in)` runs chunk k from chunk k - 1's outputs (empty
// for chunk 0) and returns chunk k + 1's inputs, or for the last chunk {"output": the model's
// output}. Tensors from other stages arrive on `device`.
torch::Tensor staged_forward(const Stages& stages, const c10::Device& device,
                             const std::function<TensorMap(int k, const TensorMap& in)>& chunk);

}  // namespace flowrun
