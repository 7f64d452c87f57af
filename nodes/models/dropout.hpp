// Dropout for models run by graph nodes: on only inside a TrainingScope, drawing its masks from
// the scope's own generator.
//
// Why not module->train()/eval() and torch::dropout:
// - torch's dropout draws from the global generator, which nodes on other threads share, so a
//   run would not be reproducible; the scope's generator is seeded by the caller
//   (forward_backward: run seed, step, rank, micro-batch), so the masks of a step depend on
//   nothing drawn before — a resumed run draws the same ones.
// - the train/eval flag lives on the module, which is shared state: an evaluator flipping it
//   to eval() while forward_backward reads the same model would be a write under a read
//   access. A thread-local scope makes "training" a property of the call instead: a forward
//   outside any scope (evaluators, samplers, tests) is an eval-mode forward.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <mutex>

#include "common/seed.hpp"

#if FLOWRUN_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace flowrun {


class TrainingScope {
 public:
  explicit TrainingScope(uint64_t seed) : seed_(seed), gen_(make_cpu_generator(seed)), prev_(current_ref()) {
    current_ref() = this;
  }
  ~TrainingScope() { current_ref() = prev_; }
  TrainingScope(const TrainingScope&) = delete;
  TrainingScope& operator=(const TrainingScope&) = delete;

  // Where the current scope's draws stand, to draw the same again later (activation
  // checkpointing recomputes a block during backward, after the scope ended): its seeds and its
  // generators' states.
  struct Snapshot {
    uint64_t seed = 0, rows_seed = 0;
    int64_t first_row = 0;
    torch::Tensor cpu_state, device_state;  // device_state: undefined when nothing was drawn on a GPU
    c10::Device device = c10::Device(c10::kCPU);
  };
  // The current scope's snapshot; false (and `out` untouched) outside a scope.
  static bool snapshot(Snapshot& out) {
    TrainingScope* s = current_ref();
    if (!s) return false;
    out.seed = s->seed_;
    out.rows_seed = s->rows_seed_;
    out.first_row = s->first_row_;
    {
      std::lock_guard<std::mutex> l(s->gen_.mutex());
      out.cpu_state = s->gen_.get_state();
    }
    if (s->device_gen_.defined()) {
      std::lock_guard<std::mutex> l(s->device_gen_.mutex());
      out.device_state = s->device_gen_.get_state();
      out.device = s->device_gen_.device();
    }
    return true;
  }
  // A scope that draws next what the snapshotted one drew next.
  explicit TrainingScope(const Snapshot& from) : TrainingScope(from.seed) {
    rows_seed_ = from.rows_seed;
    first_row_ = from.first_row;
    gen_.set_state(from.cpu_state);
    if (from.device_state.defined()) {
      current_on(from.device);  // makes device_gen_
      device_gen_.set_state(from.device_state);
    }
  }
  // The innermost scope's generator on this thread, or null (eval mode).
  static at::Generator* current() { return current_ref() ? &current_ref()->gen_ : nullptr; }

  // Draws that must not depend on how a step's rows are split among ranks and micro-batches
  // (caption_loss's parallel rows: 2 ranks of B rows must draw what 1 process of 2B draws)
  // come from a seed per global row of the step. forward_backward gives each micro-batch's
  // scope the step's rank-independent seed and the global index of its first row (rank x
  // rows per rank + the rows of the micro-batches before it); a scope made without them uses
  // its own seed and row 0.
  void set_rows(uint64_t step_seed, int64_t first_row) {
    rows_seed_ = step_seed;
    first_row_ = first_row;
  }
  // The seed of local row `row` of the batch the current scope runs, for draws tagged `tag`;
  // throws outside a scope.
  static uint64_t row_seed(int64_t row, uint64_t tag) {
    const TrainingScope* s = current_ref();
    if (!s) throw std::logic_error("TrainingScope::row_seed outside a training scope");
    ++draws();
    return mix_seed({s->rows_seed_, tag, static_cast<uint64_t>(s->first_row_ + row)});
  }
  // The same, for drawing tensors on `device`: the CPU generator for the CPU; for a GPU, a
  // generator there seeded from the scope's seed (made on first use), so masks are drawn
  // where they are used and a step's masks still depend only on the scope's seed.
  static at::Generator* current_on(const torch::Device& device) {
    TrainingScope* s = current_ref();
    if (!s) return nullptr;
    ++draws();
    if (device.is_cpu()) return &s->gen_;
#if FLOWRUN_CUDA
    if (device.is_cuda()) {
      if (!s->device_gen_.defined() || s->device_gen_.device() != device) {
        s->device_gen_ = at::cuda::detail::createCUDAGenerator(device.index());
        s->device_gen_.set_current_seed(mix_seed({s->seed_, static_cast<uint64_t>(device.index()) + 1}));
      }
      return &s->device_gen_;
    }
#endif
    throw std::runtime_error("dropout and other training-time draws on " + device.str() +
                             " need a CUDA build of flowrun (FLOWRUN_CUDA)");
  }

  // How many times this thread was handed something to draw with (current_on, row_seed), in
  // any scope: forward_backward's run.cuda_graph refuses a captured step that drew, since a
  // replay would draw the same numbers every step.
  static uint64_t& draws() {
    static thread_local uint64_t n = 0;
    return n;
  }

 private:
  static TrainingScope*& current_ref() {
    static thread_local TrainingScope* s = nullptr;
    return s;
  }
  uint64_t seed_;
  uint64_t rows_seed_ = seed_;
  int64_t first_row_ = 0;
  at::Generator gen_;
  at::Generator device_gen_;  // undefined until a draw on a GPU
  TrainingScope* prev_;
};

// x with each element zeroed with probability p and the rest scaled by 1/(1-p), inside a
// TrainingScope; x itself otherwise (or when p == 0). The mask is drawn on x's device from the
// scope's generator for it (TrainingScope::current_on).
inline torch::Tensor dropout(const torch::Tensor& x, double p) {
  if (p <= 0.0 || TrainingScope::current() == nullptr) return x;
  at::Generator* g = TrainingScope::current_on(x.device());
  torch::Tensor mask;
  {
    torch::NoGradGuard no_grad;
    mask = torch::empty_like(x).bernoulli_(1.0 - p, *g).div_(1.0 - p);
  }
  return x * mask;
}

// Dropout of this rank's part of a tensor that tensor parallel splits (x: the part of the tensor
// of sizes `whole`, starting at `first` along `dim`): the mask is drawn for the whole tensor and
// cut, so a split model draws the masks, and every draw after them, of the unsplit one (the
// result does not depend on tp; each rank draws the whole mask, as a tp 1 rank does).
inline torch::Tensor dropout_of_part(const torch::Tensor& x, double p, at::IntArrayRef whole, int64_t dim, int64_t first) {
  if (p <= 0.0 || TrainingScope::current() == nullptr) return x;
  at::Generator* g = TrainingScope::current_on(x.device());
  torch::Tensor mask;
  {
    torch::NoGradGuard no_grad;
    mask = torch::empty(whole, x.options()).bernoulli_(1.0 - p, *g).div_(1.0 - p).narrow(dim, first, x.size(dim));
  }
  return x * mask;
}

}  // namespace flowrun
