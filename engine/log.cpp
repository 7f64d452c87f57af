#include "log.hpp"

#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace flowrun {

namespace {

std::mutex g_mu;
std::string g_status;

// Writes log lines to stderr; if a progress line is showing, clears it first and redraws it
// after, so the progress line stays at the bottom of the terminal.
class StatusAwareSink : public spdlog::sinks::base_sink<std::mutex> {
 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t buf;
    formatter_->format(msg, buf);
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_status.empty()) std::fputs("\r\033[K", stderr);
    std::fwrite(buf.data(), 1, buf.size(), stderr);
    if (!g_status.empty()) std::fputs(g_status.c_str(), stderr);
    std::fflush(stderr);
  }
  void flush_() override { std::fflush(stderr); }
};

}  // namespace

void setup_logging(int rank, int world, const std::string& level) {
  auto logger = std::make_shared<spdlog::logger>("flowrun", std::make_shared<StatusAwareSink>());
  std::string pattern = "[%H:%M:%S.%e] [%^%l%$] ";
  if (world > 1) pattern += "[rank " + std::to_string(rank) + "] ";
  logger->set_pattern(pattern + "%v");
  std::string lv = level;
  if (lv.empty())
    if (const char* e = std::getenv("FLOWRUN_LOG")) lv = e;
  logger->set_level(lv.empty() ? spdlog::level::info : spdlog::level::from_str(lv));
  spdlog::set_default_logger(logger);
}

void set_status_line(const std::string& line) {
  std::lock_guard<std::mutex> l(g_mu);
  if (line.empty() && !g_status.empty()) std::fputs("\r\033[K", stderr);
  g_status = line;
  if (!line.empty()) std::fprintf(stderr, "\r\033[K%s", line.c_str());
  std::fflush(stderr);
}

}  // namespace flowrun
