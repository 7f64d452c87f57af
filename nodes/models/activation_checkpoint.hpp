// Activation checkpointing: a block's forward run without keeping its activations for backward,
// and run again during backward to get them (as torchtitan, Megatron and big_vision do, per
// block). Memory for the activations of a stack of N blocks drops from N blocks' worth to N
// block inputs plus one block's worth; the price is one more forward of each block.
//
//   torch::Tensor y = checkpointed({x, c}, [&](const std::vector<torch::Tensor>& in) {
//     return block->forward(in[0], in[1]);
//   });
//
// Forward runs `body` with grad off and keeps only its inputs. Backward runs `body` again on
// detached copies of the inputs with grad on, in the state the first run had: the same
// TrainingScope draws (the generator's state is saved and restored, so dropout masks repeat
// exactly) and the same autocast; then it backpropagates the output's gradient through that
// graph (a backward inside the backward, as torch.utils.checkpoint's reentrant variant): the
// block's parameters get their gradients there, through their own accumulators (and the hooks
// on them: forward_backward's `ready` stream), and the inputs' gradients go on. Same results as
// the plain forward: bit for bit on the CPU for a chain of blocks (the GPT); where blocks share
// an input (a DiT's time embedding) its gradient sums their contributions in another order, equal
// to float rounding (tests/nodes/activation_checkpoint_test.cpp).
//
// Outside grad mode (an evaluator, a sampler), or when nothing needs a gradient, it is just
// body(inputs). `body` must compute its output from its inputs and the module's parameters
// only (no state it changes), and must not keep its inputs.
#pragma once
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace flowrun {

using CheckpointBody = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

// `after_backward`, when given, runs once the recompute's backward has returned.
torch::Tensor checkpointed(const std::vector<torch::Tensor>& inputs, CheckpointBody body,
                           std::function<void()> after_backward = nullptr);

// Which blocks a model recomputes: its `checkpoint` parameter (none | blocks | every_N), as
// "recompute block i" for blocks 0, 1, ...: blocks: every one; every_N: blocks 0, N, 2N, ...;
// none: no block. Throws std::invalid_argument naming the value for anything else.
struct CheckpointPolicy {
  int every = 0;  // 0: none
  static CheckpointPolicy parse(const std::string& value);
  bool recompute(int64_t block) const { return every > 0 && block % every == 0; }
  // "none", "blocks", "every_2"
  std::string str() const;
};

// Block `index` of a model under `policy`: body(inputs), recomputed in backward when the policy
// says so for that index (checkpointed), else run plainly. `block` is the block's module: while a
// ParamUse is open on this thread (ZeRO stage 3, param_use.hpp) its parameters are gathered
// before the block runs (and again for its recompute) and let go after its forward when autograd
// kept nothing of them (recomputed, or no grad mode), else once its gradients are final. The one
// place a family says it:
//   x = run_block(cfg.checkpoint, i, *block, {x}, [block](const auto& in) { return block->forward(in[0]); });
torch::Tensor run_block(const CheckpointPolicy& policy, int64_t index, const torch::nn::Module& block,
                        const std::vector<torch::Tensor>& inputs, const CheckpointBody& body);

// Each block's forward and backward times (forward_backward's `time_blocks`, what `flowrun plan`
// profiles): while one is open on a thread, run_block times each block's forward on the host, and
// its backward through gradient hooks on its output (its backward starts) and its first input (it
// ends): wall-clock times, the device synchronised at each mark on a GPU (so that a block's time
// is its kernels', at the cost of the overlap a profile does not need).
//
//   BlockClock clock;                        // this thread's, until it closes
//   forward_backward(model, batch, ...);     // every run_block timed
//   for (const BlockClock::Span& s : clock.spans()) ...   // in the order they ended
class BlockClock {
 public:
  using Time = std::chrono::steady_clock::time_point;
  struct Span {
    const torch::nn::Module* block = nullptr;  // the block run_block ran (blocks_of's order names it)
    bool backward = false;
    Time start, end;
  };
  BlockClock();
  ~BlockClock();
  BlockClock(const BlockClock&) = delete;
  BlockClock& operator=(const BlockClock&) = delete;
  static BlockClock* current();
  std::vector<Span> spans() const;
  // After backward: the blocks whose backward started but whose input took no gradient (the
  // first block over frozen embeddings, as under LoRA: nothing to hook) end now, with backward.
  void end_backward();
  // run_block's: `block` ran forward in [start, end]; hooks that note when its output's gradient
  // arrives (its backward starts) and its input's (it ends).
  void forward(const torch::nn::Module* block, Time start, Time end);
  void hook_backward(const torch::nn::Module* block, const torch::Tensor& input, const torch::Tensor& output);

 private:
  struct Record;  // shared with the gradient hooks, which may outlive the clock
  std::shared_ptr<Record> record_;
  BlockClock* previous_;
};

// A model's blocks, what run_block runs (and ZeRO-3 gathers one at a time): the items of its
// outermost ModuleLists, in module order (CapPa: the encoder's, then the decoder's).
std::vector<const torch::nn::Module*> blocks_of(const torch::nn::Module& model);

// What a block's attention keeps for backward (models/attention.hpp):
enum class AttentionKeeps {
  scores,         // written out: the scores, their softmax and the dropout mask (5 units per score)
  probabilities,  // the CPU's fused self_attention (float32): the softmax alone (2 units per score),
                  // and in one block's backward their fp32 gradient
  logsumexp,      // a GPU's fused attention: one fp32 logsumexp per head and token, no scores
};

// Activation memory estimates (bytes) of a stack of `blocks` transformer blocks, `tokens` rows
// (batch x sequence) of width `dim`, `bytes` per element (4 fp32, 2 bf16), with `heads` heads of
// attention over `seq` positions: what backward keeps, per Korthikanti et al. 2022 (Megatron's
// "Reducing Activation Recomputation"): per block about 34 x tokens x dim (in 2-byte units) plus
// 5 x heads x seq x tokens for the attention scores (as `keeps` says), scaled to `bytes`; with
// checkpointing, each recomputed block keeps only its input (tokens x dim), and one block's
// worth is live while it is recomputed. Under tensor parallel over `tp` ranks (no sequence
// parallel) a rank keeps 10 + 24/tp of the 34 (the norms' and the residual's are whole on every
// rank, the attention's and the MLP's are split) and 1/tp of the scores.
// With them, what a step of those tokens computes (flowrun plan's MFU): the tokens each block
// sees, for its matrix products (6 x parameters x tokens a training step, forward and backward),
// and the attention's own products, 12 x seq x dim a token and block (QK^T and PV forward, twice
// that backward; the causal mask's skipped half counted, as nanoGPT's and PaLM's model FLOPs do).
struct ActivationEstimate {
  double plain = 0, checkpointed = 0;
  double recompute_live = 0;  // of checkpointed: the recomputed block live again during backward
  std::vector<double> block_tokens;  // each block's tokens, in the model's order
  double attention_flops = 0;        // a training step's, forward and backward, this rank's heads
  // Two stacks one after the other (CapPa's encoder, then its decoder).
  ActivationEstimate& then(const ActivationEstimate& next);
};
// What a block keeps a token beside the attention's scores, in units of dim 2-byte values: `whole`
// on every tp rank (norms, residual, the inputs of the column-split layers), `split` over the tp
// ranks. Korthikanti et al.'s GPT block (MLP 4 dim wide, dropout): 10 and 24. A family of another
// shape says its own (llama: block_units).
struct BlockUnits {
  double whole = 10, split = 24;
};
ActivationEstimate estimate_activations(int64_t blocks, int64_t tokens, int64_t dim, int64_t heads, int64_t seq,
                                        int64_t bytes, const CheckpointPolicy& policy,
                                        AttentionKeeps keeps = AttentionKeeps::scores, int64_t tp = 1,
                                        const BlockUnits& units = {});

}  // namespace flowrun
