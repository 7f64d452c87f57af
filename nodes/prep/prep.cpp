// `flowrun prep`: dispatch to one kind of data preparation (a kind per file: prep_text.cpp, ...).
#include "prep/prep.hpp"

#include <cstdio>

#include "prep/prep_arrow.hpp"
#include "prep/prep_chat.hpp"
#include "prep/prep_images.hpp"
#include "prep/prep_text.hpp"

namespace flowrun {

static const char* kPrepUsage =
    "usage: flowrun prep text --tokenizer byte|gpt2|TOKENIZER_JSON --out PREFIX FILE_OR_DIR...   token shards from text\n"
    "       flowrun prep chat --model FOLDER --out PREFIX FILE.jsonl...                 token shards + loss mask from chat data\n"
    "       flowrun prep images DIR OUT_PREFIX [--shard-size N] [--val-fraction F]   WebDataset tar shards from image+caption pairs\n"
    "       flowrun prep arrow DIR OUT_DIR [--rows-per-file N]                      HunyuanDiT's Arrow files + an Index V2 from image+caption pairs\n"
    "       flowrun prep shapes OUT_DIR [--count N] [--size S] [--set base|lora|all] the DiT demo's colored-shapes image set\n"
    "       flowrun prep KIND --help                                                 options of one kind\n";

int prep_command(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fputs(kPrepUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "text") return prep_text_command(rest);
  if (args[0] == "chat") return prep_chat_command(rest);
  if (args[0] == "images") return prep_images_command(rest);
  if (args[0] == "arrow") return prep_arrow_command(rest);
  if (args[0] == "shapes") return prep_shapes_command(rest);
  std::fprintf(stderr, "flowrun prep: unknown kind '%s' (known: text, chat, images, arrow, shapes)\n\n%s", args[0].c_str(), kPrepUsage);
  return 2;
}

}  // namespace flowrun
