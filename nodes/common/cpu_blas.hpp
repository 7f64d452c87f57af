// Which library multiplies float32 matrices on the CPU for flowrun's linear layers (run.cpu_gemm).
//
// libtorch's own GEMM is MKL's (the PyPI wheels link it). On CPUs that are not Intel's, MKL takes
// its AVX2 code path; OpenBLAS picks its kernels by the CPU it finds (Debian's libopenblas0-openmp
// runs its AVX-512 "Cooperlake" kernels on an AMD EPYC with AVX-512): on this project's 2-core
// EPYC, GPT bench's products ([2048, 256] × [256, 768] and the like, forward and backward) take
// 7.8 % less time in OpenBLAS (bench/README.md). So models/linear_cpu.cpp multiplies through
// OpenBLAS where it is installed, and through libtorch everywhere else.
//
// OpenBLAS is opened at run time (dlopen, RTLD_LOCAL), never linked: libtorch_cpu exports MKL's
// CBLAS symbols under the same names. Only an OpenMP build of OpenBLAS is taken: it runs its
// threads in the OpenMP runtime libtorch already loaded (one libgomp.so.1 per process), so the
// compute thread's team does both libraries' work, and a worker thread set to one OpenMP thread
// multiplies on one. Calls are serialised (OpenBLAS's OpenMP build keeps shared buffers); a
// product already uses every core of the calling thread's team.
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

// True when sgemm() below runs OpenBLAS: the selection is openblas, or automatic and it loaded.
bool active();

// What the linear layers multiply with, for the run log: "OpenBLAS 0.3.21 ... (Cooperlake)" or
// "libtorch (MKL)", with the reason when automatic fell back.
std::string describe();

// Row-major C[m, n] = op(A) · op(B) + beta · C, op = transpose where ta / tb; ld* = floats from
// one row to the next as stored. Only while active().
void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
           int64_t ldb, float beta, float* c, int64_t ldc);

}  // namespace flowrun::cpu_blas
