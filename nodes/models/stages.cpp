// Pipeline stages' view of a model (stages.hpp).
#include "models/stages.hpp"

#include <algorithm>
#include <optional>
#include <stdexcept>

#include "common/seed.hpp"
#include "models/dropout.hpp"
#include "parallel/tensor_messages.hpp"

namespace flowrun {

bool Stages::holds(int chunk) const { return std::find(mine.begin(), mine.end(), chunk) != mine.end(); }

void Stages::check(int64_t count, const std::string& model) const {
  int at = 0;
  for (const auto& [first, last] : blocks) {
    if (first != at || last <= first)
      throw std::runtime_error(model + ": the pipeline chunks are not consecutive runs of blocks");
    at = last;
  }
  if (at != count || blocks.empty())
    throw std::runtime_error(model + ": the pipeline chunks do not cover the " + std::to_string(count) + " blocks");
  for (int k : mine)
    if (k < 0 || k >= chunks()) throw std::runtime_error(model + ": no pipeline chunk " + std::to_string(k));
}

bool Stages::holds_block(int block) const {
  for (int k : mine)
    if (block >= blocks[static_cast<size_t>(k)].first && block < blocks[static_cast<size_t>(k)].second) return true;
  return false;
}

namespace {
thread_local StageCall* g_call = nullptr;
thread_local parallel::Group* g_channel = nullptr;
}  // namespace

StageCall::StageCall(int c, const TensorMap& i) : chunk(c), in(i), previous_(g_call) { g_call = this; }
StageCall::~StageCall() { g_call = previous_; }
StageCall* StageCall::current() { return g_call; }

StageChannel::StageChannel(parallel::Group* group) : previous_(g_channel) { g_channel = group; }
StageChannel::~StageChannel() { g_channel = previous_; }
parallel::Group* StageChannel::current() { return g_channel; }

torch::Tensor staged_forward(const Stages& stages, const c10::Device& device,
                             const std::function<TensorMap(int k, const TensorMap& in)>& chunk) {
  const int last = stages.chunks() - 1, p = stages.stages;
  if (StageCall* call = StageCall::current()) {
    // A later chunk's own draws (its dropout masks): the micro-batch's scope seeded for the chunk,
    // so no two chunks draw the same masks (the objective's draws before the model, and chunk 0's,
    // are the scope's own, as one process draws them).
    std::optional<TrainingScope> own;
    TrainingScope::Snapshot scope;
    if (call->chunk > 0 && TrainingScope::snapshot(scope)) {
      own.emplace(mix_seed({scope.seed, static_cast<uint64_t>(call->chunk)}));
      own->set_rows(scope.rows_seed, scope.first_row);
    }
    TensorMap out = chunk(call->chunk, call->in);
    if (call->chunk == last) return out.at("output");
    call->out = std::move(out);
    throw StageCall::Done{};
  }
  parallel::Group* group = StageChannel::current();
  if (!group)
    throw std::logic_error("this rank holds pipeline stages of the model only (run.parallel.pp): a node that runs it "
                           "must open a StageChannel over its pp ranks (forward_backward, evaluator and sampler do)");
  // This rank's chunks in order; chunk k's inputs from the stage of chunk k - 1, which sends them
  // in its own chunk order, the same order they are needed in here.
  parallel::Outbox out;
  torch::Tensor output;
  for (int k : stages.mine) {
    TensorMap in;
    if (k > 0) {
      parallel::Message m = parallel::recv_tensors(*group, (k - 1) % p, device);
      in = TensorMap(m.tensors.begin(), m.tensors.end());
    }
    TensorMap next = chunk(k, in);
    if (k == last) output = next.at("output");
    else parallel::send_tensors(*group, (k + 1) % p, "chunk " + std::to_string(k), {next.begin(), next.end()}, out);
  }
  // The output, from the last chunk's stage to every other.
  const int from = last % p;
  if (group->rank() == from) {
    for (int q = 0; q < p; ++q)
      if (q != from) parallel::send_tensors(*group, q, "output", {{"output", output}}, out);
  } else {
    output = parallel::recv_tensors(*group, from, device).tensors.at("output");
  }
  out.wait();
  return output;
}

}  // namespace flowrun
