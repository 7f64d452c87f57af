// What the CPU kernels of the element-wise update rules share (rules/adamw.cpp, rules/sgd.cpp):
// every tensor's elements as one index range that the OpenMP threads split (multi-tensor apply,
// as torch's _foreach kernels on a GPU), and an 8-lane loop whose result per element does not
// depend on where a range starts or ends.
#pragma once
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/cpu_simd.hpp"

namespace flowrun::rules {

// What the CPU kernels take: a defined, contiguous fp32 tensor on the CPU.
inline bool cpu_fp32(const torch::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous();
}

// Runs fn(piece, begin, end) over the elements of all pieces (each with a member `n`, its
// element count) as one index range, cut into chunks of kChunk elements that the OpenMP threads
// share: one parallel region per update, not one per tensor, and small tensors share a chunk.
// The chunks do not depend on the number of threads.
constexpr int64_t kChunk = 32768;

template <class Piece, class Fn>
void for_each_chunk(const std::vector<Piece>& pieces, const Fn& fn) {
  std::vector<int64_t> start(pieces.size() + 1, 0);
  for (size_t j = 0; j < pieces.size(); ++j) start[j + 1] = start[j] + pieces[j].n;
  const int64_t total = start.back();
  at::parallel_for(0, (total + kChunk - 1) / kChunk, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t b = c * kChunk, e = std::min(total, b + kChunk);
      auto j = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), b) - start.begin() - 1);
      for (; j < pieces.size() && start[j] < e; ++j)
        fn(pieces[j], std::max(b, start[j]) - start[j], std::min(e, start[j + 1]) - start[j]);
    }
  });
}

#if FLOWRUN_HAVE_AVX2_CODE
// An element's result must not depend on where a range starts or ends (a rank's slice of a
// buffer, ZeRO stage states, is updated as the whole buffer is, bit for bit): every element goes
// through the same 8-lane code, the last few of a range too (padded with zeros in a local
// block), and no multiply-add is contracted into an FMA, which the compiler may do in one
// inlined copy and not another (seen: one lane of a tail differed). A kernel using it turns
// contraction off around itself too (FLOWRUN_NO_FP_CONTRACT_BEGIN / _END).
#if defined(__clang__)
#define FLOWRUN_NO_FP_CONTRACT_BEGIN _Pragma("clang fp contract(off)")
#define FLOWRUN_NO_FP_CONTRACT_END
#elif defined(__GNUC__)
#define FLOWRUN_NO_FP_CONTRACT_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"fp-contract=off\")")
#define FLOWRUN_NO_FP_CONTRACT_END _Pragma("GCC pop_options")
#else
#define FLOWRUN_NO_FP_CONTRACT_BEGIN
#define FLOWRUN_NO_FP_CONTRACT_END
#endif

FLOWRUN_NO_FP_CONTRACT_BEGIN
// body(p, g, m, v) on 8 elements at a time of p[b, e) and the others (m, v may be nullptr).
template <class Body>
FLOWRUN_AVX2 inline void by_8_lanes(float* p, const float* g, float* m, float* v, int64_t b, int64_t e, const Body& body) {
  int64_t i = b;
  for (; i + 8 <= e; i += 8) body(p + i, g + i, m ? m + i : nullptr, v ? v + i : nullptr);
  if (i == e) return;
  const int64_t n = e - i;
  alignas(32) float tp[8] = {}, tg[8] = {}, tm[8] = {}, tv[8] = {};
  std::copy(p + i, p + e, tp), std::copy(g + i, g + e, tg);
  if (m) std::copy(m + i, m + e, tm);
  if (v) std::copy(v + i, v + e, tv);
  body(tp, tg, m ? tm : nullptr, v ? tv : nullptr);
  std::copy(tp, tp + n, p + i);
  if (m) std::copy(tm, tm + n, m + i);
  if (v) std::copy(tv, tv + n, v + i);
}
FLOWRUN_NO_FP_CONTRACT_END
#endif

}  // namespace flowrun::rules
