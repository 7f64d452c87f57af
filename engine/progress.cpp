#include "progress.hpp"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>

#include "log.hpp"
#include "trace.hpp"

namespace flowrun {

Progress::Progress(int64_t first, int64_t last, int log_every, const std::string& mode, Tracer* tracer)
    : first_(first), last_(last), log_every_(log_every), tracer_(tracer) {
  tty_ = isatty(fileno(stderr)) != 0 && !log_is_json();  // JSON logs: plain log lines only
  enabled_ = mode == "on" || (mode == "auto" && tty_);
  t0_ = last_draw_ = std::chrono::steady_clock::now();
  if (enabled_ && tracer_) tracer_->enable_tally(true);
}

Progress::~Progress() { close(); }

std::string Progress::format_eta(double s) {
  if (s < 0 || s > 1e7) return "?";
  long t = static_cast<long>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", t / 60, t % 60);
  return buf;
}

void Progress::step_done(int64_t step) {
  if (!enabled_) return;
  auto now = std::chrono::steady_clock::now();
  const double el = std::chrono::duration<double>(now - t0_).count();
  const double done = static_cast<double>(step - first_ + 1);
  const double rate = el > 0 ? done / el : 0;
  const double eta = rate > 0 ? (last_ - step) / rate : -1;
  if (tty_ ? step != last_ && std::chrono::duration<double>(now - last_draw_).count() < 0.2
           : step % log_every_ != 0 && step != last_)
    return;
  char line[256];
  int n = std::snprintf(line, sizeof line, "step %lld/%lld | %.2f steps/s | ETA %s", static_cast<long long>(step),
                        static_cast<long long>(last_), rate, format_eta(eta).c_str());
  if (tracer_) {  // the node with the most run time since the last line
    const Tracer::Busiest b = tracer_->take_busiest();
    const double ms = b.runs ? b.us / 1000.0 / static_cast<double>(b.runs) : 0;
    if (!b.node.empty())
      std::snprintf(line + n, sizeof line - static_cast<size_t>(n), " | slowest %s %.*f ms", b.node.c_str(),
                    ms < 10 ? 2 : 0, ms);
  }
  if (tty_) {
    last_draw_ = now;
    set_status_line(line);
  } else {
    spdlog::info("{}", line);
  }
}

void Progress::close() {
  if (enabled_ && tty_) set_status_line("");
  enabled_ = false;
}

}  // namespace flowrun
