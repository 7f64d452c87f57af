// Which library multiplies float32 matrices on the CPU for flowrun's linear layers (run.cpu_gemm).
//
// Two candidates: libtorch's own GEMM (MKL in the PyPI wheels, which takes its AVX2 code path on
// CPUs that are not Intel's) and OpenBLAS (Debian's libopenblas0-openmp, whose kernels follow
// the CPU it finds: its AVX-512 "Cooperlake" ones on an AMD EPYC with AVX-512, 7.8 % faster than
// MKL at GPT bench's products there, bench/README.md). Neither wins everywhere: an OpenBLAS
// that does not know a newer CPU falls back to generic kernels (Debian's 0.3.21 ran its SSE3
// "Prescott" ones on a recent Xeon: GPT bench at 0.33x PyTorch's speed), and which is faster
// changes with the product's shape. So `auto` (the default) decides by measurement:
//   - an OpenBLAS whose kernels are older than the CPU (a pre-AVX2 core on a CPU with AVX2,
//     OPENBLAS_CORETYPE=Prescott among them) is refused: libtorch everywhere, logged with why;
//   - otherwise each product shape (transposes, m, n, k, the calling thread's OpenMP threads;
//     m, n and k above 64 rounded up to a quarter octave, so a dimension that changes every
//     step — a packed batch's counted rows — meets few new shapes) is timed in both libraries
//     the first time it is met on this machine (a few runs each,
//     alternating, medians) and the faster one takes it. The verdicts are kept per machine in
//     a cache file (cache_file(): the CPU, both libraries' versions and kernels, the threads),
//     so every later process — a resumed run, the next test — multiplies each shape with the
//     same library and a run stays bit-identical to itself across processes.
// `libtorch` and `openblas` force one library (openblas: refused where none is installed).
//
// OpenBLAS is opened at run time (dlopen, RTLD_LOCAL), never linked: libtorch_cpu exports MKL's
// CBLAS symbols under the same names. Only an OpenMP build of OpenBLAS is taken: it runs its
// threads in the OpenMP runtime libtorch already loaded (one libgomp.so.1 per process), so the
// compute thread's team does both libraries' work, and a worker thread set to one OpenMP thread
// multiplies on one. OpenBLAS calls are serialised (its OpenMP build keeps shared buffers); a
// product already uses every core of the calling thread's team.
// Test: tests/nodes/linear_test.cpp.
#pragma once
#include <cstdint>
#include <string>

namespace flowrun::cpu_blas {

enum class Library { automatic, libtorch, openblas };

// run.cpu_gemm's values: "auto", "libtorch", "openblas" (throws std::invalid_argument otherwise).
Library parse(const std::string& name);

// Process-wide, set once at run start from run.cpu_gemm (default: automatic). openblas where no
// OpenMP OpenBLAS can be opened throws, naming the package that provides it.
void select(Library lib);

// True when linear's CPU kernel (models/linear.hpp) multiplies through gemm() below: openblas
// selected, or automatic with an OpenBLAS that loaded and was not refused.
bool active();

// What the linear layers multiply with, for the run log: "OpenBLAS 0.3.21 ... (Cooperlake)",
// "the faster of ... and libtorch, by shape", or "libtorch (why)".
std::string describe();

// Row-major C[m, n] = op(A) · op(B) + beta · C, op = transpose where ta / tb; ld* = floats from
// one row to the next as stored; beta 0 or 1. Through the library selected, or for automatic the
// one chosen for this shape (measured the first time it is met). Only while active().
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float beta, float* c, int64_t ldc);

// The same through OpenBLAS alone (the tests call it; gemm() and the measurement use it).
void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
           int64_t ldb, float beta, float* c, int64_t ldc);

// automatic: what this process chose so far, for the run log at the end ("12 product shapes:
// OpenBLAS 9, libtorch 3; measured time of the choices 0.81x libtorch's alone, 0.93x OpenBLAS's
// alone"); "" when nothing was chosen by measurement.
std::string choices_summary();

// automatic: the library this process multiplies the shape with ("openblas", "libtorch"), at the
// calling thread's OpenMP threads; "" when the shape was not met yet.
std::string chosen(bool ta, bool tb, int64_t m, int64_t n, int64_t k);

// The file that keeps this machine's verdicts (FLOWRUN_CACHE_DIR, else $XDG_CACHE_HOME/flowrun,
// else ~/.cache/flowrun; named by a hash of what decides a verdict: the CPU, the libraries'
// versions and kernels, the environment variables that pick their kernels).
std::string cache_file();

// An OpenBLAS core name (openblas_get_corename) whose kernels predate AVX2 ("Prescott",
// "Nehalem", "Sandybridge", ...): refused on a CPU that has AVX2.
bool core_predates_avx2(const std::string& core);

}  // namespace flowrun::cpu_blas
