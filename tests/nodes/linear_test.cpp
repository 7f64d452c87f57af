// flowrun::linear: a linear layer's product. On the CPU in float32 with OpenBLAS active it is one
// autograd function over OpenBLAS's GEMM (models/linear.hpp, common/cpu_blas.hpp), and it computes
// what torch's linear computes — values, and the gradients of the input, the weight and the bias —
// in both weight layouts, any input rank, strided inputs, frozen weights and empty batches;
// run.cpu_gemm: libtorch (and bf16 autocast) leave every product to libtorch.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <tuple>

#include "common/cpu_blas.hpp"
#include "models/linear.hpp"

namespace flowrun {
namespace {

// Selects a library for one test and puts the default (automatic) back after it.
struct SelectedGemm {
  explicit SelectedGemm(cpu_blas::Library lib) { cpu_blas::select(lib); }
  ~SelectedGemm() { cpu_blas::select(cpu_blas::Library::automatic); }
};

struct LinearOutcome {
  torch::Tensor y, dx, dw, db;
};

// y = linear(x, w, b) and the gradients of sum(y · g), computed by `f` in float64 or float32.
template <typename F>
LinearOutcome linear_outcome(F f, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, const torch::Tensor& g,
          torch::Dtype dtype) {
  torch::Tensor xx = x.to(dtype).detach().requires_grad_(x.requires_grad());
  torch::Tensor ww = w.to(dtype).detach().requires_grad_(w.requires_grad());
  torch::Tensor bb = b.defined() ? b.to(dtype).detach().requires_grad_(true) : torch::Tensor();
  torch::Tensor y = f(xx, ww, bb);
  if (y.requires_grad()) (y * g.to(dtype)).sum().backward();
  return {y.detach(), xx.grad(), ww.grad(), bb.defined() ? bb.grad() : torch::Tensor()};
}

torch::Tensor linear_reference(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, bool w_in_out) {
  torch::Tensor y = torch::matmul(x, w_in_out ? w : w.t());
  return b.defined() ? y + b : y;
}

// |got - want| within 1e-5 of want's largest value (float32 products of a few hundred terms).
void expect_linear_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!want.defined()) return;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_EQ(got.scalar_type(), torch::kFloat) << what;
  if (want.numel() == 0) return;
  const double scale = std::max(1.0, want.abs().max().item<double>());
  EXPECT_LT((got.to(torch::kDouble) - want).abs().max().item<double>(), 1e-5 * scale) << what;
}

// The kernel against float64 torch for x [..., in], the weight [out, in] (or [in, out]).
void expect_kernel_matches(torch::Tensor x, bool w_in_out, bool bias, bool weight_trains = true) {
  const int64_t in = x.size(-1), out = 24;
  torch::Tensor w = w_in_out ? torch::randn({in, out}) : torch::randn({out, in});
  w.requires_grad_(weight_trains);
  x.requires_grad_(true);
  torch::Tensor b = bias ? torch::randn({out}) : torch::Tensor();
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  const torch::Tensor g = torch::randn(sizes);
  ASSERT_TRUE(cpu_linear_applies(x, w, b));
  const auto kernel = [&](const torch::Tensor& a, const torch::Tensor& c, const torch::Tensor& d) {
    return cpu_linear(a, c, d, w_in_out);
  };
  const auto exact = [&](const torch::Tensor& a, const torch::Tensor& c, const torch::Tensor& d) {
    return linear_reference(a, c, d, w_in_out);
  };
  const torch::Tensor b_before = b.defined() ? b.clone() : torch::Tensor();
  const LinearOutcome got = linear_outcome(kernel, x, w, b, g, torch::kFloat), want = linear_outcome(exact, x, w, b, g, torch::kDouble);
  if (bias) EXPECT_TRUE(torch::equal(b, b_before)) << "the product wrote into the bias";  // y starts as a copy of it
  const std::string what = std::string(w_in_out ? "[in, out]" : "[out, in]") + (bias ? " with bias" : "") +
                           ", x " + c10::str(x.sizes());
  expect_linear_close(got.y, want.y, what + ": y");
  expect_linear_close(got.dx, want.dx, what + ": dx");
  expect_linear_close(got.dw, want.dw, what + ": dW");
  expect_linear_close(got.db, want.db, what + ": db");
}

#define SKIP_WITHOUT_OPENBLAS()                                              \
  if (!cpu_blas::active()) GTEST_SKIP() << cpu_blas::describe()

TEST(Linear, TheOpenBlasKernelComputesWhatTorchsLinearComputes) {
  SKIP_WITHOUT_OPENBLAS();
  torch::manual_seed(0);
  for (bool w_in_out : {false, true})
    for (bool bias : {false, true}) {
      expect_kernel_matches(torch::randn({37, 19}), w_in_out, bias);       // rows, no batch
      expect_kernel_matches(torch::randn({3, 11, 64}), w_in_out, bias);    // [B, T, C]: one product over B·T rows
      expect_kernel_matches(torch::randn({5}), w_in_out, bias);            // one vector
    }
}

TEST(Linear, StridedInputsFrozenWeightsAndEmptyBatchesToo) {
  SKIP_WITHOUT_OPENBLAS();
  torch::manual_seed(1);
  expect_kernel_matches(torch::randn({19, 37}).t(), false, true);            // a transposed view
  expect_kernel_matches(torch::randn({8, 40}).narrow(1, 3, 32), true, true);  // rows with a stride
  expect_kernel_matches(torch::randn({4, 16}), false, true, /*weight_trains=*/false);  // a frozen base: no dW
  expect_kernel_matches(torch::randn({0, 16}), false, true);                 // no rows: y empty, dW and db zero
}

TEST(Linear, TheLayerProductTakesTheKernelOnlyWhereOpenBlasIsSelected) {
  SKIP_WITHOUT_OPENBLAS();
  const torch::Tensor x = torch::randn({6, 8}).requires_grad_(true), w = torch::randn({4, 8}).requires_grad_(true);
  {
    SelectedGemm lib(cpu_blas::Library::libtorch);
    EXPECT_FALSE(cpu_linear_applies(x, w, {}));
    EXPECT_EQ(cpu_blas::describe(), "libtorch (run.cpu_gemm: libtorch)");
    // libtorch's own product: its autograd node is libtorch's, bit for bit torch::linear.
    const torch::Tensor y = flowrun::linear(x, w);
    EXPECT_TRUE(torch::equal(y, torch::nn::functional::linear(x, w)));
    EXPECT_EQ(y.grad_fn()->name().find("CpuLinear"), std::string::npos) << y.grad_fn()->name();
  }
  {
    SelectedGemm lib(cpu_blas::Library::openblas);
    EXPECT_TRUE(cpu_linear_applies(x, w, {}));
    EXPECT_NE(cpu_blas::describe().find("OpenBLAS"), std::string::npos) << cpu_blas::describe();
    EXPECT_NE(cpu_blas::describe().find("USE_OPENMP"), std::string::npos) << cpu_blas::describe();
    EXPECT_NE(flowrun::linear(x, w).grad_fn()->name().find("CpuLinear"), std::string::npos);
  }
  // Not float32 on the CPU, or under bf16 autocast: libtorch's product (autocast casts it).
  EXPECT_FALSE(cpu_linear_applies(x.to(torch::kDouble), w.to(torch::kDouble), {}));
  EXPECT_FALSE(cpu_linear_applies(x, w, torch::zeros({4}, torch::kBFloat16)));
  at::autocast::set_autocast_enabled(at::kCPU, true);
  EXPECT_FALSE(cpu_linear_applies(x, w, {}));
  at::autocast::set_autocast_enabled(at::kCPU, false);
}

// Zero-bubble schedules (train/pipeline.cpp): a product made while a DeferredWeightGrads is open
// leaves its weight's and bias's gradients out of backward (the input's is there at once), and
// flush() adds them later: the same gradients as backward computes, in both layouts.
TEST(Linear, DeferredWeightGradientsArriveAtFlushAsBackwardWouldComputeThem) {
  SKIP_WITHOUT_OPENBLAS();
  SelectedGemm lib(cpu_blas::Library::openblas);
  for (bool w_in_out : {false, true}) {
    const torch::Tensor x0 = torch::randn({6, 8}), g = torch::randn({6, 4});
    const torch::Tensor w0 = w_in_out ? torch::randn({8, 4}) : torch::randn({4, 8}), b0 = torch::randn({4});
    auto run = [&](bool defer) {
      torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
      DeferredWeightGrads deferred;
      torch::Tensor y;
      {
        std::optional<DeferredWeightGrads::Scope> scope;
        if (defer) scope.emplace(deferred);
        y = flowrun::linear(x, w, b, w_in_out);
      }
      (y * g).sum().backward();
      EXPECT_TRUE(x.grad().defined());
      EXPECT_EQ(w.grad().defined(), !defer) << "the weight's gradient waits for flush()";
      EXPECT_EQ(deferred.empty(), !defer);
      deferred.flush();
      EXPECT_TRUE(deferred.empty());
      return std::vector<torch::Tensor>{x.grad(), w.grad(), b.grad()};
    };
    const auto now = run(false), later = run(true);
    for (size_t i = 0; i < now.size(); ++i) EXPECT_TRUE(torch::allclose(now[i], later[i], 1e-6, 1e-6)) << i;
  }
}

// run.cpu_gemm auto: each product shape goes to the library measured faster for it on this
// machine. The verdict is written to the cache file the first time a shape is met (here a folder
// of the test's own), and read from it after: every process multiplies a shape alike.
struct CacheDir {
  std::string before, dir;
  CacheDir() {
    const char* b = std::getenv("FLOWRUN_CACHE_DIR");
    before = b ? b : "";
    dir = (std::filesystem::temp_directory_path() / ("flowrun-gemm-cache-" + std::to_string(getpid()))).string();
    std::filesystem::remove_all(dir);
    setenv("FLOWRUN_CACHE_DIR", dir.c_str(), 1);
  }
  ~CacheDir() {
    std::filesystem::remove_all(dir);
    if (before.empty()) unsetenv("FLOWRUN_CACHE_DIR");
    else setenv("FLOWRUN_CACHE_DIR", before.c_str(), 1);
  }
};

std::vector<std::string> cache_lines() {
  std::ifstream in(cpu_blas::cache_file());
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

TEST(Linear, AutoTakesTheFasterLibraryForEachShapeAndKeepsTheVerdictPerMachine) {
  SKIP_WITHOUT_OPENBLAS();
  CacheDir cache;
  SelectedGemm lib(cpu_blas::Library::automatic);
  EXPECT_NE(cpu_blas::describe().find("the faster of OpenBLAS"), std::string::npos) << cpu_blas::describe();
  // Shapes no other test meets: x [13, 31] · W[29, 31]ᵀ forward, then dx = g · W and dW = gᵀ · x.
  torch::Tensor x = torch::randn({13, 31}).requires_grad_(true), w = torch::randn({29, 31}).requires_grad_(true);
  const torch::Tensor y = flowrun::linear(x, w);
  y.sum().backward();
  const torch::Tensor x64 = x.detach().to(torch::kDouble), w64 = w.detach().to(torch::kDouble);
  const torch::Tensor ones = torch::ones({13, 29}, torch::kDouble);
  expect_linear_close(y.detach(), torch::matmul(x64, w64.t()), "y");
  expect_linear_close(x.grad(), torch::matmul(ones, w64), "dx");
  expect_linear_close(w.grad(), torch::matmul(ones.t(), x64), "dW");
  const std::vector<std::string> lines = cache_lines();
  ASSERT_EQ(lines.size(), 4u) << "the fingerprint and three verdicts";
  const int t = at::get_num_threads();
  for (const auto& [key, ta, tb, m, n, k] : std::vector<std::tuple<std::string, bool, bool, int, int, int>>{
           {"NT:13x29x31", false, true, 13, 29, 31}, {"NN:13x31x29", false, false, 13, 31, 29}, {"TN:29x31x13", true, false, 29, 31, 13}}) {
    const std::string want_key = key + ":t" + std::to_string(t);
    auto line = std::find_if(lines.begin(), lines.end(), [&](const std::string& l) { return l.rfind(want_key + " ", 0) == 0; });
    ASSERT_NE(line, lines.end()) << want_key;
    std::istringstream f(*line);
    std::string k2, library;
    double openblas_s = 0, libtorch_s = 0;
    f >> k2 >> library >> openblas_s >> libtorch_s;
    EXPECT_EQ(library, openblas_s < libtorch_s ? "openblas" : "libtorch") << *line;  // the faster one
    EXPECT_EQ(cpu_blas::chosen(ta, tb, m, n, k), library) << *line;
  }
  // A verdict already in the file is the one taken, whatever this process would measure: here
  // one planted for a new shape (OpenBLAS, against its own times), and nothing is measured again.
  { std::ofstream(cpu_blas::cache_file(), std::ios::app) << "NT:11x23x7:t" << t << " openblas 1 1e-9\n"; }
  flowrun::linear(torch::randn({11, 7}), torch::randn({23, 7}));
  EXPECT_EQ(cpu_blas::chosen(false, true, 11, 23, 7), "openblas");
  EXPECT_EQ(cache_lines().size(), 5u);
  EXPECT_NE(cpu_blas::choices_summary().find("product shapes: OpenBLAS took"), std::string::npos) << cpu_blas::choices_summary();
}

TEST(Linear, AnOpenBlasWhoseKernelsPredateTheCpuIsNotTaken) {
  for (const char* old : {"Prescott", "Core2", "Nehalem", "Sandybridge", "Barcelona", "Bulldozer"})
    EXPECT_TRUE(cpu_blas::core_predates_avx2(old)) << old;
  for (const char* current : {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids"})
    EXPECT_FALSE(cpu_blas::core_predates_avx2(current)) << current;
  // A process started with OPENBLAS_CORETYPE=Prescott: tests/cli/cli_test.sh cpu_gemm_choice.
}

TEST(Linear, RunCpuGemmNamesItsThreeValues) {
  EXPECT_EQ(cpu_blas::parse("auto"), cpu_blas::Library::automatic);
  EXPECT_EQ(cpu_blas::parse("libtorch"), cpu_blas::Library::libtorch);
  EXPECT_EQ(cpu_blas::parse("openblas"), cpu_blas::Library::openblas);
  EXPECT_THROW(cpu_blas::parse("mkl"), std::invalid_argument);
}

}  // namespace
}  // namespace flowrun
