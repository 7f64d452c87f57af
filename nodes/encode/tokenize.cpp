// The tokenizer nodes' shared part (tokenize.hpp) and encode_texts.
#include "encode/tokenize.hpp"

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <stdexcept>

#include "formats/files.hpp"
#include "formats/json_file.hpp"
#include "common/pretrained.hpp"

namespace flowrun {

TensorMap encode_texts(const TextTokenizer& tok, const std::vector<std::string>& texts) {
  const int64_t B = static_cast<int64_t>(texts.size()), L = tok.max_length();
  torch::Tensor input_ids = torch::full({B, L}, tok.pad_id(), torch::kInt64);
  torch::Tensor mask = torch::zeros({B, L}, torch::kInt64);
  auto ia = input_ids.accessor<int64_t, 2>();
  auto ma = mask.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int64_t> row = tok.ids(texts[static_cast<size_t>(b)], L);
    for (size_t i = 0; i < row.size() && static_cast<int64_t>(i) < L; ++i) {
      ia[b][static_cast<int64_t>(i)] = row[i];
      ma[b][static_cast<int64_t>(i)] = 1;
    }
  }
  return {{"input_ids", input_ids}, {"attention_mask", mask}};
}

std::string tokenizer_file(const std::string& vocab, const TokenizerFolder& where, std::string* folder) {
  namespace fs = std::filesystem;
  if (folder) folder->clear();
  if (!fs::is_directory(vocab)) return vocab;
  std::string dir = vocab;
  if (!fs::exists(dir + "/" + where.file) && fs::exists(dir + "/model_index.json")) {
    dir += "/" + where.component;
    if (!fs::is_directory(dir))
      throw std::runtime_error(vocab + " is a pipeline's folder (model_index.json) without " + where.component +
                               "/, where its " + where.file + " would be; give the tokenizer's folder or file instead");
  }
  if (!fs::exists(dir + "/" + where.file))
    throw std::runtime_error(dir + " has no " + where.file + " (this tokenizer reads a " + where.file +
                             "; other tokenizer files, such as tokenizer.json alone, are not read)");
  if (folder) *folder = dir;
  return dir + "/" + where.file;
}

void TokenizeNode::setup(SetupContext& ctx) {
  const Params& p = ctx.params();
  bool lowercase = p.get<bool>("lowercase");
  std::string file;
  try {
    std::string dir;
    file = tokenizer_file(p.get<std::string>("vocab"), folder(), &dir);
    const std::string config = dir + "/tokenizer_config.json";
    if (!dir.empty() && std::filesystem::exists(config)) {
      const nlohmann::json j = read_json_file(config);
      if (j.is_object() && j.contains("do_lower_case") && !j["do_lower_case"].is_null()) {
        const bool lower = json_value<bool>(j, config, "do_lower_case", false);  // "yes" is refused, not ignored
        const YAML::Node written = written_params(ctx.run(), ctx.name());
        if (written && written["lowercase"] && written["lowercase"].as<bool>() != lower)
          throw std::runtime_error(std::string("lowercase is ") + (lowercase ? "true" : "false") + " in the graph, " +
                                   config + " has do_lower_case = " + (lower ? "true" : "false") +
                                   "; drop lowercase from the graph (the folder sets it) or use another folder");
        lowercase = lower;
      }
    }
    tok_ = load(file, p.get<int64_t>("max_length"), lowercase);
  } catch (const std::exception& e) {
    throw std::runtime_error(ctx.who() + ": " + e.what());
  }
  if (ctx.run().rank == 0)
    spdlog::info("{}: vocab {} ({}), max_length {}{}", ctx.who(), tok_->vocab_size(), file, tok_->max_length(),
                 lowercase ? ", lowercase" : "");
  ctx.own_state("tokenizer", tok_);
}

void TokenizeNode::run(StepContext& ctx) { ctx.out("tokens", encode_texts(*tok_, ctx.in<TextBatch>("text"))); }

}  // namespace flowrun
