// GPU tests (ctest -L gpu; tests/gpu/run.sh builds and runs them on a machine with an NVIDIA
// GPU). Built only with FLOWRUN_CUDA; on CPU machines the cuda_syntax test compiles this file
// syntax-only. What the CPU stream tests check with a test double (tests/engine/
// device_streams_test.cpp), these check with real CUDA streams, plus placement, resume and
// precision on the device, through the real graph files at tiny sizes.
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>

#include "comm.hpp"
#include "parallel/collectives.hpp"
#include "parallel/nccl.hpp"
#include "common/cuda_graph.hpp"
#include "common/device.hpp"
#include "common/seed.hpp"
#include "common/state_io.hpp"
#include "executor.hpp"
#include "models/gpt/gpt.hpp"
#include "nodes/data_test_helpers.hpp"
#include "registry.hpp"
#include "schema.hpp"
#include "spec.hpp"
#include "state/resume.hpp"
#include "train/cross_entropy.hpp"
#include "train/forward_backward.hpp"
#include "train/losses.hpp"
#include "train/optimizer.hpp"
#include "support/run_graph.hpp"

using namespace flowrun;

namespace {

// ---- test nodes whose kernels take long on the GPU ----

// Fills a fresh buffer with -1, spins ~`cycles` on its stream, then writes `step`.
class GpuProduce : public Node {
  int64_t cycles_ = 0;

 public:
  void setup(SetupContext& c) override { cycles_ = c.params().get<int64_t>("cycles"); }
  void run(StepContext& c) override {
    torch::Tensor buf = torch::full({1 << 16}, -1.0f, torch::TensorOptions().device(torch::kCUDA));
    at::cuda::sleep(cycles_);
    buf.fill_(static_cast<float>(c.step()));
    c.out("out", buf);
  }
};

// On its stream: counts elements that are not its step (an unfinished producer's -1s).
class GpuCheck : public Node {
 public:
  static torch::Tensor& bad() {
    static torch::Tensor b;
    return b;
  }
  void run(StepContext& c) override {
    const torch::Tensor& buf = c.in<torch::Tensor>("in");
    bad() += (buf != static_cast<float>(c.step())).sum().to(torch::kFloat);
  }
};

void register_gpu_nodes() {
  static bool done = false;
  if (done) return;
  done = true;
  Registry& r = Registry::global();
  r.add(R"(type: t_gpu_produce
doc: gpu test producer
outputs: { out: { kind: value, type: tensor } }
params: { cycles: { type: int, default: 20000000, min: 0 } })",
        [] { return std::make_unique<GpuProduce>(); }, "tests");
  r.add(R"(type: t_gpu_check
doc: gpu test consumer
inputs: { in: { kind: value, type: tensor } })",
        [] { return std::make_unique<GpuCheck>(); }, "tests");
}

test::RunResult run_on_gpu(const std::string& yaml, std::vector<std::string> ov, DeviceStreams* streams) {
  ov.push_back("run.device=cuda");
  RunOptions o;
  o.streams = streams;
  return test::run_graph_text(yaml, ov, o);
}

}  // namespace

TEST(Gpu, ResolvesCudaAndMakesStreams) {
  ASSERT_TRUE(torch::cuda::is_available()) << "no GPU visible: these tests need one";
  EXPECT_EQ(resolve_device("auto", 0), "cuda:0");
  EXPECT_EQ(resolve_device("cuda", 0), "cuda:0");
  EXPECT_NE(make_device_streams("cuda:0"), nullptr);
}

TEST(Gpu, AConsumerOnAnotherStreamNeverSeesAnUnfinishedProducer) {
  register_gpu_nodes();
  auto streams = make_device_streams("cuda:0");
  GpuCheck::bad() = torch::zeros({}, torch::TensorOptions().device(torch::kCUDA));
  run_on_gpu(R"(flowrun: 1
run: { steps: 20, prefetch: 2 }
nodes:
  src: { type: t_gpu_produce, stream: io }
  chk: { type: t_gpu_check, in: { in: src.out } }
)",
             {}, streams.get());
  EXPECT_EQ(GpuCheck::bad().item<float>(), 0.0f);
}

namespace {

// What a graph run on the GPU left: its first and last logged loss, and whether every tensor
// of every state (parameters, optimizer moments, EMA, ...) lives on the GPU.
struct GpuRun {
  double first_loss = -1, last_loss = -1;
  std::vector<double> losses;  // every logged loss, in step order
  int64_t state_tensors = 0, on_gpu = 0;
};

// Runs a graph's text with overrides in OUT_DIR on the GPU; with `resume`, as the CLI does with
// run.resume=auto: from OUT_DIR's latest checkpoint, if there is one (the graph must then have a
// checkpoint node: run.resume=auto is refused without one).
GpuRun run_gpu(const std::string& yaml, const std::string& out_dir, std::vector<std::string> ov,
               DeviceStreams* streams, bool resume = true) {
  const std::string file = test::temp_dir("gpu") + "/graph.yaml";
  std::ofstream(file) << yaml;
  ov.insert(ov.end(), {"run.device=cuda", "run.progress=off", "run.out_dir=" + out_dir});
  if (resume) ov.push_back("run.resume=auto");
  GraphSpec g = load_graph(file, ov, Registry::global());
  RunInfo info = run_info(g);
  info.device = resolve_device(info.device, 0);
  std::filesystem::create_directories(info.out_dir);
  std::optional<ResumePoint> rp = find_resume_point(g, info.out_dir);
  if (rp) info.first_step = rp->step + 1;
  Executor ex(g, Registry::global(), info);
  if (rp) restore(ex, g, *rp);
  RunOptions o = run_options(g);
  o.streams = streams;
  ex.run(o);
  GpuRun r;
  for (const auto& j : test::read_jsonl(out_dir + "/metrics.jsonl"))
    if (j.contains("loss")) {
      r.last_loss = j["loss"].get<double>();
      r.losses.push_back(r.last_loss);
      if (r.first_loss < 0) r.first_loss = r.last_loss;
    }
  for (const NodeSpec& n : g.nodes)
    for (const auto& port : Registry::global().find(n.type)->schema.outputs)
      if (port.kind == PortKind::State)
        if (const StateIO* io = find_state_io(ex.state(n.name, port.name)))
          for (const auto& [_, t] : io->tensors(ex.state(n.name, port.name))) {
            // Integers are host numbers: step counters, the data cursor's position and its data's
            // fingerprint (nodes/data/cursor.cpp). Parameters, moments and EMA weights are floats.
            if (!t.is_floating_point()) continue;
            ++r.state_tensors;
            r.on_gpu += t.is_cuda();
          }
  return r;
}

// graphs/gpt.yaml at a tiny size, byte-level on the fortunes shards (scripts/data.sh).
std::vector<std::string> tiny_gpt(int64_t seq, int64_t dim, int64_t heads, std::vector<std::string> more) {
  const std::string shards = std::string(FLOWRUN_SOURCE_DIR) + "/data/text/fortunes_byte";
  EXPECT_TRUE(std::filesystem::exists(shards + ".train.bin")) << "run scripts/data.sh first";
  std::vector<std::string> v = {"data.path=" + shards, "data.seq_len=" + std::to_string(seq), "data.batch=8",
                                "model.layers=2", "model.dim=" + std::to_string(dim),
                                "model.heads=" + std::to_string(heads), "model.vocab=256",
                                "model.context=" + std::to_string(seq), "run.log_every=1", "eval.every=1000",
                                "evlog.every=1000"};
  v.insert(v.end(), more.begin(), more.end());
  return v;
}

std::string graph(const std::string& name) { return test::read_text(std::string(FLOWRUN_SOURCE_DIR) + "/graphs/" + name); }

}  // namespace

// graphs/regression.yaml on the GPU: every state tensor lives there, and the loss drops.
TEST(Gpu, RegressionGraphPlacesEveryStateOnTheGpuAndLearns) {
  auto streams = make_device_streams("cuda:0");
  GpuRun r = run_gpu(graph("regression.yaml"), test::temp_dir("gpu_reg"), {"run.steps=200", "run.log_every=50"},
                     streams.get(), /*resume=*/false);
  EXPECT_GT(r.state_tensors, 0);
  EXPECT_EQ(r.on_gpu, r.state_tensors);
  EXPECT_LT(r.last_loss, r.first_loss / 2);
}

// The GPT graph at a tiny size on the GPU: 20 steps straight end where 10, resume, 10 end.
TEST(Gpu, GptGraphResumesOnTheGpu) {
  auto streams = make_device_streams("cuda:0");
  const std::string a_dir = test::temp_dir("gpu_straight"), b_dir = test::temp_dir("gpu_resumed");
  const GpuRun straight = run_gpu(graph("gpt.yaml"), a_dir, tiny_gpt(32, 64, 2, {"run.steps=20", "ckpt.every=10"}),
                                  streams.get());
  run_gpu(graph("gpt.yaml"), b_dir, tiny_gpt(32, 64, 2, {"run.steps=10", "ckpt.every=10"}), streams.get());
  ASSERT_TRUE(std::filesystem::exists(b_dir + "/checkpoints/latest"));
  const GpuRun resumed =
      run_gpu(graph("gpt.yaml"), b_dir, tiny_gpt(32, 64, 2, {"run.steps=20", "ckpt.every=10"}), streams.get());
  EXPECT_EQ(straight.on_gpu, straight.state_tensors);
  EXPECT_EQ(resumed.on_gpu, resumed.state_tensors) << "resume left state on the CPU";
  ASSERT_GT(straight.last_loss, 0);
  // GPU kernels may sum in another order from run to run; bit-identity is the CPU's promise.
  EXPECT_NEAR(resumed.last_loss, straight.last_loss, 1e-3 * straight.last_loss);
}

// run.cuda_graph: forward and backward captured at step 4 and replayed from then on train as the
// eager steps do: 20 steps of the GPT graph in bf16, each logged loss within bf16 rounding of the
// eager run's (the same kernels on the same inputs; only cuBLAS's choices could differ), and
// the graph really replayed (17 replays: the capture's at step 4, then steps 5-20).
TEST(Gpu, CudaGraphReplayTrainsAsTheEagerStep) {
  auto streams = make_device_streams("cuda:0");
  const std::vector<std::string> ov = {"run.steps=20", "run.precision=bf16", "ckpt.every=1000", "ckpt.at=[]"};
  std::vector<std::string> graphed = ov;
  graphed.push_back("run.cuda_graph=true");
  const GpuRun eager = run_gpu(graph("gpt.yaml"), test::temp_dir("gpu_eager"), tiny_gpt(64, 128, 4, ov), streams.get());
  const int64_t replays = CapturedWork::replays();
  const GpuRun replayed =
      run_gpu(graph("gpt.yaml"), test::temp_dir("gpu_graph"), tiny_gpt(64, 128, 4, graphed), streams.get());
  EXPECT_EQ(CapturedWork::replays() - replays, 17) << "captured at step 4 (3 eager steps), replayed for steps 4-20";
  ASSERT_EQ(eager.losses.size(), 20u);
  ASSERT_EQ(replayed.losses.size(), 20u);
  for (size_t i = 0; i < eager.losses.size(); ++i)
    EXPECT_NEAR(replayed.losses[i], eager.losses[i], 1e-2 * eager.losses[i]) << "step " << i + 1;
  EXPECT_LT(replayed.last_loss, replayed.first_loss);
}

// A run with run.cuda_graph resumes: 10 steps and a checkpoint, then 10 more (captured again
// after the resumed run's warm-up) end where 20 eager steps do.
TEST(Gpu, CudaGraphRunResumes) {
  auto streams = make_device_streams("cuda:0");
  const std::vector<std::string> ov = {"run.precision=bf16", "ckpt.every=10"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), ov.begin(), ov.end());
    return tiny_gpt(64, 128, 4, more);
  };
  const GpuRun straight = run_gpu(graph("gpt.yaml"), test::temp_dir("gpu_cg_straight"), with({"run.steps=20"}), streams.get());
  const std::string dir = test::temp_dir("gpu_cg_resumed");
  run_gpu(graph("gpt.yaml"), dir, with({"run.steps=10", "run.cuda_graph=true"}), streams.get());
  const GpuRun resumed = run_gpu(graph("gpt.yaml"), dir, with({"run.steps=20", "run.cuda_graph=true"}), streams.get());
  ASSERT_GT(straight.last_loss, 0);
  EXPECT_NEAR(resumed.last_loss, straight.last_loss, 1e-2 * straight.last_loss);
}

// A step that draws random numbers (dropout here) is refused at its capture, with the reason:
// a replay would draw the same masks every step.
TEST(Gpu, CudaGraphRefusesAStepThatDrawsRandomNumbers) {
  auto streams = make_device_streams("cuda:0");
  try {
    run_gpu(graph("gpt.yaml"), test::temp_dir("gpu_cg_dropout"),
            tiny_gpt(32, 64, 2, {"run.steps=6", "model.dropout=0.1", "run.cuda_graph=true", "ckpt.at=[]"}), streams.get());
    FAIL() << "a step with dropout was captured";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("draws random numbers"), std::string::npos) << e.what();
  }
}

// bf16 autocast with fp32 master weights: the loss of the first step within 2 % of fp32's.
TEST(Gpu, Bf16LossIsCloseToFp32OnTheSameBatch) {
  auto streams = make_device_streams("cuda:0");
  const std::vector<std::string> one = {"run.steps=1", "ckpt.every=1000", "ckpt.at=[]"};
  std::vector<std::string> bf16 = one;
  bf16.push_back("run.precision=bf16");
  const double l32 = run_gpu(graph("gpt.yaml"), test::temp_dir("gpu_fp32"), tiny_gpt(64, 128, 4, one), streams.get()).first_loss;
  const double l16 = run_gpu(graph("gpt.yaml"), test::temp_dir("gpu_bf16"), tiny_gpt(64, 128, 4, bf16), streams.get()).first_loss;
  ASSERT_GT(l32, 0);
  EXPECT_NEAR(l16, l32, 0.02 * l32);
}

// The fused AdamW kernel (libtorch >= 2 on CUDA) gives the written-out update of the CPU,
// clip and weight decay included, over several steps.
TEST(Gpu, FusedAdamwMatchesTheWrittenOutUpdate) {
  torch::manual_seed(0);
  OptimConfig cfg;  // adamw
  cfg.weight_decay = 0.1;
  cfg.clip = 1.0;
  ModelState::Named cpu = {{"w", torch::randn({64, 32})}, {"b", torch::randn({32})}};
  ModelState::Named gpu;
  for (const auto& [n, t] : cpu) gpu.emplace_back(n, t.to(torch::kCUDA));
  OptimizerState s_cpu, s_gpu;
  for (int step = 1; step <= 5; ++step) {
    Grads g_cpu = {torch::randn({64, 32}) * 3, torch::randn({32}) * 3};  // norm > clip
    Grads g_gpu = {g_cpu[0].to(torch::kCUDA), g_cpu[1].to(torch::kCUDA)};
    optimizer_update(s_cpu, cpu, g_cpu, cfg, 1e-2);
    optimizer_update(s_gpu, gpu, g_gpu, cfg, 1e-2);
  }
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_TRUE(torch::allclose(gpu[i].second.cpu(), cpu[i].second, 1e-5, 1e-6)) << cpu[i].first;
    EXPECT_TRUE(torch::allclose(s_gpu.slots[i].moment("exp_avg_sq").cpu(), s_cpu.slots[i].moment("exp_avg_sq"), 1e-5, 1e-7));
  }
}

// ---- issue 30: the step's kernels, its host waits, and the streams around it ----

namespace {

gpt::Gpt tiny_gpt_module(int64_t vocab = 512) {
  gpt::Config c;
  c.layers = 2;
  c.dim = 128;
  c.heads = 4;
  c.vocab = vocab;
  c.context = 64;
  gpt::Gpt m(c);
  gpt::init_weights(*m, 7);
  return m;
}

}  // namespace

// The LM loss on CUDA: the fused kernel (automatic there) and torch's log_softmax + nll_loss
// agree with the CPU's chunked kernel, for fp32 and bf16 logits.
TEST(Gpu, CrossEntropyOnTheGpuMatchesTheCpuKernel) {
  at::Generator g = make_cpu_generator(3);
  const torch::Tensor x = torch::randn({64, 50304}, g) * 3, t = torch::randint(50304, {64}, g, torch::kLong);
  for (torch::Dtype dtype : {torch::kFloat, torch::kBFloat16})
    for (CrossEntropyKernel k : {CrossEntropyKernel::automatic, CrossEntropyKernel::fused, CrossEntropyKernel::library}) {
      torch::Tensor xc = x.to(dtype).requires_grad_(true), xg = x.to(dtype).to(torch::kCUDA).requires_grad_(true);
      torch::Tensor lc = cross_entropy_mean(xc, t), lg = cross_entropy_mean(xg, t.to(torch::kCUDA), k);
      EXPECT_NEAR(lg.item<double>(), lc.item<double>(), 1e-5 * lc.item<double>()) << dtype << " " << int(k);
      torch::Tensor gc = torch::autograd::grad({lc}, {xc})[0].to(torch::kFloat);
      torch::Tensor gg = torch::autograd::grad({lg}, {xg})[0].cpu().to(torch::kFloat);
      EXPECT_TRUE(torch::allclose(gg, gc, 1e-2, 1e-8)) << dtype << " " << int(k) << ": " << (gg - gc).abs().max().item<double>();
    }
}

// The fused kernel against cross-entropy in double of the same (rounded) logits: fp32, bf16
// and fp16; a row length that allows 16-byte loads and two that do not; a loss scaled before
// backward (the gradient takes grad_out from the device); a -inf logit is probability 0, a NaN
// or +inf logit makes the loss NaN.
TEST(Gpu, FusedCrossEntropyMatchesDoublePrecision) {
  at::Generator g = make_cpu_generator(5);
  for (int64_t V : {50304, 1001, 7})
    for (torch::Dtype dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
      const int64_t N = 96;
      torch::Tensor x = (torch::randn({N, V}, g) * 4).to(dtype), t = torch::randint(V, {N}, g, torch::kLong);
      x.index_put_({0, (t[0].item<int64_t>() + 1) % V}, -std::numeric_limits<float>::infinity());
      torch::Tensor ref_x = x.to(torch::kDouble).requires_grad_(true);
      torch::Tensor ref = torch::nn::functional::cross_entropy(ref_x, t) * 3;
      ref.backward();
      torch::Tensor xg = x.to(torch::kCUDA).requires_grad_(true);
      torch::Tensor loss = cross_entropy_mean(xg, t.to(torch::kCUDA), CrossEntropyKernel::fused) * 3;
      loss.backward();
      const std::string what = std::string(c10::toString(dtype)) + " V=" + std::to_string(V);
      EXPECT_EQ(loss.scalar_type(), torch::kFloat) << what;
      EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5 * ref.item<double>()) << what;
      ASSERT_EQ(xg.grad().scalar_type(), dtype) << what;
      torch::Tensor gr = ref_x.grad(), gg = xg.grad().cpu().to(torch::kDouble);
      const double rel = ((gg - gr).norm() / gr.norm()).item<double>();
      EXPECT_LT(rel, dtype == torch::kFloat ? 1e-5 : dtype == torch::kHalf ? 2e-3 : 1e-2) << what;
      EXPECT_TRUE(torch::isfinite(gg).all().item<bool>()) << what;
    }
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    torch::Tensor x = torch::randn({4, 300}, g).to(torch::kCUDA);
    x.index_put_({2, 17}, bad);
    torch::Tensor loss = cross_entropy_mean(x, torch::randint(300, {4}, g, torch::kLong).to(torch::kCUDA),
                                            CrossEntropyKernel::fused);
    EXPECT_TRUE(std::isnan(loss.item<float>())) << bad;
  }
}

// The caption loss's per-row losses on the fused kernel: label smoothing and a weight per row
// (the upstream gradient of each row), against the library's log-softmax path in double.
TEST(Gpu, FusedPerRowCrossEntropyWithLabelSmoothingMatchesTheLibrary) {
  at::Generator g = make_cpu_generator(9);
  for (int64_t V : {32000, 1001})
    for (torch::Dtype dtype : {torch::kFloat, torch::kBFloat16})
      for (double e : {0.0, 0.1}) {
        const int64_t N = 64;
        torch::Tensor x = (torch::randn({N, V}, g) * 4).to(dtype), t = torch::randint(V, {N}, g, torch::kLong);
        torch::Tensor w = torch::rand({N}, g);
        torch::Tensor ref_x = x.to(torch::kDouble).requires_grad_(true);
        torch::Tensor ref = cross_entropy_rows(ref_x, t, e, CrossEntropyKernel::library);
        (ref * w.to(torch::kDouble)).sum().backward();
        torch::Tensor xg = x.to(torch::kCUDA).requires_grad_(true);
        torch::Tensor rows = cross_entropy_rows(xg, t.to(torch::kCUDA), e);  // automatic: fused on a GPU
        (rows * w.to(torch::kCUDA)).sum().backward();
        const std::string what = std::string(c10::toString(dtype)) + " V=" + std::to_string(V) + " e=" + std::to_string(e);
        ASSERT_EQ(rows.sizes(), torch::IntArrayRef({N})) << what;
        EXPECT_EQ(rows.scalar_type(), torch::kFloat) << what;
        EXPECT_TRUE(torch::allclose(rows.detach().cpu().to(torch::kDouble), ref.detach(), 1e-5, 1e-5)) << what;
        ASSERT_EQ(xg.grad().scalar_type(), dtype) << what;
        torch::Tensor gr = ref_x.grad(), gg = xg.grad().cpu().to(torch::kDouble);
        EXPECT_LT(((gg - gr).norm() / gr.norm()).item<double>(), dtype == torch::kFloat ? 1e-5 : 1e-2) << what;
      }
}

// GPT's GPU attention (strided q, k, v views into the fused kernels) gives the CPU path's logits
// and gradients.
TEST(Gpu, GptAttentionOnTheGpuMatchesTheCpuPath) {
  gpt::Gpt cpu = tiny_gpt_module();
  gpt::Gpt gpu = std::dynamic_pointer_cast<gpt::GptImpl>(cpu->clone());
  gpu->to(torch::kCUDA);
  const torch::Tensor idx = torch::randint(512, {3, 40}, make_cpu_generator(4), torch::kLong);
  torch::Tensor yc = cpu->forward(idx), yg = gpu->forward(idx.to(torch::kCUDA));
  EXPECT_TRUE(torch::allclose(yg.cpu(), yc, 1e-4, 1e-4)) << (yg.cpu() - yc).abs().max().item<double>();
  (yc.square().mean()).backward();
  (yg.square().mean()).backward();
  auto pc = cpu->named_parameters(), pg = gpu->named_parameters();
  for (const auto& item : pc)
    EXPECT_TRUE(torch::allclose(pg[item.key()].grad().cpu(), item.value().grad(), 1e-3, 1e-5)) << item.key();
}

// grad_layout fresh (the default: autograd writes each gradient once) and buffer (zeroed
// and added into) train the GPT graph alike.
TEST(Gpu, FreshAndBufferGradLayoutsTrainAlike) {
  auto streams = make_device_streams("cuda:0");
  std::vector<double> last;
  for (const char* layout : {"fb.grad_layout=fresh", "fb.grad_layout=buffer"})
    last.push_back(run_gpu(graph("gpt.yaml"), test::temp_dir("gpu_layout"),
                           tiny_gpt(32, 64, 2, {"run.steps=20", "ckpt.every=1000", "ckpt.at=[]", layout}), streams.get())
                       .last_loss);
  ASSERT_GT(last[0], 0);
  EXPECT_NEAR(last[0], last[1], 1e-4 * last[1]);
}

// Steady-state training steps (forward, backward, clip and fused AdamW with the device-side
// non-finite flag) make the host wait for the GPU nowhere: torch's sync debug mode turns any
// host synchronization (an .item(), a blocking copy) into an error.
TEST(Gpu, TrainingStepsNeverWaitForTheHost) {
  auto state = gpt::make_state(tiny_gpt_module());
  state->module->to(torch::kCUDA);
  const LmLoss lm;
  OptimizerState opt;
  OptimConfig cfg;
  cfg.clip = 1.0;
  cfg.weight_decay = 0.1;
  cfg.defer_nonfinite = true;
  const torch::Tensor tokens = torch::randint(512, {8, 65}, make_cpu_generator(5), torch::kLong).to(torch::kCUDA);
  for (int step = 1; step <= 6; ++step) {
    if (step == 3) c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
    try {
      FwdBwdOptions o;
      o.precision = Precision::bf16;
      FwdBwdResult r = forward_backward(*state, {{"tokens", tokens}}, lm, o);
      optimizer_update(opt, state->named_parameters(true), r.grads, cfg, 1e-3);
    } catch (...) {
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
      ADD_FAILURE() << "step " << step << " waited for the GPU on the host";
      throw;
    }
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(nonfinite_count(opt), 0);
  EXPECT_EQ(opt.tensors().at("h.0.ln_1.weight.step").item<int64_t>(), 6);
}

// On the fused path a non-finite step is skipped by the kernel itself: parameters, moments and
// the step count stay; the count of skipped steps is on the device.
TEST(Gpu, NonFiniteStepsAreSkippedOnTheDevice) {
  ModelState::Named params = {{"w", torch::randn({64, 32}).to(torch::kCUDA)}, {"b", torch::randn({32}).to(torch::kCUDA)}};
  OptimizerState st;
  OptimConfig cfg;
  cfg.defer_nonfinite = true;
  cfg.clip = 1.0;
  auto grads = [&](float bad) {
    Grads g = {torch::randn({64, 32}).to(torch::kCUDA), torch::randn({32}).to(torch::kCUDA)};
    g[0].view({-1})[5].fill_(bad);
    return g;
  };
  optimizer_update(st, params, grads(1.0f), cfg, 1e-2);
  const torch::Tensor w = params[0].second.clone(), m = st.slots[0].moment("exp_avg").clone();
  optimizer_update(st, params, grads(std::numeric_limits<float>::quiet_NaN()), cfg, 1e-2);
  EXPECT_TRUE(torch::equal(params[0].second, w));
  EXPECT_TRUE(torch::equal(st.slots[0].moment("exp_avg"), m));
  EXPECT_EQ(nonfinite_count(st), 1);
  EXPECT_EQ(st.tensors().at("w.step").item<int64_t>(), 1);
  optimizer_update(st, params, grads(1.0f), cfg, 1e-2);
  EXPECT_EQ(st.tensors().at("w.step").item<int64_t>(), 2);
  EXPECT_FALSE(torch::equal(params[0].second, w));
}

// On the GPU the diverged run stops on the first logged step after the divergence, naming the
// steps, with the parameters of the last finite step.
TEST(Gpu, DivergedRunStopsOnTheNextLoggedStep) {
  auto streams = make_device_streams("cuda:0");
  try {
    run_gpu(R"(flowrun: 1
run: { steps: 50, log_every: 10 }
nodes:
  data:  { type: synthetic_regression, with: { in_dim: 4, out_dim: 1, batch: 16 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 2, out_dim: 1 } }
  loss:  { type: mse_loss }
  fb:    { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  opt:   { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { lr: 1.0e+30 } }
)",
            test::temp_dir("gpu_diverge"), {}, streams.get(), /*resume=*/false);
    FAIL() << "a diverging run must stop";
  } catch (const NodeError& e) {
    EXPECT_EQ(e.node, "opt");
    EXPECT_EQ(e.step % 10, 0) << "the check runs on logged steps";
    EXPECT_NE(std::string(e.what()).find("the gradients were not finite"), std::string::npos) << e.what();
  }
}

// Issue 11's stream overlap, measured: the EMA of step s on its own stream runs while the next
// step's forward (a reader of the same parameters, on the default stream) runs. Timing events
// bracket both on the device; with the EMA on the default stream the same graph shows none.
// The test nodes compute (`compute: true`), as forward/backward and the EMA: all of them are
// queued from the one compute thread in program order, so the events of two nodes on one
// stream never interleave (from two threads they could, and would read as overlap).
namespace {

struct Stamp {
  std::string tag;
  int64_t step;
  std::shared_ptr<at::cuda::CUDAEvent> ev;
};
std::vector<Stamp>& stamps() {
  static std::vector<Stamp> s;
  return s;
}
std::mutex stamps_mu;
void stamp(const std::string& tag, int64_t step) {
  auto ev = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
  ev->record(c10::cuda::getCurrentCUDAStream());
  std::lock_guard<std::mutex> l(stamps_mu);
  stamps().push_back({tag, step, ev});
}

class GpuSpinRead : public Node {
  int64_t cycles_ = 0;

 public:
  void setup(SetupContext& c) override { cycles_ = c.params().get<int64_t>("cycles"); }
  void run(StepContext& c) override {
    (void)c.state_as<ModelState>("model");
    stamp("fwd_start", c.step());
    at::cuda::sleep(cycles_);
    stamp("fwd_end", c.step());
  }
};
class GpuTouch : public Node {
 public:
  void run(StepContext& c) override {
    torch::NoGradGuard ng;
    c.state_as<ModelState>("model").trainable_parameters().front().add_(1e-3);
  }
};
class GpuStamp : public Node {
 public:
  void run(StepContext& c) override { stamp(c.params().get<std::string>("tag"), c.step()); }
};

void register_overlap_nodes() {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry& r = Registry::global();
    r.add(R"(type: t_gpu_spin_read
doc: reads the params, spins on its stream between two timing events
compute: true
inputs: { model: { kind: state, access: read, type: params } }
params: { cycles: { type: int, default: 2000000, min: 0 } })",
          [] { return std::make_unique<GpuSpinRead>(); }, "tests");
    r.add(R"(type: t_gpu_touch
doc: writes the params (a tiny add)
compute: true
inputs: { model: { kind: state, access: write, type: params } })",
          [] { return std::make_unique<GpuTouch>(); }, "tests");
    r.add(R"(type: t_gpu_stamp
doc: a timing event on its stream after the params it reads are ready
compute: true
inputs: { model: { kind: state, access: read, type: params } }
params: { tag: { type: string, default: stamp } })",
          [] { return std::make_unique<GpuStamp>(); }, "tests");
  });
}

// What the timing events of one run say, in ms on the device: the steps s in which the EMA
// [pre(s), post(s)] and the next forward [fwd_start(s+1), fwd_end(s+1)] intersect, the span from
// fwd_start(2) to fwd_end(steps) (step 1 warms up), and the EMA's own time summed over those
// steps (post - pre: exact when the EMA's stream holds nothing else).
struct Overlap {
  int steps = 0;
  double span = 0, ema = 0;
  std::string timeline;  // per step: the forward's and the EMA's [start, end] in ms
};
Overlap measure_overlap(int64_t steps) {
  std::map<std::pair<std::string, int64_t>, std::shared_ptr<at::cuda::CUDAEvent>> at;
  for (const Stamp& s : stamps()) at[{s.tag, s.step}] = s.ev;
  const auto& base = *at.at({"fwd_start", 2});
  auto ms = [&](const std::string& tag, int64_t step) { return base.elapsed_time(*at.at({tag, step})); };
  Overlap o;
  for (int64_t s = 2; s < steps; ++s) {
    if (ms("pre", s) < ms("fwd_end", s + 1) && ms("fwd_start", s + 1) < ms("post", s)) ++o.steps;
    o.ema += ms("post", s) - ms("pre", s);
    o.timeline += fmt::format(" step {}: fwd [{:.2f}, {:.2f}] ema [{:.2f}, {:.2f}];", s, ms("fwd_start", s),
                              ms("fwd_end", s), ms("pre", s), ms("post", s));
  }
  o.span = ms("fwd_end", steps);
  return o;
}

}  // namespace

TEST(Gpu, EmaOnItsStreamOverlapsTheNextForward) {
  register_overlap_nodes();
  auto streams = make_device_streams("cuda:0");
  // The device's work per step (a ~5 ms spin; an EMA over 600M parameters, ~2 ms) well above
  // the host's time to queue a step's nodes (~2.5 ms measured on an H200): with less, the host
  // sets the pace on both streams and the test measures the host (it did, at 1 ms and 270M).
  const std::string yaml = R"(flowrun: 1
run: { steps: 8, prefetch: 2 }
nodes:
  model: { type: mlp, with: { in_dim: 12288, hidden: 12288, layers: 4, out_dim: 8 } }
  fwd:   { type: t_gpu_spin_read, in: { model: model.params }, with: { cycles: 10000000 } }
  upd:   { type: t_gpu_touch, in: { model: model.params } }
  pre:   { type: t_gpu_stamp, stream: ema, in: { model: model.params }, with: { tag: pre } }
  ema:   { type: ema, stream: ema, in: { model: model.params }, with: { decay: 0.9 } }
  post:  { type: t_gpu_stamp, stream: ema, in: { model: model.params }, with: { tag: post } }
)";
  auto timed = [&](const std::vector<std::string>& ov) {
    stamps().clear();
    const auto t0 = std::chrono::steady_clock::now();
    run_on_gpu(yaml, ov, streams.get());
    torch::cuda::synchronize();
    Overlap o = measure_overlap(8);
    o.timeline += fmt::format(" host: {:.1f} s for the run", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    stamps().clear();
    return o;
  };
  const Overlap own = timed({});
  const Overlap one = timed({"pre.stream=default", "ema.stream=default", "post.stream=default"});
  SCOPED_TRACE("own stream:" + own.timeline + "\none stream:" + one.timeline);
  EXPECT_GE(own.steps, 4) << "of 6 steps";
  // The control: on one stream nothing overlaps, but pre and post are nodes of their own, and
  // the next forward may be queued between them, so their events intersect it there too (seen
  // on an H200: 5 of 6). What tells overlap from none is the time: on its own stream the EMA
  // hides under the forward's spin, so the steps take at least half the EMA's time less.
  EXPECT_LT(own.span + 0.5 * own.ema, one.span)
      << "own stream " << own.span << " ms for 6 steps (EMA " << own.ema << " ms of it), one stream " << one.span << " ms";
}

// The NCCL path with a world of one: a real communicator made over the bootstrap channel, and
// ncclAllReduce on a gradient buffer's bucket, ordered after the compute stream's writes by the
// events the allreduce node uses, waited for with the timeout.
TEST(Gpu, NcclWithAWorldOfOneReducesABucket) {
  ASSERT_EQ(comm::size(), 1);
  auto channel = comm::Channel::create("gpu test");
  std::unique_ptr<nccl::Communicator> nc = nccl::Communicator::create(*channel, 0);
  ASSERT_NE(nc, nullptr);
  auto params = std::vector<torch::Tensor>{torch::zeros({300, 200}, torch::kCUDA), torch::zeros({200}, torch::kCUDA)};
  std::shared_ptr<GradBuffer> buffer = GradBuffer::make(params);
  nccl::Events ready(1, 0), done(1, 0);
  void* compute = c10::cuda::getCurrentCUDAStream(0).stream();
  at::cuda::sleep(50000000);  // the bucket is written late on the compute stream
  buffer->flats[0].fill_(3.0f);
  ready.record(0, compute);
  nc->allreduce(buffer->flats[0].data_ptr(), static_cast<size_t>(buffer->flats[0].numel()), comm::DType::f32,
                ready.at(0), done.at(0), "bucket 0");
  done.make_wait(compute, 0);
  const double sum = buffer->flats[0].sum().item<double>();
  nc->wait(done.at(0), "bucket 0");
  EXPECT_EQ(sum, 3.0 * (300 * 200 + 200));
}

// The one collective interface (parallel/collectives.hpp) with CUDA tensors and a world of one:
// NCCL behind the caller's stream (a tensor written late on it is reduced after the write), wait()
// making the stream wait, check() the host's bounded check; the mesh's dp group of a single
// process the same.
TEST(Gpu, TheCollectiveInterfaceRunsNcclBehindTheCallersStream) {
  ASSERT_EQ(comm::size(), 1);
  for (auto group : {parallel::Group::world("gpu group"),
                     parallel::Group::along("gpu mesh", parallel::Mesh(1, 1, 1), parallel::Dim::dp, 0)}) {
    torch::Tensor t = torch::zeros({4096}, torch::kCUDA);
    at::cuda::sleep(50000000);  // written late on the current stream
    t.fill_(2.0f);
    parallel::Work w = group->all_reduce(t, comm::Op::sum, "sum");
    w.wait();
    EXPECT_EQ(t.sum().item<double>(), 2.0 * 4096) << group->name();
    w.check();
    EXPECT_TRUE(w.done());
    torch::Tensor blocks = torch::arange(10, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16));
    torch::Tensor recv = torch::full({10}, -1.0, blocks.options());
    group->reduce_scatter(blocks, recv, {10}, "reduce-scatter").wait();
    group->all_gather(blocks, {10}, "all-gather").wait();
    group->broadcast(blocks, 0, "broadcast").wait();
    EXPECT_TRUE(torch::equal(recv, blocks)) << group->name();
    EXPECT_TRUE(torch::equal(blocks.cpu(), torch::arange(10, torch::kBFloat16))) << group->name();
  }
}

// The grouped collectives of ZeRO's uneven blocks (one ncclReduce / ncclBroadcast per owner) with
// a world of one: the reduce-scatter hands this rank its block, the in-place all-gather leaves
// every block where it is, both ordered after the compute stream's writes by the events.
TEST(Gpu, NcclReduceScatterAndAllGatherOfBlocksWithAWorldOfOne) {
  ASSERT_EQ(comm::size(), 1);
  auto channel = comm::Channel::create("gpu test blocks");
  std::unique_ptr<nccl::Communicator> nc = nccl::Communicator::create(*channel, 0);
  const int64_t n = 12345;  // no multiple of anything
  torch::Tensor send = torch::zeros({n}, torch::kCUDA), recv = torch::full({n}, -1.0f, torch::kCUDA);
  nccl::Events ready(1, 0), done(1, 0);
  void* compute = c10::cuda::getCurrentCUDAStream(0).stream();
  at::cuda::sleep(50000000);  // written late on the compute stream
  send.copy_(torch::arange(n, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA)));
  ready.record(0, compute);
  nc->reduce_scatter(send.data_ptr(), recv.data_ptr(), {static_cast<size_t>(n)}, comm::DType::f32, ready.at(0),
                     done.at(0), "reduce-scatter");
  done.make_wait(compute, 0);
  EXPECT_TRUE(torch::equal(recv, send));
  ready.record(0, compute);
  nc->allgather_blocks(recv.data_ptr(), {static_cast<size_t>(n)}, comm::DType::f32, ready.at(0), done.at(0), "all-gather");
  done.make_wait(compute, 0);
  EXPECT_TRUE(torch::equal(recv, send));
  nc->wait(done.at(0), "all-gather");
}

// ZeRO over NCCL with a world of one (the sharded path runs alone as with several, the rank owning
// every element): the ZeRO stage states (its slice updated, all-gathered over NCCL) and
// gradients (buckets reduce-scattered over NCCL, the norm summed on the device) train the
// GPT graph as stage none does, every state on the GPU, and a sharded run resumes.
TEST(Gpu, ShardedOptimizerAndGradientsOverNcclTrainAsUnsharded) {
  auto streams = make_device_streams("cuda:0");
  std::map<std::string, GpuRun> runs;
  for (const std::string shard : {"none", "states", "gradients"})
    runs[shard] = run_gpu(graph("gpt.yaml"), test::temp_dir("gpu_shard"),
                          tiny_gpt(32, 64, 2, {"run.steps=20", "ckpt.every=1000", "ckpt.at=[]", "zero.stage=" + shard}),
                          streams.get());
  ASSERT_GT(runs["none"].last_loss, 0);
  for (const std::string shard : {"states", "gradients"}) {
    EXPECT_NEAR(runs[shard].last_loss, runs["none"].last_loss, 1e-4 * runs["none"].last_loss) << "shard: " << shard;
    EXPECT_EQ(runs[shard].on_gpu, runs[shard].state_tensors) << "shard: " << shard;
  }
  const std::string dir = test::temp_dir("gpu_shard_resume");
  const std::vector<std::string> ov = {"ckpt.every=10", "zero.stage=gradients"};
  run_gpu(graph("gpt.yaml"), dir, tiny_gpt(32, 64, 2, {"run.steps=10", ov[0], ov[1]}), streams.get());
  const GpuRun resumed = run_gpu(graph("gpt.yaml"), dir, tiny_gpt(32, 64, 2, {"run.steps=20", ov[0], ov[1]}), streams.get());
  EXPECT_NEAR(resumed.last_loss, runs["gradients"].last_loss, 1e-3 * runs["gradients"].last_loss);
}
