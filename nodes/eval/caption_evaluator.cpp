// caption_evaluator: how well a captioner (cappa) captions held-out images.
// Schema: schemas/caption_evaluator.yaml. Test: tests/nodes/cappa_test.cpp.
//
// On the first `batches` batches of a split (each rank its own shard, as the evaluator), with
// the captions tokenized as in training:
//   loss          the objective's teacher-forced loss (per caption the mean over its tokens,
//                 then over captions; all rows autoregressive: no TrainingScope);
//   token_acc     greedy autoregressive decoding from the start token, L = the targets'
//                 length tokens: the share of counted target positions predicted exactly;
//   exact_match   the share of captions whose every counted target is predicted (so the
//                 decoded caption equals the reference up to its end token);
//   parallel_token_acc, parallel_exact_match   the same for one-pass parallel decoding (all
//                 inputs the mask token, no causal mask).
// One all-reduce of the sums gives every rank the same numbers. Rank 0 writes
// OUT_DIR/samples/step_NNNNNNN.html: the first `samples` images of its first batch, inlined as
// PNG, with their reference, greedy and parallel captions.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iterator>

#include "comm.hpp"
#include "common/html.hpp"
#include "formats/files.hpp"
#include "formats/image_io.hpp"
#include "data/image_tensor.hpp"
#include "encode/tokenize.hpp"
#include "eval/evaluator.hpp"
#include "models/stages.hpp"
#include "parallel/mesh.hpp"
#include "parallel/tensor_parallel.hpp"
#include "registry.hpp"
#include "train/fully_sharded.hpp"
#include "train/objective.hpp"

namespace flowrun {

namespace {

// The ids of a decoded row up to and including its first end token.
std::vector<int64_t> until_eos(const torch::Tensor& row, int64_t eos) {
  std::vector<int64_t> ids;
  const torch::Tensor r = row.to(torch::kCPU, torch::kLong).contiguous();
  for (int64_t i = 0; i < r.size(0); ++i) {
    ids.push_back(r[i].item<int64_t>());
    if (ids.back() == eos) break;
  }
  return ids;
}

struct Sample {
  std::string image, reference, greedy, parallel;  // image: a data URI
};

class CaptionEvaluatorNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    const Objective& objective = ctx.state_as<Objective>("objective");
    objective_ = &objective;
    captioning_ = objective.captioning();
    if (!captioning_)
      throw std::runtime_error(ctx.who() + ": its objective is " + objective.type +
                               ", which trains no captioner; a caption evaluator needs the objective the model trains "
                               "with to offer its image key, start token and targets (Objective::captioning), as "
                               "caption_loss does");
    if (const ModelState& m = ctx.state_as<ModelState>("model"); !m.captioner)
      throw std::runtime_error(ctx.who() + ": model '" + m.kind + "' is not a captioner (its params must come from a "
                               "cappa node, or their EMA)");
    opts_ = eval_options(ctx);
    samples_ = p.get<int64_t>("samples");
    check_eval_split(ctx.state_as<Dataset>("data"), opts_, ctx.who());
    ch_ = comm::Channel::create(ctx.name());  // collective: setup runs in file order on every rank
    tp_group_ = parallel::own_tp_group(ctx.name(), ctx.run());  // a split model's collectives (TpChannel)
    dp_group_ = parallel::own_dp_group(ctx.name() + " gathers", ctx.run());  // a ZeRO-3 model's gathers
    counts_ = parallel::replica_of(ctx.run()).first;
    if (ctx.state_as<ModelState>("model").stages)  // pipeline parallel: each pass through the stages (StageChannel)
      pp_group_ = parallel::own_pp_group(ctx.name() + " pipeline", ctx.run());
  }

  void run(StepContext& ctx) override {
    const parallel::TpChannel tp_channel(tp_group_.get());
    const StageChannel stage_channel(pp_group_.get());
    const auto t0 = std::chrono::steady_clock::now();
    ShardedReader reader(ctx.state_as<ModelState>("model"), dp_group_.get(), ctx.who() + " of step " + std::to_string(ctx.step()));
    ModelState& model = reader.model();
    const ModelState::Captioner& net = *model.captioner;
    const Dataset& data = ctx.state_as<Dataset>("data");
    const TextTokenizer& tok = ctx.state_as<TextTokenizer>("tokenizer");
    const c10::Device device = model_device(model);
    const int64_t n = reader.agreed(std::min(opts_.batches, data.num_batches(opts_.split, opts_.batch, opts_.rank, opts_.world)));
    // Sums: loss x captions, captions, greedy correct, greedy exact, parallel correct, parallel exact, tokens.
    double sums[7] = {0, 0, 0, 0, 0, 0, 0};
    std::vector<Sample> page;
    torch::NoGradGuard no_grad;
    for (int64_t i = 0; i < n; ++i) {
      const std::vector<std::string> caps = data.captions(opts_.split, i, opts_.batch, opts_.rank, opts_.world);
      if (caps.empty()) throw std::runtime_error(ctx.who() + ": the dataset has no captions (an image-text dataset is needed)");
      TensorMap batch = data.batch(opts_.split, i, opts_.batch, opts_.rank, opts_.world);
      for (auto& [k, v] : encode_texts(tok, caps)) batch[k] = v;
      batch = to_device(batch, device);
      const int64_t t = objective_->targets(batch);
      sums[0] += objective_->loss(model, batch).item<double>() * static_cast<double>(t);
      sums[1] += static_cast<double>(t);

      auto [labels, mask] = captioning_->labels_of(batch.at("input_ids").to(torch::kLong), batch.at("attention_mask"));
      const torch::Tensor counted = mask.to(torch::kBool);
      const int64_t L = labels.size(1);
      const torch::Tensor& images = batch.at(captioning_->image_key());
      const torch::Tensor encoded = net.encode(model, images);  // once, for both decoders
      const torch::Tensor greedy = net.greedy(model, encoded, captioning_->start_tokens(batch.at("input_ids")), L, tok.eos_id());
      const torch::Tensor parallel = net.parallel(model, encoded, L);
      auto score = [&](const torch::Tensor& pred, double* correct, double* exact) {
        const torch::Tensor right = pred.eq(labels) | ~counted;  // positions not counted are right
        *correct += (pred.eq(labels) & counted).sum().item<double>();
        *exact += right.all(1).sum().item<double>();
      };
      score(greedy, &sums[2], &sums[3]);
      score(parallel, &sums[4], &sums[5]);
      sums[6] += counted.sum().item<double>();
      if (i == 0 && ctx.run().rank == 0)
        for (int64_t r = 0; r < std::min<int64_t>(samples_, labels.size(0)); ++r)
          page.push_back({png_data_uri(tensor_to_image(images[r])), caps[static_cast<size_t>(r)],
                          tok.decode(until_eos(greedy[r], tok.eos_id())), tok.decode(until_eos(parallel[r], tok.eos_id()))});
    }
    // The tp and pp ranks of a replica computed the same sums: its first counts them.
    if (!counts_) std::fill(std::begin(sums), std::end(sums), 0.0);
    comm::allreduce(*ch_, sums, 7, comm::Op::sum, "caption evaluation sums of step " + std::to_string(ctx.step()));
    const double rows = std::max(sums[1], 1.0), tokens = std::max(sums[6], 1.0);
    const double loss = sums[0] / rows, acc = sums[2] / tokens, exact = sums[3] / rows;
    const double pacc = sums[4] / tokens, pexact = sums[5] / rows;
    ctx.out("loss", loss);
    ctx.out("token_acc", acc);
    ctx.out("exact_match", exact);
    ctx.out("parallel_token_acc", pacc);
    ctx.out("parallel_exact_match", pexact);
    if (ctx.run().rank != 0) return;
    std::string where;
    if (!page.empty()) where = ", " + write_page(ctx, page, loss, acc, exact, pacc, pexact, static_cast<int64_t>(sums[1]));
    spdlog::info("{} step {}: {} loss {:.4g}, greedy token acc {:.3f} exact {:.3f}, parallel token acc {:.3f} exact {:.3f} "
                 "({} captions, {:.1f} s{})",
                 ctx.name(), ctx.step(), opts_.split, loss, acc, exact, pacc, pexact, static_cast<int64_t>(sums[1]),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), where);
  }

 private:
  // OUT_DIR/samples/step_NNNNNNN.html; returns its path.
  std::string write_page(const StepContext& ctx, const std::vector<Sample>& page, double loss, double acc, double exact,
                         double pacc, double pexact, int64_t captions) const {
    char name[32];
    std::snprintf(name, sizeof name, "step_%07lld.html", static_cast<long long>(ctx.step()));
    const std::string dir = ctx.run().out_dir + "/samples";
    std::filesystem::create_directories(dir);
    char figures[256];
    std::snprintf(figures, sizeof figures,
                  "%s split, %lld captions: loss %.4g; greedy token accuracy %.3f, exact match %.3f; parallel token "
                  "accuracy %.3f, exact match %.3f",
                  opts_.split.c_str(), static_cast<long long>(captions), loss, acc, exact, pacc, pexact);
    std::string h = "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + html_escape(ctx.name()) + " step " +
                    std::to_string(ctx.step()) +
                    "</title>\n<style>body{font-family:sans-serif;margin:1.5em}td{padding:6px 12px;border-bottom:1px "
                    "solid #ddd;vertical-align:middle}img{width:96px;height:96px;image-rendering:pixelated}"
                    ".ok{color:#080}.bad{color:#b00}th{text-align:left}</style></head><body>\n<h1>" +
                    html_escape(ctx.name()) + ", step " + std::to_string(ctx.step()) + "</h1>\n<p>" + figures +
                    "</p>\n<table>\n<tr><th>image</th><th>reference</th><th>greedy</th><th>parallel</th></tr>\n";
    for (const Sample& s : page) {
      auto cell = [&](const std::string& text) {
        return "<td class=\"" + std::string(text == s.reference ? "ok" : "bad") + "\">" + html_escape(text) + "</td>";
      };
      h += "<tr><td><img src=\"" + s.image + "\" alt=\"sample\"></td><td>" + html_escape(s.reference) + "</td>" +
           cell(s.greedy) + cell(s.parallel) + "</tr>\n";
    }
    h += "</table>\n</body></html>\n";
    write_file_atomic(dir + "/" + name, h);
    return dir + "/" + name;
  }

  const Objective* objective_ = nullptr;
  const Captioning* captioning_ = nullptr;  // objective_'s
  EvalOptions opts_;
  int64_t samples_ = 0;
  std::shared_ptr<comm::Channel> ch_;
  std::shared_ptr<parallel::Group> tp_group_;  // run.parallel.tp > 1: the split model's collectives
  std::shared_ptr<parallel::Group> dp_group_;  // dp > 1: a ZeRO-3 model's gathers (train/fully_sharded.hpp)
  std::shared_ptr<parallel::Group> pp_group_;  // run.parallel.pp > 1: the stages' activations (StageChannel)
  bool counts_ = true;  // the first rank of its replica: its sums count (parallel::Replica::first)
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(caption_evaluator, flowrun::CaptionEvaluatorNode)
