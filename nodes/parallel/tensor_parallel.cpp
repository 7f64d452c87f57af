// Megatron-LM's conjugate operators f and g (tensor_parallel.hpp) as autograd functions.
#include "parallel/tensor_parallel.hpp"

#include <stdexcept>

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

}  // namespace

torch::Tensor vocab_parallel_embedding(const torch::Tensor& ids, const torch::Tensor& table,
                                       const std::shared_ptr<Group>& tp) {
  if (!tp || tp->size() == 1) return torch::embedding(table, ids);
  const int64_t rows = table.size(0), first = tp->rank() * rows;
  const torch::Tensor other = (ids < first) | (ids >= first + rows);
  torch::Tensor e = torch::embedding(table, (ids - first).masked_fill(other, 0));
  return reduce_from_tp(e.masked_fill(other.unsqueeze(-1), 0.0), tp);
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                           const std::shared_ptr<Group>& tp) {
  if (logits.dim() != 2 || targets.dim() != 1 || targets.size(0) != logits.size(0))
    throw std::runtime_error("vocab-parallel cross-entropy: logits [N, V/tp] and targets [N], got " +
                             c10::str(logits.sizes()) + " and " + c10::str(targets.sizes()));
  if (!tp || tp->size() == 1) return torch::nn::functional::cross_entropy(logits.to(torch::kFloat), targets);
  return VocabParallelCrossEntropy::apply(logits, targets, tp.get());
}

torch::Tensor copy_to_tp(const torch::Tensor& x, const std::shared_ptr<Group>& tp) {
  if (!tp || tp->size() == 1) return x;
  return CopyToTp::apply(x, tp.get());
}

torch::Tensor reduce_from_tp(const torch::Tensor& y, const std::shared_ptr<Group>& tp) {
  if (!tp || tp->size() == 1) return y;
  return ReduceFromTp::apply(y, tp.get());
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

}  // namespace flowrun::parallel
