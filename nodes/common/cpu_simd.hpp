// Hand-vectorized CPU kernels (fused GELU, AdamW): AVX2 + FMA, chosen at run time, so the build
// stays for any x86-64 (and other CPUs) and the kernels fall back where the CPU lacks them.
//
//   FLOWRUN_AVX2 void kernel(...) { ... _mm256_* ... }     // compiled for AVX2 + FMA
//   if (cpu_has_avx2()) kernel(...); else portable(...);
#pragma once

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

}  // namespace flowrun
