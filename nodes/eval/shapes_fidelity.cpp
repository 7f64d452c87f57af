// shapes_fidelity: do generated images show what their prompts asked for? Scores each image
// against its caption with the shapes set's own checks (data/shapes.hpp: background color,
// shape color at the prompted place, size), per prompt and overall.
// Schema: schemas/shapes_fidelity.yaml. Test: tests/nodes/shapes_fidelity_test.cpp.
//
// Per image, score_shape_image passes 0 to 3 of its checks; a prompt's figure is the share of
// the checks its images passed, in %, and `fidelity` is the mean over the prompts (each prompt
// counts the same however many images it has). Several ranks: each scores the images it holds
// (the sampler's rank 0 all of them, the others none), then one all-reduce of the counts gives
// every rank the same figures; the ranks must hold the same captions (checked with a hash first),
// so that count i is the same prompt everywhere.
#include "eval/shapes_fidelity.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <limits>

#include "comm.hpp"
#include "comm/state_descriptor.hpp"
#include "common/named_scalars.hpp"
#include "common/tensor_map.hpp"
#include "data/image_tensor.hpp"
#include "data/shapes.hpp"
#include "encode/tokenize.hpp"
#include "registry.hpp"

namespace flowrun {

double PromptTally::percent() const {
  if (samples == 0) return std::numeric_limits<double>::quiet_NaN();
  return 100.0 * static_cast<double>(background + color + size) / (3.0 * static_cast<double>(samples));
}

double PromptTally::share(int64_t passed) const {
  if (samples == 0) return std::numeric_limits<double>::quiet_NaN();
  return 100.0 * static_cast<double>(passed) / static_cast<double>(samples);
}

namespace {

// The distinct captions, in the order of first appearance, as empty tallies; `index` (when
// given) gets each caption's position among them.
std::vector<PromptTally> prompts_of(const std::vector<std::string>& captions, std::vector<size_t>* index = nullptr) {
  std::vector<PromptTally> out;
  for (const auto& c : captions) {
    size_t k = 0;
    while (k < out.size() && out[k].caption != c) ++k;
    if (k == out.size()) out.push_back(PromptTally{c});
    if (index) index->push_back(k);
  }
  return out;
}

}  // namespace

std::vector<PromptTally> score_captioned_images(const torch::Tensor& images, const std::vector<std::string>& captions) {
  if (images.dim() != 4 || images.size(1) != 3)
    throw std::runtime_error("expected images [N, 3, H, W], got shape " + shape_str(images));
  if (images.size(0) != static_cast<int64_t>(captions.size()))
    throw std::runtime_error(std::to_string(images.size(0)) + " images but " + std::to_string(captions.size()) +
                             " captions; give one caption per image");
  std::vector<size_t> prompt;  // of each image
  std::vector<PromptTally> tallies = prompts_of(captions, &prompt);
  std::vector<ShapeSpec> want;  // each prompt's, parsed once
  for (const auto& t : tallies) {
    try {
      want.push_back(parse_shape_caption(t.caption));
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(std::string(e.what()) + " (shapes_fidelity scores captions in the shapes set's words)");
    }
  }
  const torch::Tensor cpu = images.detach().to(torch::kCPU, torch::kFloat);
  for (size_t i = 0; i < captions.size(); ++i) {
    PromptTally& t = tallies[prompt[i]];
    const ShapeScore s = score_shape_image(tensor_to_image(cpu[static_cast<int64_t>(i)]), want[prompt[i]]);
    ++t.samples;
    t.background += s.background_ok;
    t.color += s.color_ok;
    t.size += s.size_ok;
    t.kind += s.kind_ok;
  }
  return tallies;
}

namespace {

class ShapesFidelityNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    ch_ = comm::Channel::create(ctx.name());  // collective: setup runs in file order on every rank
  }

  void run(StepContext& ctx) override {
    ctx.sync("images");  // the host reads the pixels (a sampler on a device)
    const auto& images = ctx.in<TensorMap>("images");
    const auto& captions = ctx.in<TextBatch>("captions");
    const std::string at = ctx.who() + " step " + std::to_string(ctx.step());
    std::vector<PromptTally> tallies;
    if (images.empty()) {
      tallies = prompts_of(captions);  // this rank holds no images (a sampler on rank > 0)
    } else {
      auto it = images.find("image");
      if (it == images.end())
        throw std::runtime_error(at + ": its images input has no 'image' (keys: " + keys_of(images) +
                                 "); connect a sampler's samples with a vae (decoded RGB) or an image batch");
      try {
        tallies = score_captioned_images(it->second, captions);
      } catch (const std::exception& e) {
        throw std::runtime_error(at + ": " + e.what());
      }
    }
    if (tallies.empty()) throw std::runtime_error(at + ": no captions to score");

    // Same prompts on every rank (every rank sees every rank's hash, so all decide alike)? Then
    // the counts line up: one sum gives everyone the totals.
    const size_t n = tallies.size();
    std::string prompts;
    for (const auto& t : tallies) prompts += t.caption + '\n';
    const uint64_t mine = descriptor_hash(prompts);
    std::vector<uint64_t> hashes(static_cast<size_t>(comm::size()));
    ch_->allgather(&mine, hashes.data(), sizeof mine, at + ": captions check").wait();
    if (std::any_of(hashes.begin(), hashes.end(), [&](uint64_t h) { return h != hashes[0]; }))
      throw std::runtime_error(at + ": the ranks hold different captions; shapes_fidelity needs the same prompts on "
                               "every rank (a sampler's samples and captions, not a data node's batch)");
    constexpr size_t kCounts = 5;  // per prompt: samples, then each check's passes
    std::vector<double> counts;
    for (const auto& t : tallies)
      for (int64_t c : {t.samples, t.background, t.color, t.size, t.kind}) counts.push_back(static_cast<double>(c));
    comm::allreduce(*ch_, counts.data(), counts.size(), comm::Op::sum, at + ": counts");

    NamedScalars per_prompt, per_prompt_color;
    PromptTally all;
    double sum = 0;
    const PromptTally* worst = nullptr;
    for (size_t i = 0; i < n; ++i) {
      PromptTally& t = tallies[i];
      const double* c = &counts[kCounts * i];
      t.samples = static_cast<int64_t>(c[0]);
      t.background = static_cast<int64_t>(c[1]);
      t.color = static_cast<int64_t>(c[2]);
      t.size = static_cast<int64_t>(c[3]);
      t.kind = static_cast<int64_t>(c[4]);
      if (t.samples == 0)
        throw std::runtime_error(at + ": no images of \"" + t.caption + "\" on any rank; connect the images that "
                                 "go with the captions (a sampler's samples and captions)");
      per_prompt.emplace_back(t.caption, t.percent());
      per_prompt_color.emplace_back(t.caption, t.share(t.color));
      sum += t.percent();
      if (!worst || t.percent() < worst->percent()) worst = &t;
      all.samples += t.samples, all.background += t.background, all.color += t.color, all.size += t.size,
          all.kind += t.kind;
    }
    const double fidelity = sum / static_cast<double>(n);
    ctx.out("fidelity", fidelity);
    ctx.out("per_prompt", std::move(per_prompt));
    ctx.out("per_prompt_color", std::move(per_prompt_color));
    ctx.out("background", all.share(all.background));
    ctx.out("color", all.share(all.color));
    ctx.out("size", all.share(all.size));
    ctx.out("kind", all.share(all.kind));
    if (ctx.run().rank == 0)
      spdlog::info("{}: fidelity {:.1f} % over {} prompts, {} images (background {:.0f} %, color {:.0f} %, size "
                   "{:.0f} %; kind, apart, {:.0f} %); lowest {:.1f} % \"{}\"", at, fidelity, n, all.samples,
                   all.share(all.background), all.share(all.color), all.share(all.size), all.share(all.kind),
                   worst->percent(), worst->caption);
  }

 private:
  std::shared_ptr<comm::Channel> ch_;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(shapes_fidelity, flowrun::ShapesFidelityNode)
