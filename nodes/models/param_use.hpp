// A model's parameters gathered around their use (ZeRO stage 3, the zero node's stage: params;
// train/fully_sharded.hpp): between uses each parameter holds no data, and a node that runs the
// model opens a ParamUse for the time it does (forward_backward for its forward and backward, an
// evaluator or a sampler for their forwards). While it is open on a thread, run_block
// (activation_checkpoint.hpp) asks it for each block's parameters before the block runs, and
// tells it when the block's forward is done:
//
//   std::unique_ptr<ParamUse> use = model.shards->open(group, "forward_backward of step 7");
//   torch::Tensor loss = objective.loss(model, batch);   // each block gathered as it is reached
//   loss.backward();                                      // grad_done(i) as each gradient is final
//                                                         // ~ParamUse: every parameter let go
//
// The parameters that belong to no block (embeddings, final norms, a head) are gathered when it
// opens and kept until it closes.
#pragma once
#include <torch/torch.h>

namespace flowrun {

class ParamUse {
 public:
  virtual ~ParamUse();
  ParamUse(const ParamUse&) = delete;
  ParamUse& operator=(const ParamUse&) = delete;

  // Before `block` runs: its parameters whole. `recompute`: its recompute in backward (the blocks
  // then come in reverse order), else its forward.
  virtual void gather(const torch::nn::Module& block, bool recompute) = 0;
  // After its forward: `kept` when autograd saved its parameters for backward (they stay until
  // its gradients are final: grad_done); else they may go now.
  virtual void after_forward(const torch::nn::Module& block, bool kept) = 0;
  // Backward through `block` is done (a recomputed block's: its recompute's backward returned),
  // its parameters no longer needed this pass.
  virtual void backward_done(const torch::nn::Module& block) = 0;
  // A forward and its backward begin (a micro-batch): every block's gradients to be made again.
  virtual void new_pass() = 0;
  // Backward: trainable parameter `param` (module order) has its gradient of this pass.
  virtual void grad_done(int param) = 0;

  // The one open on this thread (the newest), or null.
  static ParamUse* current();

 protected:
  ParamUse();  // becomes this thread's current one; the destructor restores the previous

 private:
  ParamUse* previous_;
};

}  // namespace flowrun
