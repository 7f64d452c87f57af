// The cross-entropy kernels of a GPU build (cross_entropy_kernels.cu, compiled by nvcc into
// flowrun_cuda_kernels only with FLOWRUN_CUDA): the row-wise logsumexp + loss forward and the
// (softmax - one_hot) * grad / N backward of train/cross_entropy.hpp's `fused` kernel, reading
// logits of any float dtype directly (no fp32 copy of the [N, V] logits, no log-softmax
// output kept for backward: one fp32 logsumexp per row). Plain pointers, no torch: the torch
// glue is in cross_entropy.cpp. Each returns nullptr, or the CUDA error of the launch.
#pragma once
#include <cstdint>

namespace flowrun::cuda_kernels {

enum class Float { f32, bf16, f16 };

// logits: [N, V] row-major on the device; targets: int64 [N]; writes lse [N] and loss [N]
// (lse - logits[i, targets[i]]; NaN for a row with a NaN or +inf logit or a target outside
// [0, V)). stream: a cudaStream_t.
const char* cross_entropy_forward(Float dtype, const void* logits, const int64_t* targets, int64_t N, int64_t V,
                                  float* lse, float* loss, void* stream);

// grad [N, V] (the logits' dtype) = (exp(logits - lse) - one_hot(targets)) * grad_out[0] / N;
// grad_out: one fp32 value on the device.
const char* cross_entropy_backward(Float dtype, const void* logits, const int64_t* targets, const float* lse,
                                   const float* grad_out, int64_t N, int64_t V, void* grad, void* stream);

}  // namespace flowrun::cuda_kernels
