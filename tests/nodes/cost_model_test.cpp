// The cost model of a layout (parallel/cost_model.hpp), part by part against the formulas the
// papers give: ring collectives' volumes, ZeRO's and Megatron-LM's per-step communication, 1F1B's
// bubble and makespan, data parallel's overlap, ZeRO's memory a parameter; and what a plan must
// never offer (data parallel alone for a model one device cannot hold).
#include <gtest/gtest.h>

#include <cmath>

#include "parallel/cost_model.hpp"

namespace flowrun::parallel::cost {
namespace {

// Links that cost nothing: compute alone.
Cluster free_links(int devices) {
  Cluster c;
  c.devices = devices, c.per_node = devices;
  c.intra = c.inter = Link{0.0, 1e30};
  return c;
}

// `n` blocks of `params` parameters, each 1 s forward and 2 s backward at 8 rows, its activations
// and output sized like a transformer block's (activations 34 units of its output's 1... scaled).
Model uniform(int n, double params = 1000) {
  Model m;
  m.rows = 8;
  for (int i = 0; i < n; ++i) {
    Block b;
    b.fwd_s = 1, b.bwd_s = 2, b.params = params;
    b.activation_bytes = 34e3, b.output_bytes = 1e3;
    m.blocks.push_back(b);
  }
  return m;
}

TEST(CostModel, RingCollectivesSendThePapersBytes) {
  // All-reduce: 2 (g - 1) / g of the buffer; all-gather and reduce-scatter half of that.
  EXPECT_DOUBLE_EQ(all_reduce_bytes(1000, 4), 1500);
  EXPECT_DOUBLE_EQ(all_gather_bytes(1000, 4), 750);
  EXPECT_DOUBLE_EQ(all_reduce_bytes(1000, 1), 0);
  // Time: 2 (g - 1) steps, each a latency and S / g bytes over the link.
  const Link l{1e-5, 1e9};
  EXPECT_DOUBLE_EQ(all_reduce_time(8e9, 8, l), 14 * (1e-5 + 1.0));
  EXPECT_DOUBLE_EQ(all_gather_time(8e9, 8, l), 7 * (1e-5 + 1.0));
}

TEST(CostModel, ZeroSendsWhatDataParallelSendsAndParamsHalfAsMuchAgain) {
  // Rajbhandari et al.: data parallel and ZeRO 1-2 move 2 Psi a step, ZeRO 3 moves 3 Psi (as g grows).
  const double psi = 4e8;
  for (int g : {2, 8, 64}) {
    const double dp = data_parallel_bytes(psi, g, Zero::none);
    EXPECT_DOUBLE_EQ(dp, 2.0 * (g - 1) / g * psi);
    EXPECT_DOUBLE_EQ(data_parallel_bytes(psi, g, Zero::states), dp);
    EXPECT_DOUBLE_EQ(data_parallel_bytes(psi, g, Zero::gradients), dp);
    EXPECT_DOUBLE_EQ(data_parallel_bytes(psi, g, Zero::params), 1.5 * dp);
  }
}

TEST(CostModel, TensorParallelAllReducesABlocksOutputTwiceForwardAndTwiceBackward) {
  // Shoeybi et al.: per block, f and g operators: 2 all-reduces forward, 2 backward, of b s h.
  const double bsh = 8 * 1024 * 768 * 2.0;
  EXPECT_DOUBLE_EQ(tensor_parallel_bytes(bsh, 2), 4 * bsh);      // 2 (t - 1) / t = 1 at t = 2
  EXPECT_DOUBLE_EQ(tensor_parallel_bytes(bsh, 8), 4 * 1.75 * bsh);
  EXPECT_DOUBLE_EQ(tensor_parallel_bytes(bsh, 1), 0);
}

TEST(CostModel, OneFOneBAtEqualCostsTakesMPlusPMinusOneSlotsWithThePapersBubble) {
  // 4 blocks on 2 stages: each chunk F = 2 s, B = 4 s; 1F1B's makespan (M + p - 1)(F + B), its
  // first stage idle (p - 1) / (M + p - 1).
  const Model m = uniform(4);
  for (int M : {2, 4, 8}) {
    Layout l;
    l.pp = 2, l.microbatches = M;
    const Prediction pr = predict(m, l, free_links(2), 8.0 * M);  // 8 rows a micro-batch: the measured times
    ASSERT_TRUE(pr.fits) << pr.why;
    EXPECT_NEAR(pr.compute_s, (M + 1) * 6.0, 1e-9) << "M " << M;
    EXPECT_NEAR(pr.bubble, 1.0 / (M + 1), 1e-9) << "M " << M;
  }
  // One stage runs the M micro-batches one after the other; the rows scale the times.
  Layout one;
  one.microbatches = 2;
  EXPECT_NEAR(predict(m, one, free_links(1), 32).compute_s, 2 * 12.0 * 2, 1e-9);  // 16 rows a micro-batch: twice 8
}

TEST(CostModel, DataParallelHidesItsAllReduceBehindTheLastBackwardOnly) {
  Model m = uniform(2, 1e9 / 4);  // 2 blocks of 250 M parameters: 2 GB of fp32 gradients
  Cluster c = free_links(2);
  Layout l;
  l.dp = 2;
  c.intra = Link{0, 2e9};  // 2 GB all-reduced over 2 ranks: 2 x 1 x (1 GB / 2 GB/s) = 1 s, within 6 s of backward
  Prediction pr = predict(m, l, c, 16);
  EXPECT_NEAR(pr.compute_s, 6.0, 1e-9);
  EXPECT_NEAR(pr.comm_s, 0.0, 1e-9);
  c.intra = Link{0, 0.1e9};  // 20 s of all-reduce: 14 s of it after backward ends
  pr = predict(m, l, c, 16);
  EXPECT_NEAR(pr.comm_s, 20.0 - 4.0, 1e-9);  // backward: 2 blocks x 2 s
  EXPECT_NEAR(pr.step_s, pr.compute_s + pr.comm_s, 1e-9);
}

TEST(CostModel, MemoryAParameterIsZeROs) {
  // One replica: 4 (weights) + 4 (gradients) + 8 (AdamW) bytes a parameter. Over 4 replicas, the
  // moments / 4 at states, the gradients too at gradients (autograd's until reduced, + 1/4), the
  // weights at params (+ the stage's whole while it runs: one block here, held at the turn).
  const double psi = 1e6;
  Model m = uniform(1, psi);
  m.blocks[0].activation_bytes = m.blocks[0].output_bytes = 0;
  Layout l;
  Memory mem = predict(m, l, free_links(1), 8).memory;
  EXPECT_DOUBLE_EQ(mem.weights + mem.gradients + mem.optimizer, 16 * psi);
  l.dp = 4;
  l.zero = Zero::states;
  mem = predict(m, l, free_links(4), 32).memory;
  EXPECT_DOUBLE_EQ(mem.optimizer, 2 * psi);
  l.zero = Zero::gradients;
  mem = predict(m, l, free_links(4), 32).memory;
  EXPECT_DOUBLE_EQ(mem.gradients, 4 * psi * 1.25);
  EXPECT_DOUBLE_EQ(mem.optimizer, 2 * psi);
  l.zero = Zero::params;
  mem = predict(m, l, free_links(4), 32).memory;
  EXPECT_DOUBLE_EQ(mem.weights, psi);       // this rank's quarter
  EXPECT_DOUBLE_EQ(mem.gathered, 4 * psi);  // the whole block, gathered for the step
  // Tensor parallel splits the split share: a block all split holds 1/t of its parameters.
  Layout tp;
  tp.tp = 2;
  EXPECT_DOUBLE_EQ(predict(m, tp, free_links(2), 8).memory.weights, 2 * psi);
}

// ZeRO params gathers, at the turn from forward to backward, the blocks autograd kept (not
// recomputed) and the two in flight; the same rule forward_backward's memory advice uses
// (issue 69: the two disagreed for every_2 ... every_4). Frozen parameters are sharded too.
TEST(CostModel, ZeroParamsGathersTheKeptBlocksAndTwoInFlight) {
  const double psi = 1e6;
  Model m = uniform(8, psi);
  for (Block& b : m.blocks) b.activation_bytes = b.output_bytes = 0;
  Layout l;
  l.dp = 4, l.zero = Zero::params;
  auto gathered = [&](int every) {
    l.checkpoint_every = every;
    return predict(m, l, free_links(4), 32).memory.gathered / (4 * psi);  // in blocks
  };
  EXPECT_DOUBLE_EQ(gathered(0), 8);  // no checkpointing: the whole model
  EXPECT_DOUBLE_EQ(gathered(1), 2);  // every block recomputed: the two in flight
  EXPECT_DOUBLE_EQ(gathered(2), 6);  // blocks 1, 3, 5, 7 kept, and two in flight
  EXPECT_DOUBLE_EQ(gathered(4), 8);  // 6 kept + 2 in flight: everything
  EXPECT_DOUBLE_EQ(zero3_gathered(10, 30, 5, 100), 50);
  EXPECT_DOUBLE_EQ(zero3_gathered(10, 90, 5, 100), 100);
  // LoRA: the frozen base is sharded as well (train/fully_sharded.hpp: a flat buffer of its own).
  for (Block& b : m.blocks) b.frozen = 0.99 * psi;
  l.checkpoint_every = 1;
  EXPECT_DOUBLE_EQ(predict(m, l, free_links(4), 32).memory.weights, 8 * psi);  // 32 MB over 4
}

// Tensor parallel keeps 10 + 24/t of a block's 34 activation units a token (Korthikanti et al.).
TEST(CostModel, TensorParallelKeepsTheSplitActivationsShare) {
  EXPECT_DOUBLE_EQ(activation_units(1), 34);
  EXPECT_DOUBLE_EQ(activation_units(4), 16);
  EXPECT_DOUBLE_EQ(activations_held(2), 22.0 / 34.0);
}

// A pipeline's prediction says the cut it made: the run takes it as run.parallel.stage_layers.
TEST(CostModel, APipelinePredictionSaysItsCut) {
  Model m = uniform(6);
  m.blocks[0].fwd_s = m.blocks[1].fwd_s = 4;  // the first two blocks cost as much as the other four
  Layout l;
  l.pp = 2, l.microbatches = 2;
  const Prediction pr = predict(m, l, free_links(2), 8);
  EXPECT_EQ(pr.stage_layers, (std::vector<int>{2, 4}));
  l.pp = 1;
  EXPECT_TRUE(predict(m, l, free_links(1), 8).stage_layers.empty());
}

TEST(CostModel, CheckpointingKeepsEachBlocksOutputAndRecomputesItsForward) {
  const Model m = uniform(4);
  Layout l;
  const Prediction plain = predict(m, l, free_links(1), 8);
  l.checkpoint_every = 1;
  const Prediction ckpt = predict(m, l, free_links(1), 8);
  EXPECT_NEAR(ckpt.compute_s, plain.compute_s + 4 * 1.0, 1e-9);  // one more forward of each block
  EXPECT_DOUBLE_EQ(plain.memory.activations, 4 * 34e3);
  EXPECT_DOUBLE_EQ(ckpt.memory.activations, 4 * 1e3 + 34e3);  // the outputs, and one block recomputing
}

// Measured (the profile's checkpointed backward less its plain one), a recompute costs what it
// costs: here 2.5 s at 8 rows, 1 s at 2, where the forward takes 1 s and 0.4 s.
TEST(CostModel, ARecomputeCostsWhatTheProfileMeasured) {
  Model m = uniform(4);
  for (Block& b : m.blocks) b.rec_s = 2.5;
  Layout l;
  const double plain = predict(m, l, free_links(1), 8).compute_s;
  l.checkpoint_every = 1;
  EXPECT_NEAR(predict(m, l, free_links(1), 8).compute_s, plain + 4 * 2.5, 1e-9);
  l.checkpoint_every = 2;  // blocks 0 and 2
  EXPECT_NEAR(predict(m, l, free_links(1), 8).compute_s, plain + 2 * 2.5, 1e-9);
  // Along the sizes: 4 micro-batches of 2 rows, each recompute 1 s.
  m.sizes = {2, 8};
  for (Block& b : m.blocks) b.fwd_at = {0.4, 1}, b.bwd_at = {0.8, 2}, b.rec_at = {1, 2.5};
  l.checkpoint_every = 1, l.microbatches = 4;
  EXPECT_NEAR(predict(m, l, free_links(1), 8).compute_s, 4 * 4 * (0.4 + 0.8 + 1.0), 1e-9);
}

TEST(CostModel, AModelOneDeviceCannotHoldIsNeverPlannedAsDataParallelAlone) {
  // 8 blocks of 100 M parameters: 12.8 GB of weights, gradients and moments; devices of 8 GB.
  const Model m = uniform(8, 1e8);
  Cluster c = free_links(4);
  c.memory_bytes = 8e9;
  int feasible = 0;
  for (const Layout& l : layouts(m, c, 32, 4)) {
    const Prediction pr = predict(m, l, c, 32);
    EXPECT_EQ(l.dp * l.tp * l.pp, 4) << l.str();
    if (!pr.fits) continue;
    ++feasible;
    EXPECT_FALSE(l.tp == 1 && l.pp == 1 && l.zero == Zero::none) << l.str() << " fits: " << pr.memory.total();
  }
  EXPECT_GT(feasible, 0);
  Layout dp;
  dp.dp = 4;
  EXPECT_FALSE(predict(m, dp, c, 32).fits);
}

TEST(CostModel, ALayoutThatCannotRunSaysWhy) {
  const Model m = uniform(2);
  Layout l;
  l.dp = 2;
  EXPECT_NE(predict(m, l, free_links(4), 8).why.find("not the 4 devices"), std::string::npos);
  EXPECT_NE(predict(m, l, free_links(2), 7).why.find("do not split"), std::string::npos);
  Layout deep;
  deep.pp = 4;
  EXPECT_NE(predict(m, deep, free_links(4), 8).why.find("2 blocks do not cut into 4 chunks"), std::string::npos);
}

TEST(CostModel, ALinkFittedToMeasuredPointsIsTheLineThroughThem) {
  // Exact alpha-beta points come back as that link; noise of a few per cent stays a few per cent.
  const Link truth{20e-6, 4e9};
  std::vector<std::pair<double, double>> exact, noisy;
  for (double bytes = 4096; bytes <= 16777216; bytes *= 4) {
    exact.emplace_back(bytes, truth.time(bytes));
    noisy.emplace_back(bytes, truth.time(bytes) * (exact.size() % 2 ? 1.03 : 0.97));
  }
  const auto [fit, worst] = fit_link(exact);
  EXPECT_NEAR(fit.latency_s, truth.latency_s, 1e-9);
  EXPECT_NEAR(fit.bytes_per_s, truth.bytes_per_s, 1e3);
  EXPECT_LT(worst, 1e-9);
  EXPECT_LT(fit_link(noisy).second, 0.07);
  // Points on a line with a negative latency (t = -1 s + bytes / 1 MB/s): held at 0, through the origin.
  const auto [origin, off] = fit_link({{2e6, 1.0}, {4e6, 3.0}, {8e6, 7.0}});
  EXPECT_EQ(origin.latency_s, 0.0);
  EXPECT_GT(origin.bytes_per_s, 1e6);
  EXPECT_GT(off, 0.1);
}

TEST(CostModel, AMeasuredCollectiveReplacesTheRingFormulaWithinANode) {
  Cluster c;
  c.devices = 16, c.per_node = 8;
  c.intra = c.inter = Link{1e-5, 1e9};
  c.measured.all_reduce[4].fit = Link{1e-3, 1e10};
  EXPECT_DOUBLE_EQ(c.all_reduce(1e9, 4, 4), 1e-3 + 0.1);                       // measured: its line
  EXPECT_DOUBLE_EQ(c.all_reduce(1e9, 2, 2), all_reduce_time(1e9, 2, c.intra));  // a size not measured
  EXPECT_DOUBLE_EQ(c.all_reduce(1e9, 4, 13), all_reduce_time(1e9, 4, c.inter));  // across nodes
  // Between measured sizes the line through the two nearest, beyond them the fit.
  c.measured.all_reduce[4].points = {{1e6, 1e-3}, {4e6, 7e-3}};
  EXPECT_DOUBLE_EQ(c.all_reduce(2e6, 4, 4), 3e-3);
  EXPECT_DOUBLE_EQ(c.all_reduce(1e9, 4, 4), 1e-3 + 0.1);
}

TEST(CostModel, ATimeIsTheLineThroughTwoMeasuredSizes) {
  // 1 s forward at 8 rows of which 0.2 s does not shrink: 4 rows a micro-batch take 0.6 s.
  Model m = uniform(1);
  m.blocks[0].fwd0_s = 0.2, m.blocks[0].bwd_s = 0;
  Layout l;
  l.microbatches = 2;
  EXPECT_DOUBLE_EQ(predict(m, l, free_links(1), 8).compute_s, 2 * 0.6);
  // Measured at 2, 4 and 8 rows: 3 rows on the line through 2 and 4, 16 in proportion to 8.
  m.sizes = {2, 4, 8};
  m.blocks[0].fwd_at = {0.4, 0.5, 1.0}, m.blocks[0].bwd_at = {0, 0, 0};
  l.microbatches = 1;
  EXPECT_DOUBLE_EQ(predict(m, l, free_links(1), 3).compute_s, 0.45);
  EXPECT_DOUBLE_EQ(predict(m, l, free_links(1), 16).compute_s, 2.0);
}

TEST(CostModel, FrozenParametersAreHeldButNeitherReducedNorUpdated) {
  // LoRA: the base weights on every device, their gradients, moments and all-reduce nowhere.
  Model m = uniform(2, 1e6), lora = m;
  for (Block& b : lora.blocks) b.frozen = 0.99e6;
  Cluster c = free_links(2);
  c.intra = c.inter = Link{0, 1e6};
  Layout l;
  l.dp = 2;
  const Prediction full = predict(m, l, c, 8), adapters = predict(lora, l, c, 8);
  EXPECT_DOUBLE_EQ(adapters.memory.weights, full.memory.weights);
  EXPECT_NEAR(adapters.memory.optimizer, full.memory.optimizer / 100, 1e-6);
  EXPECT_NEAR(adapters.memory.gradients, full.memory.gradients / 100, 1e-6);
  EXPECT_LT(adapters.comm_s, full.comm_s / 10);
}

TEST(CostModel, DevicesSharingCoresTakeTurnsSoABubbleCostsNothing) {
  // 4 processes on 2 cores: each device's work at the profile's speed, 12 s in all, over 2 cores.
  const Model m = uniform(4);  // 1 s forward, 2 s backward a block at 8 rows; here 2 rows a micro-batch
  Cluster own = free_links(4), shared = own;
  shared.cores = 2, shared.threads = 1;
  Layout dp, pp;
  dp.dp = 4;
  pp.pp = 4, pp.microbatches = 4;
  // Each its own device: data parallel 4 x 0.75 s a replica; the pipeline (4 + 3) x 0.75 s.
  EXPECT_DOUBLE_EQ(predict(m, dp, own, 8).step_s, 3.0);
  EXPECT_DOUBLE_EQ(predict(m, pp, own, 8).step_s, 5.25);
  // Sharing 2 cores: both the node's 12 s of work over 2 cores; the bubble's idle time went to others.
  EXPECT_DOUBLE_EQ(predict(m, dp, shared, 8).step_s, 6.0);
  EXPECT_DOUBLE_EQ(predict(m, pp, shared, 8).step_s, 6.0);
}

}  // namespace
// Expert parallel: a rank holds its experts / ep (the attention split by tp, the rest whole), each
// micro-batch pays four all-to-alls of the routed rows on the critical path (dispatch and combine,
// forward and backward, (e - 1) / e of them sent), the experts' gradients are all-reduced over the
// dp / ep ranks holding the same experts only; a model without experts is never offered an ep.
TEST(CostModel, ExpertParallelHoldsTheExpertsOverEpAndAllToAllsTheRoutedRows) {
  const double psi = 1e6;
  Model m = uniform(1, psi);
  Block& b = m.blocks[0];
  b.split = 0.25, b.experts = 0.75, b.routed_bytes = 4e6, b.activation_bytes = b.output_bytes = 0;
  m.experts = 8;
  Layout l;
  l.dp = 2;
  const Prediction dp2 = predict(m, l, free_links(2), 16);
  l.ep = 2;
  Cluster c = free_links(2);
  c.intra = Link{0, 1e9};
  const Prediction ep2 = predict(m, l, c, 16);
  EXPECT_DOUBLE_EQ(dp2.memory.weights, 4 * psi);
  EXPECT_DOUBLE_EQ(ep2.memory.weights, 4 * psi * (0.25 + 0.75 / 2));
  EXPECT_DOUBLE_EQ(ep2.memory.optimizer, 8 * psi * (0.25 + 0.75 / 2));
  // 4 all-to-alls of 4 MB over 2 ranks at 1 GB/s: each (2 - 1) x 2 MB / 1 GB/s = 2 ms.
  EXPECT_NEAR(ep2.compute_s - dp2.compute_s, 4 * 2e-3, 1e-12);
  // The gradients: only the non-experts' 0.25 psi all-reduced over dp 2 (the experts' over dp / ep = 1).
  Layout plain = l;
  plain.ep = 1;
  b.routed_bytes = 0;      // (the all-to-alls aside)
  c.intra = Link{0, 1e3};  // slow enough that the reduce outlasts backward (2 s)
  const double with_ep = predict(m, l, c, 16).comm_s, without = predict(m, plain, c, 16).comm_s;
  EXPECT_NEAR(with_ep, all_reduce_time(0.25 * psi * 4, 2, c.intra) - 2.0, 1e-6);
  EXPECT_NEAR(without, all_reduce_time(psi * 4, 2, c.intra) - 2.0, 1e-6);
  EXPECT_NE(l.str().find("dp 2 (ep 2)"), std::string::npos) << l.str();
  // Offered only with experts that ep divides, ZeRO none (not built under ep).
  bool offered = false;
  for (const Layout& x : layouts(m, free_links(4), 16, 1)) {
    if (x.ep == 1) continue;
    offered = true;
    EXPECT_EQ(x.zero, Zero::none) << x.str();
    EXPECT_EQ(x.dp % x.ep, 0) << x.str();
  }
  EXPECT_TRUE(offered);
  m.experts = 0;
  for (const Layout& x : layouts(m, free_links(4), 16, 1)) EXPECT_EQ(x.ep, 1) << x.str();
  const Prediction refused = predict(m, l, free_links(2), 16);
  EXPECT_FALSE(refused.fits);
  EXPECT_EQ(refused.why, "no experts to split over ep");
}

}  // namespace flowrun::parallel::cost
