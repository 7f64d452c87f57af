// Megatron-LM's conjugate operators f and g (tensor_parallel.hpp) as autograd functions.
#include "parallel/tensor_parallel.hpp"

#include <stdexcept>

#include "node.hpp"  // RunInfo

namespace flowrun::parallel {

namespace {

// The group travels to backward as its address in the autograd context (saved_data holds
// IValues only). Groups live as long as the node that made them, which outlives every graph its
// forward builds.
void keep_group(torch::autograd::AutogradContext* ctx, Group* g) { ctx->saved_data["group"] = reinterpret_cast<int64_t>(g); }
Group& group_of(torch::autograd::AutogradContext* ctx) { return *reinterpret_cast<Group*>(ctx->saved_data["group"].toInt()); }

// The sum over the group, in a new tensor (the input is an autograd value: never written).
torch::Tensor summed(const torch::Tensor& t, Group& g, const char* what) {
  torch::Tensor out = t.contiguous().clone();
  g.all_reduce(out, comm::Op::sum, what).wait();
  return out;
}

struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, Group* g) {
    keep_group(ctx, g);
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    return {summed(grad[0], group_of(ctx), "tensor parallel: the gradient of a copied input"), torch::Tensor()};
  }
};

struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& y, Group* g) {
    return summed(y, *g, "tensor parallel: the sum of the ranks' partial outputs");
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list grad) {
    return {grad[0], torch::Tensor()};
  }
};

// The cross-entropy over logits split by columns (vocab_parallel_cross_entropy).
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& targets, Group* g) {
    const int64_t n = logits.size(0), v = logits.size(1), first = g->rank() * v;
    const torch::Tensor x = logits.to(torch::kFloat);
    torch::Tensor max = std::get<0>(x.max(1));
    g->all_reduce(max, comm::Op::max, "vocab-parallel cross-entropy: the rows' max").wait();
    torch::Tensor e = (x - max.unsqueeze(1)).exp();
    torch::Tensor sum = e.sum(1);
    g->all_reduce(sum, comm::Op::sum, "vocab-parallel cross-entropy: the rows' sum of exponentials").wait();
    const torch::Tensor mine = (targets >= first) & (targets < first + v);
    const torch::Tensor column = (targets - first).clamp(0, v - 1);
    torch::Tensor target = x.gather(1, column.unsqueeze(1)).squeeze(1) * mine;
    g->all_reduce(target, comm::Op::sum, "vocab-parallel cross-entropy: the targets' logits").wait();
    ctx->save_for_backward({e.div_(sum.unsqueeze(1)), column, mine});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return (sum.log() + max - target).sum() / static_cast<double>(n);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    torch::Tensor g = saved[0].clone();  // softmax, this rank's columns
    g.scatter_add_(1, saved[1].unsqueeze(1), -saved[2].to(g.scalar_type()).unsqueeze(1));  // - one-hot where held
    g.mul_(grad[0] / static_cast<double>(g.size(0)));
    return {g.to(static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt())), torch::Tensor(), torch::Tensor()};
  }
};

// The group a split layer's collective goes over (collectives.hpp thread_channel).
Group* channel(const std::shared_ptr<Group>& tp) { return &thread_channel(Dim::tp, tp, "tensor parallel"); }

}  // namespace

std::shared_ptr<Group> own_tp_group(const std::string& node, const RunInfo& run) {
  const Mesh mesh = mesh_of(run);
  return mesh.size(Dim::tp) == 1 ? nullptr : Group::along(node, mesh, Dim::tp, run.rank);
}

std::shared_ptr<Group> own_dp_group(const std::string& node, const RunInfo& run) {
  const Mesh mesh = mesh_of(run);
  return mesh.size(Dim::dp) == 1 ? nullptr : Group::along(node, mesh, Dim::dp, run.rank);
}

std::shared_ptr<Group> own_pp_group(const std::string& node, const RunInfo& run) {
  const Mesh mesh = mesh_of(run);
  return mesh.size(Dim::pp) == 1 ? nullptr : Group::along(node, mesh, Dim::pp, run.rank);
}

torch::Tensor vocab_parallel_embedding(const torch::Tensor& ids, const torch::Tensor& table,
                                       const std::shared_ptr<Group>& tp) {
  if (!tp || tp->size() == 1) return torch::embedding(table, ids);
  const int64_t rows = table.size(0), first = tp->rank() * rows;
  const torch::Tensor other = (ids < first) | (ids >= first + rows);
  torch::Tensor e = torch::embedding(table, (ids - first).masked_fill(other, 0));
  return reduce_from_tp(e.masked_fill(other.unsqueeze(-1), 0.0), tp);
}

torch::Tensor gather_vocab_logits(const torch::Tensor& logits, const std::shared_ptr<Group>& tp) {
  if (!tp || tp->size() == 1) return logits;
  return tp_whole(logits.contiguous(), TpSplit{logits.dim() - 1, 1}, *channel(tp), "the vocabulary-split logits");
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                           const std::shared_ptr<Group>& tp) {
  if (logits.dim() != 2 || targets.dim() != 1 || targets.size(0) != logits.size(0))
    throw std::runtime_error("vocab-parallel cross-entropy: logits [N, V/tp] and targets [N], got " +
                             c10::str(logits.sizes()) + " and " + c10::str(targets.sizes()));
  if (!tp || tp->size() == 1) return torch::nn::functional::cross_entropy(logits.to(torch::kFloat), targets);
  return VocabParallelCrossEntropy::apply(logits, targets, channel(tp));
}

torch::Tensor copy_to_tp(const torch::Tensor& x, const std::shared_ptr<Group>& tp) {
  if (!tp || tp->size() == 1) return x;
  return CopyToTp::apply(x, channel(tp));
}

torch::Tensor reduce_from_tp(const torch::Tensor& y, const std::shared_ptr<Group>& tp) {
  if (!tp || tp->size() == 1) return y;
  return ReduceFromTp::apply(y, channel(tp));
}

torch::Tensor tp_block(const torch::Tensor& whole, int64_t dim, const Group& tp, const std::string& what) {
  const int64_t n = whole.size(dim), parts = tp.size();
  if (n % parts != 0)
    throw std::runtime_error(what + ": " + std::to_string(n) + " along dimension " + std::to_string(dim) +
                             " does not split into " + std::to_string(parts) +
                             " equal tensor-parallel blocks; choose run.parallel.tp dividing it");
  return whole.narrow(dim, tp.rank() * (n / parts), n / parts);
}

torch::Tensor tp_part(const torch::Tensor& whole, const TpSplit& s, const Group& tp, const std::string& what) {
  if (!s.split() || tp.size() == 1) return whole;
  if (s.runs == 1) return tp_block(whole, s.dim, tp, what);
  const int64_t n = whole.size(s.dim);
  if (n % s.runs != 0)
    throw std::runtime_error(what + ": " + std::to_string(n) + " along dimension " + std::to_string(s.dim) +
                             " is not " + std::to_string(s.runs) + " equal runs");
  std::vector<torch::Tensor> parts;
  for (const torch::Tensor& run : whole.split(n / s.runs, s.dim)) parts.push_back(tp_block(run, s.dim, tp, what));
  return torch::cat(parts, s.dim);
}

torch::Tensor tp_whole(const torch::Tensor& part, const TpSplit& s, Group& tp, const std::string& what) {
  if (!s.split() || tp.size() == 1) return part;
  if (part.dim() <= s.dim || part.size(s.dim) % s.runs != 0)
    throw std::runtime_error(what + ": a part of shape " + c10::str(part.sizes()) + " cannot be split along dimension " +
                             std::to_string(s.dim) + " in " + std::to_string(s.runs) + " runs");
  // Every rank's part, one after the other in rank order, gathered in place.
  const int64_t n = part.numel(), ranks = tp.size();
  torch::Tensor flat = torch::empty({ranks * n}, part.options());
  flat.narrow(0, tp.rank() * n, n).copy_(part.reshape({-1}));
  tp.all_gather(flat, std::vector<size_t>(static_cast<size_t>(ranks), static_cast<size_t>(n)), what).wait();
  // Each part holds its block of every run: the whole is, run by run, the ranks' blocks in order.
  const int64_t block = part.size(s.dim) / s.runs;
  std::vector<torch::Tensor> pieces;
  for (int64_t r = 0; r < s.runs; ++r)
    for (int64_t q = 0; q < ranks; ++q) pieces.push_back(flat.narrow(0, q * n, n).view(part.sizes()).narrow(s.dim, r * block, block));
  return torch::cat(pieces, s.dim);
}

namespace {
// A tensor is split only when it has the split's dimension (a moment's 0-d step counter is not).
TpSplit usable(const TpSplit& s, const torch::Tensor& t) { return t.dim() > s.dim ? s : TpSplit{}; }
}  // namespace

std::map<std::string, torch::Tensor> TpLayout::wholes(const std::map<std::string, torch::Tensor>& parts, Group* over,
                                                      const Names& param_of, Group* over_ep) const {
  return wholes_by(parts, over, [&](const std::string& name) { return split(param_of ? param_of(name) : name); }, over_ep);
}

std::map<std::string, torch::Tensor> TpLayout::parts(const std::map<std::string, torch::Tensor>& wholes,
                                                     const Names& param_of, const std::string& source) const {
  return parts_by(wholes, [&](const std::string& name) { return split(param_of ? param_of(name) : name); }, source);
}

std::map<std::string, torch::Tensor> TpLayout::wholes_by(const std::map<std::string, torch::Tensor>& parts, Group* over,
                                                         const SplitOf& split_of, Group* over_ep) const {
  // The channel that gathers a split's parts: over the same ranks as the model's place.
  auto channel_for = [&](const TpSplit& s) -> Group* {
    const Group* place = group_of(s);
    if (!place) return nullptr;
    Group* ch = s.experts ? over_ep : over;
    if (!ch || ch->size() != place->size() || ch->rank() != place->rank())
      throw std::logic_error(std::string(s.experts ? "expert" : "tensor") + " parallel: gathering over '" +
                             (ch ? ch->name() : std::string("no channel")) + "', not the model's ranks (" + place->name() + ")");
    return ch;
  };
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : parts) {  // a std::map: every rank gathers in the same (name) order
    if (!t.defined()) {
      out[name] = t;
      continue;
    }
    const TpSplit s = usable(split_of(name), t);
    Group* ch = channel_for(s);
    out[name] = ch ? tp_whole(t.detach(), s, *ch, "gathering " + name) : t.detach();
  }
  return out;
}

std::map<std::string, torch::Tensor> TpLayout::parts_by(const std::map<std::string, torch::Tensor>& wholes,
                                                        const SplitOf& split_of, const std::string& source) const {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : wholes) {
    if (!t.defined()) {
      out[name] = t;
      continue;
    }
    const TpSplit s = usable(split_of(name), t);
    const Group* g = group_of(s);
    out[name] = g ? tp_part(t, s, *g, source.empty() ? name : source + ": " + name) : t;
  }
  return out;
}

}  // namespace flowrun::parallel
