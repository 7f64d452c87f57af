// Update rule `adafactor` (Shazeer & Stern 2018) as big_vision's scale_by_adafactor (the CapPa
// and ViT-g trainers), per parameter p with gradient g (after global-norm clipping), step
// t = 1, 2, ...:
//   beta2_t = min(beta2_cap, 1 - t^-decay_rate)
//   r = g^2 + eps
//   factored (p has 2+ dims and its second-largest dim >= min_dim_size_to_factor; a = the
//   largest dim, b = the second largest):
//     v_row = beta2_t v_row + (1 - beta2_t) mean_a(r)        (the shape of p without dim a)
//     v_col = beta2_t v_col + (1 - beta2_t) mean_b(r)        (the shape of p without dim b)
//     u = g / sqrt(v_row / mean_b(v_row))  [broadcast over a]  / sqrt(v_col)  [over b]
//   else:
//     v = beta2_t v + (1 - beta2_t) r;   u = g / sqrt(v)
//   update clipping (clipping_threshold d > 0): u = u / max(1, rms(u) / d)
//   momentum m (> 0): m = momentum m + (1 - momentum) u; u = m   (an EMA, not debiased)
//   p = p (1 - lr wd) - lr u            (the optimizer node applies the decay, where decays(p))
// No relative step size: lr comes from the schedule, like every other rule. Settings:
// schemas/optimizer.yaml, `adafactor:`. Not element-wise: ZeRO gives each rank whole parameters.
// Under tensor parallel (Step::part: p is this rank's block of a whole parameter along one
// dimension) the factored dims are the whole's, a mean over the split dimension and the update's
// RMS are sums over the tp group, and a statistic without the split dimension is whole on every
// rank (the same sums): the parts update as the whole would, within rounding.
#include "train/rules/adafactor.hpp"

#include <algorithm>
#include <cmath>

#include "parallel/collectives.hpp"
#include "train/optimizer.hpp"

namespace flowrun {

std::pair<int64_t, int64_t> adafactor_factored_dims(c10::IntArrayRef shape, int64_t min_dim_size_to_factor) {
  if (shape.size() < 2) return {-1, -1};
  std::vector<int64_t> order(shape.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return shape[x] < shape[y]; });
  const int64_t a = order[order.size() - 1], b = order[order.size() - 2];
  if (shape[b] < min_dim_size_to_factor) return {-1, -1};
  return {a, b};
}

namespace {

class Adafactor : public UpdateRule {
 public:
  explicit Adafactor(const Params& p)
      : decay_rate_(p.get<double>("decay_rate")),
        beta2_cap_(p.get<double>("beta2_cap")),
        eps_(p.get<double>("eps")),
        min_dim_(p.get<int64_t>("min_dim_size_to_factor")),
        clipping_threshold_(p.get<double>("clipping_threshold", 0.0)),  // null: off
        momentum_(p.get<double>("momentum")) {}

  // The momentum (exp_avg, as optax's scale_by_adafactor keeps it), if any.
  std::vector<std::string> moments() const override {
    if (momentum_ > 0) return {"exp_avg"};
    return {};
  }

  // Factored: a row and a column statistic (v_row: the shape without dim a, v_col: without dim
  // b); else one of the parameter's shape (v).
  std::vector<std::pair<std::string, std::vector<int64_t>>> own_moments(c10::IntArrayRef shape) const override {
    const auto [a, b] = adafactor_factored_dims(shape, min_dim_);
    if (a < 0) return {{"v", shape.vec()}};
    std::vector<int64_t> row = shape.vec(), col = shape.vec();
    row.erase(row.begin() + a);
    col.erase(col.begin() + b);
    return {{"v_row", row}, {"v_col", col}};
  }

  bool elementwise() const override { return false; }

  // v_row lacks dim a, v_col dim b: whole on every tp part when that is the split one, else cut
  // along the split dimension's place in it.
  int64_t own_moment_dim(c10::IntArrayRef whole, int64_t dim, const std::string& name) const override {
    const auto [a, b] = adafactor_factored_dims(whole, min_dim_);
    const int64_t gone = name == "v_row" ? a : name == "v_col" ? b : -1;
    if (gone < 0) return dim;  // v: shaped as the parameter
    return dim == gone ? -1 : dim > gone ? dim - 1 : dim;
  }

  void update(torch::Tensor& p, const torch::Tensor& g0, std::vector<torch::Tensor>& m, const Step& s) const override {
    const size_t own = momentum_ > 0 ? 1 : 0;  // m: [exp_avg], then v_row, v_col or v
    const torch::Tensor g = g0.to(torch::kFloat);
    const double beta2 = std::min(beta2_cap_, 1.0 - std::pow(static_cast<double>(s.t), -decay_rate_));
    const torch::Tensor r = g.square().add_(eps_);
    const Part* part = s.part;
    // The mean of x over dimension `d` of the whole parameter (`d_in_x`: its place in x), summed
    // over the tp parts where d is the split one.
    auto mean_over = [&](const torch::Tensor& x, int64_t d, int64_t d_in_x, bool keepdim = false) {
      if (!part || d != part->dim) return x.mean(d_in_x, keepdim);
      torch::Tensor sum = x.sum(d_in_x, keepdim).contiguous();
      part->group->all_reduce(sum, comm::Op::sum, "adafactor: a statistic over the split dimension").wait();
      return sum.div_(static_cast<double>(part->whole[static_cast<size_t>(d)]));
    };
    torch::Tensor u;
    if (m.size() - own == 2) {
      torch::Tensor &v_row = m[own], &v_col = m[own + 1];
      // The slot was made factored: the dims of the whole (a part's may order otherwise).
      const auto [a, b] = adafactor_factored_dims(part ? c10::IntArrayRef(part->whole) : g.sizes(), 0);
      v_row.mul_(beta2).add_(mean_over(r, a, a), 1.0 - beta2);
      v_col.mul_(beta2).add_(mean_over(r, b, b), 1.0 - beta2);
      const int64_t b_in_row = b > a ? b - 1 : b;  // dim b of p within v_row (dim a removed)
      const torch::Tensor row = (v_row / mean_over(v_row, b, b_in_row, /*keepdim=*/true)).rsqrt();
      u = g * row.unsqueeze(a) * v_col.rsqrt().unsqueeze(b);
    } else {
      torch::Tensor& v = m[own];
      v.mul_(beta2).add_(r, 1.0 - beta2);
      u = g * v.rsqrt();
    }
    if (clipping_threshold_ > 0) {  // clip_by_block_rms, over the whole parameter
      torch::Tensor rms = u.square().mean();
      if (part) {
        torch::Tensor sum = u.square().sum().reshape({1}).contiguous();
        part->group->all_reduce(sum, comm::Op::sum, "adafactor: the update's RMS").wait();
        rms = sum.div_(static_cast<double>(c10::multiply_integers(part->whole))).reshape({});
      }
      rms = rms.sqrt();
      u = u / torch::clamp_min(rms / clipping_threshold_, 1.0);
    }
    if (momentum_ > 0) {
      m[0].mul_(momentum_).add_(u, 1.0 - momentum_);
      u = m[0];
    }
    p.add_(u.to(g0.dtype()), -s.lr);
  }

 private:
  double decay_rate_, beta2_cap_, eps_;
  int64_t min_dim_;
  double clipping_threshold_, momentum_;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_UPDATE_RULE(adafactor, flowrun::Adafactor)
