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

#include "common/seed.hpp"

namespace flowrun {

// Seed tag for dropout streams (see common/seed.hpp).
enum : uint64_t { kSeedTagDropout = 0x64726f706f7574ull };

class TrainingScope {
 public:
  explicit TrainingScope(uint64_t seed) : gen_(make_cpu_generator(seed)), prev_(current_ref()) { current_ref() = &gen_; }
  ~TrainingScope() { current_ref() = prev_; }
  TrainingScope(const TrainingScope&) = delete;
  TrainingScope& operator=(const TrainingScope&) = delete;
  // The innermost scope's generator on this thread, or null (eval mode).
  static at::Generator* current() { return current_ref(); }

 private:
  static at::Generator*& current_ref() {
    static thread_local at::Generator* g = nullptr;
    return g;
  }
  at::Generator gen_;
  at::Generator* prev_;
};

// x with each element zeroed with probability p and the rest scaled by 1/(1-p), inside a
// TrainingScope; x itself otherwise (or when p == 0). The mask is drawn on the CPU generator,
// so x must be a CPU tensor (a CUDA path needs a CUDA generator: not written yet).
inline torch::Tensor dropout(const torch::Tensor& x, double p) {
  at::Generator* g = TrainingScope::current();
  if (p <= 0.0 || g == nullptr) return x;
  if (!x.is_cpu()) throw std::runtime_error("dropout > 0 is implemented for CPU tensors only (for now)");
  torch::Tensor mask;
  {
    torch::NoGradGuard no_grad;
    mask = torch::empty_like(x).bernoulli_(1.0 - p, *g).div_(1.0 - p);
  }
  return x * mask;
}

}  // namespace flowrun
