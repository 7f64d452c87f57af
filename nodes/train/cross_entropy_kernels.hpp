// The cross-entropy kernels of a GPU build (cross_entropy_kernels.cu, compiled by nvcc into
// flowrun_cuda_kernels only with FLOWRUN_CUDA): the row-wise logsumexp + loss forward and the
// (softmax - one_hot) * grad backward of train/cross_entropy.hpp's `fused` kernel (its mean and
// its per-row losses with label smoothing), reading
// logits of any float dtype directly (no fp32 copy of the [N, V] logits, no log-softmax
// output kept for backward: one fp32 logsumexp per row). Plain pointers, no torch: the torch
// glue is in cross_entropy.cpp. Each returns nullptr, or the CUDA error of the launch.
#pragma once
#include <cstdint>

namespace flowrun::cuda_kernels {

enum class Float { f32, bf16, f16 };

// logits: [N, V] row-major on the device; targets: int64 [N]; writes lse [N] and loss [N]
// (lse - (1 - e) logits[i, targets[i]] - e mean_j logits[i, j], e = the label smoothing; NaN
// for a row with a NaN or +inf logit or a target outside [0, V)). stream: a cudaStream_t.
const char* cross_entropy_forward(Float dtype, const void* logits, const int64_t* targets, int64_t N, int64_t V,
                                  float smoothing, float* lse, float* loss, void* stream);

// grad [N, V] (the logits' dtype) = (exp(logits - lse) - (1 - e) one_hot(targets) - e / V) * g_i,
// g_i = grad_out[0] / N (the mean's gradient: per_row false) or grad_out[i] (per_row true);
// grad_out: fp32 on the device.
const char* cross_entropy_backward(Float dtype, const void* logits, const int64_t* targets, const float* lse,
                                   const float* grad_out, bool per_row, int64_t N, int64_t V, float smoothing,
                                   void* grad, void* stream);

}  // namespace flowrun::cuda_kernels
