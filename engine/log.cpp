#include "log.hpp"

#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <sstream>
#include <stdexcept>

namespace flowrun {

namespace {

std::mutex g_mu;
std::string g_status;
bool g_json = false;

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

// A JSON string literal: quotes, backslashes and control characters escaped; other bytes
// (UTF-8) as they are.
void append_json_string(std::string& out, std::string_view s) {
  out += '"';
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20) {
      char u[8];
      std::snprintf(u, sizeof u, "\\u%04x", c);
      out += u;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
}

// One JSON object per line: time (UTC, ISO 8601 with milliseconds), level, rank, msg.
class JsonSink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit JsonSink(int rank) : rank_(rank) {}

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    const auto t = msg.time.time_since_epoch();
    const std::time_t secs = std::chrono::duration_cast<std::chrono::seconds>(t).count();
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t).count() % 1000;
    std::tm tm{};
    gmtime_r(&secs, &tm);
    char when[40];
    std::snprintf(when, sizeof when, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                  tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms));
    const auto level = spdlog::level::to_string_view(msg.level);
    std::string line = "{\"time\":\"";
    line += when;
    line += "\",\"level\":";
    append_json_string(line, std::string_view(level.data(), level.size()));
    line += ",\"rank\":" + std::to_string(rank_) + ",\"msg\":";
    append_json_string(line, std::string_view(msg.payload.data(), msg.payload.size()));
    line += "}\n";
    std::lock_guard<std::mutex> l(g_mu);
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
  }
  void flush_() override { std::fflush(stderr); }

 private:
  int rank_;
};

}  // namespace

void setup_logging(int rank, int world, const std::string& spec_arg) {
  std::string spec = spec_arg;
  if (spec.empty())
    if (const char* e = std::getenv("FLOWRUN_LOG")) spec = e;
  auto level = spdlog::level::info;
  bool json = false;
  std::stringstream words(spec);
  for (std::string w; std::getline(words, w, ',');) {
    if (w.empty()) continue;
    if (w == "json") {
      json = true;
      continue;
    }
    const auto lv = spdlog::level::from_str(w);  // unknown words come back as `off`
    if (lv == spdlog::level::off && w != "off")
      throw std::invalid_argument("FLOWRUN_LOG: unknown word '" + w +
                                  "' (a level: trace, debug, info, warn, error, off; and/or json, e.g. "
                                  "FLOWRUN_LOG=json,debug)");
    level = lv;
  }
  std::shared_ptr<spdlog::logger> logger;
  if (json) {
    logger = std::make_shared<spdlog::logger>("flowrun", std::make_shared<JsonSink>(rank));
  } else {
    logger = std::make_shared<spdlog::logger>("flowrun", std::make_shared<StatusAwareSink>());
    std::string pattern = "[%H:%M:%S.%e] [%^%l%$] ";
    if (world > 1) pattern += "[rank " + std::to_string(rank) + "] ";
    logger->set_pattern(pattern + "%v");
  }
  logger->set_level(level);
  {
    std::lock_guard<std::mutex> l(g_mu);
    g_json = json;
  }
  spdlog::set_default_logger(logger);
}

bool log_is_json() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_json;
}

void set_status_line(const std::string& line) {
  std::lock_guard<std::mutex> l(g_mu);
  if (g_json) return;
  if (line.empty() && !g_status.empty()) std::fputs("\r\033[K", stderr);
  g_status = line;
  if (!line.empty()) std::fprintf(stderr, "\r\033[K%s", line.c_str());
  std::fflush(stderr);
}

}  // namespace flowrun
