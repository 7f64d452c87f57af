// ema: an exponential moving average of a model's parameters.
// Schema: schemas/ema.yaml. Test: tests/nodes/ema_test.cpp.
#include "state/ema.hpp"

#include <algorithm>
#include <cmath>
#include <map>

#include "parallel/mesh.hpp"
#include "registry.hpp"

namespace flowrun {

EmaModel::EmaModel(const ModelState& source) {
  torch::NoGradGuard no_grad;
  ema_ = source.clone();
  std::map<std::string, torch::Tensor> mine;
  for (auto& [name, t] : ema_->named_parameters()) {
    t.set_requires_grad(false);
    mine[name] = t;
  }
  for (const auto& [name, p] : source.named_parameters(/*trainable_only=*/true)) {
    auto it = mine.find(name);
    if (it == mine.end()) throw std::runtime_error("ema: the copy of the model lacks parameter '" + name + "'");
    params_.push_back(it->second);
  }
  std::map<std::string, torch::Tensor> my_buffers;
  for (auto& [name, t] : ema_->named_buffers()) my_buffers[name] = t;
  for (const auto& [name, b] : source.named_buffers()) {
    auto it = my_buffers.find(name);
    if (it == my_buffers.end()) throw std::runtime_error("ema: the copy of the model lacks buffer '" + name + "'");
    buffers_.push_back(it->second);
  }
}

void EmaModel::update(const ModelState& source, double decay) {
  torch::NoGradGuard no_grad;
  const std::vector<torch::Tensor> src = source.trainable_parameters();
  if (src.size() != params_.size())
    throw std::runtime_error("ema: the model has " + std::to_string(src.size()) +
                             " trainable parameters, the average was made for " + std::to_string(params_.size()));
  const double w = 1.0 - decay;
  const std::vector<torch::Tensor>* from = source.shards ? nullptr : source.flat.buffers_of(src);
  if (from) flat_.ensure(params_);
  if (source.shards) {
    // ZeRO-3 (ModelState::shards): the model and its average each keep this rank's slice of the
    // flat buffer (the parameters hold nothing between uses): the average is of the slices.
    if (!ema_->shards) throw std::logic_error("ema: the model is sharded (ZeRO-3) but its average is not");
    const std::vector<torch::Tensor>& theirs = source.shards->slices();
    std::vector<torch::Tensor>& mine = ema_->shards->slices();
    for (size_t g = 0; g < mine.size(); ++g) mine[g].mul_(decay).add_(theirs[g], w);
  } else if (from && flat_.layout() == source.flat.layout()) {
    // While the model's parameters live in flat buffers (the optimizer keeps them so), the
    // average does too, in the same layout: two operations per buffer instead of two per tensor.
    const std::vector<torch::Tensor>& mine = *flat_.buffers_of(params_);
    for (size_t g = 0; g < mine.size(); ++g) mine[g].mul_(decay).add_((*from)[g], w);
  } else {
    for (size_t i = 0; i < src.size(); ++i) params_[i].mul_(decay).add_(src[i], w);
  }
  if (!buffers_.empty()) {
    const ModelState::Named bufs = source.named_buffers();
    for (size_t i = 0; i < bufs.size() && i < buffers_.size(); ++i) buffers_[i].copy_(bufs[i].second);
  }
}

double ema_decay(int64_t step, double max_decay, bool warmup, double power) {
  if (!warmup) return max_decay;
  const double n = static_cast<double>(std::max<int64_t>(step - 1, 0));
  return std::min(max_decay, 1.0 - std::pow(1.0 + n, -power));
}

namespace {

class EmaNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    decay_ = ctx.params().get<double>("decay");
    warmup_ = ctx.params().get<bool>("warmup");
    power_ = ctx.params().get<double>("power");
    // Setup runs before any step, so copying the model here reads its initial parameters.
    ModelState& source = ctx.state_as<ModelState>("model");
    ema_ = std::make_unique<EmaModel>(source);
    // For forward_backward's memory estimate: this copy (of the whole model: clone()).
    double bytes = 0;
    if (source.shards)  // ZeRO-3: this rank's slice (the parameters hold nothing between uses)
      for (const auto& t : source.shards->slices()) bytes += static_cast<double>(t.nbytes());
    else
      for (const auto& [name, t] : source.named_parameters()) bytes += static_cast<double>(t.nbytes());
    MemoryItem item{"EMA copy", ctx.name(), bytes, /*allocated=*/true, "", 0};
    if (source.shards) item.shards = parallel::replica_of(ctx.run()).count;  // over the data-parallel ranks
    source.kept.push_back(item);
    ctx.own_state("params", ema_->model());
  }

  void run(StepContext& ctx) override {
    // Runs after this step's optimizer (a read waits for the last earlier write) and
    // concurrently with the next step's forward (another read); never writes the model.
    // The decay depends only on the step, so a resumed run continues the same schedule.
    ema_->update(ctx.state_as<ModelState>("model"), ema_decay(ctx.step(), decay_, warmup_, power_));
  }

 private:
  double decay_ = 0, power_ = 0;  // setup: the schema's (defaults there)
  bool warmup_ = false;
  std::unique_ptr<EmaModel> ema_;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(ema, flowrun::EmaNode)
