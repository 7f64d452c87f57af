// GPU tests (ctest -L gpu; tests/gpu/run.sh builds and runs them on a machine with an NVIDIA
// GPU). Built only with FLOWRUN_CUDA; on CPU machines the cuda_syntax test compiles this file
// syntax-only. What the CPU stream tests check with a test double (tests/engine/
// device_streams_test.cpp), these check with real CUDA streams, plus placement, resume and
// precision on the device, through the real graph files at tiny sizes.
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "common/device.hpp"
#include "common/state_io.hpp"
#include "executor.hpp"
#include "nodes/data_test_helpers.hpp"
#include "registry.hpp"
#include "schema.hpp"
#include "spec.hpp"
#include "state/resume.hpp"
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
  int64_t state_tensors = 0, on_gpu = 0;
};

// Runs a graph's text with overrides in OUT_DIR on the GPU, resuming as the CLI does
// (run.resume=auto: from OUT_DIR's latest checkpoint, if there is one).
GpuRun run_gpu(const std::string& yaml, const std::string& out_dir, std::vector<std::string> ov,
               DeviceStreams* streams) {
  const std::string file = test::temp_dir("gpu") + "/graph.yaml";
  std::ofstream(file) << yaml;
  ov.insert(ov.end(), {"run.device=cuda", "run.progress=off", "run.resume=auto", "run.out_dir=" + out_dir});
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
      if (r.first_loss < 0) r.first_loss = r.last_loss;
    }
  for (const NodeSpec& n : g.nodes)
    for (const auto& port : Registry::global().find(n.type)->schema.outputs)
      if (port.kind == PortKind::State)
        if (const StateIO* io = find_state_io(ex.state(n.name, port.name)))
          for (const auto& [_, t] : io->tensors(ex.state(n.name, port.name))) {
            if (t.dim() == 0 && t.scalar_type() == torch::kLong) continue;  // counters (steps) are host numbers
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
                     streams.get());
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
  OptimConfig cfg;
  cfg.kind = OptimKind::adamw;
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
    EXPECT_TRUE(torch::allclose(s_gpu.slots[i].exp_avg_sq.cpu(), s_cpu.slots[i].exp_avg_sq, 1e-5, 1e-7));
  }
}
