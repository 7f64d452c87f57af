// Chrome trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing): a span per
// node per step with its step, thread, stream and the instances it waited for (`deps`, as the
// executor derived them), and counters (steps in flight, ready nodes). Spans are buffered
// and written once at the end, so tracing costs ~0.1 µs a span.
//
// Two uses, either or both: recording every event (run.trace, run.profile: engine/profile.hpp
// reads them back), and a running tally of node time per node since the last look (the
// progress line's slowest node), which keeps no events.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace flowrun {

// An instance a node's step waited for: (node name, step).
using TraceDeps = std::vector<std::pair<std::string, int64_t>>;

// A node instance's span (not stream items, marks or counters), as recorded or read back.
struct TraceSpan {
  std::string node, type, stream;
  int64_t step = 0;
  double t0 = 0, t1 = 0;  // microseconds
  int tid = 0;
  TraceDeps deps;
};

class Tracer {
 public:
  explicit Tracer(int pid = 0);
  bool enabled() const { return record_ || tally_; }
  bool records() const { return record_; }
  void enable(bool on) { record_ = on; }             // record events (run.trace, run.profile)
  void enable_tally(bool on) { tally_ = on; }        // keep per-node totals (the progress line)
  double now_us() const;  // microseconds since the tracer was made
  double us(std::chrono::steady_clock::time_point t) const;  // the same, for a given time
  // A sub-span, stream item or mark (no deps): recorded only.
  void span(const std::string& name, const std::string& cat, double t0_us, double t1_us, int64_t step,
            const std::string& stream = "");
  // A node instance's run: recorded with what it waited for, and tallied.
  void node_span(const std::string& node, const std::string& type, double t0_us, double t1_us, int64_t step,
                 const std::string& stream, TraceDeps deps);
  void counter(const std::string& name, double value);
  // Write everything recorded so far; to a temporary name, then renamed.
  void write(const std::string& path) const;
  std::vector<TraceSpan> node_spans() const;  // recorded node spans, in recording order
  // The node with the most run time since the last call (and that time, µs, and its runs);
  // resets the tally. {"", 0, 0} when nothing ran.
  struct Busiest {
    std::string node;
    double us = 0;
    int64_t runs = 0;
  };
  Busiest take_busiest();

 private:
  struct Event {
    char ph;
    std::string name, cat, stream;
    double ts, dur;
    int tid;
    int64_t step;
    double value;
    bool node = false;  // a node instance's span (deps below)
    TraceDeps deps;
  };
  bool record_ = false, tally_ = false;
  int pid_;
  std::chrono::steady_clock::time_point t0_;
  mutable std::mutex mu_;
  std::vector<Event> events_;
  std::map<std::string, std::pair<double, int64_t>> tally_us_;  // node -> (µs, runs) since take_busiest
};

}  // namespace flowrun
