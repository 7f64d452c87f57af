// The command lines of `flowrun prep text|images|shapes|chat`: positionals, `--name VALUE` or
// `--name=VALUE`, flags (options that take no value: `--strict`, given as "true"), `-h`/`--help`. Errors are
// std::invalid_argument naming the option, which the commands turn into exit code 2.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace flowrun {

class MappedFile;  // formats/indexed_dataset.hpp

struct CliArgs {
  bool help = false;
  std::vector<std::string> positional;
  std::vector<std::pair<std::string, std::string>> options;  // {"--count", "12"}, in order
};

CliArgs parse_cli_args(const std::vector<std::string>& args, const std::vector<std::string>& flags = {});
// The value of option `name` as a non-negative integer / a number, or an error naming it.
uint64_t cli_uint(const std::string& name, const std::string& value);
double cli_number(const std::string& name, const std::string& value);

// Input paths (files, or folders: their regular files, recursively, sorted by path, hidden names
// skipped) -> files, in that order. std::invalid_argument naming a path that is missing or not a
// file or folder, or when there are no files.
std::vector<std::string> expand_input_files(const std::vector<std::string>& inputs);

// An input file memory-mapped (never read whole); one that cannot be read is a bad input
// (std::invalid_argument, exit 2), naming it.
std::unique_ptr<MappedFile> map_input_file(const std::string& path);

// One `flowrun NAME` command ("prep images"): parses `args`, prints `usage` to stdout for
// -h/--help (exit 0), else runs `body` with the parsed arguments and returns its exit code. A
// std::invalid_argument (bad usage or input) prints "flowrun NAME: what" and a pointer to
// --help, exit 2; any other exception prints "flowrun NAME: what", exit 1.
int run_cli_command(const std::string& name, const char* usage, const std::vector<std::string>& args,
                    const std::function<int(const CliArgs&)>& body, const std::vector<std::string>& flags = {});

}  // namespace flowrun
