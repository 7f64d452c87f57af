// Chrome trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing): a span per
// node per step with its step, thread and stream, and counters (steps in flight, ready nodes).
// Spans are buffered per thread and written once at the end, so tracing costs ~0.1 µs a span.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace flowrun {

class Tracer {
 public:
  explicit Tracer(int pid = 0);
  bool enabled() const { return enabled_; }
  void enable(bool on) { enabled_ = on; }
  double now_us() const;  // microseconds since the tracer was made
  double us(std::chrono::steady_clock::time_point t) const;  // the same, for a given time
  void span(const std::string& name, const std::string& cat, double t0_us, double t1_us, int64_t step,
            const std::string& stream = "");
  void counter(const std::string& name, double value);
  // Write everything recorded so far; to a temporary name, then renamed.
  void write(const std::string& path) const;

 private:
  struct Event {
    char ph;
    std::string name, cat, stream;
    double ts, dur;
    int tid;
    int64_t step;
    double value;
  };
  bool enabled_ = false;
  int pid_;
  std::chrono::steady_clock::time_point t0_;
  mutable std::mutex mu_;
  std::vector<Event> events_;
};

}  // namespace flowrun
