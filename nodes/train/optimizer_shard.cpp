// ZeRO stage 1 (train/optimizer_shard.hpp): the plan, the pieces, the all-gather.
// Test: tests/nodes/optimizer_test.cpp (ShardPlan.*), tests/mpi/mpi_test.sh (zero_states).
#include "train/optimizer_shard.hpp"

#include <algorithm>
#include <stdexcept>

#include "comm.hpp"

namespace flowrun {

ShardPlan ShardPlan::make(const FlatLayout& layout, const std::vector<std::pair<std::string, torch::Tensor>>& params,
                          int rank, int world, bool whole_tensors) {
  if (world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument("ShardPlan: rank " + std::to_string(rank) + " of " + std::to_string(world));
  if (params.size() != layout.slots.size())
    throw std::invalid_argument("ShardPlan: " + std::to_string(params.size()) + " parameters for a layout of " +
                                std::to_string(layout.slots.size()));
  ShardPlan p;
  p.rank = rank;
  p.world = world;
  p.whole_tensors = whole_tensors;
  p.layout = layout;
  for (const auto& [name, t] : params) {
    p.names.push_back(name);
    p.shapes.push_back(t.sizes().vec());
  }
  for (size_t k = 0; k < layout.groups.size(); ++k) {
    Group s;
    s.numel = layout.groups[k].numel;
    const int64_t even = (s.numel + world - 1) / world;
    // Where parameters start in this buffer (whole tensors: the only places a cut may go).
    std::vector<int64_t> starts;
    for (const auto& slot : layout.slots)
      if (slot.group == static_cast<int>(k)) starts.push_back(slot.offset);
    std::sort(starts.begin(), starts.end());
    for (int q = 0; q <= world; ++q) {
      int64_t cut = std::min(s.numel, even * q);
      if (whole_tensors && q > 0 && q < world) {
        auto it = std::lower_bound(starts.begin(), starts.end(), cut);
        cut = it == starts.end() ? s.numel : *it;
      }
      s.cuts.push_back(q == world ? s.numel : std::max(cut, s.cuts.empty() ? 0 : s.cuts.back()));
    }
    for (int q = 0; q < world; ++q) s.slice = std::max(s.slice, s.cuts[q + 1] - s.cuts[q]);
    s.begin = s.cuts[rank];
    s.end = s.cuts[rank + 1];
    p.groups.push_back(s);
  }
  for (int i : layout.order) {  // buffer order: a rank's pieces lie in its slice in order
    const FlatLayout::Slot& slot = layout.slots[static_cast<size_t>(i)];
    const Group& g = p.groups[static_cast<size_t>(slot.group)];
    const int64_t lo = std::max(slot.offset, g.begin), hi = std::min(slot.offset + slot.numel, g.end);
    if (lo < hi) p.pieces.push_back({i, slot.group, lo - slot.offset, hi - lo, lo - g.begin});
  }
  return p;
}

ShardPieces shard_pieces(const ShardPlan& plan, const std::vector<std::pair<std::string, torch::Tensor>>& params,
                         const std::vector<torch::Tensor>& grads) {
  if (params.size() != plan.layout.slots.size() || grads.size() != params.size())
    throw std::runtime_error("sharded update: " + std::to_string(params.size()) + " parameters and " +
                             std::to_string(grads.size()) + " grads, the plan was made for " +
                             std::to_string(plan.layout.slots.size()));
  ShardPieces out;
  for (const auto& piece : plan.pieces) {
    const auto& [name, p] = params[static_cast<size_t>(piece.param)];
    const torch::Tensor& g = grads[static_cast<size_t>(piece.param)];
    if (piece.offset == 0 && piece.numel == p.numel()) {  // a whole parameter
      out.params.emplace_back(name, p);
      out.grads.push_back(g);
      continue;
    }
    out.params.emplace_back(name, p.view({-1}).narrow(0, piece.offset, piece.numel));
    out.grads.push_back(g.defined() ? g.reshape({-1}).narrow(0, piece.offset, piece.numel) : torch::Tensor());
  }
  return out;
}

void allgather_slices(const ShardPlan& plan, const std::vector<torch::Tensor>& buffers, comm::Channel& channel,
                      const std::string& what) {
  if (buffers.size() != plan.groups.size())
    throw std::logic_error("allgather_slices: " + std::to_string(buffers.size()) + " buffers for a plan of " +
                           std::to_string(plan.groups.size()));
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> mine, all;
  std::vector<comm::Request> pending;
  for (size_t k = 0; k < buffers.size(); ++k) {
    const ShardPlan::Group& g = plan.groups[k];
    const torch::Tensor& b = buffers[k];
    if (!b.device().is_cpu())
      throw std::runtime_error("shard: states: all-gathering parameters on " + b.device().str() +
                               " is not built yet (CPU buffers over MPI only)");
    if (b.numel() != g.numel) throw std::logic_error("allgather_slices: buffer " + std::to_string(k) + " changed size");
    if (g.slice == 0) continue;
    // Each rank's block of `slice` elements (its slice, padded); then each rank's slice back.
    torch::Tensor block = torch::zeros({g.slice}, b.options());
    block.narrow(0, 0, g.end - g.begin).copy_(b.narrow(0, g.begin, g.end - g.begin));
    torch::Tensor gathered = torch::empty({g.slice * plan.world}, b.options());
    pending.push_back(channel.allgather(block.data_ptr(), gathered.data_ptr(),
                                        static_cast<size_t>(g.slice) * b.element_size(), what));
    mine.push_back(block);
    all.push_back(gathered);
  }
  for (auto& r : pending) r.wait();
  size_t j = 0;
  for (size_t k = 0; k < buffers.size(); ++k) {
    const ShardPlan::Group& g = plan.groups[k];
    if (g.slice == 0) continue;
    const torch::Tensor& from = all[j++];
    for (int q = 0; q < plan.world; ++q)  // rank q's block: its slice, then padding
      buffers[k].narrow(0, g.cuts[q], g.cuts[q + 1] - g.cuts[q]).copy_(from.narrow(0, g.slice * q, g.cuts[q + 1] - g.cuts[q]));
  }
}

}  // namespace flowrun
