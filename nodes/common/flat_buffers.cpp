// Flat buffers (common/flat_buffers.hpp). Test: tests/nodes/flat_buffers_test.cpp.
#include "common/flat_buffers.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace flowrun {

FlatLayout FlatLayout::of(const std::vector<torch::Tensor>& tensors, bool reverse, const std::vector<int>& kinds) {
  FlatLayout l;
  const int n = static_cast<int>(tensors.size());
  if (!kinds.empty() && kinds.size() != tensors.size())
    throw std::logic_error("flat buffers: " + std::to_string(kinds.size()) + " kinds for " + std::to_string(n) + " tensors");
  l.slots.resize(static_cast<size_t>(n));
  l.position.assign(static_cast<size_t>(n), -1);
  std::vector<std::vector<int>> members;  // per group, in the given order
  for (int i = 0; i < n; ++i) {
    const torch::Tensor& t = tensors[static_cast<size_t>(i)];
    if (!t.defined()) throw std::runtime_error("flat buffers: tensor " + std::to_string(i) + " is undefined");
    const int kind = kinds.empty() ? 0 : kinds[static_cast<size_t>(i)];
    size_t g = 0;
    while (g < l.groups.size() && !(l.groups[g].dtype == t.scalar_type() && l.groups[g].device == t.device() &&
                                    l.groups[g].kind == kind))
      ++g;
    if (g == l.groups.size()) {
      l.groups.push_back({t.scalar_type(), t.device(), 0, kind});
      members.emplace_back();
    }
    members[g].push_back(i);
    l.slots[static_cast<size_t>(i)].group = static_cast<int>(g);
  }
  for (size_t g = 0; g < l.groups.size(); ++g) {
    if (reverse) std::reverse(members[g].begin(), members[g].end());
    for (int i : members[g]) {
      Slot& s = l.slots[static_cast<size_t>(i)];
      s.offset = l.groups[g].numel;
      s.numel = tensors[static_cast<size_t>(i)].numel();
      l.groups[g].numel += s.numel;
      l.position[static_cast<size_t>(i)] = static_cast<int>(l.order.size());
      l.order.push_back(i);
    }
  }
  return l;
}

bool FlatLayout::operator==(const FlatLayout& o) const {
  if (slots.size() != o.slots.size() || groups.size() != o.groups.size() || order != o.order) return false;
  for (size_t i = 0; i < slots.size(); ++i)
    if (slots[i].group != o.slots[i].group || slots[i].offset != o.slots[i].offset || slots[i].numel != o.slots[i].numel)
      return false;
  for (size_t g = 0; g < groups.size(); ++g)
    if (groups[g].dtype != o.groups[g].dtype || groups[g].device != o.groups[g].device ||
        groups[g].numel != o.groups[g].numel || groups[g].kind != o.groups[g].kind)
      return false;
  return true;
}

std::vector<torch::Tensor> FlatLayout::zeros() const {
  std::vector<torch::Tensor> out;
  out.reserve(groups.size());
  for (const Group& g : groups) out.push_back(torch::zeros({g.numel}, torch::TensorOptions().dtype(g.dtype).device(g.device)));
  return out;
}

torch::Tensor FlatLayout::view(const std::vector<torch::Tensor>& buffers, size_t i, at::IntArrayRef sizes) const {
  const Slot& s = slots.at(i);
  return buffers.at(static_cast<size_t>(s.group)).narrow(0, s.offset, s.numel).view(sizes);
}

void FlatParams::ensure(const std::vector<torch::Tensor>& tensors) {
  if (buffers_of(tensors)) return;
  torch::NoGradGuard no_grad;
  FlatLayout layout = FlatLayout::of(tensors);
  std::vector<torch::Tensor> buffers = layout.zeros();
  for (size_t i = 0; i < tensors.size(); ++i) {
    torch::Tensor v = layout.view(buffers, i, tensors[i].sizes());
    v.copy_(tensors[i]);
    torch::Tensor t = tensors[i];  // a handle to the same tensor (set_data is non-const)
    t.set_data(v);
  }
  layout_ = std::move(layout);
  buffers_ = std::move(buffers);
}

const std::vector<torch::Tensor>* FlatParams::buffers_of(const std::vector<torch::Tensor>& tensors) const {
  if (buffers_.empty() || tensors.size() != layout_.slots.size()) return nullptr;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const FlatLayout::Slot& s = layout_.slots[i];
    const torch::Tensor& b = buffers_[static_cast<size_t>(s.group)];
    const torch::Tensor& t = tensors[i];
    if (t.scalar_type() != b.scalar_type() || t.device() != b.device() || t.numel() != s.numel ||
        !t.is_contiguous())
      return nullptr;
    if (s.numel > 0 && t.data_ptr() != static_cast<const char*>(b.data_ptr()) + s.offset * static_cast<int64_t>(b.element_size()))
      return nullptr;
  }
  return &buffers_;
}

}  // namespace flowrun
