// GradBuffer (train/grad_buffer.hpp): the layout of the flat gradient buffers and the checks
// that make reusing one safe. Test: tests/nodes/forward_backward_test.cpp (GradBuffer.*).
#include "train/grad_buffer.hpp"

#include <stdexcept>
#include <string>

namespace flowrun {

std::shared_ptr<GradBuffer> GradBuffer::make(const std::vector<torch::Tensor>& params) {
  auto b = std::make_shared<GradBuffer>();
  const int n = static_cast<int>(params.size());
  b->slots.resize(static_cast<size_t>(n));
  b->position.assign(static_cast<size_t>(n), -1);

  // Groups by (dtype, device), numbered in the order their first parameter appears.
  struct Group {
    torch::Dtype dtype;
    c10::Device device;
    std::vector<int> members;  // module order
  };
  std::vector<Group> groups;
  for (int i = 0; i < n; ++i) {
    const torch::Tensor& p = params[static_cast<size_t>(i)];
    if (!p.defined()) throw std::runtime_error("GradBuffer: parameter " + std::to_string(i) + " is undefined");
    int g = 0;
    while (g < static_cast<int>(groups.size()) &&
           !(groups[static_cast<size_t>(g)].dtype == p.scalar_type() && groups[static_cast<size_t>(g)].device == p.device()))
      ++g;
    if (g == static_cast<int>(groups.size())) groups.push_back({p.scalar_type(), p.device(), {}});
    groups[static_cast<size_t>(g)].members.push_back(i);
    b->slots[static_cast<size_t>(i)].group = g;
  }

  // Within a group, reverse module order: backward finishes the last layers first, so the
  // gradients that become ready together are neighbours and a bucket is one contiguous slice.
  for (size_t g = 0; g < groups.size(); ++g) {
    int64_t offset = 0;
    for (auto it = groups[g].members.rbegin(); it != groups[g].members.rend(); ++it) {
      Slot& s = b->slots[static_cast<size_t>(*it)];
      s.offset = offset;
      s.numel = params[static_cast<size_t>(*it)].numel();
      offset += s.numel;
      b->position[static_cast<size_t>(*it)] = static_cast<int>(b->order.size());
      b->order.push_back(*it);
    }
    b->flats.push_back(torch::zeros({offset}, torch::TensorOptions().dtype(groups[g].dtype).device(groups[g].device)));
  }

  b->views.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const Slot& s = b->slots[static_cast<size_t>(i)];
    b->views.push_back(b->flats[static_cast<size_t>(s.group)].narrow(0, s.offset, s.numel).view(params[static_cast<size_t>(i)].sizes()));
  }
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
  attached_to.clear();
  attached_to.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    torch::Tensor p = params[i];  // a handle to the same parameter (mutable_grad() is non-const)
    p.mutable_grad() = views[i];
    attached_to.emplace_back(p.getIntrusivePtr());
  }
}

}  // namespace flowrun
