// GradBuffer (train/grad_buffer.hpp): the layout of the flat gradient buffers and the checks
// that make reusing one safe. Test: tests/nodes/forward_backward_test.cpp (GradBuffer.*).
#include "train/grad_buffer.hpp"

#include <stdexcept>
#include <string>

namespace flowrun {

std::shared_ptr<GradBuffer> GradBuffer::make(const std::vector<torch::Tensor>& params, const std::vector<int>& kinds) {
  // Within a group, reverse module order: backward finishes the last layers first, so the
  // gradients that become ready together are neighbours and a bucket is one contiguous slice.
  const FlatLayout layout = FlatLayout::of(params, /*reverse=*/true, kinds);
  auto b = std::make_shared<GradBuffer>();
  b->slots = layout.slots;
  b->order = layout.order;
  b->position = layout.position;
  b->flats = layout.zeros();
  for (const auto& g : layout.groups) b->kinds.push_back(g.kind);
  const int n = static_cast<int>(params.size());
  b->views.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    b->views.push_back(layout.view(b->flats, static_cast<size_t>(i), params[static_cast<size_t>(i)].sizes()));
  return b;
}

bool GradBuffer::reusable() const {
  for (size_t i = 0; i < views.size(); ++i) {
    // The buffer's own reference, plus the parameter's .grad() while it still points here (a
    // later attach() of another buffer may have moved it on). Anything more is a consumer.
    size_t expected = 1;
    if (i < attached_to.size())
      if (c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> p = attached_to[i].lock()) {
        const torch::Tensor param(std::move(p));
        const torch::Tensor& grad = param.grad();  // a reference: no count of its own
        if (grad.defined() && grad.unsafeGetTensorImpl() == views[i].unsafeGetTensorImpl()) expected = 2;
      }
    if (views[i].use_count() != expected) return false;
  }
  return true;
}

void GradBuffer::zero() {
  torch::NoGradGuard no_grad;
  for (auto& f : flats) f.zero_();
}

void GradBuffer::attach(const std::vector<torch::Tensor>& params) const {
  if (params.size() != views.size())
    throw std::runtime_error("GradBuffer::attach: the buffer was made for " + std::to_string(views.size()) +
                             " parameters, got " + std::to_string(params.size()));
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i];
    if (!p.sizes().equals(views[i].sizes()) || p.scalar_type() != views[i].scalar_type() ||
        p.device() != views[i].device())
      throw std::runtime_error("GradBuffer::attach: parameter " + std::to_string(i) + " is " +
                               std::string(c10::str(p.sizes(), " ", p.scalar_type(), " on ", p.device())) +
                               ", the buffer's slot is " +
                               std::string(c10::str(views[i].sizes(), " ", views[i].scalar_type(), " on ",
                                                    views[i].device())));
  }
  remember(params);
  for (size_t i = 0; i < params.size(); ++i) {
    torch::Tensor p = params[i];  // a handle to the same parameter (mutable_grad() is non-const)
    p.mutable_grad() = views[i];
  }
}

void GradBuffer::remember(const std::vector<torch::Tensor>& params) const {
  attached_to.clear();
  attached_to.reserve(params.size());
  for (const torch::Tensor& p : params) attached_to.emplace_back(p.getIntrusivePtr());
}

void GradBuffer::settle(size_t i, torch::Tensor param) const {
  torch::NoGradGuard no_grad;
  torch::Tensor& grad = param.mutable_grad();
  const torch::Tensor& view = views.at(i);
  if (!grad.defined())
    view.zero_();
  else if (grad.unsafeGetTensorImpl() != view.unsafeGetTensorImpl())
    view.copy_(grad);
  grad = view;
}

}  // namespace flowrun
