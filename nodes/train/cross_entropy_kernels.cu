// The fused cross-entropy kernels of a GPU: see cross_entropy_kernels.hpp.
//
// One block per row of the logits. Forward: one pass over the row keeps a running (max, sum of
// exp(x - max)) per thread (the online softmax) and, with label smoothing e, the row's sum; the
// block combines them, and the row's logsumexp and loss (lse - (1 - e) x[target] - e mean(x))
// are written as fp32. Backward: one pass writes (exp(x - lse) - (1 - e) [j == target] - e / V)
// times the row's gradient (grad_out[0] / N for a mean, grad_out[row] per row) in the logits'
// dtype. Reads are 16 bytes wide
// where the row allows it (its length a multiple of 16 bytes and the data 16-byte aligned).
// Non-finite logits (NaN, +inf) make the row's loss NaN, as the library's log_softmax would
// make it non-finite; -inf is a logit of probability 0.
#include "train/cross_entropy_kernels.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace flowrun::cuda_kernels {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// The running state of one thread's share of a row: max m, sum s of exp(x - m), and whether a
// NaN or +inf was seen.
struct Running {
  float m = -INFINITY, s = 0.f, sum = 0.f;
  bool bad = false;
  template <bool SUM>
  __device__ __forceinline__ void add(float v) {
    if constexpr (SUM) sum += v;
    if (v > m) {
      s = s * __expf(m - v) + 1.f;  // m = -inf at first: exp(-inf) = 0
      m = v;
    } else if (v > -INFINITY) {
      s += __expf(v - m);
    }
    bad |= isnan(v) || v == INFINITY;
  }
  __device__ __forceinline__ void merge(float m2, float s2, float sum2, bool bad2) {
    sum += sum2;
    if (m2 > m) {
      s = s * __expf(m - m2) + s2;
      m = m2;
    } else if (m2 > -INFINITY) {
      s += s2 * __expf(m2 - m);
    }
    bad |= bad2;
  }
};

// SUM: the row's sum is needed (label smoothing > 0).
template <typename T, int VEC, bool SUM>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets, int64_t V, float smoothing,
                   float* __restrict__ lse, float* __restrict__ loss) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  Running r;
  if constexpr (VEC > 1) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (int64_t j = threadIdx.x; j < V / VEC; j += kThreads) {
      uint4 u = xv[j];
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int k = 0; k < VEC; ++k) r.add<SUM>(to_float(e[k]));
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += kThreads) r.add<SUM>(to_float(x[j]));
  }
  // The warp, then the block.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, r.m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, r.s, o);
    const float sum2 = __shfl_xor_sync(0xffffffffu, r.sum, o);
    const int b2 = __shfl_xor_sync(0xffffffffu, static_cast<int>(r.bad), o);
    r.merge(m2, s2, sum2, b2 != 0);
  }
  __shared__ float sm[kWarps], ss[kWarps], ssum[kWarps];
  __shared__ int sb[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sm[warp] = r.m;
    ss[warp] = r.s;
    ssum[warp] = r.sum;
    sb[warp] = r.bad;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    Running all;
    for (int w = 0; w < kWarps; ++w) all.merge(sm[w], ss[w], ssum[w], sb[w] != 0);
    const int64_t t = targets[row];
    float l = all.bad ? NAN : all.m + logf(all.s);
    lse[row] = l;
    float picked = (t < 0 || t >= V) ? NAN : to_float(x[t]);
    if constexpr (SUM) picked = (1.f - smoothing) * picked + smoothing * (all.sum / static_cast<float>(V));
    loss[row] = l - picked;
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets,
                    const float* __restrict__ lse, const float* __restrict__ grad_out, int64_t go_stride,
                    float go_scale, float smoothing, int64_t V, T* __restrict__ grad) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  T* g = grad + row * V;
  const float l = lse[row], scale = grad_out[row * go_stride] * go_scale;
  const float hit = (1.f - smoothing) * scale, spread = smoothing / static_cast<float>(V) * scale;
  const int64_t t = targets[row];
  if constexpr (VEC > 1) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* gv = reinterpret_cast<uint4*>(g);
    for (int64_t j = threadIdx.x; j < V / VEC; j += kThreads) {
      uint4 u = xv[j], w;
      const T* e = reinterpret_cast<const T*>(&u);
      T* o = reinterpret_cast<T*>(&w);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        float p = __expf(to_float(e[k]) - l) * scale - spread;
        if (j * VEC + k == t) p -= hit;
        o[k] = from_float<T>(p);
      }
      gv[j] = w;
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += kThreads) {
      float p = __expf(to_float(x[j]) - l) * scale - spread;
      if (j == t) p -= hit;
      g[j] = from_float<T>(p);
    }
  }
}

// 16-byte loads when every row starts on a 16-byte boundary.
template <typename T>
bool wide(const void* p, int64_t V) {
  constexpr int vec = 16 / sizeof(T);
  return V % vec == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <typename T>
void launch_forward(const void* logits, const int64_t* targets, int64_t N, int64_t V, float smoothing, float* lse,
                    float* loss, cudaStream_t s) {
  const T* x = static_cast<const T*>(logits);
  constexpr int vec = 16 / sizeof(T);
  const bool w = wide<T>(logits, V), sum = smoothing != 0.f;
  if (w && sum) forward_kernel<T, vec, true><<<N, kThreads, 0, s>>>(x, targets, V, smoothing, lse, loss);
  else if (w) forward_kernel<T, vec, false><<<N, kThreads, 0, s>>>(x, targets, V, smoothing, lse, loss);
  else if (sum) forward_kernel<T, 1, true><<<N, kThreads, 0, s>>>(x, targets, V, smoothing, lse, loss);
  else forward_kernel<T, 1, false><<<N, kThreads, 0, s>>>(x, targets, V, smoothing, lse, loss);
}

template <typename T>
void launch_backward(const void* logits, const int64_t* targets, const float* lse, const float* grad_out,
                     bool per_row, int64_t N, int64_t V, float smoothing, void* grad, cudaStream_t s) {
  const T* x = static_cast<const T*>(logits);
  T* g = static_cast<T*>(grad);
  const int64_t stride = per_row ? 1 : 0;
  const float scale = per_row ? 1.f : 1.f / static_cast<float>(N);
  if (wide<T>(logits, V) && wide<T>(grad, V))
    backward_kernel<T, 16 / sizeof(T)><<<N, kThreads, 0, s>>>(x, targets, lse, grad_out, stride, scale, smoothing, V, g);
  else
    backward_kernel<T, 1><<<N, kThreads, 0, s>>>(x, targets, lse, grad_out, stride, scale, smoothing, V, g);
}

const char* last_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace

const char* cross_entropy_forward(Float dtype, const void* logits, const int64_t* targets, int64_t N, int64_t V,
                                  float smoothing, float* lse, float* loss, void* stream) {
  if (N <= 0 || V <= 0) return "cross_entropy_forward: empty logits";
  if (N > INT32_MAX) return "cross_entropy_forward: more than 2^31 - 1 rows";
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Float::f32: launch_forward<float>(logits, targets, N, V, smoothing, lse, loss, s); break;
    case Float::bf16: launch_forward<__nv_bfloat16>(logits, targets, N, V, smoothing, lse, loss, s); break;
    case Float::f16: launch_forward<__half>(logits, targets, N, V, smoothing, lse, loss, s); break;
  }
  return last_error();
}

const char* cross_entropy_backward(Float dtype, const void* logits, const int64_t* targets, const float* lse,
                                   const float* grad_out, bool per_row, int64_t N, int64_t V, float smoothing,
                                   void* grad, void* stream) {
  if (N <= 0 || V <= 0) return "cross_entropy_backward: empty logits";
  if (N > INT32_MAX) return "cross_entropy_backward: more than 2^31 - 1 rows";
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Float::f32: launch_backward<float>(logits, targets, lse, grad_out, per_row, N, V, smoothing, grad, s); break;
    case Float::bf16: launch_backward<__nv_bfloat16>(logits, targets, lse, grad_out, per_row, N, V, smoothing, grad, s); break;
    case Float::f16: launch_backward<__half>(logits, targets, lse, grad_out, per_row, N, V, smoothing, grad, s); break;
  }
  return last_error();
}

}  // namespace flowrun::cuda_kernels
