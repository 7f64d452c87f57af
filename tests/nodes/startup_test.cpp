// startup (nodes/comm/startup.cpp): before step 1 of a multi-process run, every state with a
// StateIO is checked to have the same tensor names, dtypes and shapes on every rank, then
// broadcast from rank 0. Here, in a single process: the descriptor that is compared, and that
// the whole sync leaves every state exactly as it was (same values, same storage). The
// multi-rank paths (mismatch error, broadcast, load) need processes started by mpirun.
#include <gtest/gtest.h>

#include "comm.hpp"
#include "comm/startup.hpp"
#include "comm/state_descriptor.hpp"
#include "common/state_io.hpp"
#include "data/cursor.hpp"
#include "node_test_helpers.hpp"
#include "train/optimizer.hpp"

namespace flowrun {
namespace {

// ---- the descriptor ------------------------------------------------------------------------

TEST(StateDescriptor, NamesDtypesAndShapesInNameOrder) {
  const NamedTensors t = {{"b", torch::zeros({2, 3})}, {"a", torch::tensor(int64_t{5})}, {"c", torch::Tensor()}};
  EXPECT_EQ(describe_tensors(t), "a Long []\nb Float [2, 3]\nc undefined\n");
  EXPECT_EQ(describe_tensors({}), "");
}

TEST(StateDescriptor, ValuesAndDevicesDoNotCountShapesDtypesAndNamesDo) {
  const std::string base = describe_tensors({{"w", torch::zeros({4, 2})}});
  EXPECT_EQ(descriptor_hash(describe_tensors({{"w", torch::randn({4, 2})}})), descriptor_hash(base));
  // A transposed (non-contiguous) view of the same shape is the same description.
  EXPECT_EQ(describe_tensors({{"w", torch::zeros({2, 4}).t()}}), base);
  for (const NamedTensors& other : {NamedTensors{{"w", torch::zeros({2, 4})}}, NamedTensors{{"w", torch::zeros({4, 2}, torch::kDouble)}},
                                    NamedTensors{{"v", torch::zeros({4, 2})}},
                                    NamedTensors{{"w", torch::zeros({4, 2})}, {"x", torch::zeros({1})}}})
    EXPECT_NE(descriptor_hash(describe_tensors(other)), descriptor_hash(base)) << describe_tensors(other);
  // FNV-1a 64 (the same number on every machine): the empty string is the offset basis, and
  // "a" the reference implementation's test vector.
  EXPECT_EQ(descriptor_hash(""), 14695981039346656037ull);
  EXPECT_EQ(descriptor_hash("a"), 0xaf63dc4c8601ec8cull);
}

TEST(StateDescriptor, FirstDifferenceNamesTheTensor) {
  const std::string r0 = describe_tensors({{"a", torch::zeros({1})}, {"w", torch::zeros({8, 4})}});
  EXPECT_EQ(first_difference(r0, r0), "");
  EXPECT_EQ(first_difference(r0, describe_tensors({{"a", torch::zeros({1})}, {"w", torch::zeros({16, 4})}})),
            "rank 0 has 'w Float [8, 4]' where this rank has 'w Float [16, 4]'");
  EXPECT_EQ(first_difference(r0, describe_tensors({{"a", torch::zeros({1})}})),
            "rank 0 has 'w Float [8, 4]' where this rank has nothing more");
}

// ---- the sync, in one process --------------------------------------------------------------

// A node owning a state no StateIO knows (like a Dataset): the sync must pass over it.
class OpaqueStateNode : public Node {
 public:
  void setup(SetupContext& c) override { c.own_state("thing", std::make_shared<int>(42)); }
  void run(StepContext&) override {}
};

void register_opaque_state() {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry::global().add(R"(type: t_opaque_state
doc: owns a state without a StateIO
outputs: { thing: { kind: state, access: none, type: any, doc: an int } })",
                           [] { return std::make_unique<OpaqueStateNode>(); }, "tests");
  });
}

const char* kGraph = R"(
flowrun: 1
run: { steps: 3, seed: 4 }
nodes:
  data: { type: synthetic_regression, with: { in_dim: 4, batch: 8 } }
  other: { type: t_opaque_state }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 1 } }
  loss: { type: mse_loss }
  fb: { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  opt: { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { lr: 0.01 } }
  ema: { type: ema, in: { model: model.params }, with: { decay: 0.5 } }
)";

// Every StateIO state of the graph: ref -> (clones of its tensors, their storage pointers).
struct Seen {
  std::map<std::string, NamedTensors> values;
  std::map<std::string, std::map<std::string, const void*>> storage;
};

Seen look(test::GraphRun& g) {
  Seen s;
  for (const auto& [node, port] : std::vector<std::pair<std::string, std::string>>{
           {"data", "cursor"}, {"model", "params"}, {"opt", "state"}, {"ema", "params"}}) {
    Value& v = g.ex->state(node, port);
    const StateIO* io = find_state_io(v);
    if (!io) throw std::runtime_error(node + "." + port + ": no StateIO");
    for (const auto& [k, t] : io->tensors(v)) {
      s.values[node + "." + port][k] = t.detach().clone();
      s.storage[node + "." + port][k] = t.data_ptr();
    }
  }
  return s;
}

void expect_same(const Seen& before, const Seen& after, bool same_storage) {
  ASSERT_EQ(before.values.size(), after.values.size());
  for (const auto& [ref, tensors] : before.values) {
    const NamedTensors& now = after.values.at(ref);
    ASSERT_EQ(describe_tensors(now), describe_tensors(tensors)) << ref;
    for (const auto& [k, t] : tensors) {
      EXPECT_TRUE(torch::equal(now.at(k), t)) << ref << " " << k;
      if (same_storage && ref != "data.cursor" && k.find("step") == std::string::npos && k != "updates")
        EXPECT_EQ(after.storage.at(ref).at(k), before.storage.at(ref).at(k)) << ref << " " << k << ": replaced";
    }
  }
}

TEST(StartupSync, OneProcessLeavesEveryStateAsItWas) {
  ASSERT_EQ(comm::size(), 1);
  register_opaque_state();
  auto ch = comm::Channel::create("startup");
  auto g = test::load_graph_text(kGraph);
  // Right after setup (what the CLI does) ...
  Seen before = look(*g);
  sync_start_state(*g->ex, *g->spec, *ch);
  expect_same(before, look(*g), /*same_storage=*/true);
  EXPECT_EQ(*g->ex->state("other", "thing").as<std::shared_ptr<int>>("other.thing"), 42);
  // ... and with optimizer moments, EMA weights and a cursor that moved.
  g->run();
  EXPECT_EQ(g->state<DataCursor>("data", "cursor").batches, 3);
  ASSERT_FALSE(g->state<OptimizerState>("opt", "state").slots.empty());
  before = look(*g);
  sync_start_state(*g->ex, *g->spec, *ch);
  expect_same(before, look(*g), /*same_storage=*/true);
}

TEST(StartupSync, OptimizerMomentsPendingAfterAResumeAreKept) {
  // After a resume, the optimizer holds the restored moments pending until its first update
  // (a whole state: a partial one is refused): the sync must not drop them.
  register_opaque_state();
  auto ch = comm::Channel::create("startup");
  auto g = test::load_graph_text(kGraph);
  OptimizerState& st = g->state<OptimizerState>("opt", "state");
  std::map<std::string, torch::Tensor> saved;
  for (const auto& [name, shape] : st.expected)
    saved[name] = shape.empty() ? torch::tensor(int64_t{7}) : torch::ones(shape);
  st.load(saved);
  sync_start_state(*g->ex, *g->spec, *ch);
  EXPECT_EQ(st.updates, 7);
  ASSERT_EQ(st.pending.count("0.weight.exp_avg"), 1u);
  EXPECT_TRUE(torch::equal(st.pending.at("0.weight.exp_avg"), torch::ones({8, 4})));
}

}  // namespace
}  // namespace flowrun
