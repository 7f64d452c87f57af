// gelu_tanh: the fused CPU GELU (tanh approximation) is as accurate as torch::gelu(x, "tanh")
// against the exact (double) values, forward and backward, at every length (vector body and
// scalar tail) and over the whole range (saturation on both sides, zero, huge values); other
// inputs take torch's own.
#include <gtest/gtest.h>

#include "common/cpu_simd.hpp"
#include "common/torch_setup.hpp"
#include "models/gelu_tanh.hpp"

namespace flowrun {
namespace {

// Forward and input gradient (for upstream gradient g) of f at x.
std::pair<torch::Tensor, torch::Tensor> value_and_grad(const std::function<torch::Tensor(const torch::Tensor&)>& f,
                                                       const torch::Tensor& x, const torch::Tensor& g) {
  torch::Tensor xx = x.detach().clone().requires_grad_(true);
  torch::Tensor y = f(xx);
  y.backward(g);
  return {y.detach(), xx.grad()};
}

torch::Tensor reference(const torch::Tensor& x) { return torch::gelu(x, "tanh"); }

// Max |got - exact| / (1 + |exact|) (absolute below 1, relative above), exact = torch's formula
// in double precision.
double error(const torch::Tensor& got, const torch::Tensor& exact) {
  return ((got.to(torch::kDouble) - exact).abs() / (exact.abs() + 1.0)).max().item<double>();
}

// gelu_tanh against the exact values, and no worse than torch's own fp32 gelu(tanh) (plus a
// little: both round differently). `backward`: also the input gradient (needs x^2 finite).
void expect_accurate(const torch::Tensor& x, bool backward = true) {
  torch::Tensor g = torch::randn_like(x);
  auto [y, gx] = value_and_grad(gelu_tanh, x, g);
  auto [y32, gx32] = value_and_grad(reference, x, g);
  auto [y64, gx64] = value_and_grad(reference, x.to(torch::kDouble), g.to(torch::kDouble));
  const double ours = error(y, y64), torchs = error(y32, y64);
  EXPECT_LT(ours, 1e-6) << "forward, n=" << x.numel() << " (torch fp32: " << torchs << ")";
  EXPECT_LE(ours, torchs + 2e-7) << "forward, n=" << x.numel();
  ::testing::Test::RecordProperty("forward_error_ours_vs_torch", std::to_string(ours) + " / " + std::to_string(torchs));
  if (!backward) return;
  const double gours = error(gx, gx64), gtorchs = error(gx32, gx64);
  EXPECT_LT(gours, 2e-6) << "backward, n=" << x.numel() << " (torch fp32: " << gtorchs << ")";
  EXPECT_LE(gours, gtorchs + 5e-7) << "backward, n=" << x.numel();  // a few ulp either way
}

// The fused kernels (and every at::parallel_for of flowrun's code) split over torch's intra-op
// threads as torch's own operators do: compiled without OpenMP (cmake/torch.cmake), the loop ran
// on one thread while the other cores waited, a few per cent of every CPU step.
TEST(GeluTanh, KernelsSplitOverTorchsThreads) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  EXPECT_EQ(parallel_for_threads_used(), 2);
  at::set_num_threads(1);
  EXPECT_EQ(parallel_for_threads_used(), 1);
  at::set_num_threads(before);
}

TEST(GeluTanh, MatchesTorchOverTheRange) {
  if (!cpu_has_avx2()) GTEST_SKIP() << "no AVX2/FMA: gelu_tanh is torch::gelu here";
  torch::manual_seed(0);
  expect_accurate(torch::randn({4096, 257}) * 3);     // parallel chunks, odd row length
  expect_accurate(torch::linspace(-12, 12, 100003));  // through both saturations
  expect_accurate(torch::tensor({0.0f, -0.0f, 1e-30f, -1e-30f, 1e-3f, -1e-3f, 5.0f, -5.0f, 50.0f, -50.0f, 1e15f,
                                 -1e15f}));
  // x^2 overflows: the forward still saturates to x and to -0, as torch's.
  torch::Tensor huge = torch::tensor({1e20f, -1e20f, 3.4e38f, -3.4e38f});
  EXPECT_TRUE(torch::equal(gelu_tanh(huge), reference(huge))) << gelu_tanh(huge) << reference(huge);
}

TEST(GeluTanh, EveryTailLength) {
  if (!cpu_has_avx2()) GTEST_SKIP() << "no AVX2/FMA: gelu_tanh is torch::gelu here";
  torch::manual_seed(1);
  for (int64_t n = 1; n <= 17; ++n) expect_accurate(torch::randn({n}) * 4);
}

TEST(GeluTanh, KernelsTakeTheFastPathOnlyWhereTheyApply) {
  torch::manual_seed(2);
  // Other dtypes and layouts are torch's own gelu, bit for bit.
  torch::Tensor d = torch::randn({64, 33}, torch::kDouble);
  EXPECT_TRUE(torch::equal(gelu_tanh(d), reference(d)));
  torch::Tensor t = torch::randn({33, 64}).t();  // not contiguous
  EXPECT_TRUE(torch::equal(gelu_tanh(t), reference(t)));
  // The fused path differs from torch's in the last bits somewhere on a large input: it ran.
  if (cpu_has_avx2()) {
    torch::Tensor x = torch::randn({1 << 16});
    EXPECT_FALSE(torch::equal(gelu_tanh(x), reference(x)));
  }
}

TEST(GeluTanh, ReportsAMissingCpuFeatureInsteadOfWritingGarbage) {
  float x[3] = {-1.0f, 0.0f, 1.0f}, y[3] = {7, 7, 7};
  const bool ran = gelu_tanh_forward_kernel(x, y, 3);
  EXPECT_EQ(ran, cpu_has_avx2());
  if (!ran) EXPECT_EQ(y[0], 7.0f);
}

}  // namespace
}  // namespace flowrun
