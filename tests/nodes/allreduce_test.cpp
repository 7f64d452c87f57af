// allreduce: the bucket plan over a gradient buffer, and the node in a training graph. In one
// process an all-reduce changes nothing, so fb -> sync -> opt must train exactly like fb -> opt
// (whatever the bucket sizes, overlap or compression), and a parameter nobody used must stay
// undefined. Equivalence across real ranks is tested under mpirun (tests/mpi/).
#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "comm.hpp"
#include "node_test_helpers.hpp"
#include "registry.hpp"
#include "schema.hpp"
#include "train/allreduce.hpp"
#include "train/grad_buffer.hpp"

namespace flowrun {
namespace {

// ---- the bucket plan ----

constexpr double kMiB = 1024.0 * 1024.0;

TEST(AllreduceBuckets, ConsecutiveReversedPositionsCappedPerGroup) {
  // Module order, elements: f32 100, f64 100, f32 300, f32 50, f64 50, f32 200, f32 1000.
  std::vector<torch::Tensor> ps = {torch::zeros({100}), torch::zeros({100}, torch::kDouble),
                                   torch::zeros({30, 10}), torch::zeros({50}),
                                   torch::zeros({50}, torch::kDouble), torch::zeros({200}),
                                   torch::zeros({10, 100})};
  auto b = GradBuffer::make(ps);
  // First bucket of each group: at most 1000 bytes; the others: at most 2000 bytes.
  BucketPlan plan = plan_buckets(*b, 1000.5 / kMiB, 2000.5 / kMiB);
  // float group, buffer order 6, 5, 3, 2, 0 (bytes 4000, 800, 200, 1200, 400):
  //   [6] alone (larger than the first cap), [5, 3] = 1000, [2, 0] = 1600 (adding 2 to [5, 3]
  //   would make 2200); double group, order 4, 1 (400, 800): [4] (first cap), [1].
  struct Want {
    int group;
    int64_t offset, numel, bytes;
    int first, end;
  };
  const std::vector<Want> want = {
      {0, 0, 1000, 4000, 0, 1}, {0, 1000, 250, 1000, 1, 3}, {0, 1250, 400, 1600, 3, 5},
      {1, 0, 50, 400, 5, 6},    {1, 50, 100, 800, 6, 7},
  };
  ASSERT_EQ(plan.buckets.size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    const Bucket& got = plan.buckets[k];
    EXPECT_EQ(got.group, want[k].group) << "bucket " << k;
    EXPECT_EQ(got.offset, want[k].offset) << "bucket " << k;
    EXPECT_EQ(got.numel, want[k].numel) << "bucket " << k;
    EXPECT_EQ(got.bytes, want[k].bytes) << "bucket " << k;
    EXPECT_EQ(got.first, want[k].first) << "bucket " << k;
    EXPECT_EQ(got.end, want[k].end) << "bucket " << k;
  }
  EXPECT_EQ(plan.bucket_of, (std::vector<int>{2, 4, 2, 1, 3, 1, 0}));
  // Every bucket is exactly the slices of its parameters' views.
  for (size_t i = 0; i < ps.size(); ++i) {
    const Bucket& bk = plan.buckets[static_cast<size_t>(plan.bucket_of[i])];
    const GradBuffer::Slot& s = b->slots[i];
    EXPECT_EQ(s.group, bk.group) << i;
    EXPECT_GE(s.offset, bk.offset) << i;
    EXPECT_LE(s.offset + s.numel, bk.offset + bk.numel) << i;
  }

  // The defaults (1 MB first, 25 MB after) put a small model in one bucket per group.
  BucketPlan big = plan_buckets(*b, 1, 25);
  ASSERT_EQ(big.buckets.size(), 2u);
  EXPECT_EQ(big.buckets[0].numel, b->flats[0].numel());
  EXPECT_EQ(big.buckets[1].numel, b->flats[1].numel());
  // A zero cap: one bucket per parameter, in buffer order.
  BucketPlan each = plan_buckets(*b, 0, 0);
  ASSERT_EQ(each.buckets.size(), ps.size());
  for (size_t k = 0; k < ps.size(); ++k)
    EXPECT_EQ(each.buckets[k].first, static_cast<int>(k));

  // The plan knows the layout it was made for.
  EXPECT_TRUE(plan.fits(*GradBuffer::make(ps)));
  EXPECT_FALSE(plan.fits(*GradBuffer::make({ps[0], ps[1]})));
  EXPECT_FALSE(plan.fits(*GradBuffer::make({ps[1], ps[0], ps[2], ps[3], ps[4], ps[5], ps[6]})));
}

TEST(AllreduceSchema, PortsAndParams) {
  const NodeType* t = Registry::global().find("allreduce");
  ASSERT_NE(t, nullptr);
  ASSERT_NE(t->schema.input("ready"), nullptr);
  EXPECT_EQ(t->schema.input("ready")->kind, PortKind::Stream);
  EXPECT_EQ(t->schema.input("ready")->type, "grad_ready");
  ASSERT_NE(t->schema.output("grads"), nullptr);
  EXPECT_EQ(t->schema.output("grads")->kind, PortKind::Value);
  EXPECT_EQ(t->schema.output("grads")->type, "grads");
  for (const char* p : {"bucket_mb", "first_bucket_mb", "compress", "overlap"}) {
    bool found = false;
    for (const auto& ps : t->schema.params) found = found || ps.name == p;
    EXPECT_TRUE(found) << p;
  }
  // Documented like every built-in (tests/nodes/builtin_schemas_test.cpp).
  EXPECT_EQ(t->schema.origin, "built-in");
  EXPECT_FALSE(t->schema.doc.empty());
  for (const auto* ports : {&t->schema.inputs, &t->schema.outputs})
    for (const auto& p : *ports) EXPECT_FALSE(p.doc.empty()) << p.name;
  for (const auto& p : t->schema.params) {
    EXPECT_FALSE(p.doc.empty()) << p.name;
    EXPECT_TRUE(p.has_default) << p.name;
  }
  const NodeType* fb = Registry::global().find("forward_backward");
  ASSERT_NE(fb, nullptr);
  ASSERT_NE(fb->schema.output("ready"), nullptr);
  EXPECT_EQ(fb->schema.output("ready")->kind, PortKind::Stream);
  EXPECT_EQ(fb->schema.output("ready")->type, "grad_ready");
}

// ---- the node in a graph ----

// The regression graph (graphs/regression.yaml, smaller), with or without `sync` between
// forward_backward and the optimizer. Tiny buckets, so a step has several.
std::string regression(bool with_sync) {
  std::string g = R"(
flowrun: 1
run: { steps: 20, seed: 1, prefetch: 2, log_every: 1 }
nodes:
  data:  { type: synthetic_regression, with: { in_dim: 8, out_dim: 1, batch: 64, hidden: 32, noise: 0.01 } }
  model: { type: mlp, with: { in_dim: 8, hidden: 32, layers: 2, out_dim: 1, activation: relu } }
  loss:  { type: mse_loss }
  fb:    { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
)";
  if (with_sync)
    g += "  sync:  { type: allreduce, in: { ready: fb.ready }, with: { bucket_mb: 0.002, first_bucket_mb: 0.0005 } }\n";
  g += std::string("  opt:   { type: optimizer, in: { grads: ") + (with_sync ? "sync" : "fb") +
       R"(.grads, model: model.params },
           with: { kind: adamw, lr: 1.0e-2, weight_decay: 0.01, clip: 1.0 } }
  log:   { type: metrics, in: { loss: fb.loss, grad_norm: opt.grad_norm } }
)";
  return g;
}

std::map<std::string, torch::Tensor> train(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  auto g = test::load_graph_text(yaml, overrides);
  g->run();
  EXPECT_EQ(g->metrics().size(), 20u);
  return test::snapshot(g->state<ModelState>("model", "params"));
}

void expect_identical(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b,
                      const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [k, v] : a) EXPECT_TRUE(torch::equal(v, b.at(k))) << what << ": " << k;
}

TEST(AllreduceNode, OneProcessTrainsExactlyLikeNoSync) {
  ASSERT_EQ(comm::size(), 1);
  const auto want = train(regression(false));
  const auto start = test::snapshot(test::load_graph_text(regression(false))->state<ModelState>("model", "params"));
  bool moved = false;
  for (const auto& [k, v] : want) moved = moved || !torch::equal(v, start.at(k));
  ASSERT_TRUE(moved) << "the parameters did not change in 20 steps";
  expect_identical(train(regression(true)), want, "overlap");
  expect_identical(train(regression(true), {"sync.overlap=false"}), want, "overlap=false");
  expect_identical(train(regression(true), {"sync.compress=bf16"}), want, "compress=bf16");
  expect_identical(train(regression(true), {"sync.bucket_mb=25", "sync.first_bucket_mb=1"}), want, "default buckets");
  // With micro-batches, only the last one's backward feeds the stream.
  expect_identical(train(regression(true), {"fb.accumulate=3"}), train(regression(false), {"fb.accumulate=3"}),
                   "accumulate=3");
  // Fresh grads (no buffer in one process: the items carry autograd's own tensors) train the same.
  for (const char* layout : {"fb.grad_layout=fresh", "fb.grad_layout=buffer"}) {
    expect_identical(train(regression(true), {layout}), want, layout);
    expect_identical(train(regression(true), {layout, "fb.accumulate=3"}), train(regression(false), {"fb.accumulate=3"}),
                     std::string(layout) + ", accumulate=3");
  }
}

TEST(AllreduceNode, LoggedLossesMatchThroughRunGraphText) {
  // The same comparison through test::run_graph_text: every logged loss and grad norm equal.
  test::RunResult a = test::run_graph_text(regression(false));
  test::RunResult b = test::run_graph_text(regression(true), {"sync.overlap=false"});
  ASSERT_EQ(a.metrics.size(), 20u);
  ASSERT_EQ(b.metrics.size(), 20u);
  for (size_t i = 0; i < a.metrics.size(); ++i) {
    EXPECT_EQ(a.metrics[i]["loss"].get<double>(), b.metrics[i]["loss"].get<double>()) << i;
    EXPECT_EQ(a.metrics[i]["grad_norm"].get<double>(), b.metrics[i]["grad_norm"].get<double>()) << i;
  }
}

// Test-only node types: a model with a parameter the loss never uses, a probe that remembers
// which grads were defined, and a `ready` source that sends too few items.
struct UnusedNet : torch::nn::Module {
  torch::nn::Linear l1{nullptr}, l2{nullptr};
  torch::Tensor unused;
  explicit UnusedNet(int64_t in) {
    torch::manual_seed(0);
    l1 = register_module("l1", torch::nn::Linear(in, 5));
    unused = register_parameter("unused", torch::full({4}, 0.5));
    l2 = register_module("l2", torch::nn::Linear(5, 1));
  }
};

class UnusedModelNode : public Node {
 public:
  void setup(SetupContext& c) override {
    auto net = std::make_shared<UnusedNet>(c.params().get<int64_t>("in_dim"));
    auto fwd = [](torch::nn::Module& m, const TensorMap& b) {
      auto& n = static_cast<UnusedNet&>(m);
      return n.l2->forward(torch::tanh(n.l1->forward(b.at("x"))));
    };
    c.own_state("params", std::make_shared<ModelState>(net, fwd, "unused_net"));
  }
  void run(StepContext&) override {}
};

struct GradsSeen {
  std::vector<bool> a_defined, b_defined;
  bool equal = true;
};
std::mutex probe_mu;
std::map<int64_t, GradsSeen> probe_seen;

class GradsProbeNode : public Node {
 public:
  void run(StepContext& c) override {
    const Grads& a = c.in<Grads>("a");
    const Grads& b = c.in<Grads>("b");
    GradsSeen s;
    for (size_t i = 0; i < a.size(); ++i) {
      s.a_defined.push_back(a[i].defined());
      s.b_defined.push_back(i < b.size() && b[i].defined());
      if (i < b.size() && a[i].defined() && b[i].defined()) s.equal = s.equal && torch::equal(a[i], b[i]);
    }
    s.equal = s.equal && a.size() == b.size();
    std::lock_guard<std::mutex> l(probe_mu);
    probe_seen[c.step()] = s;
  }
};

class ShortReadyNode : public Node {
 public:
  void run(StepContext& c) override {
    auto params = c.state_as<ModelState>("model").trainable_parameters();
    auto buffer = GradBuffer::make(params);
    const int n = static_cast<int>(params.size());
    c.emit("ready", GradReady{0, true, buffer, buffer->views[0]}, 0, n);  // one item of n
  }
};

void register_types() {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry& r = Registry::global();
    r.add(R"(type: t_unused_model
doc: a two-layer model with a parameter its forward never uses
outputs: { params: { kind: state, access: none, type: params, doc: the model } }
params: { in_dim: { type: int, default: 3, doc: inputs } })",
          [] { return std::make_unique<UnusedModelNode>(); }, "tests");
    r.add(R"(type: t_grads_probe
doc: remembers which grads were defined, and whether two grads inputs agree
inputs:
  a: { kind: value, type: grads, doc: grads }
  b: { kind: value, type: grads, doc: grads })",
          [] { return std::make_unique<GradsProbeNode>(); }, "tests");
    r.add(R"(type: t_short_ready
doc: sends one GradReady item where the model has more parameters
inputs: { model: { kind: state, access: read, type: params, doc: the model } }
outputs: { ready: { kind: stream, type: grad_ready, doc: items } })",
          [] { return std::make_unique<ShortReadyNode>(); }, "tests");
  });
}

TEST(AllreduceNode, ParameterUnusedEverywhereStaysUndefined) {
  register_types();
  {
    std::lock_guard<std::mutex> l(probe_mu);
    probe_seen.clear();
  }
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 3, seed: 2 }
nodes:
  data:  { type: synthetic_regression, with: { in_dim: 3, batch: 8 } }
  model: { type: t_unused_model, with: { in_dim: 3 } }
  loss:  { type: mse_loss }
  fb:    { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  sync:  { type: allreduce, in: { ready: fb.ready }, with: { bucket_mb: 0.00001, first_bucket_mb: 0.00001 } }
  probe: { type: t_grads_probe, in: { a: fb.grads, b: sync.grads } }
  opt:   { type: optimizer, in: { grads: sync.grads, model: model.params }, with: { kind: sgd, lr: 0.1 } }
)");
  g->run();
  std::lock_guard<std::mutex> l(probe_mu);
  ASSERT_EQ(probe_seen.size(), 3u);
  // Defined for every parameter but `unused`.
  std::vector<bool> want;
  for (const auto& [k, v] : g->state<ModelState>("model", "params").named_parameters(true)) want.push_back(k != "unused");
  ASSERT_EQ(want.size(), 5u);
  for (const auto& [step, s] : probe_seen) {
    EXPECT_EQ(s.a_defined, want) << "fb.grads, step " << step;
    EXPECT_EQ(s.b_defined, want) << "sync.grads, step " << step;
    EXPECT_TRUE(s.equal) << step;
  }
  // The optimizer skipped it.
  auto named = g->state<ModelState>("model", "params").named_parameters();
  for (const auto& [k, v] : named)
    if (k == "unused") EXPECT_TRUE(torch::equal(v, torch::full({4}, 0.5))) << k;
}

TEST(AllreduceNode, TooFewItemsIsAClearError) {
  register_types();
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 1, seed: 2 }
nodes:
  model: { type: t_unused_model }
  src:   { type: t_short_ready, in: { model: model.params } }
  sync:  { type: allreduce, in: { ready: src.ready } }
)");
  try {
    g->run();
    FAIL() << "no error";
  } catch (const std::exception& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("node 'sync' (allreduce)"), std::string::npos) << m;
    EXPECT_NE(m.find("got 1 items on 'ready' for 5 trainable parameters"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace flowrun
