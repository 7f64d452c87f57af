// generate: completions of fixed prompts, for seeing a fine-tune change the model's answers.
// Schema: schemas/generate.yaml. Test: tests/nodes/generate_test.cpp. The decoding is
// models/generate.hpp; here the prompts are rendered (chat template) and tokenized, and the
// completions decoded and written.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/html.hpp"
#include "formats/chat_template.hpp"
#include "formats/files.hpp"
#include "formats/tfevents.hpp"
#include "formats/tokenizer.hpp"
#include "models/generate.hpp"
#include "parallel/tensor_parallel.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

class GenerateNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    const std::string path = p.get<std::string>("tokenizer");
    try {
      tok_ = BpeTokenizer::load_hf(path);
      if (p.get<bool>("chat")) {  // the folder's template: the tokenizer's folder, or the one holding the file
        const std::string folder = std::filesystem::is_directory(path) ? path : std::filesystem::path(path).parent_path().string();
        tmpl_ = p.has("template") ? ChatTemplate::named(p.get<std::string>("template")) : ChatTemplate::from_folder(folder);
      }
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    tp_group_ = parallel::own_tp_group(ctx.name(), ctx.run());  // collective: setup runs in file order on every rank
    if (parallel::mesh_of(ctx.run()).size(parallel::Dim::ep) > 1)
      throw std::runtime_error(ctx.who() + ": generation under expert parallel (run.parallel.ep) is not built (each ep rank "
                               "would decode its own lengths while their all-to-alls must pair up); generate from the "
                               "checkpoint at ep 1 (flowrun GRAPH run.parallel.ep=1 run.resume=auto: a checkpoint written at "
                               "any layout loads at any other)");
    prompts_ = p.get<std::vector<std::string>>("prompts");
    if (prompts_.empty()) throw std::runtime_error(ctx.who() + ": prompts is empty (give at least one)");
    if (p.has("system")) system_ = p.get<std::string>("system");
    chat_opts_.add_generation_prompt = true;
    chat_opts_.enable_thinking = p.get<bool>("enable_thinking");
    opts_.max_new_tokens = p.get<int64_t>("max_new_tokens");
    opts_.temperature = p.get<double>("temperature");
    opts_.top_k = p.get<int64_t>("top_k");
    opts_.top_p = p.get<double>("top_p");
    opts_.seed = node_seed(ctx);
    stops_ = p.get<std::vector<std::string>>("stop");
    if (p.get<bool>("tensorboard") && ctx.run().rank == 0) tb_ = tfevents::EventFile::open(ctx.run().out_dir + "/tb");
    // The end of a turn or of a text: the chat templates' and the tokenizers' own.
    for (const char* t : {"<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>"})
      if (auto id = tok_->added_token_id(t)) opts_.stop_ids.push_back(*id);
    // The prompts' ids, once.
    for (const std::string& text : prompts_) {
      std::vector<int32_t> ids;
      if (tmpl_) {
        std::vector<ChatMessage> m;
        if (system_) m.push_back({"system", *system_, std::nullopt});
        m.push_back({"user", text, std::nullopt});
        ids = tokenize_chat(*tmpl_, *tok_, m, chat_opts_).ids;
      } else {
        ids = tok_->specials_before();
        tok_->encode(text, ids);
      }
      prompt_ids_.emplace_back(ids.begin(), ids.end());
    }
  }

  void run(StepContext& ctx) override {
    ModelState& model = ctx.state_as<ModelState>("model");
    const parallel::TpChannel tp_channel(tp_group_.get());  // a split model's collectives: this node's own
    const auto stop = [&](size_t, const std::vector<int64_t>& ids) {
      if (stops_.empty()) return false;
      const std::string text = decode(ids);
      for (const std::string& s : stops_)
        if (text.size() >= s.size() && text.find(s, text.size() > s.size() + 64 ? text.size() - s.size() - 64 : 0) != std::string::npos)
          return true;
      return false;
    };
    GenerateResult r;
    try {
      r = generate(model, prompt_ids_, opts_, stop);
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    const double rate = r.new_tokens / std::max(r.seconds, 1e-9);
    ctx.out("tokens_per_s", rate);
    if (ctx.run().rank != 0) return;
    std::vector<std::string> completions;
    for (const auto& ids : r.tokens) completions.push_back(decode(ids));
    write(ctx, completions);
    spdlog::info("{} step {}: {} completions, {:.0f} new tokens/s; \"{}\" -> \"{}\"", ctx.name(), ctx.step(), completions.size(), rate,
                 prompts_[0], completions[0]);
  }

 private:
  // The text of ids, the end-of-turn and end-of-text tokens left out (skip_special_tokens for them).
  std::string decode(const std::vector<int64_t>& ids) const {
    std::vector<int32_t> kept;
    for (int64_t id : ids)
      if (std::find(opts_.stop_ids.begin(), opts_.stop_ids.end(), id) == opts_.stop_ids.end()) kept.push_back(static_cast<int32_t>(id));
    return tok_->decode(kept);
  }

  void write(const StepContext& ctx, const std::vector<std::string>& completions) const {
    const std::string dir = ctx.run().out_dir + "/generations";
    std::filesystem::create_directories(dir);
    char name[32];
    std::snprintf(name, sizeof name, "step_%07lld.html", static_cast<long long>(ctx.step()));
    std::string h = "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + html_escape(ctx.name()) + " step " +
                    std::to_string(ctx.step()) +
                    "</title>\n<style>body{font-family:sans-serif;margin:1.5em}td{padding:6px 12px;border-bottom:1px solid #ddd;"
                    "vertical-align:top;white-space:pre-wrap}</style></head><body>\n<h1>" +
                    html_escape(ctx.name()) + ", step " + std::to_string(ctx.step()) + "</h1>\n<table>\n<tr><th>prompt</th><th>completion</th></tr>\n";
    std::ofstream jsonl(ctx.run().out_dir + "/generations.jsonl", std::ios::app);
    for (size_t i = 0; i < completions.size(); ++i) {
      h += "<tr><td>" + html_escape(prompts_[i]) + "</td><td>" + html_escape(completions[i]) + "</td></tr>\n";
      jsonl << nlohmann::json({{"step", ctx.step()}, {"node", ctx.name()}, {"prompt", prompts_[i]}, {"completion", completions[i]}})
                   .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
            << "\n";
    }
    h += "</table>\n</body></html>\n";
    write_file_atomic(dir + "/" + name, h);
    if (tb_) {  // a Markdown table, tagged by the node's name
      auto cell = [](std::string s) {
        std::string out;
        for (char c : s) out += c == '|' ? std::string("\\|") : c == '\n' ? std::string("<br>") : std::string(1, c);
        return out;
      };
      std::string md = "| prompt | completion |\n|---|---|\n";
      for (size_t i = 0; i < completions.size(); ++i) md += "| " + cell(prompts_[i]) + " | " + cell(completions[i]) + " |\n";
      tb_->text(ctx.step(), ctx.name(), md);
      tb_->flush();
    }
  }

  std::unique_ptr<BpeTokenizer> tok_;
  std::unique_ptr<ChatTemplate> tmpl_;
  std::vector<std::string> prompts_, stops_;
  std::optional<std::string> system_;
  ChatOptions chat_opts_;
  GenerateOptions opts_;
  std::vector<std::vector<int64_t>> prompt_ids_;
  std::shared_ptr<parallel::Group> tp_group_;
  std::shared_ptr<tfevents::EventFile> tb_;  // rank 0 with tensorboard: true  // run.parallel.tp > 1: the split model's collectives (TpChannel)
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(generate, flowrun::GenerateNode)
