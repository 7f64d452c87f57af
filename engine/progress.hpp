// Progress of a run: "step 40/200 | 3.2 steps/s | ETA 0:50 | slowest fb 210 ms" kept at the
// bottom of a terminal (redrawn at most 5 times a second), or a plain log line every log_every
// steps otherwise. "slowest": the node with the most run time since the last line (from the
// tracer's tally), with its mean time per run.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace flowrun {

class Tracer;

class Progress {
 public:
  // mode: "auto" (terminal only), "on", "off".
  // tracer: where the slowest node comes from (its tally is switched on here); may be null.
  Progress(int64_t first, int64_t last, int log_every, const std::string& mode, Tracer* tracer = nullptr);
  ~Progress();
  void step_done(int64_t step);
  void close();  // leave the terminal line clean
  static std::string format_eta(double seconds);

 private:
  int64_t first_, last_;
  int log_every_;
  bool tty_, enabled_;
  Tracer* tracer_;
  std::chrono::steady_clock::time_point t0_, last_draw_;
};

}  // namespace flowrun
