// The command lines of `flowrun prep text|images|shapes`: positionals, `--name VALUE` or
// `--name=VALUE` (every option takes a value), `-h`/`--help`. Errors are
// std::invalid_argument naming the option, which the commands turn into exit code 2.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace flowrun {

struct CliArgs {
  bool help = false;
  std::vector<std::string> positional;
  std::vector<std::pair<std::string, std::string>> options;  // {"--count", "12"}, in order
};

CliArgs parse_cli_args(const std::vector<std::string>& args);
// The value of option `name` as a non-negative integer / a number, or an error naming it.
uint64_t cli_uint(const std::string& name, const std::string& value);
double cli_number(const std::string& name, const std::string& value);

}  // namespace flowrun
