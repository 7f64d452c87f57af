// GradHooks (train/grad_hooks.hpp). Test: tests/nodes/forward_backward_test.cpp.
#include "train/grad_hooks.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <stdexcept>
#include <string>

namespace flowrun {

GradHooks::GradHooks(const std::vector<torch::Tensor>& params) {
  params_.reserve(params.size());
  accumulators_.reserve(params.size());
  keys_.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i];
    if (!p.requires_grad() || !p.is_leaf())
      throw std::runtime_error("gradient hooks: parameter " + std::to_string(i) +
                               " is not a leaf tensor that requires grad");
    std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(p);
    if (!acc) throw std::runtime_error("gradient hooks: parameter " + std::to_string(i) + " has no grad accumulator");
    // The lambda holds fn_ by value (shared): safe even if the accumulator outlives us.
    std::shared_ptr<Fn> fn = fn_;
    const int index = static_cast<int>(i);
    uintptr_t key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [fn, index](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (*fn) (*fn)(index);
          return outputs;
        }));
    params_.push_back(p.unsafeGetTensorImpl());
    accumulators_.push_back(std::move(acc));
    keys_.push_back(key);
  }
}

GradHooks::~GradHooks() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(keys_[i]);
}

bool GradHooks::covers(const std::vector<torch::Tensor>& params) const {
  if (params.size() != params_.size()) return false;
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].unsafeGetTensorImpl() != params_[i]) return false;
  return true;
}

}  // namespace flowrun
