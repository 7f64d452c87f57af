// forward_backward's pipeline path (pipeline.hpp): this rank's program of F / B / W operations.
#include "train/pipeline.hpp"

#include <chrono>
#include <map>
#include <optional>

#include "common/device.hpp"
#include "common/seed.hpp"
#include "models/dropout.hpp"
#include "models/linear.hpp"
#include "parallel/tensor_messages.hpp"

namespace flowrun {

namespace pl = parallel::pipeline;

namespace {

// What one (chunk, micro-batch) keeps from its forward to its backward (and its W).
struct InFlight {
  TensorMap inputs;   // chunk k - 1's outputs as leaves (their .grad() is what B sends back)
  TensorMap outputs;  // what was sent on (autograd's graph hangs off them); the last chunk: none
  torch::Tensor loss;  // the last chunk: the micro-batch's loss x its share of the rows
  std::unique_ptr<DeferredWeightGrads> deferred;  // zero_bubble: the weight gradients for W
};

// Messages from one peer arrive in the order it sent them; one needed now may be behind others
// (interleaved: chunks' messages cross), which wait here by their label. With the count of
// messages each peer sends this step (`expected`), the next one's header is asked for as soon as
// the last one is in (never earlier: receives pair up in the order they are posted), so it travels
// while this rank computes.
class Inbox {
 public:
  Inbox(parallel::Group& g, c10::Device d, std::map<int, int> expected = {})
      : group_(g), device_(d), expected_(std::move(expected)) {
    for (const auto& [peer, n] : expected_)
      if (n > 0) next_.emplace(peer, parallel::Incoming(group_, peer));
  }
  TensorMap take(int peer, const std::string& label) {
    auto& early = early_[peer];
    for (;;) {
      if (auto it = early.find(label); it != early.end()) {
        TensorMap t = std::move(it->second);
        early.erase(it);
        return t;
      }
      auto next = next_.find(peer);
      parallel::Message m = next != next_.end() ? next->second.take(device_) : parallel::recv_tensors(group_, peer, device_);
      if (next != next_.end()) next_.erase(next);
      if (--expected_[peer] > 0) next_.emplace(peer, parallel::Incoming(group_, peer));
      early.emplace(std::move(m.label), TensorMap(m.tensors.begin(), m.tensors.end()));
    }
  }

 private:
  parallel::Group& group_;
  c10::Device device_;
  std::map<int, int> expected_;
  std::map<int, parallel::Incoming> next_;  // a posted header receive, per peer
  std::map<int, std::map<std::string, TensorMap>> early_;
};

std::string label(char what, int chunk, int mb) { return std::string(1, what) + std::to_string(chunk) + "." + std::to_string(mb); }

}  // namespace

PipelineRun::PipelineRun(pl::Schedule s, std::shared_ptr<parallel::Group> g, int st)
    : schedule(std::move(s)), group(std::move(g)), stage(st) {
  const int p = schedule.config.stages, C = schedule.config.chunks();
  for (const pl::Slot& slot : schedule.ranks.at(static_cast<size_t>(stage))) {
    if (slot.op.type == pl::Op::F && slot.op.chunk > 0) ++from_peers[(slot.op.chunk - 1) % p];
    if (slot.op.type == pl::Op::B && slot.op.chunk < C - 1) ++from_peers[(slot.op.chunk + 1) % p];
  }
}

FwdBwdResult pipeline_forward_backward(ModelState& model, const TensorMap& given, const Objective& objective,
                                       const FwdBwdOptions& options, PipelineRun& run) {
  if (!model.stages) throw std::logic_error("pipeline_forward_backward: the model is not cut into stages");
  const Stages& stages = *model.stages;
  const pl::Schedule& schedule = run.schedule;
  const int p = schedule.config.stages, C = schedule.config.chunks(), M = schedule.config.microbatches;
  const c10::Device device = model_device(model);
  check_needs(objective, given);
  const TensorMap batch = to_device(given, device);
  std::vector<torch::Tensor> params = model.trainable_parameters();
  if (params.empty()) throw std::runtime_error("the model's stage has no trainable parameters");
  const size_t n = params.size();
  const bool copy = options.buffer && options.fill == GradFill::copy;
  start_grads(options, params);

  torch::AutoGradMode grad_on(true);
  const int64_t total = batch_rows(batch);
  if (M > total)
    throw std::runtime_error("run.parallel.microbatches " + std::to_string(M) + " is more than the batch's " +
                             std::to_string(total) + " rows (per data-parallel replica)");
  const std::vector<TensorMap> parts = M == 1 ? std::vector<TensorMap>{batch} : split_batch(batch, M);
  std::vector<int64_t> first_row(static_cast<size_t>(M), options.first_row);
  for (int m = 1; m < M; ++m)
    first_row[static_cast<size_t>(m)] = first_row[static_cast<size_t>(m - 1)] + batch_rows(parts[static_cast<size_t>(m - 1)]);

  parallel::Group& group = *run.group;
  parallel::Outbox outbox;
  Inbox inbox(group, device, run.from_peers);
  std::map<std::pair<int, int>, InFlight> held;  // (chunk, mb)
  torch::Tensor loss_sum;
  const bool split = schedule.config.kind == pl::Kind::zero_bubble;
  run.last_step.clear();

  for (const pl::Slot& slot : schedule.ranks.at(static_cast<size_t>(run.stage))) {
    const pl::Op op = slot.op;
    const int k = op.chunk, m = op.mb;
    const TensorMap& part = parts[static_cast<size_t>(m)];
    // An operation's time starts once its inputs are here: waiting for another stage is the bubble.
    auto started = std::chrono::steady_clock::now();
    if (op.type == pl::Op::F) {
      InFlight f;
      if (k > 0) {  // the previous chunk's outputs, as leaves of this chunk's graph
        for (auto& [name, t] : inbox.take((k - 1) % p, label('a', k - 1, m)))
          f.inputs[name] = t.is_floating_point() ? t.requires_grad_(true) : t;
        started = std::chrono::steady_clock::now();
      }
      // Micro-batch m's draws as forward_backward's (accumulate M) draw them, on every stage: the
      // objective's (diffusion's timesteps and noise) alike everywhere; a later chunk's dropout
      // masks from a seed of its own (staged_forward).
      std::optional<TrainingScope> training;
      if (options.dropout_seed) {
        training.emplace(mix_seed({*options.dropout_seed, static_cast<uint64_t>(m)}));
        training->set_rows(options.rows_seed, first_row[static_cast<size_t>(m)]);
      }
      if (split) f.deferred = std::make_unique<DeferredWeightGrads>();
      std::optional<DeferredWeightGrads::Scope> deferring;
      if (f.deferred) deferring.emplace(*f.deferred);
      AutocastScope autocast(options.precision, device);
      // The objective on every stage (models/stages.hpp): what it makes of the micro-batch is the
      // first chunk's input; a chunk before the last ends it with its outputs.
      StageCall call(k, f.inputs);
      torch::Tensor loss;
      try {
        loss = objective.loss(model, part);
      } catch (const StageCall::Done&) {
        f.outputs = std::move(call.out);
      }
      if (k == C - 1) {
        if (!loss.defined() || loss.dim() != 0)
          throw std::runtime_error("objective " + objective.type + " returned a non-scalar loss");
        const double w = static_cast<double>(batch_rows(part)) / static_cast<double>(total);
        f.loss = loss * w;
        torch::Tensor l = loss.detach() * w;
        loss_sum = loss_sum.defined() ? loss_sum + l : l;
      } else {
        if (loss.defined())
          throw std::logic_error("pipeline: chunk " + std::to_string(k) + "'s forward did not stop the objective (the "
                                 "model's forward is not staged_forward)");
        parallel::send_tensors(group, (k + 1) % p, label('a', k, m), {f.outputs.begin(), f.outputs.end()}, outbox);
      }
      held.emplace(std::make_pair(k, m), std::move(f));
    } else if (op.type == pl::Op::B) {
      InFlight& f = held.at({k, m});
      if (k == C - 1) {
        if (!f.loss.requires_grad()) throw std::runtime_error("the loss does not depend on any trainable parameter");
        f.loss.backward();
      } else {
        TensorMap grads = inbox.take((k + 1) % p, label('g', k + 1, m));
        started = std::chrono::steady_clock::now();
        std::vector<torch::Tensor> outs, gs;
        for (auto& [name, t] : f.outputs)
          if (t.requires_grad()) {
            outs.push_back(t);
            gs.push_back(grads.at(name));
          }
        if (!outs.empty()) torch::autograd::backward(outs, gs);
      }
      if (k > 0) {
        TensorMap back;
        for (auto& [name, t] : f.inputs)
          if (t.is_floating_point()) back[name] = t.grad().defined() ? t.grad() : torch::zeros_like(t);
        parallel::send_tensors(group, (k - 1) % p, label('g', k, m), {back.begin(), back.end()}, outbox);
      }
      f.loss = torch::Tensor();
      f.outputs.clear();
      if (!f.deferred) held.erase({k, m});
    } else {
      InFlight& f = held.at({k, m});
      f.deferred->flush();
      held.erase({k, m});
    }
    run.last_step.push_back({op, started, std::chrono::steady_clock::now()});
    outbox.prune();
  }
  outbox.wait();

  // The tied parameters (GPT's token table on the first and the last stage): both gradients
  // summed, first + last on both ranks (the same bits), so both copies update alike.
  const bool first = stages.first(), last = stages.last();
  if (!stages.tied.empty() && first != last) {
    std::map<std::string, torch::Tensor> mine;
    auto named = model.named_parameters(/*trainable_only=*/true);
    for (auto& [name, t] : named)
      for (const auto& tied : stages.tied)
        if (name == tied) mine[name] = t.grad().defined() ? t.grad() : torch::zeros_like(t);
    const int peer = first ? p - 1 : 0;
    parallel::Outbox out;
    parallel::send_tensors(group, peer, "tied", mine, out);
    parallel::Message theirs = parallel::recv_tensors(group, peer, device);
    out.wait();
    torch::NoGradGuard no_grad;
    for (auto& [name, t] : named) {
      auto it = theirs.tensors.find(name);
      if (it == theirs.tensors.end() || !mine.count(name)) continue;
      const torch::Tensor& a = first ? mine[name] : it->second;  // the first stage's
      const torch::Tensor& b = first ? it->second : mine[name];
      torch::Tensor sum = a + b;
      if (t.grad().defined()) t.mutable_grad().copy_(sum);
      else t.mutable_grad() = sum;
    }
  }

  // The loss, the last stage's, on every stage (its logger may be on any).
  torch::Tensor loss = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat).device(device));
  if (last) loss.copy_(loss_sum.reshape({1}).to(torch::kFloat));
  group.broadcast(loss, p - 1, "the loss of the last pipeline stage").wait();

  // Which parameters got a gradient (with a buffer attached before the step: all, its views),
  // then the gradients into the buffer (GradFill::copy), reported in reverse module order.
  std::vector<char> used(n);
  for (size_t k = 0; k < n; ++k) used[k] = params[k].grad().defined();
  if (copy)
    for (size_t k = n; k-- > 0;) options.buffer->settle(k, params[k]);
  FwdBwdResult r;
  r.loss = loss.reshape({});
  r.grads.reserve(n);
  for (size_t k = 0; k < n; ++k) r.grads.push_back(used[k] ? params[k].grad() : torch::Tensor());
  if (options.on_ready)
    for (size_t k = n; k-- > 0;) options.on_ready(static_cast<int>(k), used[k] != 0);
  return r;
}

}  // namespace flowrun
