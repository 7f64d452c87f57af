// evaluator: a model's mean loss on fixed batches of a held-out split.
// Schema: schemas/evaluator.yaml. Test: tests/nodes/evaluator_test.cpp.
//
// Several ranks: each scores its own shard (Dataset::batch shards by rank), then one
// all-reduce of (sum of loss * targets, targets, batches) on the node's channel gives every
// rank the same global token-weighted mean.
#include "eval/evaluator.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <limits>

#include "parallel/mesh.hpp"
#include "parallel/expert_parallel.hpp"
#include "parallel/tensor_parallel.hpp"
#include "comm.hpp"
#include "encode/text_encode.hpp"
#include "encode/tokenize.hpp"
#include "registry.hpp"
#include "train/fully_sharded.hpp"

namespace flowrun {

EvalResult evaluate(ModelState& model, const Dataset& data, const Objective& objective, const EvalOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  // Eval mode = no TrainingScope (models/dropout.hpp). module->eval() is not called: the
  // module is shared with forward_backward, which may be reading it at the same time.
  torch::NoGradGuard no_grad;
  const int64_t available = data.num_batches(o.split, o.batch, o.rank, o.world);
  const int64_t n = std::min(o.batches, available);
  if (n <= 0)
    throw std::runtime_error("split '" + o.split + "' holds no batch of " + std::to_string(o.batch) +
                             " rows for this process; lower `batch` or add data");
  const c10::Device device = model_device(model);
  // Sum of loss * targets, kept on the model's device: read back once at the end.
  torch::Tensor sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(device));
  int64_t targets = 0;
  for (int64_t i = 0; i < n; ++i) {
    TensorMap batch = to_device(data.batch(o.split, i, o.batch, o.rank, o.world), device);
    if (o.cond) batch = merge_batches(batch, o.cond(i, batch));
    check_needs(objective, batch);
    const int64_t t = objective.targets(batch);
    torch::Tensor loss;
    {
      AutocastScope autocast(o.precision, device);
      loss = objective.loss(model, batch);
    }
    sum += loss.detach().to(torch::kDouble) * static_cast<double>(t);
    targets += t;
  }
  EvalResult r;
  r.batches = n;
  r.targets = targets;
  r.loss_sum = sum.item<double>();
  r.loss = targets > 0 ? r.loss_sum / static_cast<double>(targets) : std::numeric_limits<double>::quiet_NaN();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

EvalOptions eval_options(const SetupContext& ctx) {
  const Params& p = ctx.params();
  EvalOptions o;
  o.split = p.get<std::string>("split");
  o.batches = p.get<int64_t>("batches");
  o.batch = p.get<int64_t>("batch");
  const parallel::Replica replica = parallel::replica_of(ctx.run());  // the tp ranks of a replica score the same batches
  o.rank = replica.index;
  o.world = replica.count;
  return o;
}

void check_eval_split(const Dataset& data, const EvalOptions& o, const std::string& who) {
  std::string have;
  bool found = false;
  for (const auto& s : data.splits()) {
    found = found || s == o.split;
    have += (have.empty() ? "" : ", ") + s;
  }
  if (!found) throw std::runtime_error(who + ": the dataset has no split '" + o.split + "'; it has {" + have + "}");
  // Now rather than at the first evaluation, where a rank with an empty shard would fail
  // alone while the others wait for it in the all-reduce.
  if (data.num_batches(o.split, o.batch, o.rank, o.world) <= 0)
    throw std::runtime_error(who + ": split '" + o.split + "' holds no batch of " + std::to_string(o.batch) +
                             " rows per rank for " + (o.world > 1 ? std::to_string(o.world) + " ranks" : "one process") +
                             "; lower `batch` or add data");
}

namespace {

class EvaluatorNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    objective_ = &ctx.state_as<Objective>("objective");
    // The outputs other nodes read besides `loss` must be ones the objective reports.
    std::string offered;
    for (const auto& r : objective_->reports()) offered += (offered.empty() ? "" : ", ") + r.name;
    for (const auto& port : ctx.value_outputs()) {
      if (port == "loss") continue;
      bool found = false;
      for (const auto& r : objective_->reports()) found = found || r.name == port;
      if (!found)
        throw std::runtime_error(ctx.who() + ": a node reads its output '" + port + "', but objective " + objective_->type +
                                 (offered.empty() ? " reports nothing beside loss" : " reports only {" + offered + "}"));
    }
    opts_ = eval_options(ctx);
    opts_.precision = run_precision(ctx.run());
    ch_ = comm::Channel::create(ctx.name());  // collective: setup runs in file order on every rank
    tp_group_ = parallel::own_tp_group(ctx.name(), ctx.run());  // a split model's collectives (TpChannel)
    ep_group_ = parallel::own_ep_group(ctx.name(), ctx.run());  // a mixture of experts' all-to-alls (EpChannel)
    dp_group_ = parallel::own_dp_group(ctx.name() + " gathers", ctx.run());  // a ZeRO-3 model's gathers
    check_precision(opts_.precision, model_device(ctx.state_as<ModelState>("model")), ctx.who());
    const Dataset& data = ctx.state_as<Dataset>("data");
    // Text conditioning: the captions of each batch, tokenized and encoded as training did.
    check_text_pairs(ctx);
    with_text_ = ctx.connected("encoder");
    if (ctx.connected("vae")) {
      vae_ = &ctx.state_as<ModelState>("vae");
      if (!vae_->condition)
        throw std::runtime_error(ctx.who() + ": its vae input (a " + vae_->kind + "'s params) encodes no batches; " +
                                 "connect a vae_encode node's params");
    }
    check_eval_split(data, opts_, ctx.who());
    counts_ = parallel::replica_of(ctx.run()).first;
    if (ctx.state_as<ModelState>("model").stages)  // pipeline parallel: each batch through the stages (StageChannel)
      pp_group_ = parallel::own_pp_group(ctx.name() + " pipeline", ctx.run());
  }

  void run(StepContext& ctx) override {
    const parallel::TpChannel tp_channel(tp_group_.get());
    const parallel::EpChannel ep_channel(ep_group_.get());
    const StageChannel stage_channel(pp_group_.get());
    ShardedReader reader(ctx.state_as<ModelState>("model"), dp_group_.get(), ctx.who() + " of step " + std::to_string(ctx.step()));
    const Dataset& data = ctx.state_as<Dataset>("data");
    EvalOptions o = opts_;
    if (reader.sharded()) o.batches = reader.agreed(std::min(o.batches, data.num_batches(o.split, o.batch, o.rank, o.world)));
    if (ep_group_) {  // expert parallel: every ep rank runs as many forwards (their all-to-alls pair up)
      torch::Tensor n = torch::tensor({static_cast<double>(std::min(o.batches, data.num_batches(o.split, o.batch, o.rank, o.world)))},
                                      torch::kDouble);
      ep_group_->all_reduce(n, comm::Op::min, "expert parallel: the batches every ep rank evaluates").wait();
      o.batches = static_cast<int64_t>(n.item<double>());
    }
    if (with_text_ || vae_) {
      const TextConditioner text = text_conditioner(ctx);
      o.cond = [&, text, vae = vae_](int64_t i, const TensorMap& batch) {
        TensorMap cond;
        if (!text.empty()) {
          const std::vector<std::string> caps = data.captions(o.split, i, o.batch, o.rank, o.world);
          if (caps.empty())
            throw std::runtime_error(ctx.who() + ": the dataset has no captions to encode; disconnect tokenizer and encoder");
          cond = text.encode(caps);
        }
        if (vae) {  // as training's vae_encode, but the posterior mean: the same latents at every evaluation
          try {
            for (auto& [key, t] : vae->condition(*vae, batch)) cond[key] = std::move(t);
          } catch (const std::exception& e) {
            throw std::runtime_error(ctx.who() + ": its vae input: " + e.what());
          }
        }
        return cond;
      };
    }
    const EvalResult r = evaluate(reader.model(), data, *objective_, o);
    // Every rank's sums, added up: the mean over every target that any rank scored.
    double sums[3] = {r.loss_sum, static_cast<double>(r.targets), static_cast<double>(r.batches)};
    // The tp and pp ranks of a replica computed the same sums: its first counts them.
    if (!counts_) std::fill(std::begin(sums), std::end(sums), 0.0);
    comm::allreduce(*ch_, sums, 3, comm::Op::sum, "evaluation sums of step " + std::to_string(ctx.step()));
    const double loss = sums[1] > 0 ? sums[0] / sums[1] : std::numeric_limits<double>::quiet_NaN();
    const auto batches = static_cast<int64_t>(sums[2]);
    std::string reported;
    ctx.out("loss", loss);
    for (const auto& rep : objective_->reports()) {
      const double v = rep.of(loss);
      reported += fmt::format(" {} {:.4g}", rep.name, v);
      ctx.out(rep.name, v);
    }
    if (ctx.run().rank == 0)  // batches: of all ranks; seconds: rank 0's
      spdlog::info("{} step {}: {} loss {:.4g}{} ({} batches, {:.1f} s)", ctx.name(), ctx.step(), opts_.split, loss,
                   reported, batches, r.seconds);
  }

 private:
  const Objective* objective_ = nullptr;
  bool with_text_ = false;
  ModelState* vae_ = nullptr;  // the vae input's state (frozen: never written; its `condition`), when connected
  EvalOptions opts_;
  std::shared_ptr<comm::Channel> ch_;
  std::shared_ptr<parallel::Group> ep_group_;  // run.parallel.ep > 1: the experts' all-to-alls (EpChannel)
  std::shared_ptr<parallel::Group> tp_group_;  // run.parallel.tp > 1: the split model's collectives
  std::shared_ptr<parallel::Group> dp_group_;  // dp > 1: a ZeRO-3 model's gathers (train/fully_sharded.hpp)
  std::shared_ptr<parallel::Group> pp_group_;  // pipeline stages: the batches' activations between them
  bool counts_ = true;  // the first rank of its replica: its sums count (parallel::Replica::first)
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(evaluator, flowrun::EvaluatorNode)
