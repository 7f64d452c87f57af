// StateIO: how checkpoint and resume save and restore a state object they know nothing about.
// A Value holds its object by exact type (std::shared_ptr<ModelState>, ...), so each state type
// registers how to list its tensors by name and how to load them back, keyed by that type.
// Every state type registers itself where it is defined, with FLOWRUN_STATE_TYPE(MyState) in a
// .cpp file (MyState needs tensors() and load(map)): models/model_state.cpp, data/cursor.cpp,
// train/optimizer.cpp; a plugin's state type the same way.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <typeindex>
#include <vector>

#include <torch/torch.h>

#include "parallel/placement.hpp"  // TensorPiece
#include "registry.hpp"  // FLOWRUN_CONCAT
#include "value.hpp"

namespace flowrun {

using NamedTensors = std::map<std::string, torch::Tensor>;

// Where a load reads the tensors of one state (a checkpoint's: state/checkpoint_read.hpp), by
// their whole names: only the boxes asked for are read.
class StateSource {
 public:
  virtual ~StateSource() = default;
  virtual std::vector<std::string> names() const = 0;
  virtual bool has(const std::string& name) const = 0;
  // The whole tensor's shape and dtype (an error naming the tensor and `where()` if absent).
  virtual std::vector<int64_t> shape(const std::string& name) const = 0;
  virtual torch::ScalarType dtype(const std::string& name) const = 0;
  // `into` (its sizes: the box's; any dtype and device: converted) filled with the box at
  // `offsets` of tensor `name`.
  virtual void read(const std::string& name, const std::vector<int64_t>& offsets, torch::Tensor into) const = 0;
  torch::Tensor whole(const std::string& name) const {
    torch::Tensor t = torch::empty(shape(name), torch::TensorOptions().dtype(dtype(name)));
    read(name, std::vector<int64_t>(static_cast<size_t>(t.dim()), 0), t);
    return t;
  }
  // The file or folder, for messages.
  virtual std::string where() const = 0;
};

namespace parallel {
class Group;
}

struct StateIO {
  std::function<NamedTensors(const Value&)> tensors;            // aliases of the live tensors
  std::function<void(Value&, const NamedTensors&)> load;         // copy values in
  // Optional, for a state the ranks hold pieces of (a sharded optimizer state, a model split over
  // tp): gather it so that tensors() lists it whole on the writer (rank 0 of the run). Only for
  // exports: a checkpoint with exports: true calls it, on every state it saves, so that what a
  // model exports (a PEFT or Hugging Face folder) is whole; its own files are each rank's pieces
  // (below), never gathered. Collective: the checkpoint node calls it on every rank first, with
  // its own channels (the groups its schema declares).
  struct Groups {
    bool writer;             // this rank is rank 0 of the run: it keeps what is gathered
    parallel::Group& dp;     // this rank's data-parallel ranks (what ZeRO shards over; all of them when tp is 1)
    parallel::Group* tp = nullptr;  // this rank's tensor-parallel ranks (run.parallel.tp > 1), else null
    parallel::Group* pp = nullptr;  // this rank's pipeline stages (run.parallel.pp > 1), else null
    parallel::Group* ep = nullptr;  // this rank's expert-parallel ranks (run.parallel.ep > 1), else null
  };
  std::function<void(Value&, const Groups&)> collect;
  // Optional, with collect: let go of what it gathered, once the exporters copied it (whole
  // tensors the writer would otherwise hold until the next checkpoint).
  std::function<void(Value&)> release;
  // Optional: true when the ranks hold different parts of this state (a model split over tensor
  // parallel, cut into pipeline stages): the start-up sync compares its shapes (under pipeline
  // parallel among the ranks of one stage) but does not broadcast rank 0's values.
  std::function<bool(const Value&)> partitioned;

  // Optional, for per-rank checkpoints: what this rank holds, as pieces of the whole tensors (views
  // of the live ones; parallel/placement.hpp makes them from a tp split or a ZeRO slice). Unset:
  // tensors() is whole, the same on every rank that holds the state. The checkpoint writes each
  // element once, from one of the ranks holding it.
  std::function<std::vector<TensorPiece>(const Value&)> pieces;
  // Optional, with pieces: load what this rank holds from `source`, reading only its boxes. Unset:
  // load() of every tensor whole.
  std::function<void(Value&, const StateSource&)> load_from;
};

void register_state_io(std::type_index type, StateIO io);
// The StateIO for the object a Value holds, or nullptr.
const StateIO* find_state_io(const Value& v);

template <class T>
void register_state_type() {
  register_state_io(std::type_index(typeid(std::shared_ptr<T>)),
                    StateIO{[](const Value& v) { return NamedTensors(v.as<std::shared_ptr<T>>()->tensors()); },
                            [](Value& v, const NamedTensors& t) { v.as_mut<std::shared_ptr<T>>()->load(t); }});
}

}  // namespace flowrun

#define FLOWRUN_STATE_TYPE(T) \
  static const bool FLOWRUN_CONCAT(flowrun_state_io_, __LINE__) = (::flowrun::register_state_type<T>(), true);
