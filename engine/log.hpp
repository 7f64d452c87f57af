// Logging: spdlog to stderr, "[rank N]" in every line once the world has more than one
// process, and a sink that clears the progress line before printing (so the two never mix).
// FLOWRUN_LOG: a level (trace, debug, info, warn, error, off) and/or `json`, comma-separated
// (FLOWRUN_LOG=json,debug). With json every log line is one JSON object for cluster log
// collectors: {"time": "2026-11-25T07:34:11.759Z", "level": "info", "rank": 0, "msg": "..."},
// and the progress line is never drawn in place (it is logged every log_every steps).
#pragma once
#include <string>

namespace flowrun {

// spec: FLOWRUN_LOG's syntax; "" reads FLOWRUN_LOG (unset: info, text). Throws
// std::invalid_argument naming FLOWRUN_LOG and the word it does not know.
void setup_logging(int rank, int world, const std::string& spec = "");
bool log_is_json();
// The progress line the log sink redraws under each log line ("" = none; never with json).
void set_status_line(const std::string& line);

}  // namespace flowrun
