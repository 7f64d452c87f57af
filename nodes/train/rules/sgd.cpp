// Update rule `sgd`: SGD with momentum, as torch.optim.SGD (the buffer starts as the first
// gradient: m = mu m + g from m = 0). Per parameter p, gradient g (clipped):
//   m = mu m + g;   p = p (1 - lr wd) - lr m        (momentum 0: p = p (1 - lr wd) - lr g)
// (the optimizer node applies the decay, only where decays(p)). Settings: schemas/optimizer.yaml,
// `sgd:`. fp32 CPU tensors take one AVX2 pass over all of them, the rest update().
#include "train/optimizer.hpp"
#include "train/rules/cpu_apply.hpp"

namespace flowrun {
namespace {

// The CPU kernel's constants for one tensor: d = g * clip (+ momentum * m, stored in m);
// p = p * decay - lr d.
struct SgdPiece {
  float* p;
  const float* g;
  float* m;  // nullptr: no momentum
  int64_t n;
  float clip, decay, lr, momentum;
};

#if FLOWRUN_HAVE_AVX2_CODE
FLOWRUN_NO_FP_CONTRACT_BEGIN
FLOWRUN_AVX2 void sgd_cpu_kernel(const SgdPiece& k, int64_t b, int64_t e) {
  const __m256 clip = _mm256_set1_ps(k.clip), decay = _mm256_set1_ps(k.decay), lr = _mm256_set1_ps(k.lr);
  const __m256 mu = _mm256_set1_ps(k.momentum);
  rules::by_8_lanes(k.p, k.g, k.m, nullptr, b, e, [&](float* pp, const float* gg, float* mm, float*) FLOWRUN_AVX2 {
    __m256 d = _mm256_mul_ps(_mm256_loadu_ps(gg), clip);
    if (mm) {
      d = _mm256_add_ps(_mm256_mul_ps(mu, _mm256_loadu_ps(mm)), d);
      _mm256_storeu_ps(mm, d);
    }
    _mm256_storeu_ps(pp, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(pp), decay), _mm256_mul_ps(lr, d)));
  });
}
FLOWRUN_NO_FP_CONTRACT_END
#else
void sgd_cpu_kernel(const SgdPiece&, int64_t, int64_t) {}
#endif

class Sgd : public UpdateRule {
 public:
  explicit Sgd(const Params& p) : momentum_(p.get<double>("momentum")) {}

  std::vector<std::string> moments() const override {
    if (momentum_ > 0) return {"momentum_buffer"};  // torch.optim.SGD's name
    return {};
  }

  void update(torch::Tensor& p, const torch::Tensor& g, std::vector<torch::Tensor>& m, const Step& s) const override {
    if (m.empty()) {
      p.add_(g, -s.lr);
      return;
    }
    m[0].mul_(momentum_).add_(g);
    p.add_(m[0], -s.lr);
  }

  void update_many(Batch& b) const override {
    if (!cpu_has_avx2()) return;
    const bool momentum = momentum_ > 0;
    std::vector<SgdPiece> pieces;
    for (size_t i = 0; i < b.params.size(); ++i) {
      const torch::Tensor& p = b.params[i].second;
      const torch::Tensor& g = b.grads[i];
      OptimizerState::Slot& s = b.state.slots[i];
      if (!rules::cpu_fp32(p) || !rules::cpu_fp32(g) || (momentum && !rules::cpu_fp32(s.m[0]))) continue;
      s.step += 1;
      const float decay = b.weight_decay > 0 && s.decays(p) ? static_cast<float>(1.0 - b.lr * b.weight_decay) : 1.0f;
      pieces.push_back({p.data_ptr<float>(), g.data_ptr<float>(), momentum ? s.m[0].data_ptr<float>() : nullptr,
                        p.numel(), b.clip_cpu, decay, static_cast<float>(b.lr), static_cast<float>(momentum_)});
      b.done[i] = 1;
      // Written through pointers: tell autograd the tensors changed, as in-place ops would.
      torch::autograd::impl::bump_version(p);
      if (momentum) torch::autograd::impl::bump_version(s.m[0]);
    }
    rules::for_each_chunk(pieces, [](const SgdPiece& k, int64_t lo, int64_t hi) { sgd_cpu_kernel(k, lo, hi); });
  }

 private:
  double momentum_;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_UPDATE_RULE(sgd, flowrun::Sgd)
