// The node API: what a node type implements and what the engine gives it.
//
// A node is created once per graph node, set up once (in file order, so the state of earlier
// nodes already exists), then run once per step on which it is active. The executor decides
// when; a node never waits on another node itself.
//
//   class Scale : public flowrun::Node {
//     double k_;
//    public:
//     void setup(flowrun::SetupContext& c) override { k_ = c.params().get<double>("k"); }
//     void run(flowrun::StepContext& c) override {
//       c.out("y", c.in<torch::Tensor>("x") * k_);
//     }
//   };
//   FLOWRUN_NODE(scale, Scale)   // schema: schemas/scale.yaml
#pragma once
#include <yaml-cpp/yaml.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "device_streams.hpp"
#include "schema.hpp"
#include "spec.hpp"
#include "value.hpp"

namespace flowrun {

struct GraphSpec;
struct NodeSpec;

// A node's parameters (its `with:` after checking, defaults filled in).
class Params {
 public:
  Params() = default;
  Params(YAML::Node n, std::string node_name, std::string prefix = "")
      : n_(std::move(n)), node_(std::move(node_name)), prefix_(std::move(prefix)) {}
  bool has(const std::string& key) const { return n_[key] && !n_[key].IsNull(); }
  template <class T>
  T get(const std::string& key) const {
    YAML::Node v = n_[key];
    if (!v || v.IsNull()) throw std::runtime_error("node '" + node_ + "': parameter '" + prefix_ + key + "' is not set");
    try {
      return v.as<T>();
    } catch (const YAML::Exception& e) {
      throw std::runtime_error("node '" + node_ + "': parameter '" + prefix_ + key + "': " + e.what());
    }
  }
  // A map parameter's fields (a schema `fields:` group, e.g. the dit's lora), read with the same
  // errors, naming the field by its path ("lora.rank").
  Params sub(const std::string& key) const { return Params(n_[key], node_, prefix_ + key + "."); }
  template <class T>
  T get(const std::string& key, T fallback) const { return has(key) ? get<T>(key) : fallback; }
  // Several parameters of one type into the fields of a config, in one statement:
  //   p.read<int64_t>({{"vocab", &c.vocab}, {"dim", &c.dim}, {"layers", &c.layers}});
  template <class T>
  void read(std::initializer_list<std::pair<const char*, T*>> fields) const {
    for (const auto& [key, to] : fields) *to = get<T>(key);
  }
  YAML::Node node() const { return n_; }
  YAML::Node operator[](const std::string& key) const { return n_[key]; }

 private:
  YAML::Node n_;
  std::string node_, prefix_;
};

// What every context knows: which node, the run's settings, where to write.
struct RunInfo {
  const GraphSpec* graph = nullptr;
  std::string out_dir;
  int64_t first_step = 1;  // first step this process runs (> 1 after resume)
  int64_t last_step = 0;   // run.steps
  uint64_t seed = 0;
  int log_every = 10;
  int rank = 0, world = 1;
  // run.device as written (auto, cpu, cuda, cuda:N); nodes place tensors with
  // flowrun::run_device() (nodes/common/device.hpp), which resolves it.
  std::string device = "auto";
};

class NodeRuntime;  // executor-side state of one node (hidden)

class ContextBase {
 public:
  const std::string& name() const;
  const std::string& type() const;
  const Params& params() const;
  const RunInfo& run() const;
  // "node 'opt' (optimizer)", for messages.
  std::string who() const;
  // The node's schedule (every / at); !periodic() for a node that runs every step.
  const Schedule& schedule() const;

 protected:
  explicit ContextBase(NodeRuntime* rt) : rt_(rt) {}
  NodeRuntime* rt_;
};

class SetupContext : public ContextBase {
 public:
  explicit SetupContext(NodeRuntime* rt) : ContextBase(rt) {}
  // Create the object behind one of this node's state output ports.
  void own_state(const std::string& port, Value v);
  // The object behind a state input port (created by an earlier node's setup); it may be kept,
  // but touched only inside run(), where the executor orders the accesses.
  Value& state(const std::string& port);
  template <class T>
  T& state_as(const std::string& port) { return *state(port).as<std::shared_ptr<T>>(what(port)); }
  // A `many` state input: the state objects, in the order written; and the refs as written.
  std::vector<Value*> states_all(const std::string& port);
  std::vector<std::string> refs(const std::string& port) const;
  bool connected(const std::string& port) const;
  // Names of the connected input ports (for wildcard "*" ports), in file order.
  std::vector<std::string> input_ports() const;
  // Names of the value outputs, sorted: the schema's named ones, and for a "*" output the
  // names other nodes read from it (out() under any other name is dropped).
  std::vector<std::string> value_outputs() const;
  // The state `state_port` of the node that feeds value input `value_port` (its first ref),
  // for a check at setup that needs what made the values (an encoder's embedding against the
  // tokenizer's vocabulary). Read-only, and only here; nullptr when the input is not connected,
  // or its producer owns no such state or has not created it.
  const Value* producer_state(const std::string& value_port, const std::string& state_port) const;

 private:
  std::string what(const std::string& port) const;
};

class StepContext : public ContextBase {
 public:
  StepContext(NodeRuntime* rt, int64_t step, void* frame) : ContextBase(rt), step_(step), frame_(frame) {}
  int64_t step() const { return step_; }  // 1-based

  // Value inputs produced this step.
  const Value& in(const std::string& port) const;
  template <class T>
  const T& in(const std::string& port) const { return in(port).as<T>(what(port)); }
  // A `many` input: one value per ref, in the order written. For a state port these are the
  // state objects (under the port's access).
  std::vector<const Value*> in_all(const std::string& port) const;
  std::vector<Value*> states_all(const std::string& port);
  // The refs an input names, as written ("model.params"), in order.
  std::vector<std::string> refs(const std::string& port) const;
  bool connected(const std::string& port) const;
  std::vector<std::string> input_ports() const;

  // State inputs and owned state outputs, under the access the schema declared.
  Value& state(const std::string& port);
  template <class T>
  T& state_as(const std::string& port) { return *state(port).as<std::shared_ptr<T>>(what(port)); }

  // Value outputs: set once per step.
  void out(const std::string& port, Value v);
  // Stream outputs: item `index` of `count`; consumers receive it while this node still runs.
  void emit(const std::string& port, Value v, int index, int count);

  // Device streams (device_streams.hpp; on CUDA, or the CPU test double): the kernels a node
  // launches in run() are only queued on its stream, and the executor orders streams for it.
  // A node that reads a value input's contents on the host (a loss for a log line) calls
  // sync(port) first: the host waits for that input's producer, and only then. Without
  // device streams (CPU) both are no-ops: sync returns at once, record returns nullptr.
  void sync(const std::string& port) const;
  // An event after the work this node queued so far (e.g. copies a background writer waits
  // for with DeviceEvent::synchronize()).
  std::shared_ptr<DeviceEvent> record() const;

  // Executor trace: record a sub-span of this node's step (e.g. "bucket 3"), by steady_clock
  // times (work done on another thread, like a collective on the communication thread).
  void trace_mark(const std::string& what, std::chrono::steady_clock::time_point t0,
                  std::chrono::steady_clock::time_point t1) const;

 private:
  std::string what(const std::string& port) const;
  int64_t step_;
  void* frame_;
};

class Node {
 public:
  virtual ~Node() = default;
  virtual void setup(SetupContext&) {}
  virtual void run(StepContext& ctx) = 0;
  // One item of a stream input; called in arrival order, serially, after the node's other
  // inputs of that step are ready and before run(), which is called once all items arrived.
  virtual void on_item(StepContext&, const std::string& /*port*/, const Value&, int /*index*/, int /*count*/) {}
  // After the last step (also after a stop): flush and join background work.
  virtual void finish(ContextBase&) {}
};

using NodeFactory = std::function<std::unique_ptr<Node>()>;

// The seed of a node whose schema has a nullable `seed` parameter: its value, or run.seed when
// it is null (the schemas say so: "null: run.seed").
inline uint64_t node_seed(const ContextBase& ctx) {
  return ctx.params().has("seed") ? ctx.params().get<uint64_t>("seed") : ctx.run().seed;
}

}  // namespace flowrun
