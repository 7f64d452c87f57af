// Activation checkpointing (models/activation_checkpoint.hpp) on the GPT, CapPa, the DiT and the
// VAE: the same losses and gradients as the plain forward (the GPT's bit for bit on the CPU,
// dropout, bf16 autocast, micro-batches and the `ready` reports included; the others' to float
// rounding where blocks share inputs), and a step's peak resident memory much lower.
#include <gtest/gtest.h>


#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include "common/seed.hpp"
#include "data_test_helpers.hpp"
#include "models/activation_checkpoint.hpp"
#include "models/cappa/cappa.hpp"
#include "models/dit/dit.hpp"
#include "models/gpt/gpt.hpp"
#include "models/vae/vae.hpp"
#include "dit_test_helpers.hpp"
#include "node_test_helpers.hpp"
#include "train/forward_backward.hpp"
#include "train/losses.hpp"
#include "support/memory.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace {

// forward_backward's time_blocks (what flowrun plan profiles): under a BlockClock every block
// run_block runs gets its forward span and its backward span (from its output's gradient to its
// input's), the backward in reverse block order, each inside the backward pass; blocks_of lists a
// model's blocks as run_block meets them (a GPT's h.0, h.1, ...).
TEST(BlockClock, EveryBlockGetsItsForwardAndItsBackward) {
  gpt::Config c;
  c.layers = 3, c.dim = 16, c.heads = 2, c.vocab = 32, c.context = 8;
  gpt::Gpt model(c);
  gpt::init_weights(*model, 1);
  const std::vector<const torch::nn::Module*> blocks = blocks_of(*model);
  ASSERT_EQ(blocks.size(), 3u);
  EXPECT_EQ(blocks[0], (*model->h)[0].get());
  const torch::Tensor idx = torch::randint(0, 32, {2, 8}, torch::kLong);
  std::vector<BlockClock::Span> spans;
  std::chrono::steady_clock::time_point backward_start;
  {
    BlockClock clock;
    const torch::Tensor loss = model->forward(idx).square().mean();
    backward_start = std::chrono::steady_clock::now();
    loss.backward();
    spans = clock.spans();
  }
  ASSERT_EQ(spans.size(), 6u);
  for (size_t i = 0; i < 3; ++i) {  // the forwards, in order, before backward
    EXPECT_FALSE(spans[i].backward);
    EXPECT_EQ(spans[i].block, blocks[i]);
    EXPECT_LE(spans[i].end, backward_start);
  }
  for (size_t i = 0; i < 3; ++i) {  // the backwards: the last block's first
    EXPECT_TRUE(spans[3 + i].backward);
    EXPECT_EQ(spans[3 + i].block, blocks[2 - i]);
    EXPECT_GE(spans[3 + i].start, backward_start);
    EXPECT_LT(spans[3 + i].start, spans[3 + i].end);
  }
  // No clock: nothing timed, the same result.
  EXPECT_EQ(BlockClock::current(), nullptr);
}

// A block whose input takes no gradient (the first block over frozen embeddings, as under LoRA)
// has no input hook to end its backward: it ends with backward (end_backward), so every block
// still gets both spans (issue 69: flowrun plan of graphs/hydit_lora.yaml stopped at "timed 4
// block forwards and 3 backwards").
TEST(BlockClock, ABlockOverFrozenInputsEndsWithBackward) {
  gpt::Config c;
  c.layers = 2, c.dim = 16, c.heads = 2, c.vocab = 32, c.context = 8;
  gpt::Gpt model(c);
  gpt::init_weights(*model, 1);
  model->wte->weight.set_requires_grad(false);
  model->wpe->weight.set_requires_grad(false);
  const torch::Tensor idx = torch::randint(0, 32, {2, 8}, torch::kLong);
  BlockClock clock;
  const torch::Tensor loss = model->forward(idx).square().mean();
  loss.backward();
  EXPECT_EQ(clock.spans().size(), 3u);  // block 0's backward is still open
  clock.end_backward();
  const std::vector<BlockClock::Span> spans = clock.spans();
  ASSERT_EQ(spans.size(), 4u);
  EXPECT_TRUE(spans[3].backward);
  EXPECT_EQ(spans[3].block, blocks_of(*model)[0]);
  EXPECT_LT(spans[3].start, spans[3].end);
}

std::shared_ptr<ModelState> gpt_model(const std::string& checkpoint, int64_t layers, int64_t dim, int64_t heads,
                                      int64_t context, double dropout = 0.0) {
  gpt::Config c;
  c.layers = layers;
  c.dim = dim;
  c.heads = heads;
  c.vocab = 64;
  c.context = context;
  c.dropout = dropout;
  c.checkpoint = CheckpointPolicy::parse(checkpoint);
  gpt::Gpt m(c);
  gpt::init_weights(*m, 11);
  return gpt::make_state(m);
}

struct Step {
  double loss = 0;
  std::vector<torch::Tensor> grads;
  std::vector<int> ready;  // the order forward_backward's `ready` reported the parameters
};

Step step(ModelState& m, const torch::Tensor& tokens, FwdBwdOptions o) {
  Step s;
  auto params = m.trainable_parameters();
  o.buffer = GradBuffer::make(params);
  o.fill = GradFill::copy;
  o.on_ready = [&](int i, bool) { s.ready.push_back(i); };
  FwdBwdResult r = forward_backward(m, {{"tokens", tokens}}, LmLoss(), o);
  s.loss = r.loss.item<double>();
  for (const auto& g : r.grads) s.grads.push_back(g.defined() ? g.clone() : g);
  return s;
}

void expect_same(const Step& a, const Step& b, const std::string& what) {
  EXPECT_EQ(a.loss, b.loss) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size()) << what;
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << what << ": grad " << i;
  // Every parameter reported once (the order may differ: recomputed blocks finish later).
  std::vector<int> ra = a.ready, rb = b.ready;
  std::sort(ra.begin(), ra.end());
  std::sort(rb.begin(), rb.end());
  EXPECT_EQ(ra, rb) << what;
  EXPECT_EQ(ra.size(), a.grads.size()) << what;
}

// Families whose blocks share inputs (the DiT's time embedding and text states, CapPa's encoder
// output in every decoder block, the VAE's skip paths): a shared input's gradient is the sum of
// the blocks' contributions, and a recomputed block's arrives from its own backward, so the sum
// is taken in another order: equal to float rounding, not bit for bit (the GPT's blocks form a
// chain: bit for bit there). Rounding is measured against the largest gradient element of the
// model: a parameter whose gradient cancels to ~0 (a bias before a norm) differs by as much.
void expect_grads_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  double scale = 0;
  for (const auto& w : want)
    if (w.defined()) scale = std::max(scale, w.abs().max().item<double>());
  ASSERT_GT(scale, 0);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].defined(), want[i].defined()) << "grad " << i;
    if (!want[i].defined()) continue;
    const double diff = (got[i] - want[i]).abs().max().item<double>();
    EXPECT_LE(diff, 1e-6 * scale) << "grad " << i << ": max |difference| " << diff << ", the largest gradient element " << scale;
  }
}

// One step of `objective` on `batch` with the model as `make` builds it for checkpoint none,
// blocks and every_2: the same loss bit for bit, the same gradients to float rounding.
void expect_policies_match(const std::function<std::shared_ptr<ModelState>(const std::string&)>& make,
                           const TensorMap& batch, const Objective& objective, const FwdBwdOptions& o) {
  auto run = [&](ModelState& m) {
    FwdBwdResult r = forward_backward(m, batch, objective, o);
    Step s;
    s.loss = r.loss.item<double>();
    for (const auto& g : r.grads) s.grads.push_back(g.defined() ? g.clone() : g);
    return s;
  };
  auto plain = make("none");
  const Step want = run(*plain);
  for (const char* policy : {"blocks", "every_2"}) {
    auto m = make(policy);
    const Step got = run(*m);
    EXPECT_EQ(got.loss, want.loss) << policy;
    expect_grads_close(got.grads, want.grads);
  }
}

TEST(ActivationCheckpoint, GptGradientsEqualThePlainRunBitForBit) {
  const torch::Tensor tokens = torch::randint(64, {4, 33}, make_cpu_generator(3), torch::kLong);
  for (int64_t accumulate : {1, 2}) {
    FwdBwdOptions o;
    o.accumulate = accumulate;
    auto plain = gpt_model("none", 12, 32, 4, 32);
    const Step want = step(*plain, tokens, o);
    for (const char* policy : {"blocks", "every_2", "every_4"}) {
      auto m = gpt_model(policy, 12, 32, 4, 32);
      expect_same(step(*m, tokens, o), want, std::string(policy) + ", accumulate " + std::to_string(accumulate));
    }
  }
}

// Dropout inside a recomputed block draws the same masks again (the scope's generator state is
// restored for the recompute), and bf16 autocast runs the recompute as it ran the forward.
TEST(ActivationCheckpoint, DropoutAndAutocastRepeatExactly) {
  const torch::Tensor tokens = torch::randint(64, {4, 17}, make_cpu_generator(4), torch::kLong);
  FwdBwdOptions o;
  o.dropout_seed = 12345;
  auto plain = gpt_model("none", 4, 32, 4, 16, /*dropout=*/0.2);
  const Step want = step(*plain, tokens, o);
  auto m = gpt_model("blocks", 4, 32, 4, 16, 0.2);
  expect_same(step(*m, tokens, o), want, "dropout 0.2");
  // Another seed gives other masks: the comparison above could fail.
  FwdBwdOptions other = o;
  other.dropout_seed = 999;
  EXPECT_NE(step(*m, tokens, other).loss, want.loss);

  o.dropout_seed.reset();
  o.precision = Precision::bf16;
  auto p16 = gpt_model("none", 2, 32, 4, 16), c16 = gpt_model("blocks", 2, 32, 4, 16);
  expect_same(step(*c16, tokens, o), step(*p16, tokens, o), "bf16 autocast");
}

// CapPa: the encoder's and the decoder's blocks recomputed (the decoder's take the encoder's
// output and the attention bias as inputs too); caption_loss's parallel rows drawn in a
// training scope.
TEST(ActivationCheckpoint, CappaGradientsEqualThePlainRun) {
  auto model = [](const std::string& checkpoint) {
    cappa::Config c;
    c.image_size = 16, c.patch = 4, c.width = 32, c.depth = 3, c.heads = 2, c.mlp_dim = 64;
    c.dec_width = 24, c.dec_depth = 3, c.dec_heads = 2, c.dec_mlp_dim = 48;
    c.vocab = 11, c.max_len = 7;
    c.checkpoint = CheckpointPolicy::parse(checkpoint);
    cappa::Cappa m(c);
    torch::NoGradGuard no_grad;  // every parameter random (the init's zero head would hide a lot)
    at::Generator g = make_cpu_generator(8);
    for (auto& p : m->parameters()) p.copy_(torch::randn(p.sizes(), g) * 0.3);
    return cappa::make_state(m);
  };
  const TensorMap batch = {{"image", torch::randn({4, 3, 16, 16}, make_cpu_generator(9))},
                           {"input_ids", torch::randint(1, 11, {4, 6}, make_cpu_generator(10), torch::kLong)}};
  FwdBwdOptions o;
  o.dropout_seed = 77;  // the parallel rows are drawn in the scope
  expect_policies_match(model, batch, CaptionLoss(CaptionLoss::Options{}), o);
}

// DiT: blocks take the time embedding, the text states, RoPE and (the later half) a long skip as
// inputs too; diffusion_loss draws t and noise in the scope.
TEST(ActivationCheckpoint, DitGradientsEqualThePlainRun) {
  auto model = [](const std::string& checkpoint) {
    dit::Config c = dit_test::tiny(/*depth=*/5);
    c.checkpoint = CheckpointPolicy::parse(checkpoint);
    dit::Dit m(c);
    dit_test::randomize(*m, 12);
    return dit::make_state(m);
  };
  at::Generator g = make_cpu_generator(13);
  const TensorMap batch = {{"image", torch::randn({3, 3, 8, 8}, g)}, {"text_emb", torch::randn({3, 5, 8}, g)},
                           {"text_mask", torch::ones({3, 5}, torch::kLong)}};
  diffusion::Options d;
  d.x_key = "image";
  d.cond_drop = 0.3;
  FwdBwdOptions o;
  o.dropout_seed = 5;
  expect_policies_match(model, batch, DiffusionLoss(d), o);
}

// The VAE (graphs/vae.yaml's model): down, mid and up blocks recomputed; vae_loss samples the
// posterior from the scope's generator.
TEST(ActivationCheckpoint, VaeGradientsEqualThePlainRun) {
  auto model = [](const std::string& checkpoint) {
    vae::Config c;
    c.block_out_channels = {8, 16};
    c.layers_per_block = 1;
    c.norm_num_groups = 4;
    c.checkpoint = CheckpointPolicy::parse(checkpoint);
    return vae::make_vae_state(vae::make_autoencoder(c, vae::Part::both, "", 3, /*trainable=*/true), /*frozen=*/false);
  };
  const TensorMap batch = {{"image", torch::rand({2, 3, 16, 16}, make_cpu_generator(14)) * 2 - 1}};
  FwdBwdOptions o;
  o.dropout_seed = 21;
  expect_policies_match(model, batch, VaeLoss(VaeLoss::Options{}), o);
}

// The VAE's estimate (vae::estimate_activations, what forward_backward's memory line prints) against
// what a forward with grad keeps alive for backward, measured as the bytes malloc holds after it
// (glibc's mallinfo2: every arena and the mmapped blocks; torch's CPU allocator is malloc):
// within 25 % plain and with every block recomputed, where it keeps about a fifth.
TEST(ActivationCheckpoint, VaeEstimateIsWhatAForwardKeeps) {
  const TensorMap batch = {{"image", torch::rand({2, 3, 64, 64}, make_cpu_generator(3)) * 2 - 1}};
  VaeLoss::Options lo;
  lo.sample = false;
  const VaeLoss objective(lo);
  std::map<std::string, double> measured, estimated;
  for (const char* policy : {"none", "blocks"}) {
    vae::Config c;
    c.block_out_channels = {32, 64, 64};
    c.layers_per_block = 2;
    c.norm_num_groups = 8;
    c.checkpoint = CheckpointPolicy::parse(policy);
    auto state = vae::make_vae_state(vae::make_autoencoder(c, vae::Part::both, "", 3, /*trainable=*/true), false);
    const double before = test::malloc_in_use();
    torch::Tensor loss = objective.loss(*state, batch);
    measured[policy] = test::malloc_in_use() - before;
    const ActivationEstimate e = state->activations(batch, 4, c.checkpoint);
    estimated[policy] = std::string(policy) == "none" ? e.plain : e.checkpointed - e.recompute_live;
    std::printf("vae [32, 64, 64] x 2 layers, 2 x 64 x 64 images, fp32, checkpoint: %s: a forward keeps %.2f MB, "
                "estimated %.2f MB (%.2f MB at the peak of backward)\n",
                policy, measured[policy] / 1e6, estimated[policy] / 1e6, e.checkpointed / 1e6);
    EXPECT_NEAR(measured[policy] / estimated[policy], 1.0, 0.25) << policy;
    loss.backward();
  }
  EXPECT_LT(measured["blocks"], 0.35 * measured["none"]);
}

// Outside grad mode (an evaluator) a checkpointed model is its plain forward.
TEST(ActivationCheckpoint, NoGradForwardIsThePlainForward) {
  const torch::Tensor idx = torch::randint(64, {2, 16}, make_cpu_generator(5), torch::kLong);
  auto a = gpt_model("none", 3, 32, 4, 16), b = gpt_model("blocks", 3, 32, 4, 16);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(a->forward({{"tokens", idx}}), b->forward({{"tokens", idx}})));
}

// graphs/gpt.yaml at 12 blocks of 128 on 32 x 256-token byte sequences (fp32, no EMA, evaluation
// or checkpoints), one step, as a user runs it: what the step adds to the flowrun process's peak
// resident memory (its "done" line) at least 40 % lower with every block recomputed. Measured:
// the whole process's peak, less that of the same run on one 8-token row (the library, the
// model and the data: libtorch 2.x alone keeps some 0.3 GB resident).
double peak_gb(const std::string& checkpoint, int batch = 32, int seq_len = 256) {
  const std::string src = FLOWRUN_SOURCE_DIR, dir = test::temp_dir("ckpt_mem");
  const std::vector<std::string> args = {
      src + "/graphs/gpt.yaml", "data.path=" + src + "/data/text/fortunes_byte", "data.seq_len=" + std::to_string(seq_len),
      "data.batch=" + std::to_string(batch), "model.layers=12", "model.dim=128", "model.heads=4", "model.vocab=256", "model.context=256",
      "model.checkpoint=" + checkpoint, "run.steps=1", "run.prefetch=0", "ema.every=1000000", "eval.every=1000000",
      "evlog.every=1000000", "ckpt.every=1000000", "ckpt.at=[]", "run.progress=off", "run.out_dir=" + dir + "/o"};
  const int rc = test::run_flowrun(args, dir + "/log");
  std::ifstream in(dir + "/log");
  std::stringstream log;
  log << in.rdbuf();
  EXPECT_EQ(rc, 0) << log.str();
  const std::string text = log.str(), key = "peak resident memory ";
  const size_t at = text.find(key);
  if (at == std::string::npos) {
    ADD_FAILURE() << "no peak memory in the log:\n" << text;
    return -1;
  }
  return std::stod(text.substr(at + key.size()));
}

TEST(ActivationCheckpoint, PeakMemoryOfAStepIsMuchLower) {
  FLOWRUN_NEEDS_DATA(std::string(FLOWRUN_SOURCE_DIR) + "/data/text/fortunes_byte.train.bin");
  const double base = peak_gb("none", 1, 8);
  const double plain = peak_gb("none") - base, recomputed = peak_gb("blocks") - base;
  const ActivationEstimate e =
      estimate_activations(12, 32 * 256, 128, 4, 256, 4, CheckpointPolicy::parse("blocks"), AttentionKeeps::probabilities);
  std::printf("flowrun's peak resident memory above a one-row run's (%.3f GB), 12 blocks x 128, 32 x 256 tokens, "
              "fp32: %.3f GB plain, %.3f GB with checkpoint: blocks (activations estimated %.3f / %.3f GB)\n",
              base, plain, recomputed, e.plain / 1e9, e.checkpointed / 1e9);
  ASSERT_GT(base, 0);
  ASSERT_GT(plain, 0);
  EXPECT_LE(recomputed, 0.6 * plain) << plain << " GB vs " << recomputed << " GB";
}

// Under tensor parallel (no sequence parallel) a rank keeps Korthikanti's 10 + 24/tp units a
// token of a block (the norms and the residual whole, the attention and the MLP split) and 1/tp
// of the attention scores; a recomputed block's input stays whole.
TEST(ActivationCheckpoint, UnderTensorParallelARankKeepsItsShareOfTheSplitSubLayers) {
  const CheckpointPolicy none = CheckpointPolicy::parse("none"), blocks = CheckpointPolicy::parse("blocks");
  const int64_t tokens = 8 * 64, dim = 128, heads = 4, seq = 64;
  const double unit = static_cast<double>(tokens * dim) * 4 / 2;           // one of the 34, fp32
  const double scores = 5.0 * heads * tokens * seq * 4 / 2;                 // the written-out attention's
  const ActivationEstimate whole = estimate_activations(2, tokens, dim, heads, seq, 4, none);
  const ActivationEstimate two = estimate_activations(2, tokens, dim, heads, seq, 4, none, AttentionKeeps::scores, 2);
  EXPECT_DOUBLE_EQ(whole.plain, 2 * (34 * unit + scores));
  EXPECT_DOUBLE_EQ(two.plain, 2 * (22 * unit + scores / 2));
  const ActivationEstimate two_blocks = estimate_activations(2, tokens, dim, heads, seq, 4, blocks, AttentionKeeps::scores, 2);
  EXPECT_DOUBLE_EQ(two_blocks.checkpointed, 2 * static_cast<double>(tokens * dim) * 4 + (22 * unit + scores / 2));
}

TEST(ActivationCheckpoint, PolicyParsesItsValuesAndRefusesOthers) {
  EXPECT_EQ(CheckpointPolicy::parse("none").every, 0);
  EXPECT_EQ(CheckpointPolicy::parse("blocks").every, 1);
  const CheckpointPolicy two = CheckpointPolicy::parse("every_2");
  EXPECT_TRUE(two.recompute(0));
  EXPECT_FALSE(two.recompute(1));
  EXPECT_TRUE(two.recompute(2));
  EXPECT_EQ(two.str(), "every_2");
  for (const char* bad : {"all", "every_0", "every_x", "every_2x", ""})
    EXPECT_THROW(CheckpointPolicy::parse(bad), std::invalid_argument) << bad;
}

}  // namespace
}  // namespace flowrun
