// GELU with the tanh approximation (GPT-2's "gelu_new", HunyuanDiT's MLP):
//
//   gelu(x) = 0.5 x (1 + tanh(u)),   u = sqrt(2/pi) (x + 0.044715 x^3)
//           = x s,                   s = sigmoid(2u)          (0.5 (1 + tanh u) = sigmoid(2u))
//   gelu'(x) = s + x s (1 - s) d(2u)/dx,   d(2u)/dx = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2)
//
// On the CPU, for contiguous fp32 tensors, one pass forward and one pass backward (backward
// recomputes s from x): libtorch 1.13's gelu(tanh) spent most of its time in a full-precision
// tanh, and its backward more than twice that (18 ms of a 370 ms GPT bench step). PyTorch 2.11's
// runs about as fast (bench/README.md); this one stays for its gradient at x << 0. The exp here
// is Cephes' expf (within 2 ulp): results are as close to the exact (double) values as
// torch::gelu(x, "tanh")'s, and closer for the gradient at x << 0, where torch's 1 - tanh^2
// cancels (tests/nodes/gelu_tanh_test.cpp). Everything else (other dtypes, devices, layouts; CPUs
// without AVX2 and FMA) is torch::gelu(x, "tanh").
#pragma once
#include <torch/torch.h>

namespace flowrun {

torch::Tensor gelu_tanh(const torch::Tensor& x);

// The kernels, for the tests: y = gelu(x); gx = g * gelu'(x). Pointers to n floats.
// Returns false (doing nothing) where the CPU lacks AVX2/FMA.
bool gelu_tanh_forward_kernel(const float* x, float* y, int64_t n);
bool gelu_tanh_backward_kernel(const float* x, const float* g, float* gx, int64_t n);

}  // namespace flowrun
