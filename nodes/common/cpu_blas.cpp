// The CPU linear layers' GEMM library: see cpu_blas.hpp. Test: tests/nodes/linear_test.cpp.
//
// In order: OpenBLAS (opening it, refusing generic kernels), libtorch's GEMM on raw pointers,
// the per-machine verdicts (the cache file, measuring a shape), then the interface.
#include "common/cpu_blas.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <climits>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "hash.hpp"

namespace flowrun::cpu_blas {

namespace {

// ---- OpenBLAS ----------------------------------------------------------------------------------

// CBLAS's enums.
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

struct OpenBlas {
  using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                         int);
  Sgemm sgemm = nullptr;
  int (*get_num_threads)() = nullptr;
  void (*set_num_threads)(int) = nullptr;
  std::string config, core, path;
  std::string name() const { return config + " (" + core + ") at " + path; }
  // Why automatic does not take it ("" when it may): kernels older than the CPU.
  std::string refused;
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

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
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
      l->config = config ? config() : "";
      if (!l->sgemm || !l->get_num_threads || !l->set_num_threads || !config) {
        reason = path + " lacks cblas_sgemm or openblas_get_config";
      } else if (l->config.find("USE_OPENMP") == std::string::npos) {
        reason = path + " is not an OpenMP build (" + l->config + "); Debian: apt install libopenblas0-openmp";
      } else {
        l->core = core ? core() : "?";
        l->path = path;
        if (cpu_has_avx2() && core_predates_avx2(l->core))
          l->refused = "its kernels are " + l->core + "'s, older than this CPU (which has AVX2" +
                       (__builtin_cpu_supports("avx512f") ? std::string(" and AVX-512") : std::string()) +
                       "): OpenBLAS does not know the CPU, or OPENBLAS_CORETYPE chose them";
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

std::mutex g_openblas_mu;

void openblas_gemm(const OpenBlas& lib, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a,
                   int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  for (int64_t v : {m, n, k, lda, ldb, ldc})
    if (v > INT_MAX) throw std::runtime_error("cpu_blas::sgemm: a dimension exceeds OpenBLAS's 32-bit int");
  // The calling thread's OpenMP team size: the compute thread's run.threads, a worker's one.
  // OpenBLAS keeps a process-wide count; set it per call, under the lock, to this thread's.
  const int threads = at::get_num_threads();
  std::lock_guard<std::mutex> lock(g_openblas_mu);
  if (lib.get_num_threads() != threads) lib.set_num_threads(threads);
  lib.sgemm(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, static_cast<int>(m), static_cast<int>(n),
            static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
            static_cast<int>(ldc));
}

// ---- libtorch's GEMM on the same pointers ---------------------------------------------------------

void torch_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                int64_t ldb, float beta, float* c, int64_t ldc) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto stored = [&](const float* p, int64_t rows, int64_t cols, int64_t ld) {
    return at::from_blob(const_cast<float*>(p), {rows, cols}, {ld, 1}, f32);
  };
  const at::Tensor A = ta ? stored(a, k, m, lda).t() : stored(a, m, k, lda);
  const at::Tensor B = tb ? stored(b, n, k, ldb).t() : stored(b, k, n, ldb);
  at::Tensor C = stored(c, m, n, ldc);
  if (beta == 0.0f)
    at::mm_out(C, A, B);
  else
    C.addmm_(A, B, beta, 1.0f);
}

// ---- the verdicts: which library multiplies a shape, per machine ------------------------------

struct Verdict {
  bool openblas = false;
  double openblas_s = 0, libtorch_s = 0;  // the medians measured
};

// A dimension as verdicts key it: exact up to 64, above rounded up to a quarter octave (4, 5, 6 or 7
// times a power of two: within 25 %). Shapes that differ less share the first one's verdict, so a
// dimension that changes every step — a packed batch's counted rows, which size the head's
// products — is measured a few times, not at every step.
int64_t bucket(int64_t d) {
  if (d <= 64) return d;
  int64_t unit = 1;
  while ((d + unit - 1) / unit > 7) unit *= 2;
  return (d + unit - 1) / unit * unit;
}

std::string shape_key(bool ta, bool tb, int64_t m, int64_t n, int64_t k, int threads) {
  return fmt::format("{}{}:{}x{}x{}:t{}", ta ? 'T' : 'N', tb ? 'T' : 'N', bucket(m), bucket(n), bucket(k), threads);
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

// What decides a verdict, as one line: the cache file's name is its hash, its first line it.
const std::string& fingerprint() {
  static const std::string f = [] {
    const OpenBlas* lib = load(nullptr);
    std::string s = cpu_model() + "; " + std::to_string(std::thread::hardware_concurrency()) + " cpus; libtorch " +
                    TORCH_VERSION + "; " + (lib ? lib->config + " (" + lib->core + ")" : "no OpenBLAS");
    for (const char* env : {"OPENBLAS_CORETYPE", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE"})
      if (const char* v = std::getenv(env)) s += fmt::format("; {}={}", env, v);
    return s;
  }();
  return f;
}

// Every verdict of the cache file (lines "KEY openblas|libtorch OPENBLAS_S LIBTORCH_S" after
// the fingerprint line).
std::map<std::string, Verdict> read_verdicts(int fd) {
  std::map<std::string, Verdict> out;
  std::string text;
  char buf[65536];
  lseek(fd, 0, SEEK_SET);
  for (ssize_t r; (r = read(fd, buf, sizeof buf)) > 0;) text.append(buf, static_cast<size_t>(r));
  std::istringstream lines(text);
  std::string line;
  std::getline(lines, line);  // the fingerprint
  while (std::getline(lines, line)) {
    std::istringstream f(line);
    std::string key, lib;
    Verdict v;
    if (f >> key >> lib >> v.openblas_s >> v.libtorch_s && (lib == "openblas" || lib == "libtorch")) {
      v.openblas = lib == "openblas";
      out.emplace(key, v);  // the first verdict of a key holds
    }
  }
  return out;
}

// Times one shape in both libraries on the caller's operands (C on a scratch copy): a warm-up
// call each, then rounds alternating between them, the median of each.
Verdict measure(const OpenBlas& lib, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                const float* b, int64_t ldb, float beta, const float* c, int64_t ldc) {
  std::vector<float> scratch(static_cast<size_t>(m * n));
  auto reset = [&] {
    for (int64_t i = 0; i < m; ++i)
      std::copy(c + i * ldc, c + i * ldc + n, scratch.begin() + i * n);
  };
  using clock = std::chrono::steady_clock;
  auto time = [&](bool openblas) {
    if (beta != 0.0f) reset();
    const auto t0 = clock::now();
    if (openblas) openblas_gemm(lib, ta, tb, m, n, k, a, lda, b, ldb, beta, scratch.data(), n);
    else torch_gemm(ta, tb, m, n, k, a, lda, b, ldb, beta, scratch.data(), n);
    return std::chrono::duration<double>(clock::now() - t0).count();
  };
  time(true);
  const double warm = time(false);
  // More rounds for quick products (their timings are noisier), fewer for slow ones.
  const int rounds = warm < 1e-3 ? 7 : warm < 20e-3 ? 5 : 3;
  std::vector<double> ob, lt;
  for (int r = 0; r < rounds; ++r) {
    ob.push_back(time(true));
    lt.push_back(time(false));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  Verdict v;
  v.openblas_s = median(ob);
  v.libtorch_s = median(lt);
  v.openblas = v.openblas_s < v.libtorch_s;
  return v;
}

std::atomic<Library> g_choice{Library::automatic};

// This process's verdicts (from the cache file or measured), and what it chose them for.
struct Verdicts {
  std::mutex mu;
  std::map<std::string, Verdict> by_shape;
  std::map<std::string, int64_t> uses;  // products multiplied per shape
  bool warned = false;                  // the cache file could not be used: said once
};
Verdicts& verdicts() {
  static Verdicts v;
  return v;
}

// The library for a shape: this process's verdict, else the cache file's, else measured now and
// added to the file. The file is locked (flock) from reading to writing, so two processes that
// meet a new shape at once measure it once, and every process takes the first verdict.
bool prefer_openblas(const OpenBlas& lib, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a,
                     int64_t lda, const float* b, int64_t ldb, float beta, const float* c, int64_t ldc) {
  const std::string key = shape_key(ta, tb, m, n, k, at::get_num_threads());
  Verdicts& vs = verdicts();
  std::lock_guard<std::mutex> lock(vs.mu);
  ++vs.uses[key];
  if (auto it = vs.by_shape.find(key); it != vs.by_shape.end()) return it->second.openblas;
  const std::string path = cache_file();
  int fd = -1;
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (!ec) fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0 || flock(fd, LOCK_EX) != 0) {
    if (!vs.warned)
      spdlog::warn("cpu_gemm auto: cannot use the cache file {} ({}); this process measures each product shape itself",
                   path, std::strerror(errno));
    vs.warned = true;
    if (fd >= 0) close(fd);
    fd = -1;
  }
  if (fd >= 0) {
    for (auto& [k2, v] : read_verdicts(fd)) vs.by_shape.emplace(k2, v);
    if (auto it = vs.by_shape.find(key); it != vs.by_shape.end()) {
      close(fd);  // releases the lock
      return it->second.openblas;
    }
  }
  const Verdict v = measure(lib, ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
  vs.by_shape.emplace(key, v);
  spdlog::debug("cpu_gemm auto: {} takes {} (OpenBLAS {:.3g} ms, libtorch {:.3g} ms)", key,
                v.openblas ? "OpenBLAS" : "libtorch", v.openblas_s * 1e3, v.libtorch_s * 1e3);
  if (fd >= 0) {
    std::string line;
    if (lseek(fd, 0, SEEK_END) == 0) line = fingerprint() + "\n";
    line += fmt::format("{} {} {:.6g} {:.6g}\n", key, v.openblas ? "openblas" : "libtorch", v.openblas_s, v.libtorch_s);
    if (write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()) && !vs.warned) {
      spdlog::warn("cpu_gemm auto: could not add to {}: {}", path, std::strerror(errno));
      vs.warned = true;
    }
    close(fd);
  }
  return v.openblas;
}

}  // namespace

// ---- the interface ------------------------------------------------------------------------------

bool core_predates_avx2(const std::string& core) {
  // OpenBLAS's x86 core names (its TARGET list) whose kernels use SSE or AVX but not AVX2.
  static const char* const kOld[] = {"Katmai",   "Coppermine", "Northwood", "Prescott",    "Banias",   "Yonah",
                                     "Core2",    "Penryn",     "Dunnington", "Nehalem",    "Sandybridge", "Atom",
                                     "Athlon",   "Opteron",    "Opteron_SSE3", "Barcelona", "Shanghai", "Istanbul",
                                     "Bobcat",   "Bulldozer",  "Piledriver", "Steamroller", "Nano",    "Generic"};
  std::string lower = core;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char ch) { return std::tolower(ch); });
  for (const char* old : kOld) {
    std::string o = old;
    std::transform(o.begin(), o.end(), o.begin(), [](unsigned char ch) { return std::tolower(ch); });
    if (lower == o) return true;
  }
  return false;
}

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
  if (c == Library::libtorch) return false;
  const OpenBlas* lib = load(nullptr);
  return lib && (c == Library::openblas || lib->refused.empty());
}

std::string describe() {
  const Library c = g_choice.load();
  if (c == Library::libtorch) return "libtorch (run.cpu_gemm: libtorch)";
  std::string why;
  const OpenBlas* lib = load(&why);
  if (!lib) return "libtorch (" + why + ")";
  if (c == Library::openblas)
    return lib->name() + (lib->refused.empty() ? "" : "; note: " + lib->refused + ", which auto would refuse");
  if (!lib->refused.empty()) return "libtorch (OpenBLAS refused: " + lib->refused + ")";
  return "the faster of " + lib->name() + " and libtorch for each product shape, measured once on this machine (" +
         cache_file() + ")";
}

void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
           int64_t ldb, float beta, float* c, int64_t ldc) {
  const OpenBlas* lib = load(nullptr);
  if (!lib) throw std::logic_error("cpu_blas::sgemm without OpenBLAS (check active() first)");
  openblas_gemm(*lib, ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
}

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float beta, float* c, int64_t ldc) {
  const Library choice = g_choice.load();
  const OpenBlas* lib = load(nullptr);
  const bool openblas = lib && (choice == Library::openblas ||
                                (choice == Library::automatic && lib->refused.empty() &&
                                 prefer_openblas(*lib, ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc)));
  if (openblas)
    openblas_gemm(*lib, ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
  else
    torch_gemm(ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc);
}

std::string choices_summary() {
  Verdicts& vs = verdicts();
  std::lock_guard<std::mutex> lock(vs.mu);
  int shapes = 0, openblas = 0;
  double chosen = 0, libtorch_only = 0, openblas_only = 0;  // the measured time of one product each, times its uses
  for (const auto& [key, n] : vs.uses) {
    auto it = vs.by_shape.find(key);
    if (it == vs.by_shape.end()) continue;
    const Verdict& v = it->second;
    ++shapes;
    openblas += v.openblas;
    chosen += n * std::min(v.openblas_s, v.libtorch_s);
    libtorch_only += n * v.libtorch_s;
    openblas_only += n * v.openblas_s;
  }
  if (shapes == 0) return "";
  return fmt::format(
      "{} product shape{}: OpenBLAS took {}, libtorch {}; the measured time of the choices, by their use in this run, "
      "{:.2f}x libtorch's alone and {:.2f}x OpenBLAS's alone",
      shapes, shapes == 1 ? "" : "s", openblas, shapes - openblas, chosen / libtorch_only, chosen / openblas_only);
}

std::string chosen(bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
  Verdicts& vs = verdicts();
  std::lock_guard<std::mutex> lock(vs.mu);
  auto it = vs.by_shape.find(shape_key(ta, tb, m, n, k, at::get_num_threads()));
  return it == vs.by_shape.end() ? "" : it->second.openblas ? "openblas" : "libtorch";
}

std::string cache_file() {
  std::string dir;
  if (const char* d = std::getenv("FLOWRUN_CACHE_DIR"); d && *d)
    dir = d;
  else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
    dir = std::string(x) + "/flowrun";
  else if (const char* h = std::getenv("HOME"); h && *h)
    dir = std::string(h) + "/.cache/flowrun";
  else
    dir = "/tmp/flowrun-cache-" + std::to_string(getuid());
  return fmt::format("{}/cpu_gemm-{:016x}.txt", dir, fnv1a(fingerprint()));
}

}  // namespace flowrun::cpu_blas
