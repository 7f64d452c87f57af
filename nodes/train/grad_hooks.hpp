// GradHooks: tells, during backward, the moment each trainable parameter's gradient has been
// accumulated into its .grad() (what forward_backward's `ready` stream is made of).
//
// A post hook on each parameter's grad accumulator (the AccumulateGrad node autograd runs for a
// leaf) fires right after it added the parameter's gradient. A parameter holds its accumulator
// only weakly: once no autograd graph refers to it, it is freed with its hooks and the next
// forward makes a new, hook-less one. So GradHooks keeps the accumulators alive for as long as it
// lives, as PyTorch DDP's Reducer does (reducer.cpp, grad_accumulators_), and removes its hooks
// when destroyed. Register once per model and keep the object across steps.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace flowrun {

class GradHooks {
 public:
  // fn(i): parameter i (index into the params given to the constructor) got its gradient.
  using Fn = std::function<void(int param)>;

  explicit GradHooks(const std::vector<torch::Tensor>& params);
  ~GradHooks();
  GradHooks(const GradHooks&) = delete;
  GradHooks& operator=(const GradHooks&) = delete;

  // True when made for exactly these parameter tensors (same objects, same order).
  bool covers(const std::vector<torch::Tensor>& params) const;

  // While the returned guard lives, hooks call fn (from the thread that runs the accumulator:
  // the caller of backward() for CPU tensors). Outside a guard the hooks do nothing. Set it only
  // outside backward.
  class Armed {
   public:
    Armed(GradHooks& h, Fn fn) : h_(h) { *h_.fn_ = std::move(fn); }
    ~Armed() { *h_.fn_ = nullptr; }
    Armed(const Armed&) = delete;
    Armed& operator=(const Armed&) = delete;

   private:
    GradHooks& h_;
  };

 private:
  // Identity only; the accumulators hold the parameters, so no other tensor takes their address.
  std::vector<const c10::TensorImpl*> params_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> keys_;  // del_post_hook keys, per accumulator
  // Shared with the hook lambdas, which may outlive this object inside an accumulator that a
  // live autograd graph still holds.
  std::shared_ptr<Fn> fn_ = std::make_shared<Fn>();
};

}  // namespace flowrun
