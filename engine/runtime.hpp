// Executor-side state of one graph node: its Node object and how its ports are bound to
// frame slots (values), state objects and stream consumers. Internal to engine/.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "device_streams.hpp"
#include "node.hpp"
#include "spec.hpp"

namespace flowrun {

class Tracer;

struct InputBinding {
  std::string port;
  PortKind kind = PortKind::Value;
  Access access = Access::None;
  std::vector<int> producers;  // node index per ref
  std::vector<int> slots;      // value: frame slot per ref; state: state id per ref
  std::vector<std::string> refs;  // "node.port" per ref, as written
};

// With device streams (device_streams.hpp): the event a node instance recorded on its stream
// when its run() returned. Made when the instance is admitted, set once before the instances
// that wait for it are released, kept alive by them (a retired step's event may still be
// waited on by a later step's consumer).
struct Recorded {
  int stream = -1;
  std::shared_ptr<DeviceEvent> event;  // null until run() returned (or if it threw)
};

// Per-step values, indexed by slot (one per value output port of the graph), and, with
// device streams, each node's Recorded of this step (by node index).
struct Frame {
  std::vector<Value> values;
  std::vector<std::shared_ptr<Recorded>> recorded;
};

class ExecutorCore;

class NodeRuntime {
 public:
  int index = -1;
  const NodeSpec* spec = nullptr;
  const NodeSchema* schema = nullptr;
  std::unique_ptr<Node> node;
  Params params;
  const RunInfo* info = nullptr;
  std::string who;  // "node 'opt' (optimizer)"
  bool stateless = false;
  bool compute = false;  // schema `compute: true`: runs on the compute thread when there is one
  bool communicates = false;  // made a communication channel in setup(): waits on other ranks in run()
  bool has_stream_inputs = false;
  DeviceStreams* streams = nullptr;  // set for a run with device streams (RunOptions::streams)
  int stream = -1;                   // this node's stream id there

  std::vector<InputBinding> inputs;
  std::map<std::string, int> out_slot;     // value output port -> frame slot
  std::map<std::string, int> owned_state;  // state output port -> state id
  std::map<std::string, Access> owned_access;
  std::map<std::string, std::vector<std::pair<int, std::string>>> stream_consumers;  // port -> (node, their port)
  std::vector<Value>* states = nullptr;
  ExecutorCore* core = nullptr;
  Tracer* tracer = nullptr;

  const InputBinding* input(const std::string& port) const {
    for (const auto& b : inputs)
      if (b.port == port) return &b;
    return nullptr;
  }
};

// What StepContext needs from the executor (stream delivery).
class ExecutorCore {
 public:
  virtual ~ExecutorCore() = default;
  virtual void deliver_item(int producer, int64_t step, const std::string& port, Value v, int index, int count) = 0;
  // Node `node`'s state output `port` (nullptr if it owns none of that name).
  virtual Value* owned_state(int node, const std::string& port) = 0;
};

}  // namespace flowrun
