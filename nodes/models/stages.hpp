// Pipeline parallel's view of a model (run.parallel.pp > 1; docs/parallel.md "Pipeline parallel"):
// the model's blocks cut into chunks (parallel/pipeline_schedule.hpp), each rank building and
// holding only its chunks' blocks, the embedding with chunk 0 and the head with the last. Set by a
// family that cuts (gpt) on ModelState::stages; forward_backward's pipeline path
// (train/pipeline.hpp) runs the chunks as the schedule says.
//
// A chunk's forward takes the micro-batch and the previous chunk's outputs and gives the next
// chunk's inputs; the last chunk's runs inside the objective (its loss reads model.forward(batch)),
// so the pipeline path opens a StageCall around it and the model's forward, seeing one, runs that
// chunk from the call's inputs instead of the whole model.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/tensor_map.hpp"

namespace flowrun {

struct ModelState;

struct Stages {
  int stages = 1;                           // run.parallel.pp
  std::vector<std::pair<int, int>> blocks;  // per chunk: its blocks [first, last); chunk k on pp rank k % stages
  std::vector<int> mine;                    // the chunks this rank holds, in order
  // Parameters this rank holds as a copy of another chunk's (GPT's tied token table on the last
  // chunk, beside the first chunk's): their gradients are summed with the owner's every step (so
  // both update alike), and the gradient norm counts the owner's only.
  std::vector<std::string> tied;
  // Chunk k's forward: from the micro-batch and chunk k - 1's outputs (empty for chunk 0) to chunk
  // k + 1's inputs.
  std::function<TensorMap(ModelState& self, int k, const TensorMap& batch, const TensorMap& in)> forward;

  int chunks() const { return static_cast<int>(blocks.size()); }
  bool holds(int chunk) const;
  bool first() const { return holds(0); }
  bool last() const { return holds(chunks() - 1); }
};

// Around the last chunk's forward inside an objective: the model's forward runs chunk `chunk`
// from `in`. Thread-local (forward runs on the calling thread); nests.
class StageCall {
 public:
  StageCall(int chunk, const TensorMap& in);
  ~StageCall();
  StageCall(const StageCall&) = delete;
  StageCall& operator=(const StageCall&) = delete;
  static const StageCall* current();
  int chunk;
  const TensorMap& in;

 private:
  const StageCall* previous_;
};

}  // namespace flowrun
