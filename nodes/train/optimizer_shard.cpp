// ZeRO stages 1 and 2 (train/optimizer_shard.hpp): the plan, the pieces, the all-gather, the
// packing for the gradients' reduce-scatter.
// Test: tests/nodes/optimizer_test.cpp (ShardPlan.*), tests/mpi/mpi_test.sh (zero_states, zero_gradients).
#include "train/optimizer_shard.hpp"

#include <algorithm>
#include <stdexcept>

#include "comm.hpp"

namespace flowrun {

std::vector<size_t> ShardPlan::Group::counts() const {
  std::vector<size_t> out;
  for (size_t q = 0; q + 1 < cuts.size(); ++q) out.push_back(static_cast<size_t>(cuts[q + 1] - cuts[q]));
  return out;
}

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
    if (!g.defined()) {
      out.grads.emplace_back();
    } else if (g.numel() == p.numel()) {
      out.grads.push_back(g.reshape({-1}).narrow(0, piece.offset, piece.numel));
    } else if (g.numel() == piece.numel) {  // this rank's piece already (stage 2)
      out.grads.push_back(g.reshape({-1}));
    } else {
      throw std::runtime_error("sharded update: the grad of " + name + " has " + std::to_string(g.numel()) +
                               " elements, neither the parameter's " + std::to_string(p.numel()) + " nor this rank's " +
                               std::to_string(piece.numel) + " of them (was it sharded by another plan?)");
    }
  }
  return out;
}

ShardPieces slice_pieces(const ShardPlan& plan, const std::vector<torch::Tensor>& slices,
                         const std::vector<torch::Tensor>& grads) {
  if (grads.size() != plan.layout.slots.size() || slices.size() != plan.groups.size())
    throw std::runtime_error("sharded update: " + std::to_string(grads.size()) + " grads and " +
                             std::to_string(slices.size()) + " slices, the plan was made for " +
                             std::to_string(plan.layout.slots.size()) + " parameters in " +
                             std::to_string(plan.groups.size()) + " buffers");
  ShardPieces out;
  for (const auto& piece : plan.pieces) {
    const size_t i = static_cast<size_t>(piece.param);
    const bool whole = piece.offset == 0 && piece.numel == plan.layout.slots[i].numel;
    const torch::Tensor p = slices[static_cast<size_t>(piece.group)].narrow(0, piece.at, piece.numel);
    out.params.emplace_back(plan.names[i], whole ? p.view(plan.shapes[i]) : p);
    const torch::Tensor& g = grads[i];
    if (g.defined() && g.numel() != piece.numel)
      throw std::runtime_error("sharded update: the grad of " + plan.names[i] + " has " + std::to_string(g.numel()) +
                               " elements, not this rank's " + std::to_string(piece.numel) + " (stage params reduce-"
                               "scatters every gradient: was it made by another plan?)");
    out.grads.push_back(!g.defined() ? g : whole ? g.view(plan.shapes[i]) : g.reshape({-1}));
  }
  return out;
}

std::vector<parallel::Work> allgather_slices(const ShardPlan& plan, const std::vector<torch::Tensor>& buffers,
                                             parallel::Group& group, const std::string& what) {
  if (buffers.size() != plan.groups.size())
    throw std::logic_error("allgather_slices: " + std::to_string(buffers.size()) + " buffers for a plan of " +
                           std::to_string(plan.groups.size()));
  // In place: each rank's slice lies where it belongs in every rank's buffer already, so the
  // buffers themselves are the all-gather's blocks (no staging copy of the model).
  std::vector<parallel::Work> pending;
  for (size_t k = 0; k < buffers.size(); ++k) {
    const ShardPlan::Group& g = plan.groups[k];
    const torch::Tensor& b = buffers[k];
    if (b.numel() != g.numel || !b.is_contiguous())
      throw std::logic_error("allgather_slices: buffer " + std::to_string(k) + " changed size");
    pending.push_back(group.all_gather(b, g.counts(), what));
  }
  return pending;
}

std::shared_ptr<const GradShard> GradShard::make(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                                                 int rank, int world, bool whole_tensors) {
  std::vector<torch::Tensor> tensors;
  for (const auto& [name, t] : params) tensors.push_back(t);
  auto s = std::make_shared<GradShard>();
  s->plan = ShardPlan::make(FlatLayout::of(tensors), params, rank, world, whole_tensors);
  s->buckets = FlatLayout::of(tensors, /*reverse=*/true);
  return s;
}

namespace {
// Parameter i's elements rank q updates: [lo, hi) of the parameter (empty: lo >= hi).
std::pair<int64_t, int64_t> owned(const ShardPlan& plan, int i, int q) {
  const FlatLayout::Slot& slot = plan.layout.slots[static_cast<size_t>(i)];
  const ShardPlan::Group& g = plan.groups[static_cast<size_t>(slot.group)];
  const int64_t lo = std::max(slot.offset, g.cuts[static_cast<size_t>(q)]);
  const int64_t hi = std::min(slot.offset + slot.numel, g.cuts[static_cast<size_t>(q) + 1]);
  return {lo - slot.offset, hi - slot.offset};
}

void check_bucket(const GradShard& shard, int first, int end) {
  if (first < 0 || end > static_cast<int>(shard.buckets.order.size()) || first > end)
    throw std::logic_error("sharded gradients: bucket [" + std::to_string(first) + ", " + std::to_string(end) +
                           ") outside the " + std::to_string(shard.buckets.order.size()) + " parameters");
}
}  // namespace

torch::Tensor pack_by_owner(const GradShard& shard, int first, int end, const std::vector<torch::Tensor>& grads,
                            std::vector<size_t>& counts, double divide_by) {
  check_bucket(shard, first, end);
  const ShardPlan& plan = shard.plan;
  torch::NoGradGuard no_grad;
  int64_t numel = 0;
  for (int k = first; k < end; ++k) numel += shard.buckets.slots[static_cast<size_t>(shard.buckets.order[static_cast<size_t>(k)])].numel;
  const int group = first < end ? shard.buckets.slots[static_cast<size_t>(shard.buckets.order[static_cast<size_t>(first)])].group : 0;
  const FlatLayout::Group& g = shard.buckets.groups.at(static_cast<size_t>(group));
  torch::Tensor out = torch::empty({numel}, torch::TensorOptions().dtype(g.dtype).device(g.device));
  counts.assign(static_cast<size_t>(plan.world), 0);
  int64_t at = 0;
  for (int q = 0; q < plan.world; ++q)
    for (int k = first; k < end; ++k) {
      const int i = shard.buckets.order[static_cast<size_t>(k)];
      const auto [lo, hi] = owned(plan, i, q);
      if (lo >= hi) continue;
      torch::Tensor to = out.narrow(0, at, hi - lo);
      const torch::Tensor& grad = grads[static_cast<size_t>(i)];
      if (!grad.defined()) to.zero_();
      else if (divide_by == 1) to.copy_(grad.reshape({-1}).narrow(0, lo, hi - lo));
      else at::div_out(to, grad.reshape({-1}).narrow(0, lo, hi - lo), divide_by);
      at += hi - lo;
      counts[static_cast<size_t>(q)] += static_cast<size_t>(hi - lo);
    }
  if (at != numel) throw std::logic_error("pack_by_owner: packed " + std::to_string(at) + " of " + std::to_string(numel));
  return out;
}

void unpack_mine(const GradShard& shard, int first, int end, const torch::Tensor& mine,
                 const std::vector<torch::Tensor>& slices) {
  check_bucket(shard, first, end);
  const ShardPlan& plan = shard.plan;
  torch::NoGradGuard no_grad;
  int64_t at = 0;
  for (int k = first; k < end; ++k) {
    const int i = shard.buckets.order[static_cast<size_t>(k)];
    const auto [lo, hi] = owned(plan, i, plan.rank);
    if (lo >= hi) continue;
    const FlatLayout::Slot& slot = plan.layout.slots[static_cast<size_t>(i)];
    const ShardPlan::Group& g = plan.groups[static_cast<size_t>(slot.group)];
    slices.at(static_cast<size_t>(slot.group)).narrow(0, slot.offset + lo - g.begin, hi - lo).copy_(mine.narrow(0, at, hi - lo));
    at += hi - lo;
  }
  if (at != mine.numel())
    throw std::logic_error("unpack_mine: " + std::to_string(mine.numel()) + " elements received, " + std::to_string(at) +
                           " expected");
}

std::vector<torch::Tensor> pieces_of_slices(const ShardPlan& plan, const std::vector<torch::Tensor>& slices) {
  std::vector<torch::Tensor> out(plan.layout.slots.size());
  for (const auto& piece : plan.pieces) {
    torch::Tensor t = slices.at(static_cast<size_t>(piece.group)).narrow(0, piece.at, piece.numel);
    const auto& shape = plan.shapes[static_cast<size_t>(piece.param)];
    out[static_cast<size_t>(piece.param)] = piece.numel == c10::multiply_integers(shape) ? t.view(shape) : t;
  }
  return out;
}

}  // namespace flowrun
