// `flowrun prep`: dispatch to one kind of data preparation (a kind per file: prep_text.cpp, ...).
#include "data/prep.hpp"

#include <cstdio>

#include "data/prep_text.hpp"

namespace flowrun {

static const char* kPrepUsage =
    "usage: flowrun prep text --tokenizer byte|gpt2 --out PREFIX FILE_OR_DIR...   token shards from text\n"
    "       flowrun prep KIND --help                                                 options of one kind\n";

int prep_command(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fputs(kPrepUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "text") return prep_text_command(rest);
  std::fprintf(stderr, "flowrun prep: unknown kind '%s' (known: text)\n\n%s", args[0].c_str(), kPrepUsage);
  return 2;
}

}  // namespace flowrun
