// Helpers for the node tests (tests/nodes/*_test.cpp): run a graph given as YAML text and keep
// its executor, so a test can look at the state objects afterwards; and a few test-only node
// types that poke at models (never built-ins).
//   t_set_params   writes model: fills every trainable parameter with `value` each step
//   t_zero_grads   reads model; outputs grads: zeros shaped like the trainable parameters
//   t_batch_probe  reads a batch; remembers each step's batch (BatchProbe::seen)
//   t_scalars      outputs d: double, i: int64, t: 0-d float tensor, ti: 0-d int64 tensor, v: [2] tensor,
//                  n: NamedScalars
// And models small enough to check by hand: bigram_model (next-token logits = a row of a
// [vocab, vocab] table).
#pragma once
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/grads.hpp"
#include "common/seed.hpp"
#include "common/named_scalars.hpp"
#include "common/tensor_map.hpp"
#include "executor.hpp"
#include "models/model_state.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "support/run_graph.hpp"

namespace flowrun::test {

struct BatchProbe {
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::map<int64_t, TensorMap>& seen() {
    static std::map<int64_t, TensorMap> s;
    return s;
  }
};

namespace detail {

class SetParams : public Node {
  double value_ = 0;

 public:
  void setup(SetupContext& c) override { value_ = c.params().get<double>("value"); }
  void run(StepContext& c) override {
    torch::NoGradGuard no_grad;
    for (auto& p : c.state_as<ModelState>("model").trainable_parameters()) p.fill_(value_);
  }
};

class ZeroGrads : public Node {
 public:
  void run(StepContext& c) override {
    Grads g;
    for (const auto& p : c.state_as<ModelState>("model").trainable_parameters()) g.push_back(torch::zeros_like(p));
    c.out("grads", std::move(g));
  }
};

class ProbeBatch : public Node {
 public:
  void run(StepContext& c) override {
    std::lock_guard<std::mutex> l(BatchProbe::mu());
    BatchProbe::seen()[c.step()] = c.in<TensorMap>("batch");
  }
};

class Scalars : public Node {
 public:
  void run(StepContext& c) override {
    const int64_t s = c.step();
    c.out("d", 1.5 * static_cast<double>(s));
    c.out("i", s);
    c.out("t", torch::tensor(0.25f * static_cast<float>(s)));
    c.out("ti", torch::tensor(s * 10, torch::kInt64));
    c.out("v", torch::ones({2}));
    c.out("n", NamedScalars{{"first", 0.5 * static_cast<double>(s)}, {"a b/c", -static_cast<double>(s)}});
  }
};

// Its `captions` every step (port type text, as an image data node's), "{step}" in a caption
// replaced by the step: the tokenizer and text encoder graphs' source.
class Captions : public Node {
 public:
  void setup(SetupContext& c) override { captions_ = c.params().get<std::vector<std::string>>("captions"); }
  void run(StepContext& c) override {
    std::vector<std::string> out = captions_;
    for (std::string& s : out)
      for (size_t at; (at = s.find("{step}")) != std::string::npos;) s.replace(at, 6, std::to_string(c.step()));
    c.out("text", std::move(out));
  }

 private:
  std::vector<std::string> captions_;
};

}  // namespace detail

inline void register_node_test_types() {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry& r = Registry::global();
    r.add(R"(type: t_set_params
doc: fills every trainable parameter of a model with a value, every step
inputs: { model: { kind: state, access: write, type: params, doc: the model } }
params: { value: { type: float, default: 0.0, doc: the value } })",
          [] { return std::make_unique<detail::SetParams>(); }, "tests");
    r.add(R"(type: t_zero_grads
doc: zero gradients shaped like a model's trainable parameters
inputs: { model: { kind: state, access: read, type: params, doc: the model } }
outputs: { grads: { kind: value, type: grads, doc: zeros } })",
          [] { return std::make_unique<detail::ZeroGrads>(); }, "tests");
    r.add(R"(type: t_batch_probe
doc: remembers every batch it sees
inputs: { batch: { kind: value, type: batch, doc: the batch } })",
          [] { return std::make_unique<detail::ProbeBatch>(); }, "tests");
    r.add(R"(type: t_scalars
doc: scalars of several C++ types
outputs:
  d: { kind: value, type: scalar, doc: double }
  i: { kind: value, type: scalar, doc: int64 }
  t: { kind: value, type: scalar, doc: 0-d float tensor }
  ti: { kind: value, type: scalar, doc: 0-d int64 tensor }
  v: { kind: value, type: tensor, doc: a tensor of 2 elements }
  n: { kind: value, type: scalars, doc: "NamedScalars first = step / 2, 'a b/c' = -step" })",
          [] { return std::make_unique<detail::Scalars>(); }, "tests");
    r.add(R"(type: t_captions
doc: the same captions every step ("{step}" in one becomes the step)
outputs: { text: { kind: value, type: text, doc: "std::vector<std::string>, one per row" } }
params: { captions: { type: list, items: { type: string }, required: true, doc: the captions } })",
          [] { return std::make_unique<detail::Captions>(); }, "tests");
  });
}

// A graph loaded from YAML text with its executor (every node's setup() done), in a fresh
// temporary folder; run() runs it; state<T>() reads an owned state object afterwards.
struct GraphRun {
  std::string dir, out_dir;
  std::unique_ptr<GraphSpec> spec;
  std::unique_ptr<Executor> ex;
  RunStats stats;

  void run() {
    stats = ex->run(run_options(*spec));
  }
  template <class T>
  T& state(const std::string& node, const std::string& port) {
    return *ex->state(node, port).as<std::shared_ptr<T>>(node + "." + port);
  }
  std::vector<nlohmann::json> metrics() const { return read_jsonl(out_dir + "/metrics.jsonl"); }
};

// The graph as rank `rank` of `world` whose run starts at `first_step` (a resumed run), with
// run.out_dir in a fresh temporary folder and the progress line off.
inline std::unique_ptr<GraphRun> load_graph_at(const std::string& yaml, int rank = 0, int world = 1,
                                               int64_t first_step = 1, const std::vector<std::string>& overrides = {}) {
  register_node_test_types();
  auto r = std::make_unique<GraphRun>();
  r->dir = temp_dir("nodes");
  const std::string file = r->dir + "/graph.yaml";
  std::ofstream(file) << yaml;
  std::vector<std::string> ov = {"run.out_dir=" + r->dir + "/out", "run.progress=off"};
  ov.insert(ov.end(), overrides.begin(), overrides.end());
  r->spec = std::make_unique<GraphSpec>(load_graph(file, ov, Registry::global()));
  RunInfo info = run_info(*r->spec);
  info.first_step = first_step;
  info.rank = rank, info.world = world;
  r->out_dir = info.out_dir;
  r->ex = std::make_unique<Executor>(*r->spec, Registry::global(), info);
  return r;
}

inline std::unique_ptr<GraphRun> load_graph_text(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  return load_graph_at(yaml, 0, 1, 1, overrides);
}

// Run the graph and return the batches its t_batch_probe saw, by step.
// The error loading `yaml` ends in (load_graph_text: check and set up), or "no error".
inline std::string graph_error(const std::string& yaml) {
  try {
    load_graph_text(yaml);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

inline std::map<int64_t, TensorMap> run_and_probe(GraphRun& g) {
  {
    std::lock_guard<std::mutex> l(BatchProbe::mu());
    BatchProbe::seen().clear();
  }
  g.run();
  std::lock_guard<std::mutex> l(BatchProbe::mu());
  return BatchProbe::seen();
}

// Read a file of the source tree (graphs/..., schemas/...).
inline std::string source_file(const std::string& rel) {
  std::ifstream in(std::string(FLOWRUN_SOURCE_DIR) + "/" + rel);
  if (!in) throw std::runtime_error("cannot read " + rel);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Copies of a model's parameters by name.
// A bigram language model: the logits of each batch "tokens" row's next token are the row of a
// seeded random [vocab, vocab] table (its one parameter, "table") at the token.
inline std::shared_ptr<ModelState> bigram_model(int64_t vocab, uint64_t seed = 7) {
  auto m = std::make_shared<torch::nn::Module>();
  at::Generator g = make_cpu_generator(seed);
  m->register_parameter("table", torch::randn({vocab, vocab}, g));
  return std::make_shared<ModelState>(
      m,
      [](torch::nn::Module& mod, const TensorMap& b) {
        const torch::Tensor& tok = b.at("tokens");
        return torch::embedding(mod.named_parameters()["table"], tok.narrow(1, 0, tok.size(1) - 1));
      },
      "bigram");
}

inline std::map<std::string, torch::Tensor> snapshot(const ModelState& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [k, v] : m.named_parameters()) out[k] = v.detach().clone();
  return out;
}

// A module's parameters by name, copied.
inline std::map<std::string, torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : m.named_parameters(true)) out[item.key()] = item.value().detach().clone();
  return out;
}

}  // namespace flowrun::test
