// The product of a linear layer: y = x · Wᵀ + b (weight [out, in], as torch::nn::Linear) or
// y = x · W + b (w_in_out: weight [in, out], Hugging Face's Conv1D); lora::Linear's base product
// and GPT's tied head. Where cpu_linear_applies() (float32 on the CPU, OpenBLAS active:
// common/cpu_blas.hpp, run.cpu_gemm), one autograd function whose three products run through
// OpenBLAS; elsewhere libtorch's linear (addmm), or for Conv1D's layout matmul as transformers
// computes it.
//
// Forward copies the bias into y and multiplies with β = 1 (as torch's addmm does), for a
// [..., in] input of any rank: one product over the rows, never a separate bias pass (libtorch's
// x · W + b for a 3-d x in Conv1D's layout is a product and then an add). Backward computes only
// the gradients autograd asks for: dx = g · W (or g · Wᵀ), dW = gᵀ · x (or xᵀ · g), db = Σ rows g.
// Test: tests/nodes/linear_test.cpp (the kernel against torch's linear, values and gradients).
#pragma once
#include <torch/torch.h>

namespace flowrun {

// bias may be undefined (no bias).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {},
                     bool w_in_out = false);

// The CPU kernel alone, for the tests:

// x, weight (and bias, when defined) float32 on the CPU, outside CPU autocast, and OpenBLAS active.
bool cpu_linear_applies(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);

// bias may be undefined (no bias).
torch::Tensor cpu_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                         bool w_in_out);

}  // namespace flowrun
