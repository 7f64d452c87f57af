// The subcommands' command-line helpers (args.hpp).
#include "args.hpp"

#include <spdlog/spdlog.h>

#include <cstdio>
#include <sstream>

#include "log.hpp"
#include "registry.hpp"
#include "spec.hpp"

namespace flowrun::cli {

bool wants_help(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") return true;
  return false;
}

FileArgs split_args(const std::vector<std::string>& args) {
  FileArgs f;
  for (const auto& a : args) {
    if (a.rfind("--", 0) == 0)
      f.flags.push_back(a);
    else if (f.file.empty() && a.find('=') == std::string::npos)
      f.file = a;
    else if (a.find('=') != std::string::npos)
      f.overrides.push_back(a);
    else
      f.error = "unexpected argument '" + a + "' (overrides are KEY=VALUE)";
  }
  if (f.file.empty() && f.error.empty()) f.error = "no graph file given";
  return f;
}

bool has_flag(const FileArgs& f, const std::string& flag) {
  for (const auto& x : f.flags)
    if (x == flag) return true;
  return false;
}

int usage_error(const std::string& cmd, const std::string& msg, const char* usage) {
  std::fprintf(stderr, "flowrun %s: %s\n%s", cmd.c_str(), msg.c_str(), usage);
  return 2;
}

bool load(const std::string& file, const std::vector<std::string>& overrides, GraphSpec& out) {
  try {
    out = load_graph(file, overrides, Registry::global());
    return true;
  } catch (const GraphError& e) {
    const std::string count = fmt::format("{}: {} error{}", file, e.diagnostics().size(), e.diagnostics().size() == 1 ? "" : "s");
    if (log_is_json()) {  // for log collectors: each diagnostic one error line
      std::stringstream lines(e.diagnostics().str());
      for (std::string l; std::getline(lines, l);)
        if (!l.empty()) spdlog::error("{}", l);
      spdlog::error("{}", count);
    } else {
      std::fputs(e.diagnostics().str().c_str(), stderr);
      std::fprintf(stderr, "%s\n", count.c_str());
    }
    return false;
  }
  // The checker reports problems as diagnostics; anything else is a flowrun bug, but still an
  // error message and exit 2, never a crash.
  catch (const std::exception& e) {
    std::fprintf(stderr, "%s: could not check the file: %s (a flowrun bug: please report it with the file)\n",
                 file.c_str(), e.what());
    return false;
  }
}

}  // namespace flowrun::cli
