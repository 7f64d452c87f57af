#include "prep/cli_args.hpp"

#include "formats/indexed_dataset.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <stdexcept>

namespace flowrun {

CliArgs parse_cli_args(const std::vector<std::string>& args, const std::vector<std::string>& flags) {
  CliArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      out.help = true;
    } else if (a.rfind("--", 0) != 0) {
      out.positional.push_back(a);
    } else if (const size_t eq = a.find('='); eq != std::string::npos) {
      out.options.emplace_back(a.substr(0, eq), a.substr(eq + 1));
    } else if (std::find(flags.begin(), flags.end(), a) != flags.end()) {
      out.options.emplace_back(a, "true");
    } else {
      if (i + 1 >= args.size()) throw std::invalid_argument(a + " needs a value");
      out.options.emplace_back(a, args[++i]);
    }
  }
  return out;
}

uint64_t cli_uint(const std::string& name, const std::string& value) {
  if (value.empty() || value.size() > 19 || value.find_first_not_of("0123456789") != std::string::npos)
    throw std::invalid_argument(name + ": '" + value + "' is not a non-negative integer");
  return std::stoull(value);
}

double cli_number(const std::string& name, const std::string& value) {
  size_t used = 0;
  double d = 0;
  try {
    d = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (value.empty() || used != value.size()) throw std::invalid_argument(name + ": '" + value + "' is not a number");
  return d;
}

std::vector<std::string> expand_input_files(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    if (std::filesystem::is_directory(in, ec)) {
      std::vector<std::string> found;
      for (auto it = std::filesystem::recursive_directory_iterator(in, ec); !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
        const std::string name = it->path().filename().string();
        if (!name.empty() && name[0] == '.') {
          if (it->is_directory()) it.disable_recursion_pending();
          continue;
        }
        if (it->is_regular_file()) found.push_back(it->path().string());
      }
      if (ec) throw std::invalid_argument(in + ": cannot list: " + ec.message());
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (std::filesystem::is_regular_file(in, ec)) {
      files.push_back(in);
    } else if (std::filesystem::exists(in, ec)) {
      throw std::invalid_argument(in + ": not a regular file or folder (a device, pipe or socket); give text files or folders of them");
    } else {
      throw std::invalid_argument(in + ": no such file or folder");
    }
  }
  if (files.empty()) throw std::invalid_argument("no input files (the folders given hold none)");
  return files;
}

std::unique_ptr<MappedFile> map_input_file(const std::string& path) {
  try {
    return std::make_unique<MappedFile>(path);
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(e.what());
  }
}

int run_cli_command(const std::string& name, const char* usage, const std::vector<std::string>& args,
                    const std::function<int(const CliArgs&)>& body, const std::vector<std::string>& flags) {
  try {
    const CliArgs cl = parse_cli_args(args, flags);
    if (cl.help) {
      std::fputs(usage, stdout);
      return 0;
    }
    return body(cl);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "flowrun %s: %s\n(flowrun %s --help for usage)\n", name.c_str(), e.what(), name.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flowrun %s: %s\n", name.c_str(), e.what());
    return 1;
  }
}

}  // namespace flowrun
