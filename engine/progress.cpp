#include "progress.hpp"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>

#include "log.hpp"

namespace flowrun {

Progress::Progress(int64_t first, int64_t last, int log_every, const std::string& mode)
    : first_(first), last_(last), log_every_(log_every) {
  tty_ = isatty(fileno(stderr)) != 0 && !log_is_json();  // JSON logs: plain log lines only
  enabled_ = mode == "on" || (mode == "auto" && tty_);
  t0_ = last_draw_ = std::chrono::steady_clock::now();
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
  char line[160];
  std::snprintf(line, sizeof line, "step %lld/%lld | %.2f steps/s | ETA %s", static_cast<long long>(step),
                static_cast<long long>(last_), rate, format_eta(eta).c_str());
  if (tty_) {
    if (step != last_ && std::chrono::duration<double>(now - last_draw_).count() < 0.2) return;
    last_draw_ = now;
    set_status_line(line);
  } else if (step % log_every_ == 0 || step == last_) {
    spdlog::info("{}", line);
  }
}

void Progress::close() {
  if (enabled_ && tty_) set_status_line("");
  enabled_ = false;
}

}  // namespace flowrun
