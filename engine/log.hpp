// Logging: spdlog to stderr, "[rank N]" in every line once the world has more than one
// process, and a sink that clears the progress line before printing (so the two never mix).
#pragma once
#include <string>

namespace flowrun {

void setup_logging(int rank, int world, const std::string& level = "");  // level: FLOWRUN_LOG or info
// The progress line the log sink redraws under each log line ("" = none).
void set_status_line(const std::string& line);

}  // namespace flowrun
