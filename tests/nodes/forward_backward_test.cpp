// forward_backward: the loss and grads of the objective; micro-batches give the grads of the
// whole batch; grads are the parameters' own .grad() tensors, fresh each step. With a gradient
// buffer (train/grad_buffer.hpp): the same grads bit for bit, as views of the buffer, and the
// `ready` reports (on_ready) each parameter once, from inside the last backward.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/cuda_graph.hpp"
#include "common/memory.hpp"
#include "common/seed.hpp"
#include "data_test_helpers.hpp"
#include "float_compare.hpp"
#include "models/gpt/gpt.hpp"
#include "node_test_helpers.hpp"
#include "train/cross_entropy.hpp"
#include "train/forward_backward.hpp"
#include "train/losses.hpp"
#include "train/grad_buffer.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace {

// A small MLP model (the mlp node's layout) built directly.
std::shared_ptr<ModelState> small_model(int64_t in = 3, int64_t out = 2) {
  torch::manual_seed(0);
  torch::nn::Sequential seq(torch::nn::Linear(in, 5), torch::nn::Tanh(), torch::nn::Linear(5, out));
  return std::make_shared<ModelState>(
      seq.ptr(),
      [](torch::nn::Module& m, const TensorMap& b) { return m.as<torch::nn::SequentialImpl>()->forward(b.at("x")); },
      "test");
}

TEST(ForwardBackward, MseLossAndGradsMatchAutograd) {
  auto m = small_model();
  TensorMap batch = {{"x", torch::randn({8, 3})}, {"y", torch::randn({8, 2})}};
  FwdBwdResult r = forward_backward(*m, batch, MseLoss(), 1);

  // Reference: the same computation on a copy, by hand.
  auto ref = m->clone();
  torch::Tensor loss = ((ref->forward(batch) - batch.at("y")).pow(2)).mean();
  auto ref_params = ref->trainable_parameters();
  auto ref_grads = torch::autograd::grad({loss}, ref_params);

  EXPECT_EQ(r.loss.dim(), 0);
  EXPECT_FALSE(r.loss.requires_grad());
  EXPECT_NEAR(r.loss.item<double>(), loss.item<double>(), 1e-6);
  auto params = m->trainable_parameters();
  ASSERT_EQ(r.grads.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    test::expect_close(r.grads[i], ref_grads[i], 1e-5, "grad " + std::to_string(i));
    // Aliases of the parameters' .grad(), not copies.
    EXPECT_EQ(r.grads[i].data_ptr(), params[i].grad().data_ptr()) << i;
  }
}

TEST(ForwardBackward, MicroBatchesGiveTheWholeBatchsGrads) {
  auto m = small_model();
  TensorMap batch = {{"x", torch::randn({10, 3})}, {"y", torch::randn({10, 2})}};
  FwdBwdResult whole = forward_backward(*m, batch, MseLoss(), 1);
  std::vector<torch::Tensor> want;
  for (const auto& g : whole.grads) want.push_back(g.clone());
  // 10 rows in 3 parts (4, 3, 3) and in 10 parts of one row each.
  for (int64_t acc : {2, 3, 10}) {
    FwdBwdResult r = forward_backward(*m, batch, MseLoss(), acc);
    EXPECT_NEAR(r.loss.item<double>(), whole.loss.item<double>(), 1e-6) << acc;
    // Other row counts in each product: float32 rounding apart (float_compare.hpp).
    for (size_t i = 0; i < want.size(); ++i)
      test::expect_close(r.grads[i], want[i], 1e-5, "grad " + std::to_string(i) + ", accumulate " + std::to_string(acc));
  }
}

TEST(ForwardBackward, GradsAreFreshEachStep) {
  // The previous step's grads, still held by their consumers, are not added to or overwritten.
  auto m = small_model();
  TensorMap b1 = {{"x", torch::randn({4, 3})}, {"y", torch::randn({4, 2})}};
  TensorMap b2 = {{"x", torch::randn({4, 3})}, {"y", torch::randn({4, 2})}};
  FwdBwdResult r1 = forward_backward(*m, b1, MseLoss(), 1);
  std::vector<torch::Tensor> kept;
  for (const auto& g : r1.grads) kept.push_back(g.clone());
  FwdBwdResult r2 = forward_backward(*m, b2, MseLoss(), 1);
  auto fresh = small_model();  // same init (seed 0)
  FwdBwdResult only2 = forward_backward(*fresh, b2, MseLoss(), 1);
  for (size_t i = 0; i < kept.size(); ++i) {
    EXPECT_TRUE(torch::equal(r1.grads[i], kept[i])) << i;
    EXPECT_TRUE(torch::allclose(r2.grads[i], only2.grads[i])) << i;
  }
}

TEST(ForwardBackward, SplitBatch) {
  TensorMap b = {{"x", torch::arange(10).view({5, 2})}, {"w", torch::tensor(3.0)}};
  auto parts = split_batch(b, 2);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[0].at("x").size(0), 3);
  EXPECT_EQ(parts[1].at("x").size(0), 2);
  EXPECT_EQ(parts[1].at("x")[0][0].item<int64_t>(), 6);
  EXPECT_EQ(parts[1].at("w").item<double>(), 3.0);  // 0-d tensors go to every part
  EXPECT_THROW(split_batch(b, 6), std::runtime_error);
  TensorMap bad = {{"x", torch::zeros({5, 2})}, {"y", torch::zeros({4, 1})}};
  EXPECT_THROW(split_batch(bad, 2), std::runtime_error);
}

TEST(ForwardBackward, ErrorsSayWhatIsMissing) {
  auto m = small_model();
  TensorMap no_y = {{"x", torch::randn({4, 3})}};
  try {
    forward_backward(*m, no_y, MseLoss(), 1);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("'y'"), std::string::npos) << e.what();
  }
  TensorMap wrong_shape = {{"x", torch::randn({4, 3})}, {"y", torch::randn({4, 3})}};
  EXPECT_THROW(forward_backward(*m, wrong_shape, MseLoss(), 1), std::runtime_error);
}

// -mean over (b, t) of log softmax(logits[b, t])[tokens[b, t+1]], in doubles, by loops.
double cross_entropy_by_hand(const torch::Tensor& table, const torch::Tensor& tokens) {
  const torch::Tensor table64 = table.to(torch::kDouble);
  auto tab = table64.accessor<double, 2>();
  auto tok = tokens.accessor<int64_t, 2>();
  const int64_t V = table.size(1);
  double sum = 0;
  int64_t n = 0;
  for (int64_t b = 0; b < tokens.size(0); ++b)
    for (int64_t t = 0; t + 1 < tokens.size(1); ++t) {
      const int64_t prev = tok[b][t], next = tok[b][t + 1];
      double z = 0;
      for (int64_t v = 0; v < V; ++v) z += std::exp(tab[prev][v]);
      sum += -(tab[prev][next] - std::log(z));
      ++n;
    }
  return sum / static_cast<double>(n);
}

TEST(ForwardBackward, LmIsTheMeanNextTokenCrossEntropy) {
  torch::manual_seed(1);
  auto m = test::bigram_model(7);
  torch::Tensor tokens = torch::randint(7, {3, 6}, torch::kLong);
  TensorMap batch = {{"tokens", tokens}};
  const LmLoss lm;
  const double want = cross_entropy_by_hand(m->named_parameters()[0].second.detach(), tokens);
  FwdBwdResult r = forward_backward(*m, batch, lm, 1);
  EXPECT_NEAR(r.loss.item<double>(), want, 1e-5);
  EXPECT_EQ(lm.targets(batch), 3 * 5);  // B * T
  EXPECT_EQ(MseLoss().targets({{"x", torch::zeros({4, 2})}, {"y", torch::zeros({4, 1})}}), 4);
  // Micro-batches: same loss (every row has T targets, so row shares are token shares).
  EXPECT_NEAR(forward_backward(*m, batch, lm, 3).loss.item<double>(), want, 1e-5);

  // Errors name what is wrong.
  EXPECT_THROW(forward_backward(*m, {{"x", tokens}}, lm, 1), std::runtime_error);
  EXPECT_THROW(forward_backward(*m, {{"tokens", tokens.narrow(1, 0, 1)}}, lm, 1), std::runtime_error);
}

TEST(CrossEntropy, FusedMatchesTorchsValueAndGradient) {
  // V = 300000 makes the CPU path use chunks of 3 rows: 10 rows are 4 chunks, the last partial.
  for (int64_t V : {7, 300000}) {
    at::Generator g = make_cpu_generator(static_cast<uint64_t>(V));
    torch::Tensor x = (torch::randn({10, V}, g) * 4).requires_grad_(true);
    torch::Tensor t = torch::randint(V, {10}, g, torch::kLong);
    torch::Tensor mine = cross_entropy_mean(x, t);
    // Reference: torch's cross_entropy in double (fp32 sums over 300k terms differ by ~1e-6
    // relative between summation orders, torch's own fp32 result included).
    torch::Tensor x64 = x.detach().to(torch::kDouble).requires_grad_(true);
    torch::Tensor ref = torch::nn::functional::cross_entropy(x64, t);
    EXPECT_NEAR(mine.item<double>(), ref.item<double>(), 1e-6 * ref.item<double>()) << V;
    torch::Tensor w = torch::tensor(1.7);  // a non-unit upstream gradient
    auto gm = torch::autograd::grad({mine * w}, {x})[0];
    auto gr = torch::autograd::grad({ref * w}, {x64})[0].to(torch::kFloat);
    EXPECT_TRUE(torch::allclose(gm, gr, 1e-5, 1e-7)) << V << ": " << (gm - gr).abs().max().item<double>();
  }
  EXPECT_THROW(cross_entropy_mean(torch::zeros({2, 3}, torch::kLong), torch::zeros({2}, torch::kLong)),
               std::runtime_error);
}

// The GPU's kernel (torch's log_softmax + nll_loss, chosen for any non-CPU logits) and the CPU's
// chunked one give the same value and gradient, and both take bf16 logits (softmax in fp32).
TEST(CrossEntropy, LibraryAndChunkedKernelsAgreeForFp32AndBf16Logits) {
  at::Generator g = make_cpu_generator(5);
  const torch::Tensor x32 = torch::randn({12, 300000}, g) * 3, t = torch::randint(300000, {12}, g, torch::kLong);
  for (torch::Dtype dtype : {torch::kFloat, torch::kBFloat16}) {
    std::vector<torch::Tensor> value, grad;
    for (CrossEntropyKernel k : {CrossEntropyKernel::chunked, CrossEntropyKernel::library}) {
      torch::Tensor x = x32.to(dtype).requires_grad_(true);
      torch::Tensor l = cross_entropy_mean(x, t, k);
      EXPECT_EQ(l.scalar_type(), torch::kFloat);
      value.push_back(l.detach());
      grad.push_back(torch::autograd::grad({l * 1.7}, {x})[0]);
      EXPECT_EQ(grad.back().scalar_type(), dtype);  // the gradient comes back in the logits' dtype
    }
    EXPECT_NEAR(value[0].item<double>(), value[1].item<double>(), 1e-5 * value[1].item<double>()) << dtype;  // fp32 sums of 300k terms in two orders
    const double tol = dtype == torch::kFloat ? 1e-8 : 1e-7;  // softmax entries are ~1e-5 each
    EXPECT_TRUE(torch::allclose(grad[0].to(torch::kFloat), grad[1].to(torch::kFloat), 1e-2, tol))
        << dtype << ": " << (grad[0].to(torch::kFloat) - grad[1].to(torch::kFloat)).abs().max().item<double>();
  }
}

// Given the logits to spend (lm_loss: the model's output is the loss's alone), the CPU kernel
// computes the gradient in the forward and writes it over them: the same value and gradient as
// torch's, one [N, V] tensor fewer. bf16 logits are spent as their fp32 copy, whatever the flag.
TEST(CrossEntropy, SpentLogitsHoldTheGradientAfterTheForwardWithTorchsValueAndGradient) {
  for (int64_t V : {7, 300000}) {  // 300000: chunks of 3 rows, the last partial
    at::Generator g = make_cpu_generator(static_cast<uint64_t>(V) + 1);
    const torch::Tensor leaf = (torch::randn({10, V}, g) * 4).requires_grad_(true);
    const torch::Tensor t = torch::randint(V, {10}, g, torch::kLong);
    torch::Tensor x64 = leaf.detach().to(torch::kDouble).requires_grad_(true);
    const torch::Tensor ref = torch::nn::functional::cross_entropy(x64, t);
    const torch::Tensor want = torch::autograd::grad({ref * 0.25}, {x64})[0].to(torch::kFloat);

    const torch::Tensor logits = leaf * 1;  // a model's output: not a leaf
    const torch::Tensor mine = cross_entropy_mean(logits, t, CrossEntropyKernel::automatic, /*logits_spent=*/true);
    EXPECT_NEAR(mine.item<double>(), ref.item<double>(), 1e-6 * ref.item<double>()) << V;
    // After the forward the logits' memory holds (softmax - one_hot) / N ...
    EXPECT_TRUE(torch::allclose(logits.detach(), want * 4, 1e-5, 1e-7)) << V;
    // ... which the backward hands on, scaled by the upstream gradient (a micro-batch's share).
    const torch::Tensor got = torch::autograd::grad({mine * 0.25}, {leaf}, {}, /*retain_graph=*/true)[0];
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-8)) << V << ": " << (got - want).abs().max().item<double>();
    try {
      torch::autograd::grad({mine}, {leaf});
      FAIL() << "a second backward through spent logits was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("backward twice through the in-place kernel"), std::string::npos) << e.what();
    }
  }
  // Not spent, or no gradient wanted: the logits are left as they were.
  const torch::Tensor x = torch::randn({4, 9}).requires_grad_(true), y = x * 1, t = torch::zeros({4}, torch::kLong);
  const torch::Tensor before = y.detach().clone();
  cross_entropy_mean(y, t);
  {
    torch::NoGradGuard no_grad;
    cross_entropy_mean(y, t, CrossEntropyKernel::automatic, true);
  }
  EXPECT_TRUE(torch::equal(y.detach(), before));
  // bf16: its fp32 copy is spent, the bf16 logits kept; the gradient comes back in bf16.
  const torch::Tensor b = (torch::randn({4, 9}) * 3).to(torch::kBFloat16).requires_grad_(true), bb = b * 1;
  const torch::Tensor bf_before = bb.detach().clone();
  const torch::Tensor lb = cross_entropy_mean(bb, t);
  EXPECT_TRUE(torch::equal(bb.detach(), bf_before));
  const torch::Tensor gb = torch::autograd::grad({lb}, {b})[0];
  EXPECT_EQ(gb.scalar_type(), torch::kBFloat16);
  torch::Tensor b32 = b.detach().to(torch::kFloat).requires_grad_(true);
  const torch::Tensor gr = torch::autograd::grad({torch::nn::functional::cross_entropy(b32, t)}, {b32})[0];
  EXPECT_TRUE(torch::allclose(gb.to(torch::kFloat), gr, 1e-2, 1e-3));
}

// The fused kernel is the GPU's: asked for on CPU logits it says where it runs (and, in a
// build without CUDA, that it needs one); tests/gpu checks its values.
TEST(CrossEntropy, TheFusedKernelRunsOnlyOnACudaDevice) {
  const torch::Tensor x = torch::randn({4, 10}), t = torch::zeros({4}, torch::kLong);
  try {
    cross_entropy_mean(x, t, CrossEntropyKernel::fused);
    FAIL() << "fused on CPU logits was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("runs on a CUDA device; logits are on cpu"), std::string::npos) << e.what();
  }
}

// Per-row losses with label smoothing (the caption loss's) are torch's cross_entropy with
// label_smoothing, row by row, value and gradient; smoothing outside [0, 1] and the mean-only
// chunked kernel are refused.
TEST(CrossEntropy, RowsWithLabelSmoothingAreTorchsPerRowLoss) {
  at::Generator g = make_cpu_generator(11);
  const torch::Tensor x = torch::randn({9, 37}, g) * 3, t = torch::randint(37, {9}, g, torch::kLong);
  const torch::Tensor w = torch::rand({9}, g);  // a weight per row, as the caption loss's mask
  for (double e : {0.0, 0.1}) {
    torch::Tensor xm = x.clone().requires_grad_(true), x64 = x.to(torch::kDouble).requires_grad_(true);
    torch::Tensor mine = cross_entropy_rows(xm, t, e);
    namespace F = torch::nn::functional;
    torch::Tensor ref = F::cross_entropy(x64, t, F::CrossEntropyFuncOptions().reduction(torch::kNone).label_smoothing(e));
    ASSERT_EQ(mine.sizes(), torch::IntArrayRef({9}));
    EXPECT_TRUE(torch::allclose(mine.to(torch::kDouble), ref, 1e-6, 1e-7)) << e;
    auto gm = torch::autograd::grad({(mine * w).sum()}, {xm})[0];
    auto gr = torch::autograd::grad({(ref * w.to(torch::kDouble)).sum()}, {x64})[0].to(torch::kFloat);
    EXPECT_TRUE(torch::allclose(gm, gr, 1e-5, 1e-7)) << e << ": " << (gm - gr).abs().max().item<double>();
  }
  EXPECT_THROW(cross_entropy_rows(x, t, 1.5), std::runtime_error);
  EXPECT_THROW(cross_entropy_rows(x, t, 0, CrossEntropyKernel::chunked), std::runtime_error);
}

gpt::Gpt tiny_gpt() {
  gpt::Config c;
  c.layers = 2;
  c.dim = 64;
  c.heads = 4;
  c.vocab = 50;
  c.context = 32;
  gpt::Gpt m(c);
  gpt::init_weights(*m, 3);
  return m;
}

TEST(ForwardBackward, Bf16AutocastOnCpuIsCloseToFp32) {
  auto state = gpt::make_state(tiny_gpt());
  at::Generator g = make_cpu_generator(5);
  TensorMap batch = {{"tokens", torch::randint(50, {4, 17}, g, torch::kLong)}};
  FwdBwdOptions o;
  FwdBwdResult f32 = forward_backward(*state, batch, LmLoss(), o);
  std::vector<torch::Tensor> g32;
  for (const auto& t : f32.grads) g32.push_back(t.clone());
  o.precision = Precision::bf16;
  FwdBwdResult b16 = forward_backward(*state, batch, LmLoss(), o);
  const double l32 = f32.loss.item<double>(), l16 = b16.loss.item<double>();
  EXPECT_TRUE(std::isfinite(l16));
  EXPECT_NE(l16, l32);  // autocast really ran in bf16
  EXPECT_NEAR(l16, l32, 0.02 * l32);
  // Grads stay fp32 (the parameters' dtype), finite and close in direction.
  for (size_t i = 0; i < g32.size(); ++i) {
    ASSERT_EQ(b16.grads[i].scalar_type(), torch::kFloat) << i;
    EXPECT_TRUE(torch::isfinite(b16.grads[i]).all().item<bool>()) << i;
    const double cos = torch::cosine_similarity(b16.grads[i].flatten(), g32[i].flatten(), 0).item<double>();
    EXPECT_GT(cos, 0.95) << i;
  }
  // The autocast state is restored after the call.
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
}

TEST(ForwardBackwardNode, PrecisionFromTheRun) {
  const std::string yaml = R"(
flowrun: 1
run: { steps: 1, seed: 3 }
nodes:
  data: { type: synthetic_regression, with: { in_dim: 4, batch: 16 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 1 } }
  loss: { type: mse_loss }
  fb: { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  log: { type: metrics, in: { loss: fb.loss, rows: fb.tokens } }
)";
  // fp16 is not offered (it would need a loss scaler): the file is refused before anything runs.
  try {
    test::load_graph_text(yaml, {"run.precision=fp16"});
    FAIL() << "fp16 accepted";
  } catch (const GraphError& e) {
    EXPECT_NE(std::string(e.what()).find("run.precision"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos) << e.what();
  }
  auto g = test::load_graph_text(yaml, {"run.precision=bf16"});
  g->run();
  auto m = g->metrics();
  ASSERT_EQ(m.size(), 1u);
  EXPECT_TRUE(std::isfinite(m[0]["loss"].get<double>()));
  EXPECT_EQ(m[0]["rows"].get<int64_t>(), 16);
}

// Two SGD steps of a small MLP on regression batches, as a graph file.
const char* const kTwoSgdSteps = R"(
flowrun: 1
run: { steps: 2, seed: 3 }
nodes:
  data: { type: synthetic_regression, with: { in_dim: 4, batch: 16 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 1 } }
  loss: { type: mse_loss }
  fb: { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  opt: { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { kind: sgd, lr: 0.1 } }
)";

TEST(ForwardBackwardNode, AccumulateInAGraph) {
  // The same two-step training with accumulate 1 and 4 ends at the same parameters.
  const std::string yaml = kTwoSgdSteps;
  auto a = test::load_graph_text(yaml);
  auto b = test::load_graph_text(yaml, {"fb.accumulate=4"});
  a->run();
  b->run();
  auto pa = test::snapshot(a->state<ModelState>("model", "params"));
  auto pb = test::snapshot(b->state<ModelState>("model", "params"));
  for (const auto& [k, v] : pa) EXPECT_TRUE(torch::allclose(v, pb.at(k), 1e-5, 1e-6)) << k;
}

// run.cuda_graph (forward and backward captured once as a CUDA graph, then replayed): what a
// replay could never do is refused before the first step, naming the node and the setting.
// (On a GPU: tests/gpu/gpu_test.cpp, Gpu.CudaGraph*.)
TEST(ForwardBackwardNode, CudaGraphRefusesWhatCannotBeReplayed) {
  const std::string yaml = kTwoSgdSteps;
  auto refusal = [&](std::vector<std::string> ov) -> std::string {
    ov.push_back("run.cuda_graph=true");
    try {
      test::load_graph_text(yaml, ov)->run();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(ran)";
  };
  // Two gradient buffers taken in turn: a replay writes where the capture did.
  const std::string buffer = refusal({"fb.grad_layout=buffer"});
  EXPECT_NE(buffer.find("node 'fb' (forward_backward): run.cuda_graph needs grad_layout fresh"), std::string::npos)
      << buffer;
  EXPECT_NE(buffer.find("set run.cuda_graph=false"), std::string::npos) << buffer;
  // No GPU here: nothing to capture.
  const std::string cpu = refusal({"run.device=cpu"});
  EXPECT_NE(cpu.find(CapturedWork::available() ? "run.cuda_graph needs the model on a GPU; it is on cpu"
                                               : "run.cuda_graph needs a CUDA build of flowrun"),
            std::string::npos)
      << cpu;
  // Off (the default), the same graph trains.
  EXPECT_NO_THROW(test::load_graph_text(yaml)->run());
}

// ---- gradient buffer, hooks and the ready stream ----

TEST(GradBuffer, LayoutIsReverseModuleOrderPerDtypeGroup) {
  // Module order: f32 [2,3], f32 [4], f64 [5], f32 [1].
  std::vector<torch::Tensor> ps = {torch::randn({2, 3}), torch::randn({4}), torch::randn({5}, torch::kDouble),
                                   torch::randn({1})};
  auto b = GradBuffer::make(ps);
  ASSERT_EQ(b->flats.size(), 2u);  // float, then double (order of first appearance)
  EXPECT_EQ(b->flats[0].numel(), 11);
  EXPECT_EQ(b->flats[0].scalar_type(), torch::kFloat);
  EXPECT_EQ(b->flats[1].numel(), 5);
  EXPECT_EQ(b->flats[1].scalar_type(), torch::kDouble);
  // Reverse module order within each group: float 3, 1, 0; then double 2.
  EXPECT_EQ(b->order, (std::vector<int>{3, 1, 0, 2}));
  EXPECT_EQ(b->position, (std::vector<int>{2, 1, 3, 0}));
  const std::vector<int64_t> offset = {5, 1, 0, 0}, group = {0, 0, 1, 0};
  for (size_t i = 0; i < ps.size(); ++i) {
    EXPECT_EQ(b->slots[i].group, group[i]) << i;
    EXPECT_EQ(b->slots[i].offset, offset[i]) << i;
    EXPECT_EQ(b->slots[i].numel, ps[i].numel()) << i;
    // A view shaped like the parameter, at its offset in the flat buffer.
    EXPECT_TRUE(b->views[i].sizes().equals(ps[i].sizes())) << i;
    EXPECT_EQ(b->views[i].scalar_type(), ps[i].scalar_type()) << i;
    const auto& flat = b->flats[static_cast<size_t>(group[i])];
    EXPECT_EQ(static_cast<char*>(b->views[i].data_ptr()),
              static_cast<char*>(flat.data_ptr()) + offset[i] * flat.element_size())
        << i;
  }
  for (const auto& f : b->flats) EXPECT_EQ(f.abs().sum().item<double>(), 0.0);
  b->views[0].fill_(2);
  b->zero();
  EXPECT_EQ(b->flats[0].abs().sum().item<double>(), 0.0);
}

TEST(GradBuffer, ReusableOnlyWhenNobodyElseHoldsItsViews) {
  std::vector<torch::Tensor> ps = {torch::randn({3}).requires_grad_(), torch::randn({2, 2}).requires_grad_()};
  auto a = GradBuffer::make(ps);
  auto b = GradBuffer::make(ps);
  EXPECT_TRUE(a->reusable());
  a->attach(ps);  // the parameters' .grad() now hold a's views: that does not count
  EXPECT_EQ(ps[0].grad().data_ptr(), a->views[0].data_ptr());
  EXPECT_TRUE(a->reusable());
  {
    Grads held = {ps[0].grad(), torch::Tensor()};  // a consumer holding one of last step's grads
    EXPECT_FALSE(a->reusable());
    b->attach(ps);  // the next step moved the .grad()s on; the consumer still holds a's view
    EXPECT_FALSE(a->reusable());
    EXPECT_TRUE(b->reusable());
  }
  EXPECT_TRUE(a->reusable());
  {
    torch::Tensor copy = b->views[1];  // any extra handle of a view counts
    EXPECT_FALSE(b->reusable());
  }
  EXPECT_TRUE(b->reusable());
  EXPECT_THROW(a->attach({ps[0]}), std::runtime_error);
  EXPECT_THROW(a->attach({ps[1], ps[0]}), std::runtime_error);  // shapes differ
}

// An MLP with a parameter the loss never touches.
std::shared_ptr<ModelState> model_with_unused_param() {
  torch::manual_seed(0);
  struct Net : torch::nn::Module {
    torch::nn::Linear l1{nullptr}, l2{nullptr};
    torch::Tensor unused;
    Net() {
      l1 = register_module("l1", torch::nn::Linear(3, 5));
      unused = register_parameter("unused", torch::randn({4}));
      l2 = register_module("l2", torch::nn::Linear(5, 2));
    }
  };
  auto net = std::make_shared<Net>();
  return std::make_shared<ModelState>(
      net,
      [](torch::nn::Module& m, const TensorMap& b) {
        auto& n = static_cast<Net&>(m);
        return n.l2->forward(torch::tanh(n.l1->forward(b.at("x"))));
      },
      "unused");
}

// Equal bit for bit, except that -0 and +0 count as the same (0 + g turns a -0 into +0).
::testing::AssertionResult same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.defined() != b.defined()) return ::testing::AssertionFailure() << "one is undefined";
  if (!a.defined()) return ::testing::AssertionSuccess();
  if (!a.sizes().equals(b.sizes()) || a.scalar_type() != b.scalar_type())
    return ::testing::AssertionFailure() << "shape or dtype differ";
  const torch::Tensor x = (a + 0.0).contiguous().view(torch::kInt32), y = (b + 0.0).contiguous().view(torch::kInt32);
  if (torch::equal(x, y)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max difference " << (a - b).abs().max().item<double>();
}

// Both ways of filling the buffer (GradFill::accumulate: zeroed, autograd adds into it;
// GradFill::copy: autograd writes fresh tensors, each finished one copied into its view) give the
// fresh-tensor grads bit for bit, as views of the buffer that the parameters' .grad() are.
TEST(ForwardBackward, BufferGivesBitIdenticalGradsAsViews) {
  auto m = small_model();
  TensorMap batch = {{"x", torch::randn({9, 3})}, {"y", torch::randn({9, 2})}};
  for (GradFill fill : {GradFill::accumulate, GradFill::copy})
  for (int64_t acc : {1, 3}) {
    FwdBwdOptions plain;
    plain.accumulate = acc;
    FwdBwdResult r0 = forward_backward(*m, batch, MseLoss(), plain);
    std::vector<torch::Tensor> want;
    for (const auto& g : r0.grads) want.push_back(g.clone());

    FwdBwdOptions o = plain;
    auto params = m->trainable_parameters();
    o.buffer = GradBuffer::make(params);
    o.fill = fill;
    o.buffer->flats[0].fill_(7);  // stale values: every slot is zeroed or overwritten
    FwdBwdResult r = forward_backward(*m, batch, MseLoss(), o);
    EXPECT_EQ(r.loss.item<double>(), r0.loss.item<double>());
    ASSERT_EQ(r.grads.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(same_bits(r.grads[i], want[i])) << "fill " << int(fill) << ", accumulate " << acc << ", grad " << i;
      // Views of the buffer: same storage, at the slot's place; and the parameter's own .grad().
      EXPECT_TRUE(r.grads[i].is_alias_of(o.buffer->flats[0])) << i;
      EXPECT_EQ(r.grads[i].data_ptr(), o.buffer->views[i].data_ptr()) << i;
      EXPECT_EQ(params[i].grad().unsafeGetTensorImpl(), o.buffer->views[i].unsafeGetTensorImpl()) << i;
    }
  }
}

struct ReadyCall {
  int param;
  bool used;
  torch::Tensor grad_then;  // a copy of the parameter's gradient when it was reported
  bool first_layer_zero;    // parameter 0's gradient (the first layer's weight) still all zero
};

std::vector<ReadyCall> run_with_ready(ModelState& m, const TensorMap& batch, int64_t acc, FwdBwdResult& r,
                                      std::shared_ptr<GradBuffer>& buffer, GradFill fill = GradFill::accumulate) {
  auto params = m.trainable_parameters();
  buffer = GradBuffer::make(params);
  std::vector<ReadyCall> calls;
  FwdBwdOptions o;
  o.accumulate = acc;
  o.buffer = buffer;
  o.fill = fill;
  o.on_ready = [&](int i, bool used) {
    calls.push_back({i, used, buffer->views[static_cast<size_t>(i)].clone(),
                     buffer->views[0].abs().sum().item<double>() == 0.0});
  };
  r = forward_backward(m, batch, MseLoss(), o);
  return calls;
}

TEST(ForwardBackward, ReadyReportsEachParameterOnceWithItsFinalGrad) {
  auto m = model_with_unused_param();
  const ModelState::Named named = m->named_parameters(/*trainable_only=*/true);
  const int n = static_cast<int>(named.size());
  ASSERT_EQ(n, 5);
  int unused = -1;  // libtorch lists a module's own parameters before its children's: 0
  for (int i = 0; i < n; ++i)
    if (named[static_cast<size_t>(i)].first == "unused") unused = i;
  ASSERT_GE(unused, 0);
  TensorMap batch = {{"x", torch::randn({6, 3})}, {"y", torch::randn({6, 2})}};
  for (GradFill fill : {GradFill::accumulate, GradFill::copy})
  for (int64_t acc : {1, 3}) {
    FwdBwdResult r;
    std::shared_ptr<GradBuffer> buffer;
    std::vector<ReadyCall> calls = run_with_ready(*m, batch, acc, r, buffer, fill);
    // Exactly n calls: the earlier micro-batches reported nothing.
    ASSERT_EQ(calls.size(), static_cast<size_t>(n)) << acc;
    std::vector<int> seen(static_cast<size_t>(n), 0);
    for (const auto& c : calls) {
      ASSERT_GE(c.param, 0);
      ASSERT_LT(c.param, n);
      ++seen[static_cast<size_t>(c.param)];
      EXPECT_EQ(c.used, c.param != unused) << c.param;
      // Reported when final: the gradient then is the gradient returned, so no earlier
      // micro-batch reported it.
      if (c.used) EXPECT_TRUE(torch::equal(c.grad_then, r.grads[static_cast<size_t>(c.param)])) << acc << " " << c.param;
    }
    for (int i = 0; i < n; ++i) EXPECT_EQ(seen[static_cast<size_t>(i)], 1) << "parameter " << i;
    // The unused parameter is reported after backward, and its grad is undefined (its view zero).
    EXPECT_EQ(calls.back().param, unused);
    EXPECT_FALSE(r.grads[unused].defined());
    EXPECT_EQ(buffer->views[unused].abs().sum().item<double>(), 0.0);
    for (int i = 0; i < n; ++i)
      if (i != unused) EXPECT_TRUE(r.grads[static_cast<size_t>(i)].defined()) << i;
    // Same grads as without the buffer and hooks.
    FwdBwdResult plain = forward_backward(*m, batch, MseLoss(), acc);
    for (int i = 0; i < n; ++i)
      EXPECT_TRUE(same_bits(r.grads[static_cast<size_t>(i)], plain.grads[static_cast<size_t>(i)])) << i;
  }
}

TEST(ForwardBackward, ReadyFiresWhileBackwardIsStillRunning) {
  // Backward reaches l2 before l1: when the first parameter is reported, the first layer's
  // weight gradient (parameter 0) is still all zero, so backward had not returned yet; after
  // the call it is not zero.
  auto m = small_model();
  TensorMap batch = {{"x", torch::randn({6, 3})}, {"y", torch::randn({6, 2})}};
  for (GradFill fill : {GradFill::accumulate, GradFill::copy}) {
  FwdBwdResult r;
  std::shared_ptr<GradBuffer> buffer;
  std::vector<ReadyCall> calls = run_with_ready(*m, batch, 1, r, buffer, fill);
  ASSERT_EQ(calls.size(), 4u);
  EXPECT_GE(calls.front().param, 2);  // a parameter of the last layer comes first
  EXPECT_TRUE(calls.front().first_layer_zero);
  EXPECT_GT(r.grads[0].abs().sum().item<double>(), 0.0);
  // Parameter 0 is reported after its own gradient is in.
  for (const auto& c : calls)
    if (c.param == 0) EXPECT_FALSE(c.first_layer_zero);
  }
}

TEST(ForwardBackward, HooksKeptAcrossCallsReportEveryStep) {
  // The node keeps one GradHooks for all steps; the accumulators it holds keep the hooks alive.
  auto m = small_model();
  auto params = m->trainable_parameters();
  FwdBwdOptions o;
  o.hooks = std::make_shared<GradHooks>(params);
  o.buffer = GradBuffer::make(params);
  int calls = 0;
  o.on_ready = [&](int, bool used) { calls += used ? 1 : 0; };
  for (int step = 0; step < 3; ++step) {
    TensorMap batch = {{"x", torch::randn({4, 3})}, {"y", torch::randn({4, 2})}};
    forward_backward(*m, batch, MseLoss(), o);
  }
  EXPECT_EQ(calls, 12);
  // Without on_ready nothing is called, and grads still come out right.
  o.on_ready = nullptr;
  TensorMap batch = {{"x", torch::randn({4, 3})}, {"y", torch::randn({4, 2})}};
  FwdBwdResult r = forward_backward(*m, batch, MseLoss(), o);
  EXPECT_EQ(calls, 12);
  std::vector<torch::Tensor> got;
  for (const auto& g : r.grads) got.push_back(g.clone());
  FwdBwdResult plain = forward_backward(*m, batch, MseLoss(), 1);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(same_bits(got[i], plain.grads[i])) << i;
  // Hooks made for other parameters are refused.
  FwdBwdOptions other = o;
  other.hooks = std::make_shared<GradHooks>(small_model()->trainable_parameters());
  EXPECT_THROW(forward_backward(*m, batch, MseLoss(), other), std::runtime_error);
}

// A consumer that holds step s's grads while step s+1's backward runs must not see them change.
// t_grads_copy (a write access to the model, so the next forward_backward waits for it) copies
// the grads as produced; t_grads_slow holds the grads themselves for a while, then compares.
class GradsCopyNode : public Node {
 public:
  void run(StepContext& c) override {
    Grads copy;
    for (const auto& g : c.in<Grads>("grads")) copy.push_back(g.defined() ? g.clone() : g);
    c.out("copy", std::move(copy));
  }
};

std::atomic<int> slow_mismatches{0}, slow_runs{0};

class GradsSlowNode : public Node {
 public:
  void run(StepContext& c) override {
    const Grads& held = c.in<Grads>("grads");
    std::this_thread::sleep_for(std::chrono::milliseconds(15));  // the next step's backward runs meanwhile
    const Grads& copy = c.in<Grads>("copy");
    for (size_t i = 0; i < held.size(); ++i)
      if (!torch::equal(held[i], copy[i])) ++slow_mismatches;
    ++slow_runs;
  }
};

TEST(ForwardBackwardNode, GradsHeldByAConsumerAreNeverOverwritten) {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry::global().add(R"(type: t_grads_copy
doc: copies grads; writes the model (only to order the next forward_backward after it)
inputs:
  grads: { kind: value, type: grads, doc: grads }
  model: { kind: state, access: write, type: params, doc: the model (not written) }
outputs: { copy: { kind: value, type: grads, doc: copies } })",
                           [] { return std::make_unique<GradsCopyNode>(); }, "tests");
    Registry::global().add(R"(type: t_grads_slow
doc: holds grads for a while, then compares them with a copy
inputs:
  grads: { kind: value, type: grads, doc: grads }
  copy: { kind: value, type: grads, doc: the copy })",
                           [] { return std::make_unique<GradsSlowNode>(); }, "tests");
  });
  slow_mismatches = 0;
  slow_runs = 0;
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 6, seed: 3, prefetch: 4 }
nodes:
  data: { type: synthetic_regression, with: { in_dim: 4, batch: 16 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 1 } }
  loss: { type: mse_loss }
  fb: { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  copy: { type: t_grads_copy, in: { grads: fb.grads, model: model.params } }
  slow: { type: t_grads_slow, in: { grads: fb.grads, copy: copy.copy } }
  opt: { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { kind: sgd, lr: 0.1 } }
)");
  g->run();
  EXPECT_EQ(slow_runs.load(), 6);
  EXPECT_EQ(slow_mismatches.load(), 0);
}

// The step's memory, estimated before the first step (memory_check; common/memory.hpp).
// graphs/gpt.yaml at a small size, as a user runs it: the log line holds every part, each
// from its own source: gradients = weights (all trainable), AdamW's state = 2 x, the EMA's copy = 1 x.
std::string run_gpt(const std::vector<std::string>& overrides, int* rc) {
  const std::string src = FLOWRUN_SOURCE_DIR, dir = test::temp_dir("memory");
  std::vector<std::string> args = {src + "/graphs/gpt.yaml", "data.path=" + src + "/data/text/fortunes_byte",
                                   "model.vocab=256", "model.layers=2", "model.dim=64", "model.heads=4",
                                   "run.steps=1", "eval.every=1000000", "evlog.every=1000000", "ckpt.every=1000000",
                                   "ckpt.at=[]", "run.progress=off", "run.out_dir=" + dir + "/o"};
  args.insert(args.end(), overrides.begin(), overrides.end());
  *rc = test::run_flowrun(args, dir + "/log");
  std::ifstream in(dir + "/log");
  std::stringstream log;
  log << in.rdbuf();
  return log.str();
}

double mb_after(const std::string& text, const std::string& key) {
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + key.size()));
}

TEST(ForwardBackwardMemory, TheEstimateBeforeTheFirstStepHasEveryPart) {
  FLOWRUN_NEEDS_DATA(std::string(FLOWRUN_SOURCE_DIR) + "/data/text/fortunes_byte.train.bin");
  int rc = 0;
  const std::string log = run_gpt({"model.context=64", "data.seq_len=64", "data.batch=8"}, &rc);
  ASSERT_EQ(rc, 0) << log;
  const size_t at = log.find("memory per rank (estimate): ");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string line = log.substr(at, log.find('\n', at) - at);
  const double weights = mb_after(line, "weights "), grads = mb_after(line, "gradients ");
  const double opt = mb_after(line, "optimizer state (adamw) (opt) "), ema = mb_after(line, "EMA copy (ema) ");
  ASSERT_GT(weights, 0) << line;
  // (printed with one decimal, in the same unit here: ~480 KB)
  EXPECT_NEAR(grads, weights, 0.11) << line;
  EXPECT_NEAR(opt, 2 * weights, 0.21) << line;
  EXPECT_NEAR(ema, weights, 0.11) << line;
  EXPECT_NE(line.find("activations of a micro-batch (8 rows, fp32, checkpoint: none) "), std::string::npos) << line;
  EXPECT_NE(line.find(" available now, "), std::string::npos) << line;
  // Checkpointing lowers the activations' figure; accumulate halves the rows.
  const std::string blocks = run_gpt({"model.context=64", "data.seq_len=64", "data.batch=8", "model.checkpoint=blocks",
                                      "fb.accumulate=2"}, &rc);
  ASSERT_EQ(rc, 0) << blocks;
  EXPECT_NE(blocks.find("activations of a micro-batch (4 rows, fp32, checkpoint: blocks) "), std::string::npos) << blocks;
}

// A step that cannot fit is refused before it allocates anything, naming the figures and what
// would make it fit: one sequence of 32768 tokens keeps 4 heads x 32768^2 attention
// probabilities per block (fp32), ~17 GB, two blocks and the gradient of one ~52 GB, beyond this
// machine. The refusal names checkpointing (one block's worth and its gradient then: less, not
// enough alone), more tensor parallel and ZeRO stage params; a larger accumulate cannot help one
// row.
TEST(ForwardBackwardMemory, AStepThatCannotFitIsRefusedWithTheSettingsThatWouldHelp) {
  FLOWRUN_NEEDS_DATA(std::string(FLOWRUN_SOURCE_DIR) + "/data/text/fortunes_byte.train.bin");
  if (available_host_memory() > 200e9) GTEST_SKIP() << "this machine has more than 200 GB available";
  int rc = 0;
  const std::string log =
      run_gpt({"model.layers=2", "model.dim=32", "model.context=32768", "data.seq_len=32768", "data.batch=1",
               "eval.batch=1"}, &rc);
  EXPECT_NE(rc, 0) << log;
  EXPECT_NE(log.find("(forward_backward): the step needs about "), std::string::npos) << log;
  EXPECT_NE(log.find("activations of a micro-batch (1 rows, fp32, checkpoint: none)"), std::string::npos) << log;
  EXPECT_NE(log.find("model.checkpoint=blocks ("), std::string::npos) << log;
  EXPECT_NE(log.find(": not enough alone)"), std::string::npos) << log;
  EXPECT_EQ(log.find("fb.accumulate="), std::string::npos) << log;
  // Layouts over more processes, with what a rank would hold: tp splits most of a block's
  // activations (the smallest tp that fits, else the largest the model takes); ZeRO-3 divides the
  // weights and state but no activation, so none of its process counts is enough and the largest
  // tried is named.
  EXPECT_NE(log.find("run.parallel.tp="), std::string::npos) << log;
  // Issue 69: 4 heads take tp 2 or 4, never 8 (which the run then refused), as flowrun plan filters.
  EXPECT_EQ(log.find("run.parallel.tp=8"), std::string::npos) << log;
  EXPECT_NE(log.find(" a rank"), std::string::npos) << log;
  EXPECT_NE(log.find("zero.stage=params with 8 processes ("), std::string::npos) << log;
  EXPECT_NE(log.find("fb.memory_check=warn runs anyway"), std::string::npos) << log;
}

}  // namespace
}  // namespace flowrun
