// Hand-vectorized CPU kernels (fused GELU, AdamW, attention's softmax): AVX2 + FMA, chosen at run
// time, so the build stays for any x86-64 (and other CPUs) and the kernels fall back where the CPU
// lacks them.
//
//   FLOWRUN_AVX2 void kernel(...) { ... _mm256_* ... }     // compiled for AVX2 + FMA
//   if (cpu_has_avx2()) kernel(...); else portable(...);
#pragma once

#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>
#define FLOWRUN_HAVE_AVX2_CODE 1
#define FLOWRUN_AVX2 __attribute__((target("avx2,fma")))
#else
#define FLOWRUN_HAVE_AVX2_CODE 0
#define FLOWRUN_AVX2
#endif

namespace flowrun {

// True where this CPU runs FLOWRUN_AVX2 code.
inline bool cpu_has_avx2() {
#if FLOWRUN_HAVE_AVX2_CODE
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

#if FLOWRUN_HAVE_AVX2_CODE
// e^z, 8 lanes: Cephes expf. z = n ln2 + r (|r| <= ln2/2), e^r by a degree-7 polynomial,
// 2^n from the exponent bits, within 2 ulp. Below -87.3 it returns e^-87.3 (a normal float:
// 1 + e^z is 1 to float precision, and a softmax term of it is nil beside the row's maximum's
// 1); above Cephes' 88.376 it returns +inf (so gelu_tanh's sigmoid of a very negative input is
// exactly 0, and gelu(-huge) is -0, as torch's). Used by the fused GELU and the CPU attention.
FLOWRUN_AVX2 inline __m256 exp8(__m256 z) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 over = _mm256_cmp_ps(z, hi, _CMP_GT_OQ);
  z = _mm256_min_ps(_mm256_max_ps(z, _mm256_set1_ps(-87.3f)), hi);
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(z, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), z);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(HUGE_VALF), over);
}

#endif

}  // namespace flowrun
