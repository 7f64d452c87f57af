// What the subcommands share of reading their command line: FILE, KEY=VALUE overrides and
// --flags; help; usage errors; loading the graph with every diagnostic printed.
#pragma once
#include <string>
#include <vector>

namespace flowrun {
struct GraphSpec;
}

namespace flowrun::cli {

bool wants_help(const std::vector<std::string>& args);  // --help or -h among them

// FILE, then KEY=VALUE overrides and --flags.
struct FileArgs {
  std::string file;
  std::vector<std::string> overrides;
  std::vector<std::string> flags;
  std::string error;
};
FileArgs split_args(const std::vector<std::string>& args);
bool has_flag(const FileArgs& f, const std::string& flag);

// "flowrun CMD: msg" and the usage on stderr; returns 2.
int usage_error(const std::string& cmd, const std::string& msg, const char* usage);

// Loads and checks; prints every diagnostic on failure.
bool load(const std::string& file, const std::vector<std::string>& overrides, GraphSpec& out);

}  // namespace flowrun::cli
