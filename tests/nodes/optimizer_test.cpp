// optimizer: AdamW and SGD match torch.optim's updates; weight decay skips biases; clipping;
// learning-rate schedules; the state lists its tensors and can be restored.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "node_test_helpers.hpp"
#include "support/run_graph.hpp"
#include "common/state_io.hpp"
#include "train/optimizer.hpp"

namespace flowrun {
namespace {

struct Toy {
  std::shared_ptr<ModelState> model;
  torch::nn::Linear lin{nullptr};
};

Toy toy(uint64_t seed = 0, int64_t in = 4, int64_t out = 3) {
  torch::manual_seed(seed);
  Toy t;
  t.lin = torch::nn::Linear(in, out);
  t.model = std::make_shared<ModelState>(
      t.lin.ptr(), [](torch::nn::Module& m, const TensorMap& b) { return m.as<torch::nn::LinearImpl>()->forward(b.at("x")); },
      "toy");
  return t;
}

Grads random_grads(const ModelState& m, int64_t step) {
  torch::manual_seed(1000 + step);
  Grads g;
  for (const auto& p : m.trainable_parameters()) g.push_back(torch::randn_like(p));
  return g;
}

TEST(Optimizer, AdamwMatchesTorchAdamw) {
  // torch's AdamW decays every parameter of a group; give it the weight in a group with weight
  // decay and the bias in one without, which is what flowrun's rule does for a Linear.
  Toy ours = toy(), ref = toy();
  OptimizerState st;
  OptimConfig cfg;
  cfg.rule = make_update_rule("adamw", "{beta1: 0.8, beta2: 0.95, eps: 1.0e-6}");
  cfg.weight_decay = 0.1;
  const double lr = 0.05;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  auto o_decay = std::make_unique<torch::optim::AdamWOptions>(lr);
  o_decay->betas({0.8, 0.95}).eps(1e-6).weight_decay(0.1);
  auto o_plain = std::make_unique<torch::optim::AdamWOptions>(lr);
  o_plain->betas({0.8, 0.95}).eps(1e-6).weight_decay(0.0);
  groups.emplace_back(std::vector<torch::Tensor>{ref.lin->weight}, std::move(o_decay));
  groups.emplace_back(std::vector<torch::Tensor>{ref.lin->bias}, std::move(o_plain));
  torch::optim::AdamW torch_opt(groups, torch::optim::AdamWOptions(lr));

  for (int64_t step = 1; step <= 6; ++step) {
    Grads g = random_grads(*ours.model, step);
    optimizer_update(st, ours.model->named_parameters(true), g, cfg, lr);
    ref.lin->weight.mutable_grad() = g[0].clone();
    ref.lin->bias.mutable_grad() = g[1].clone();
    torch_opt.step();
  }
  EXPECT_TRUE(torch::allclose(ours.lin->weight, ref.lin->weight, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(ours.lin->bias, ref.lin->bias, 1e-6, 1e-7));
  EXPECT_EQ(st.updates, 6);
  EXPECT_EQ(st.slots[0].step, 6);
}

TEST(Optimizer, AdamwOnLargeTensorsWithClippingMatchesTorch) {
  // 300 x 257 weights and 257 biases: the CPU kernel's vector body, its scalar tail and several
  // parallel chunks; clipping on (the grads' norm is far above 1), so the clip factor enters.
  Toy ours = toy(3, 300, 257), ref = toy(3, 300, 257);
  OptimizerState st;
  OptimConfig cfg;
  cfg.rule = make_update_rule("adamw", "{beta2: 0.95}");
  cfg.weight_decay = 0.1;
  cfg.clip = 1.0;
  const double lr = 1e-3;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  auto o_decay = std::make_unique<torch::optim::AdamWOptions>(lr);
  o_decay->betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1);
  auto o_plain = std::make_unique<torch::optim::AdamWOptions>(lr);
  o_plain->betas({0.9, 0.95}).eps(1e-8).weight_decay(0.0);
  groups.emplace_back(std::vector<torch::Tensor>{ref.lin->weight}, std::move(o_decay));
  groups.emplace_back(std::vector<torch::Tensor>{ref.lin->bias}, std::move(o_plain));
  torch::optim::AdamW torch_opt(groups, torch::optim::AdamWOptions(lr));
  for (int64_t step = 1; step <= 5; ++step) {
    Grads g = random_grads(*ours.model, step);
    optimizer_update(st, ours.model->named_parameters(true), g, cfg, lr);
    ref.lin->weight.mutable_grad() = g[0].clone();
    ref.lin->bias.mutable_grad() = g[1].clone();
    torch::nn::utils::clip_grad_norm_(std::vector<torch::Tensor>{ref.lin->weight, ref.lin->bias}, 1.0);
    torch_opt.step();
  }
  EXPECT_TRUE(torch::allclose(ours.lin->weight, ref.lin->weight, 1e-5, 1e-7))
      << (ours.lin->weight - ref.lin->weight).abs().max().item<float>();
  EXPECT_TRUE(torch::allclose(ours.lin->bias, ref.lin->bias, 1e-5, 1e-7));
  const auto& ref_state = static_cast<const torch::optim::AdamWParamState&>(
      *torch_opt.state().at(ref.lin->weight.unsafeGetTensorImpl()));
  EXPECT_TRUE(torch::allclose(st.slots[0].moment("exp_avg_sq"), ref_state.exp_avg_sq(), 1e-5, 1e-12));
}

TEST(Optimizer, SgdMomentumMatchesTorchSgd) {
  Toy ours = toy(), ref = toy();
  OptimizerState st;
  OptimConfig cfg;
  cfg.rule = make_update_rule("sgd", "{momentum: 0.9}");
  const double lr = 0.1;
  torch::optim::SGD torch_opt(ref.model->trainable_parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
  for (int64_t step = 1; step <= 5; ++step) {
    Grads g = random_grads(*ours.model, step);
    optimizer_update(st, ours.model->named_parameters(true), g, cfg, lr);
    ref.lin->weight.mutable_grad() = g[0].clone();
    ref.lin->bias.mutable_grad() = g[1].clone();
    torch_opt.step();
  }
  EXPECT_TRUE(torch::allclose(ours.lin->weight, ref.lin->weight, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(ours.lin->bias, ref.lin->bias, 1e-6, 1e-7));
}

TEST(Optimizer, NonFiniteGradsStopOrSkip) {
  Toy t = toy();
  torch::Tensor w0 = t.lin->weight.detach().clone();
  OptimizerState st;
  OptimConfig cfg;
  Grads g = random_grads(*t.model, 1);
  g[0][0][0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(optimizer_update(st, t.model->named_parameters(true), g, cfg, 0.1), NonFiniteGrads);
  EXPECT_TRUE(torch::equal(t.lin->weight, w0));
  cfg.skip_nonfinite = true;
  torch::Tensor norm = optimizer_update(st, t.model->named_parameters(true), g, cfg, 0.1);
  EXPECT_TRUE(std::isnan(norm.item<double>()));
  EXPECT_TRUE(torch::equal(t.lin->weight, w0));  // skipped: untouched
  EXPECT_EQ(st.slots[0].step, 0);
}

// defer_nonfinite (the optimizer node on a GPU, where reading the norm would make each step wait
// for the host): a non-finite step never throws; it is skipped, leaving parameters, moments and
// step counts as they were, and counted in the state for the caller to read when it logs.
TEST(Optimizer, DeferredNonFiniteStepsAreSkippedAndCounted) {
  for (const char* kind : {"adamw", "sgd", "adafactor"}) {
    Toy t = toy();
    OptimizerState st;
    OptimConfig cfg;
    cfg.rule = make_update_rule(kind);
    cfg.defer_nonfinite = true;
    cfg.clip = 1.0;
    optimizer_update(st, t.model->named_parameters(true), random_grads(*t.model, 1), cfg, 0.1);
    EXPECT_EQ(nonfinite_count(st), 0);
    const std::map<std::string, torch::Tensor> before = test::snapshot(*t.model);
    std::map<std::string, torch::Tensor> moments;
    for (const auto& [k, v] : st.tensors()) moments[k] = v.clone();
    for (int bad = 1; bad <= 2; ++bad) {
      Grads g = random_grads(*t.model, 1 + bad);
      g[bad - 1].view({-1})[0] = bad == 1 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
      torch::Tensor norm;
      EXPECT_NO_THROW(norm = optimizer_update(st, t.model->named_parameters(true), g, cfg, 0.1));
      EXPECT_FALSE(std::isfinite(norm.item<double>()));
      EXPECT_EQ(nonfinite_count(st), bad);
    }
    const std::map<std::string, torch::Tensor> after = test::snapshot(*t.model);
    for (const auto& [k, v] : before) EXPECT_TRUE(torch::equal(v, after.at(k))) << kind << " " << k;
    for (const auto& [k, v] : st.tensors()) EXPECT_TRUE(torch::equal(v, moments.at(k))) << kind << " " << k;
    // A finite step after them updates as usual and leaves the count.
    optimizer_update(st, t.model->named_parameters(true), random_grads(*t.model, 9), cfg, 0.1);
    EXPECT_EQ(nonfinite_count(st), 2);
    EXPECT_EQ(st.slots[0].step, 2);
    EXPECT_FALSE(torch::equal(t.lin->weight, before.at("weight")));
  }
}

// ZeRO-1's plan: over any world size, every element of every parameter is in exactly one rank's
// pieces, each rank's slice is contiguous and at most ceil(numel / world) long, and the pieces lie
// in the slice in buffer order.
TEST(ShardPlan, EveryElementIsInExactlyOneRanksPieces) {
  Toy t = toy(0, 7, 5);
  ModelState::Named named = t.model->named_parameters(true);
  std::vector<torch::Tensor> ps;
  for (const auto& [_, p] : named) ps.push_back(p);
  const FlatLayout layout = FlatLayout::of(ps);
  for (int world : {1, 2, 3, 7, 64}) {
    std::vector<std::vector<int>> seen(ps.size());
    for (size_t i = 0; i < ps.size(); ++i) seen[i].assign(static_cast<size_t>(ps[i].numel()), 0);
    for (int rank = 0; rank < world; ++rank) {
      const ShardPlan plan = ShardPlan::make(layout, named, rank, world);
      ASSERT_EQ(plan.groups.size(), 1u);
      EXPECT_LE(plan.groups[0].end - plan.groups[0].begin, (plan.groups[0].numel + world - 1) / world);
      int64_t at = 0;
      for (const auto& piece : plan.pieces) {
        EXPECT_EQ(piece.at, at) << "world " << world << " rank " << rank;
        at += piece.numel;
        for (int64_t k = piece.offset; k < piece.offset + piece.numel; ++k)
          ++seen[static_cast<size_t>(piece.param)][static_cast<size_t>(k)];
      }
      EXPECT_EQ(at, plan.groups[0].end - plan.groups[0].begin);
    }
    for (const auto& s : seen)
      for (int c : s) ASSERT_EQ(c, 1) << "world " << world;
  }
}

// Two ranks simulated in one process: each updates its pieces (with the norm of all the grads),
// the slices put together as the all-gather would: the same parameters, bit for bit, as one
// unsharded optimizer, over several steps with clipping and weight decay (biases do not decay,
// also in a piece). AdamW and SGD cut the buffer element-wise (through the weight), Adafactor
// by whole parameters (rank 0 the weight, factored, rank 1 the bias).
TEST(ShardPlan, ShardedUpdatesAreTheUnshardedOnesBitForBit) {
  for (const std::string kind : {"adamw", "sgd", "adafactor"}) {
    OptimConfig cfg;
    cfg.rule = make_update_rule(kind, kind == "adafactor" ? "{min_dim_size_to_factor: 4}" : "{}");
    cfg.clip = 0.5;
    cfg.weight_decay = 0.1;
    Toy whole = toy(1, 9, 6);
    std::vector<Toy> ranks = {toy(1, 9, 6), toy(1, 9, 6)};
    OptimizerState s_whole;
    std::vector<OptimizerState> s_rank(2);
    for (int step = 1; step <= 4; ++step) {
      const Grads g = random_grads(*whole.model, step);
      optimizer_update(s_whole, whole.model->named_parameters(true), g, cfg, 0.05);
      std::vector<torch::Tensor> slices;
      for (int r = 0; r < 2; ++r) {
        ModelState& m = *ranks[static_cast<size_t>(r)].model;
        m.flat.ensure(m.trainable_parameters());
        const ModelState::Named named = m.named_parameters(true);
        OptimizerState& st = s_rank[static_cast<size_t>(r)];
        if (st.slots.empty())
          make_shard_slots(st, ShardPlan::make(m.flat.layout(), named, r, 2, kind == "adafactor"), named, cfg);
        if (kind == "adafactor") {  // whole parameters: the weight on rank 0, the bias on rank 1
          ASSERT_EQ(st.shard.pieces.size(), 1u);
          EXPECT_EQ(st.shard.pieces[0].numel, named[static_cast<size_t>(st.shard.pieces[0].param)].second.numel());
          EXPECT_EQ(st.slots[0].moment("v_row").defined(), r == 0);
        }
        const ShardPieces pieces = shard_pieces(st.shard, named, g);
        optimizer_update(st, pieces.params, pieces.grads, cfg, 0.05, global_norm(g));
        const auto& grp = st.shard.groups[0];
        slices.push_back((*m.flat.buffers_of(m.trainable_parameters()))[0].narrow(0, grp.begin, grp.end - grp.begin).clone());
      }
      for (int r = 0; r < 2; ++r) {  // the all-gather
        ModelState& m = *ranks[static_cast<size_t>(r)].model;
        torch::Tensor buf = (*m.flat.buffers_of(m.trainable_parameters()))[0];
        torch::NoGradGuard ng;
        for (int q = 0; q < 2; ++q) {
          const auto& grp = s_rank[static_cast<size_t>(q)].shard.groups[0];
          buf.narrow(0, grp.begin, grp.end - grp.begin).copy_(slices[static_cast<size_t>(q)]);
        }
      }
      for (int r = 0; r < 2; ++r) {
        EXPECT_TRUE(torch::equal(ranks[static_cast<size_t>(r)].lin->weight, whole.lin->weight)) << kind << " step " << step;
        EXPECT_TRUE(torch::equal(ranks[static_cast<size_t>(r)].lin->bias, whole.lin->bias)) << kind << " step " << step;
      }
    }
  }
}

// A checkpoint's state as a StateSource (common/state_io.hpp), counting the elements read.
class CountingSource : public StateSource {
 public:
  explicit CountingSource(NamedTensors t) : t_(std::move(t)) {}
  std::vector<std::string> names() const override {
    std::vector<std::string> out;
    for (const auto& [k, _] : t_) out.push_back(k);
    return out;
  }
  bool has(const std::string& name) const override { return t_.count(name) > 0; }
  std::vector<int64_t> shape(const std::string& name) const override { return t_.at(name).sizes().vec(); }
  torch::ScalarType dtype(const std::string& name) const override { return t_.at(name).scalar_type(); }
  void read(const std::string& name, const std::vector<int64_t>& offsets, torch::Tensor into) const override {
    torch::Tensor from = t_.at(name);
    for (size_t d = 0; d < offsets.size(); ++d) from = from.narrow(static_cast<int64_t>(d), offsets[d], into.size(static_cast<int64_t>(d)));
    into.copy_(from);
    read_[name] += into.numel();
  }
  std::string where() const override { return "the test's checkpoint"; }
  NamedTensors t_;
  mutable std::map<std::string, int64_t> read_;
};

// Issue 72: a ZeRO resume never holds a replica's whole state. The optimizer node makes its slots
// at setup; a resume then reads each rank's slices of the saved moments into them, and nothing
// else: the two ranks read every element once between them, each its pieces, and continue where
// the state of one process left off. A tensor missing, of another shape or not finite is refused,
// naming it.
TEST(ShardPlan, AResumeReadsOnlyThisRanksSlices) {
  OptimConfig cfg;
  Toy whole = toy(1, 9, 6);
  OptimizerState saved;
  for (int64_t s = 1; s <= 3; ++s)
    optimizer_update(saved, whole.model->named_parameters(true), random_grads(*whole.model, s), cfg, 0.01);
  const NamedTensors t = saved.tensors();
  int64_t moments_read = 0;
  for (int r = 0; r < 2; ++r) {
    Toy m = toy(1, 9, 6);
    m.model->flat.ensure(m.model->trainable_parameters());
    const ModelState::Named named = m.model->named_parameters(true);
    auto st = std::make_shared<OptimizerState>();
    st->expect(named, *cfg.rule);
    make_shard_slots(*st, ShardPlan::make(m.model->flat.layout(), named, r, 2), named, cfg);
    Value v(st);
    CountingSource src(t);
    find_state_io(v)->load_from(v, src);
    int64_t mine = 0;
    for (const auto& piece : st->shard.pieces) mine += piece.numel;
    EXPECT_EQ(src.read_["weight.exp_avg"] + src.read_["bias.exp_avg"], mine) << "rank " << r;
    EXPECT_EQ(src.read_["weight.exp_avg_sq"] + src.read_["bias.exp_avg_sq"], mine) << "rank " << r;
    moments_read += 2 * mine;
    for (size_t k = 0; k < st->slots.size(); ++k) {
      const ShardPlan::Piece& piece = st->shard.pieces[k];
      for (const char* moment : {"exp_avg", "exp_avg_sq"})
        EXPECT_TRUE(torch::equal(st->slots[k].moment(moment).reshape({-1}),
                                 t.at(st->slots[k].name + "." + moment).reshape({-1}).narrow(0, piece.offset, piece.numel)))
            << st->slots[k].name << "." << moment << " on rank " << r;
      EXPECT_EQ(st->slots[k].step, 3);
    }
    EXPECT_EQ(st->updates, 3);
    EXPECT_TRUE(st->pending.empty());
  }
  EXPECT_EQ(moments_read, 2 * (6 * 9 + 6));  // every element of both moments, once
  // Refused, naming the tensor: missing, another shape, not finite.
  auto refusal = [&](NamedTensors damaged) {
    Toy m = toy(1, 9, 6);
    m.model->flat.ensure(m.model->trainable_parameters());
    const ModelState::Named named = m.model->named_parameters(true);
    auto st = std::make_shared<OptimizerState>();
    st->expect(named, *cfg.rule);
    make_shard_slots(*st, ShardPlan::make(m.model->flat.layout(), named, 0, 2), named, cfg);
    Value v(st);
    CountingSource src(std::move(damaged));
    try {
      find_state_io(v)->load_from(v, src);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  NamedTensors missing = t;
  missing.erase("bias.exp_avg_sq");
  EXPECT_NE(refusal(missing).find("tensor 'bias.exp_avg_sq' is missing"), std::string::npos);
  NamedTensors transposed = t;
  transposed["weight.exp_avg"] = t.at("weight.exp_avg").t().contiguous();
  EXPECT_NE(refusal(transposed).find("tensor 'weight.exp_avg' has shape [9, 6], expected [6, 9]"), std::string::npos);
  NamedTensors nan = t;
  nan["weight.exp_avg_sq"] = t.at("weight.exp_avg_sq").clone();
  nan["weight.exp_avg_sq"].view({-1})[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(refusal(nan).find("tensor 'weight.exp_avg_sq' holds NaN or infinite values"), std::string::npos);
}

// ZeRO-2's reduce-scatter, three ranks simulated in one process: each packs a bucket's gradients
// by owner (divided by the world), rank q receives the sum of every rank's block q and unpacks it
// into its slices; its pieces are then exactly its pieces of the average, a gradient one rank
// lacks counting as zeros. Element-wise and by whole parameters, in one bucket and in three.
TEST(GradShard, EachRankGetsItsPiecesOfTheAverage) {
  torch::manual_seed(5);
  const ModelState::Named named = {{"a", torch::zeros({7, 5})}, {"b", torch::zeros({7})},
                                   {"c", torch::zeros({3, 7})}, {"d", torch::zeros({3})}};
  const int world = 3, n = static_cast<int>(named.size());
  std::vector<Grads> g(world);
  for (int r = 0; r < world; ++r)
    for (const auto& [_, p] : named) g[static_cast<size_t>(r)].push_back(torch::randn_like(p));
  g[1][2] = torch::Tensor();  // rank 1 gave "c" no gradient
  for (bool whole : {false, true})
    for (const std::vector<int>& cuts : {std::vector<int>{0, n}, std::vector<int>{0, 1, 3, n}}) {
      std::vector<std::shared_ptr<const GradShard>> shard;
      std::vector<std::vector<torch::Tensor>> slices(world);
      for (int q = 0; q < world; ++q) {
        shard.push_back(GradShard::make(named, q, world, whole));
        for (const auto& grp : shard.back()->plan.groups) slices[static_cast<size_t>(q)].push_back(torch::full({grp.end - grp.begin}, -1.0f));
      }
      for (size_t b = 0; b + 1 < cuts.size(); ++b) {
        std::vector<torch::Tensor> packed;
        std::vector<size_t> counts;
        for (int r = 0; r < world; ++r) packed.push_back(pack_by_owner(*shard[static_cast<size_t>(r)], cuts[b], cuts[b + 1], g[static_cast<size_t>(r)], counts, world));
        int64_t at = 0;
        for (int q = 0; q < world; ++q) {
          const auto c = static_cast<int64_t>(counts[static_cast<size_t>(q)]);
          torch::Tensor sum = packed[0].narrow(0, at, c).clone();
          for (int r = 1; r < world; ++r) sum += packed[static_cast<size_t>(r)].narrow(0, at, c);
          unpack_mine(*shard[static_cast<size_t>(q)], cuts[b], cuts[b + 1], sum, slices[static_cast<size_t>(q)]);
          at += c;
        }
      }
      std::vector<int64_t> covered(static_cast<size_t>(n), 0);
      for (int q = 0; q < world; ++q) {
        const Grads mine = pieces_of_slices(shard[static_cast<size_t>(q)]->plan, slices[static_cast<size_t>(q)]);
        ASSERT_EQ(mine.size(), named.size());
        for (const auto& piece : shard[static_cast<size_t>(q)]->plan.pieces) {
          const size_t i = static_cast<size_t>(piece.param);
          torch::Tensor avg = torch::zeros_like(named[i].second);
          for (int r = 0; r < world; ++r)
            if (g[static_cast<size_t>(r)][i].defined()) avg = avg + g[static_cast<size_t>(r)][i].div(world);
          ASSERT_TRUE(mine[i].defined());
          EXPECT_TRUE(torch::allclose(mine[i].reshape({-1}), avg.reshape({-1}).narrow(0, piece.offset, piece.numel), 1e-6, 1e-7))
              << "whole " << whole << " buckets " << cuts.size() - 1 << " rank " << q << " param " << named[i].first;
          if (whole) EXPECT_EQ(mine[i].sizes(), named[i].second.sizes());
          covered[i] += piece.numel;
        }
      }
      for (int i = 0; i < n; ++i) EXPECT_EQ(covered[static_cast<size_t>(i)], named[static_cast<size_t>(i)].second.numel());
    }
}

// A regression graph of `steps` steps whose optimizer has `with` (a flow map).
std::string optimizer_graph(const std::string& with, int steps = 1) {
  return "flowrun: 1\nrun: { steps: " + std::to_string(steps) + R"( }
nodes:
  data:  { type: synthetic_regression, with: { in_dim: 4, out_dim: 1, batch: 16 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 2, out_dim: 1 } }
  loss:  { type: mse_loss }
  fb:    { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  opt:   { type: optimizer, in: { grads: fb.grads, model: model.params },
           with: )" + with + " }\n";
}

TEST(OptimizerNode, DivergedRunStopsWithTheStep) {
  try {
    test::run_graph_text(optimizer_graph("{ kind: sgd, lr: 1.0e+30 }", 50));
    FAIL() << "a diverging run must stop";
  } catch (const NodeError& e) {
    EXPECT_EQ(e.node, "opt");
    EXPECT_GT(e.step, 1);
    EXPECT_NE(std::string(e.what()).find("failed at step " + std::to_string(e.step) + ": the gradients are not finite"),
              std::string::npos)
        << e.what();
  }
}

TEST(Optimizer, UndefinedGradsAreSkipped) {
  Toy t = toy();
  torch::Tensor bias0 = t.lin->bias.detach().clone();
  OptimizerState st;
  OptimConfig cfg;
  Grads g = random_grads(*t.model, 1);
  g[1] = torch::Tensor();
  optimizer_update(st, t.model->named_parameters(true), g, cfg, 0.1);
  EXPECT_TRUE(torch::equal(t.lin->bias, bias0));
  EXPECT_EQ(st.slots[1].step, 0);
  EXPECT_EQ(st.slots[0].step, 1);
}

TEST(Optimizer, ClippingScalesTheUpdateNotTheGrads) {
  Toy t = toy();
  torch::Tensor w0 = t.lin->weight.detach().clone();
  OptimizerState st;
  OptimConfig cfg;
  cfg.rule = make_update_rule("sgd", "{momentum: 0}");
  cfg.clip = 0.5;
  Grads g = random_grads(*t.model, 1);
  std::vector<torch::Tensor> g0 = {g[0].clone(), g[1].clone()};
  const double norm = std::sqrt(g[0].pow(2).sum().item<double>() + g[1].pow(2).sum().item<double>());
  ASSERT_GT(norm, 0.5);
  torch::Tensor got = optimizer_update(st, t.model->named_parameters(true), g, cfg, 1.0);
  EXPECT_NEAR(got.item<double>(), norm, 1e-4);  // reported before clipping
  EXPECT_TRUE(torch::allclose(t.lin->weight, w0 - g0[0] * (0.5 / (norm + 1e-6)), 1e-5, 1e-6));
  EXPECT_TRUE(torch::equal(g[0], g0[0]));  // the grad tensors themselves are untouched
  // Below the threshold nothing is scaled.
  Toy u = toy();
  OptimizerState st2;
  cfg.clip = 10 * norm;
  torch::Tensor u0 = u.lin->weight.detach().clone();
  optimizer_update(st2, u.model->named_parameters(true), g, cfg, 1.0);
  EXPECT_TRUE(torch::allclose(u.lin->weight, u0 - g0[0], 1e-6, 1e-7));
}

TEST(Optimizer, StateListsItsTensorsAndRestores) {
  Toy a = toy(), b = toy();
  OptimizerState sa;
  OptimConfig cfg;
  for (int64_t s = 1; s <= 3; ++s) optimizer_update(sa, a.model->named_parameters(true), random_grads(*a.model, s), cfg, 0.01);
  auto t = sa.tensors();
  for (const char* k : {"weight.exp_avg", "weight.exp_avg_sq", "weight.step", "bias.exp_avg", "bias.exp_avg_sq",
                        "bias.step", "updates"})
    EXPECT_TRUE(t.count(k)) << k;
  EXPECT_EQ(t.at("weight.step").item<int64_t>(), 3);
  // A fresh state loaded from the tensors (before its first update) continues like the original.
  OptimizerState sb;
  sb.load(t);
  b.model->load(a.model->tensors());
  for (int64_t s = 4; s <= 5; ++s) {
    optimizer_update(sa, a.model->named_parameters(true), random_grads(*a.model, s), cfg, 0.01);
    optimizer_update(sb, b.model->named_parameters(true), random_grads(*b.model, s), cfg, 0.01);
  }
  EXPECT_TRUE(torch::equal(a.lin->weight, b.lin->weight));
  EXPECT_TRUE(torch::equal(a.lin->bias, b.lin->bias));
  EXPECT_EQ(sb.updates, 5);
}

TEST(Optimizer, LearningRateSchedules) {
  LrSchedule s;
  s.lr = 1.0;
  EXPECT_DOUBLE_EQ(s.at(1, 100), 1.0);
  EXPECT_DOUBLE_EQ(s.at(100, 100), 1.0);
  s.warmup = 10;
  EXPECT_DOUBLE_EQ(s.at(1, 100), 0.1);
  EXPECT_DOUBLE_EQ(s.at(10, 100), 1.0);
  EXPECT_DOUBLE_EQ(s.at(50, 100), 1.0);
  s.kind = LrDecay::cosine;
  s.min_lr = 0.1;
  EXPECT_DOUBLE_EQ(s.at(10, 110), 1.0);
  EXPECT_NEAR(s.at(60, 110), 0.55, 1e-12);  // half way: (1 + 0.1) / 2
  EXPECT_NEAR(s.at(110, 110), 0.1, 1e-12);
  s.kind = LrDecay::linear;
  EXPECT_NEAR(s.at(35, 110), 1.0 - 0.9 * 0.25, 1e-12);
  EXPECT_NEAR(s.at(110, 110), 0.1, 1e-12);
}

TEST(OptimizerNode, WeightDecaySkipsBiases) {
  // Zero gradients: AdamW's step is 0 / (0 + eps) = 0, so only the decoupled decay moves the
  // parameters: weights shrink by (1 - lr * wd) per step; biases (1-D) stay as they were.
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 5, seed: 2 }
nodes:
  model: { type: mlp, with: { in_dim: 3, hidden: 4, layers: 1, out_dim: 2 } }
  zero: { type: t_zero_grads, in: { model: model.params } }
  opt: { type: optimizer, in: { grads: zero.grads, model: model.params },
         with: { kind: adamw, lr: 0.1, weight_decay: 0.5 } }
  log: { type: metrics, in: { lr: opt.lr, grad_norm: opt.grad_norm } }
)");
  ModelState& m = g->state<ModelState>("model", "params");
  auto before = test::snapshot(m);
  g->run();
  const double shrink = std::pow(1.0 - 0.1 * 0.5, 5);
  for (const auto& [k, v] : m.named_parameters()) {
    if (v.dim() >= 2)
      EXPECT_TRUE(torch::allclose(v, before.at(k) * shrink, 1e-6, 1e-7)) << k;
    else
      EXPECT_TRUE(torch::equal(v, before.at(k))) << k << " is a bias: no decay";
  }
  // The state's step counts and the logged outputs.
  auto& st = g->state<OptimizerState>("opt", "state");
  EXPECT_EQ(st.updates, 5);
  auto metrics = g->metrics();
  ASSERT_FALSE(metrics.empty());
  EXPECT_DOUBLE_EQ(metrics.back()["lr"].get<double>(), 0.1);
  EXPECT_DOUBLE_EQ(metrics.back()["grad_norm"].get<double>(), 0.0);
}

TEST(OptimizerNode, WarmupInAGraph) {
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 4, seed: 2, log_every: 1 }
nodes:
  model: { type: mlp, with: { in_dim: 3, hidden: 4, layers: 1, out_dim: 2 } }
  zero: { type: t_zero_grads, in: { model: model.params } }
  opt: { type: optimizer, in: { grads: zero.grads, model: model.params }, with: { lr: 0.2, warmup: 4 } }
  log: { type: metrics, in: { lr: opt.lr } }
)");
  g->run();
  auto metrics = g->metrics();
  ASSERT_EQ(metrics.size(), 4u);
  for (int s = 1; s <= 4; ++s) EXPECT_NEAR(metrics[s - 1]["lr"].get<double>(), 0.05 * s, 1e-12);
}

}  // namespace
}  // namespace flowrun

// ---- update rules as registered components (train/update_rule.hpp) ---------------------------

namespace flowrun {
namespace {

std::string graph_error(const std::string& opt_with) {
  try {
    test::load_graph_text(optimizer_graph(opt_with));
  } catch (const GraphError& e) {
    return e.what();
  }
  return "";
}

// Every kind the schema offers is a registered rule, and each rule's settings are a group of its
// own that applies to its kind only; print-config-like output lists the chosen rule's only.
TEST(UpdateRules, EachKindIsARuleWithItsOwnGroup) {
  const NodeSchema& s = Registry::global().find("optimizer")->schema;
  ASSERT_NE(s.param("kind"), nullptr);
  for (const std::string& kind : s.param("kind")->values) {
    SCOPED_TRACE(kind);
    const ParamSchema* group = s.param(kind);
    ASSERT_NE(group, nullptr) << "no settings group for kind " << kind;
    EXPECT_EQ(group->type, ParamType::Map);
    EXPECT_EQ(group->when_param, "kind");
    EXPECT_EQ(group->when_values, std::vector<std::string>{kind});
    EXPECT_EQ(make_update_rule(kind)->kind, kind);  // registered, made from the schema's defaults
  }
  for (const char* kind : {"adamw", "sgd", "adafactor"})
    EXPECT_NE(std::find(s.param("kind")->values.begin(), s.param("kind")->values.end(), kind), s.param("kind")->values.end());
  // The checked parameters hold the chosen rule's settings, defaults filled, and no other's.
  auto g = test::load_graph_text(optimizer_graph("{ kind: sgd, sgd: { momentum: 0.5 } }"));
  const YAML::Node with = g->spec->nodes[static_cast<size_t>(g->spec->index_of("opt"))].params;
  EXPECT_EQ(with["sgd"]["momentum"].as<double>(), 0.5);
  EXPECT_FALSE(with["adamw"]);
  EXPECT_FALSE(with["adafactor"]);
}

// Another rule's settings, or a rule's setting written where the old flat schema had it, are
// refused by the checker with the key, the line and the fix.
TEST(UpdateRules, TheCheckerRefusesAnotherRulesSettings) {
  std::string e = graph_error("{ kind: sgd, lr: 0.1,\n                   adamw: { beta1: 0.8 } }");
  EXPECT_NE(e.find("graph.yaml:10:"), std::string::npos) << e;  // the line of adamw:
  EXPECT_NE(e.find("nodes.opt.with.adamw: 'adamw' applies with kind: adamw only, and kind is sgd: drop 'adamw' (or set "
                   "it to null), or set kind: adamw"),
            std::string::npos)
      << e;
  // Set to null (what an override can do: opt.adamw=null), it is as if not given.
  EXPECT_EQ(graph_error("{ kind: sgd, adamw: null }"), "");
  e = graph_error("{ kind: adamw, beta2: 0.95 }");
  EXPECT_NE(e.find("unknown parameter 'beta2'; it is a field of a map: did you mean 'adamw.beta2'?"), std::string::npos) << e;
  e = graph_error("{ kind: lamb }");
  EXPECT_NE(e.find("'lamb' is not one of {adamw, sgd, adafactor"), std::string::npos) << e;
  EXPECT_EQ(graph_error("{ kind: adafactor, adafactor: { momentum: 0.0 } }"), "");
}

// A rule added as a plugin adds it (add_update_rule): a new kind with its own checked settings,
// and the optimizer's shared parts (weight decay, clipping, the step count) around its update.
class TestSignDescent : public UpdateRule {
 public:
  explicit TestSignDescent(const Params& p) : scale_(p.get<double>("scale")) {}
  std::vector<std::string> moments() const override { return {}; }
  void update(torch::Tensor& p, const torch::Tensor& g, std::vector<torch::Tensor>&, const Step& s) const override {
    p.add_(g.sign(), -s.lr * scale_);
  }

 private:
  double scale_;
};

TEST(UpdateRules, APluginRuleBecomesAKindWithItsOwnSettings) {
  static const bool added = [] {
    add_update_rule(Registry::global(), R"yaml(group: t_sign_descent
doc: "p -= lr * scale * sign(g) (a test rule)"
params:
  scale: { type: float, default: 1.0, min: 0, doc: "step per unit of lr" }
)yaml",
                    rule_factory<TestSignDescent>(), "optimizer_test");
    return true;
  }();
  ASSERT_TRUE(added);
  EXPECT_THROW(add_update_rule(Registry::global(), "group: t_sign_descent\nparams: {}\n", rule_factory<TestSignDescent>(), "again"),
               std::runtime_error);
  EXPECT_NE(graph_error("{ kind: t_sign_descent, t_sign_descent: { scale: -1 } }").find("nodes.opt.with.t_sign_descent.scale"),
            std::string::npos);
  EXPECT_NE(graph_error("{ kind: adamw, t_sign_descent: { scale: 2 } }").find("applies with kind: t_sign_descent only"),
            std::string::npos);
  EXPECT_EQ(graph_error("{ kind: t_sign_descent, t_sign_descent: { scale: 2 } }"), "");

  Toy t = toy();
  const torch::Tensor w0 = t.lin->weight.detach().clone(), b0 = t.lin->bias.detach().clone();
  OptimizerState st;
  OptimConfig cfg;
  cfg.rule = make_update_rule("t_sign_descent", "{scale: 0.5}");
  cfg.weight_decay = 0.1;
  const Grads g = random_grads(*t.model, 1);
  optimizer_update(st, t.model->named_parameters(true), g, cfg, 0.2);
  // Decay on the weight (a matrix) only, then the rule's step.
  EXPECT_TRUE(torch::allclose(t.lin->weight, w0 * (1 - 0.2 * 0.1) - 0.2 * 0.5 * g[0].sign()));
  EXPECT_TRUE(torch::allclose(t.lin->bias, b0 - 0.2 * 0.5 * g[1].sign()));
  const auto saved = st.tensors();
  EXPECT_EQ(saved.at("weight.step").item<int64_t>(), 1);
  EXPECT_EQ(saved.size(), 3u);  // two steps and "updates": the rule keeps no moment
}

// A parameter a type no longer takes (schema `moved:`) is refused with where its setting went,
// not as an unknown parameter with a guess: the optimizer's `shard`, now a zero node's stage.
TEST(OptimizerNode, TheRetiredShardParameterSaysWhereItWent) {
  test::CheckedGraph g = test::check_graph_text(R"(flowrun: 1
nodes:
  data: { type: synthetic_regression }
  model: { type: mlp }
  loss: { type: mse_loss }
  fb: { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  opt: { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { shard: states } }
)");
  ASSERT_EQ(g.diags.size(), 1u);
  const std::string d = g.diags[0].str();
  EXPECT_NE(d.find(":7:81: nodes.opt.with.shard: parameter 'shard' is no longer here: the ZeRO plan is a node of its own"),
            std::string::npos)
      << d;
  EXPECT_NE(d.find("zero: { type: zero, with: { stage: states } }"), std::string::npos) << d;
}

}  // namespace
}  // namespace flowrun
