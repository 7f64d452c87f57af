// The fused GELU (tanh approximation): see gelu_tanh.hpp for the math.
// Test: tests/nodes/gelu_tanh_test.cpp.
#include "models/gelu_tanh.hpp"

#include <ATen/Parallel.h>

#include <cmath>

#include "common/cpu_simd.hpp"

namespace flowrun {

namespace {

constexpr float kA = 1.5957691216057308f;  // 2 sqrt(2/pi)
constexpr float kC = 0.044715f;

#if FLOWRUN_HAVE_AVX2_CODE
// s = sigmoid(2u) = 1 / (1 + e^(-2u)), 2u = kA x (1 + kC x^2).
FLOWRUN_AVX2 inline __m256 sig8(__m256 x, __m256 x2) {
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 two_u = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(kA), x), _mm256_fmadd_ps(_mm256_set1_ps(kC), x2, one));
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), two_u))));
}

// The same for one float (the tails of the vector loops): same formula, same rounding steps.
FLOWRUN_AVX2 inline float sig1(float x) {
  alignas(32) float v[8] = {x}, s[8];
  __m256 vx = _mm256_load_ps(v);
  _mm256_store_ps(s, sig8(vx, _mm256_mul_ps(vx, vx)));
  return s[0];
}

FLOWRUN_AVX2 void forward_avx2(const float* x, float* y, int64_t b, int64_t e) {
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    __m256 vx = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(vx, sig8(vx, _mm256_mul_ps(vx, vx))));
  }
  for (; i < e; ++i) y[i] = x[i] * sig1(x[i]);
}

// gx = g (s + x s (1 - s) kA (1 + 3 kC x^2))
FLOWRUN_AVX2 void backward_avx2(const float* x, const float* g, float* gx, int64_t b, int64_t e) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    __m256 vx = _mm256_loadu_ps(x + i);
    __m256 x2 = _mm256_mul_ps(vx, vx);
    __m256 s = sig8(vx, x2);
    __m256 du = _mm256_mul_ps(_mm256_set1_ps(kA), _mm256_fmadd_ps(_mm256_set1_ps(3.0f * kC), x2, one));
    __m256 d = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(vx, s), _mm256_sub_ps(one, s)), du, s);
    _mm256_storeu_ps(gx + i, _mm256_mul_ps(_mm256_loadu_ps(g + i), d));
  }
  for (; i < e; ++i) {
    const float s = sig1(x[i]);
    const float du = kA * (1.0f + 3.0f * kC * x[i] * x[i]);
    gx[i] = g[i] * (s + x[i] * s * (1.0f - s) * du);
  }
}

#else
void forward_avx2(const float*, float*, int64_t, int64_t) {}
void backward_avx2(const float*, const float*, float*, int64_t, int64_t) {}
#endif

constexpr int64_t kGrain = 16384;  // elements per task: a few microseconds of work

bool fast_path(const torch::Tensor& x) {
  return cpu_has_avx2() && x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.is_contiguous();
}

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct GeluTanh : torch::autograd::Function<GeluTanh> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x) {
    torch::Tensor y = torch::empty_like(x);
    gelu_tanh_forward_kernel(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
    ctx->save_for_backward({x});
    return y;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grad_out) {
    const torch::Tensor x = ctx->get_saved_variables()[0];
    const torch::Tensor g = grad_out[0].contiguous();
    if (g.scalar_type() != torch::kFloat || !g.device().is_cpu())
      return {at::gelu_backward(g, x, "tanh")};
    torch::Tensor gx = torch::empty_like(x);
    gelu_tanh_backward_kernel(x.data_ptr<float>(), g.data_ptr<float>(), gx.data_ptr<float>(), x.numel());
    return {gx};
  }
};

}  // namespace

bool gelu_tanh_forward_kernel(const float* x, float* y, int64_t n) {
  if (!cpu_has_avx2()) return false;
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) { forward_avx2(x, y, b, e); });
  return true;
}

bool gelu_tanh_backward_kernel(const float* x, const float* g, float* gx, int64_t n) {
  if (!cpu_has_avx2()) return false;
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) { backward_avx2(x, g, gx, b, e); });
  return true;
}

torch::Tensor gelu_tanh(const torch::Tensor& x) {
  if (!fast_path(x)) return torch::gelu(x, "tanh");
  return GeluTanh::apply(x);
}

}  // namespace flowrun
