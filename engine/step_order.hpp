// The order one step keeps, as the sequential program's: what a node instance (node, step)
// waits for besides the producers of its inputs, from its own previous step and the states it
// reads and writes. The executor's admission derives it for every step it admits
// (executor.cpp); `flowrun explain` derives the same for a step to print it (explain.cpp).
//
//   StepOrder<Ref> order(states, nodes);
//   for each node i that runs in step s, in file order:
//     order.admit(i, s, stateless, accesses[i], Ref{i, s}, [&](const Ref& r, Why why, int state) { ... });
//
// The rule (docs/executor.md): a serial node waits for its last step that ran; a read of a
// state waits for the last write before it; a write waits for that write and every read since
// it. Ref is anything with `node` and `step` that Ref{node, step} builds (the executor's carries
// its device event too).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "schema.hpp"  // Access, NodeSchema

namespace flowrun {

struct GraphSpec;

// The states a run has and who accesses them, numbered once for the executor and `flowrun
// explain`: each node's owned state outputs, in file order then schema order; a node's accesses
// are its state inputs (in port order), then the owned outputs it writes every step.
struct StateTable {
  std::vector<std::string> names;                             // by id: "node.port"
  std::vector<std::map<std::string, int>> owned;              // per node: its state output -> id
  std::vector<std::vector<std::pair<int, Access>>> accesses;  // per node, as StepOrder::admit takes them
};
// schemas: each node's, in file order.
StateTable number_states(const GraphSpec& g, const std::vector<const NodeSchema*>& schemas);

// Why an instance waits for another.
enum class Why { previous_step, read_after_write, write_after_write, write_after_read };

template <class Ref>
class StepOrder {
 public:
  StepOrder(size_t states, size_t nodes) : tracks_(states), last_active_(nodes, -1) {}

  // Node i runs in step s (`me` is that instance) with these state accesses (state id, read or
  // write, in port order); `wait(ref, why, state)` for each instance it must wait for (state: the
  // state id, -1 for its previous step). Call in file order for each node that runs in step s.
  template <class Wait>
  void admit(int i, int64_t s, bool stateless, const std::vector<std::pair<int, Access>>& accesses, const Ref& me,
             Wait&& wait) {
    if (!stateless && last_active_[static_cast<size_t>(i)] >= 0)
      wait(Ref{i, last_active_[static_cast<size_t>(i)]}, Why::previous_step, -1);
    last_active_[static_cast<size_t>(i)] = s;
    for (auto [sid, acc] : accesses) {
      Track& t = tracks_[static_cast<size_t>(sid)];
      if (acc == Access::Read) {
        if (t.written) wait(t.last_write, Why::read_after_write, sid);
        t.reads.push_back(me);
      } else {
        if (t.written) wait(t.last_write, Why::write_after_write, sid);
        for (const auto& r : t.reads) wait(r, Why::write_after_read, sid);
        t.last_write = me;
        t.written = true;
        t.reads.clear();
      }
    }
  }

 private:
  struct Track {
    Ref last_write{};
    bool written = false;
    std::vector<Ref> reads;  // since last_write
  };
  std::vector<Track> tracks_;
  std::vector<int64_t> last_active_;
};

}  // namespace flowrun
