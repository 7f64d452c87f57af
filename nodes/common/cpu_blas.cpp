// OpenBLAS for the CPU linear layers: see cpu_blas.hpp. Test: tests/nodes/linear_cpu_test.cpp.
#include "common/cpu_blas.hpp"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <atomic>
#include <climits>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace flowrun::cpu_blas {

namespace {

// CBLAS's enums.
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

struct OpenBlas {
  using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                         int);
  Sgemm sgemm = nullptr;
  int (*get_num_threads)() = nullptr;
  void (*set_num_threads)(int) = nullptr;
  std::string name;  // "OpenBLAS 0.3.21 ... (Cooperlake) at PATH"
};

// Where Debian's libopenblas0-openmp puts the library (the alternatives link libopenblas.so.0
// may name the pthreads build instead), then whatever the loader finds under that name.
std::vector<std::string> candidates() {
  std::vector<std::string> paths;
  for (const char* dir : {"/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"})
    paths.push_back(std::string(dir) + "/openblas-openmp/libopenblas.so.0");
  paths.push_back("libopenblas.so.0");
  return paths;
}

// The first OpenMP build of OpenBLAS that opens, or why none did.
const OpenBlas* load(std::string* why) {
  static std::string reason;
  static const OpenBlas* lib = []() -> const OpenBlas* {
    reason = "no OpenBLAS found (Debian: apt install libopenblas0-openmp)";
    for (const std::string& path : candidates()) {
      void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!h) continue;
      auto config = reinterpret_cast<char* (*)()>(dlsym(h, "openblas_get_config"));
      auto core = reinterpret_cast<char* (*)()>(dlsym(h, "openblas_get_corename"));
      auto* l = new OpenBlas;
      l->sgemm = reinterpret_cast<OpenBlas::Sgemm>(dlsym(h, "cblas_sgemm"));
      l->get_num_threads = reinterpret_cast<int (*)()>(dlsym(h, "openblas_get_num_threads"));
      l->set_num_threads = reinterpret_cast<void (*)(int)>(dlsym(h, "openblas_set_num_threads"));
      const std::string cfg = config ? config() : "";
      if (!l->sgemm || !l->get_num_threads || !l->set_num_threads || !config) {
        reason = path + " lacks cblas_sgemm or openblas_get_config";
      } else if (cfg.find("USE_OPENMP") == std::string::npos) {
        reason = path + " is not an OpenMP build (" + cfg + "); Debian: apt install libopenblas0-openmp";
      } else {
        l->name = cfg + " (" + (core ? core() : "?") + ") at " + path;
        return l;  // kept open for the process
      }
      delete l;
      dlclose(h);
    }
    return nullptr;
  }();
  if (why) *why = reason;
  return lib;
}

std::atomic<Library> g_choice{Library::automatic};
std::mutex g_mu;

}  // namespace

Library parse(const std::string& name) {
  if (name == "auto") return Library::automatic;
  if (name == "libtorch") return Library::libtorch;
  if (name == "openblas") return Library::openblas;
  throw std::invalid_argument("cpu_gemm: '" + name + "' is not one of auto, libtorch, openblas");
}

void select(Library lib) {
  std::string why;
  if (lib == Library::openblas && !load(&why))
    throw std::runtime_error("run.cpu_gemm: openblas, but " + why + "; or set run.cpu_gemm: auto");
  g_choice = lib;
}

bool active() {
  const Library c = g_choice.load();
  return c == Library::openblas || (c == Library::automatic && load(nullptr));
}

std::string describe() {
  std::string why;
  const OpenBlas* lib = g_choice.load() == Library::libtorch ? nullptr : load(&why);
  if (lib) return lib->name;
  return g_choice.load() == Library::libtorch ? "libtorch (run.cpu_gemm: libtorch)" : "libtorch (" + why + ")";
}

void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
           int64_t ldb, float beta, float* c, int64_t ldc) {
  const OpenBlas* lib = load(nullptr);
  if (!lib) throw std::logic_error("cpu_blas::sgemm without OpenBLAS (check active() first)");
  for (int64_t v : {m, n, k, lda, ldb, ldc})
    if (v > INT_MAX) throw std::runtime_error("cpu_blas::sgemm: a dimension exceeds OpenBLAS's 32-bit int");
  // The calling thread's OpenMP team size: the compute thread's run.threads, a worker's one.
  // OpenBLAS keeps a process-wide count; set it per call, under the lock, to this thread's.
  const int threads = at::get_num_threads();
  std::lock_guard<std::mutex> lock(g_mu);
  if (lib->get_num_threads() != threads) lib->set_num_threads(threads);
  lib->sgemm(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, static_cast<int>(m), static_cast<int>(n),
             static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
             static_cast<int>(ldc));
}

}  // namespace flowrun::cpu_blas
