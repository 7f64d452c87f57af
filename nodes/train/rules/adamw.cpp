// Update rule `adamw`: Adam with decoupled weight decay, as torch.optim.AdamW (bias-corrected,
// eps outside the square root). Per parameter p, gradient g (clipped), step t = 1, 2, ...:
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   p = p (1 - lr wd) - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// (the optimizer node applies the decay, only where decays(p)). Settings: schemas/optimizer.yaml,
// `adamw:`. Three ways to run it, same formulas: torch's fused multi-tensor kernel on a GPU, one
// AVX2 pass over every fp32 CPU tensor, and tensor operations (update()) for the rest.

#include <cmath>

#include "train/optimizer.hpp"
#include "train/rules/cpu_apply.hpp"

namespace flowrun {
namespace {

// The CPU kernel's constants for one tensor:
//   g' = g * clip;  m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2
//   p  = p * decay  -  step_size m / (sqrt(v) / sqrt_bc2 + eps)
struct AdamwPiece {
  float *p, *m, *v;
  const float* g;
  int64_t n;
  float clip, b1, b2, decay, step_size, sqrt_bc2, eps;
};

#if FLOWRUN_HAVE_AVX2_CODE
FLOWRUN_NO_FP_CONTRACT_BEGIN
FLOWRUN_AVX2 void adamw_cpu_kernel(const AdamwPiece& k, int64_t b, int64_t e) {
  const __m256 clip = _mm256_set1_ps(k.clip), b1 = _mm256_set1_ps(k.b1), c1 = _mm256_set1_ps(1.0f - k.b1);
  const __m256 b2 = _mm256_set1_ps(k.b2), c2 = _mm256_set1_ps(1.0f - k.b2), decay = _mm256_set1_ps(k.decay);
  const __m256 step = _mm256_set1_ps(k.step_size), sbc2 = _mm256_set1_ps(k.sqrt_bc2), eps = _mm256_set1_ps(k.eps);
  rules::by_8_lanes(k.p, k.g, k.m, k.v, b, e, [&](float* pp, const float* gg, float* mm, float* vv) FLOWRUN_AVX2 {
    const __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(gg), clip);
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(mm)), _mm256_mul_ps(c1, gi));
    const __m256 vi = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(vv)), _mm256_mul_ps(_mm256_mul_ps(c2, gi), gi));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), sbc2), eps);
    const __m256 pi = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(pp), decay),
                                    _mm256_div_ps(_mm256_mul_ps(step, mi), denom));
    _mm256_storeu_ps(mm, mi);
    _mm256_storeu_ps(vv, vi);
    _mm256_storeu_ps(pp, pi);
  });
}
FLOWRUN_NO_FP_CONTRACT_END
#else
void adamw_cpu_kernel(const AdamwPiece&, int64_t, int64_t) {}
#endif

class AdamW : public UpdateRule {
 public:
  explicit AdamW(const Params& p) : b1_(p.get<double>("beta1")), b2_(p.get<double>("beta2")), eps_(p.get<double>("eps")) {}

  std::vector<std::string> moments() const override { return {"exp_avg", "exp_avg_sq"}; }

  void update(torch::Tensor& p, const torch::Tensor& g, std::vector<torch::Tensor>& m, const Step& s) const override {
    m[0].mul_(b1_).add_(g, 1.0 - b1_);
    m[1].mul_(b2_).addcmul_(g, g, 1.0 - b2_);
    const double t = static_cast<double>(s.t);
    const double bc1 = 1.0 - std::pow(b1_, t), bc2 = 1.0 - std::pow(b2_, t);
    torch::Tensor denom = (m[1].sqrt() / std::sqrt(bc2)).add_(eps_);
    p.addcdiv_(m[0], denom, -s.lr / bc1);
  }

  // On a GPU: torch's fused multi-tensor kernel (torch.optim.AdamW(fused=True)), one launch
  // for all parameters of a group instead of ~8 per parameter. Not for CPU tensors, mixed
  // devices or dtypes, a parameter without a gradient this step, or
  // moments of different ages (a parameter that once had no gradient).
  bool on_device(const OptimizerState& st, const ModelState::Named& params, const Grads& grads) const override {
    if (params.empty() || !params.front().second.is_cuda()) return false;
    const torch::Device device = params.front().second.device();
    const auto dtype = params.front().second.scalar_type();
    for (size_t i = 0; i < params.size(); ++i)
      if (!grads[i].defined() || params[i].second.device() != device || params[i].second.scalar_type() != dtype ||
          grads[i].scalar_type() != dtype)
        return false;
    // All parameters take this step together, so one step tensor serves every one of them.
    for (const auto& s : st.slots)
      if (s.step != st.slots.front().step) return false;
    return true;
  }

  void update_many(Batch& b) const override {
    if (b.on_device)
      fused(b);
    else
      cpu(b);
  }

 private:
  // The clip factor enters as the kernel's grad_scale (it divides: 1 / coef), a non-finite
  // step's flag as its found_inf (the kernel then changes nothing, and the step tensor does not
  // advance). Two groups: parameters that decay and those that do not.
  void fused(Batch& b) const {
    OptimizerState& st = b.state;
    const torch::Device device = b.params.front().second.device();
    if (!st.fused_step.defined())
      st.fused_step = torch::full({}, static_cast<double>(st.slots.front().step),
                                  torch::TensorOptions().dtype(torch::kFloat).device(device));
    // step += 1 - found: a skipped update does not count (torch's fused AdamW does the same).
    if (b.found_inf.defined())
      st.fused_step.sub_(b.found_inf).add_(1);
    else
      st.fused_step.add_(1);
    std::vector<at::Tensor> p[2], g[2], m[2], v[2], steps[2];
    for (size_t i = 0; i < b.params.size(); ++i) {
      OptimizerState::Slot& s = st.slots[i];
      const torch::Tensor& w = b.params[i].second;
      s.step += 1;  // the host's count; fused_step is the truth (tensors() reports it)
      const int k = s.decays(w) ? 0 : 1;
      p[k].push_back(w);
      g[k].push_back(b.grads[i]);
      m[k].push_back(s.m[0]);
      v[k].push_back(s.m[1]);
      b.done[i] = 1;
    }
    c10::optional<at::Tensor> scale, found;
    if (b.clip.defined()) scale = b.clip.reciprocal().to(torch::kFloat);
    if (b.found_inf.defined()) found = b.found_inf;
    for (int k = 0; k < 2; ++k) {
      if (p[k].empty()) continue;
      steps[k].assign(p[k].size(), st.fused_step);
      at::_fused_adamw_(p[k], g[k], m[k], v[k], /*max_exp_avg_sqs=*/{}, steps[k], b.lr, b1_, b2_,
                        k == 0 ? b.weight_decay : 0.0, eps_, /*amsgrad=*/false, /*maximize=*/false, scale, found);
    }
  }

  // fp32 CPU tensors: one pass over all of them (rules/cpu_apply.hpp).
  void cpu(Batch& b) const {
    if (!cpu_has_avx2()) return;
    std::vector<AdamwPiece> pieces;
    for (size_t i = 0; i < b.params.size(); ++i) {
      const torch::Tensor& p = b.params[i].second;
      const torch::Tensor& g = b.grads[i];
      OptimizerState::Slot& s = b.state.slots[i];
      if (!rules::cpu_fp32(p) || !rules::cpu_fp32(g) || !rules::cpu_fp32(s.m[0]) || !rules::cpu_fp32(s.m[1])) continue;
      s.step += 1;
      const double t = static_cast<double>(s.step);
      const double bc1 = 1.0 - std::pow(b1_, t), bc2 = 1.0 - std::pow(b2_, t);
      const float decay = b.weight_decay > 0 && s.decays(p) ? static_cast<float>(1.0 - b.lr * b.weight_decay) : 1.0f;
      pieces.push_back({p.data_ptr<float>(), s.m[0].data_ptr<float>(), s.m[1].data_ptr<float>(), g.data_ptr<float>(),
                        p.numel(), b.clip_cpu, static_cast<float>(b1_), static_cast<float>(b2_), decay,
                        static_cast<float>(b.lr / bc1), static_cast<float>(std::sqrt(bc2)), static_cast<float>(eps_)});
      b.done[i] = 1;
      // Written through pointers: tell autograd the tensors changed, as in-place ops would.
      for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&p, &s.m[0], &s.m[1]})
        torch::autograd::impl::bump_version(*t);
    }
    rules::for_each_chunk(pieces, [](const AdamwPiece& k, int64_t lo, int64_t hi) { adamw_cpu_kernel(k, lo, hi); });
  }

  double b1_, b2_, eps_;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_UPDATE_RULE(adamw, flowrun::AdamW)
