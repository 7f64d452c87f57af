// Node types for engine tests only (never built-ins): sources, sleepers, state readers and
// writers that record what they saw, stream producers/consumers, a node that throws.
//   t_source   out: value int = step*1000 + k                    params: k, sleep_ms
//   t_op       in: list of int values -> out = step*1000 + sum(in) % 1000 (serial)
//   t_par      same as t_op but stateless (steps may run in parallel)
//   t_math     same as t_op, of a compute type (runs on the compute thread); fail_at: throws there
//   t_cell     owns state `cell` (a Cell: version counter)
//   t_read     reads state `s`, records the version it saw          params: sleep_us
//   t_write    writes state `s`: records the version, then bumps it  params: sleep_us
//   t_fail     throws at step `at`
//   t_channel  opens a channel over `group` in setup; its schema declares collectives over dp only
//   t_stream   emits `count` items on stream `items`, sleep_ms apart
//   t_sink     stream input `items`; records item times; out = number of items
//   t_dev_*    device-stream nodes: their work runs on the current ThreadStreams stream
//              (thread_streams.hpp) and poisons what it writes while it "computes":
//   t_dev_source  out: buf = step*1000 + k, written by a kernel   params: k, sleep_us
//   t_dev_check   in: buf; violation if its kernel sees it unfinished or of another step;
//                 every host_every steps also reads it on the host after sync("in")
//   t_dev_cell    owns state `cell` (a DevCell)
//   t_dev_read / t_dev_write   read / bump the cell in a kernel     params: sleep_us
//   t_dev_stream / t_dev_sink  items written by kernels; the sink checks each on its stream
#pragma once
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>
#include <string>
#include <vector>

namespace flowrun::test {

void register_test_nodes();  // idempotent

// A state object that notices forbidden overlaps (a write with anything else running).
struct Cell {
  std::atomic<int> readers{0}, writers{0};
  std::atomic<int> violations{0};
  int64_t version = 0;
};

// Device-stream test nodes (t_dev_*): a buffer a kernel writes, and a state cell.
struct DevBuf {
  std::atomic<int64_t> v{0};
};
struct DevCell {
  std::atomic<int64_t> version{0};
};

struct Event {
  std::string node;
  int64_t step;
  std::string what;  // "read", "write", "out", "item", "run"
  int64_t value;
  double t0_ms, t1_ms;  // since the recorder was cleared
  std::thread::id thread = {};  // where it ran (Recorder::add fills it in)
};

// What test nodes saw, across threads.
class Recorder {
 public:
  static Recorder& get();
  void clear();
  void add(Event e);
  std::vector<Event> events() const;
  double now_ms() const;
  int violations() const { return violations_; }
  void violation() { ++violations_; }

 private:
  mutable std::mutex mu_;
  std::vector<Event> ev_;
  std::atomic<int> violations_{0};
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

}  // namespace flowrun::test
