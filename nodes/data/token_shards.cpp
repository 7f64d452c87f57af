// token_shards: batches of token windows from Megatron indexed-dataset shards (made by
// `flowrun prep text`). Schema: schemas/token_shards.yaml. Test: tests/nodes/token_shards_test.cpp.
// Window and order rules: token_shards.hpp.
#include "data/token_shards.hpp"

#include <algorithm>
#include <chrono>
#include <thread>

#include <filesystem>
#include <stdexcept>

#include "parallel/mesh.hpp"
#include "common/device.hpp"
#include "common/memory.hpp"
#include "common/seed.hpp"
#include "data/cursor.hpp"
#include "data/shuffle.hpp"
#include "hash.hpp"
#include "registry.hpp"

namespace flowrun {

namespace {
}

// ---- windows -------------------------------------------------------------------------------

TokenWindows::TokenWindows(std::shared_ptr<const IndexedDataset> data, int64_t seq_len)
    : data_(std::move(data)), seq_len_(seq_len), count_(0) {
  if (seq_len < 1) throw std::invalid_argument("seq_len must be >= 1");
  if (!dtype_is_integer(data_->dtype()))
    throw std::runtime_error(data_->prefix() + ".idx: dtype " + dtype_name(data_->dtype()) + " holds no token ids");
  // The last window needs seq_len + 1 tokens from its start.
  count_ = data_->num_tokens() > seq_len ? (data_->num_tokens() - 1) / seq_len : 0;
}

TensorMap TokenWindows::batch(const std::vector<int64_t>& ids) const {
  const auto rows = static_cast<int64_t>(ids.size()), cols = seq_len_ + 1;
  torch::Tensor t = torch::empty({rows, cols}, torch::kInt64);
  int64_t* out = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    if (ids[i] < 0 || ids[i] >= count_)
      throw std::out_of_range(data_->prefix() + ": no window " + std::to_string(ids[i]) + " (" + std::to_string(count_) + " windows)");
    read(ids[i], out + i * cols);
  }
  return {{"tokens", t}};
}

// ---- training order ------------------------------------------------------------------------

TokenShardSampler::TokenShardSampler(TokenWindows windows, int64_t batch, uint64_t seed)
    : windows_(std::move(windows)),
      order_(windows_.count(), batch, seed,
             windows_.data().prefix() + ".{bin,idx}: " + std::to_string(windows_.data().num_tokens()) + " tokens make " +
                 std::to_string(windows_.count()) + " windows of seq_len+1 = " + std::to_string(windows_.seq_len() + 1) + " tokens") {}

// ---- dataset state -------------------------------------------------------------------------

std::vector<std::string> TokenShardsDataset::splits() const {
  std::vector<std::string> names;
  for (const auto& [name, w] : splits_) names.push_back(name);
  return names;
}

const TokenWindows& TokenShardsDataset::find(const std::string& split) const {
  for (const auto& [name, w] : splits_)
    if (name == split) return w;
  std::string have;
  for (const auto& [name, w] : splits_) have += (have.empty() ? "" : ", ") + name;
  throw std::invalid_argument("token_shards dataset: no split '" + split + "' (have: " + have +
                              "; a split is there when PREFIX." + split + ".{bin,idx} exist)");
}

int64_t TokenShardsDataset::num_batches(const std::string& split, int64_t batch, int rank, int world) const {
  return fixed_pass_batches(find(split).count(), batch, rank, world, "token_shards dataset");
}

TensorMap TokenShardsDataset::batch(const std::string& split, int64_t index, int64_t batch, int rank, int world) const {
  return find(split).batch(fixed_pass_rows(find(split).count(), split, index, batch, rank, world, "token_shards dataset"));
}

// ---- the node ------------------------------------------------------------------------------

namespace {

std::shared_ptr<const IndexedDataset> open_split(const std::string& path, const std::string& split) {
  const std::string prefix = path + "." + split;
  if (!IndexedDataset::exists(prefix))
    throw std::runtime_error("no token shards at " + prefix + ".{bin,idx} (path is relative to the current folder; make them with "
                             "`flowrun prep text --out " + path + " ...`, or scripts/data.sh for data/text/fortunes_*)");
  return std::make_shared<const IndexedDataset>(prefix);  // validates; errors name the file
}

// What the cursor reads: the windows, over a hash of every document's size and of the first and
// last tokens (a rebuilt corpus changes one or the other).
DataFingerprint fingerprint(const TokenWindows& w) {
  const IndexedDataset& d = w.data();
  uint64_t h = fnv1a(std::to_string(d.num_sequences()) + " " + std::to_string(d.num_tokens()));
  for (int64_t i = 0; i < d.num_sequences(); ++i) {
    const int32_t n = d.sequence_size(i);
    h = fnv1a(std::string_view(reinterpret_cast<const char*>(&n), sizeof n), h);
  }
  const int64_t ends = std::min<int64_t>(4096, d.num_tokens());
  std::vector<int64_t> tokens(static_cast<size_t>(ends));
  for (const int64_t at : {int64_t{0}, d.num_tokens() - ends}) {
    d.read_tokens(at, ends, tokens.data());
    h = fnv1a(std::string_view(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(int64_t)), h);
  }
  return {w.count(), 2, static_cast<int64_t>(h)};
}

class TokenShardsNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    const std::string path = p.get<std::string>("path"), split = p.get<std::string>("split");
    const int64_t seq_len = p.get<int64_t>("seq_len"), batch = p.get<int64_t>("batch");
    delay_ms_ = p.get<int64_t>("delay_ms");
    check_batch_fits(ctx.who(), std::to_string(batch) + " windows of " + std::to_string(seq_len + 1) + " int64 tokens",
                     static_cast<double>(batch) * static_cast<double>(seq_len + 1) * 8);
    const uint64_t seed = node_seed(ctx);
    const parallel::Replica replica = parallel::replica_of(ctx.run());  // the tp ranks of a replica read the same batches
    rank_ = replica.index, world_ = replica.count;

    TokenWindows own(open_split(path, split), seq_len);
    sampler_ = std::make_unique<TokenShardSampler>(own, batch, seed);
    sampler_->steps_per_epoch(world_);  // fail now, not at step 1, if the split is too small

    // The dataset state: this split, and the other one if its files exist.
    std::vector<std::pair<std::string, TokenWindows>> splits;
    for (const char* name : {"train", "val"}) {
      if (name == split)
        splits.emplace_back(name, own);
      else if (IndexedDataset::exists(path + "." + name))
        splits.emplace_back(name, TokenWindows(open_split(path, name), seq_len));
    }
    ctx.own_state("dataset", std::shared_ptr<Dataset>(std::make_shared<TokenShardsDataset>(std::move(splits))));
    auto cursor = std::make_shared<DataCursor>();
    cursor->data = fingerprint(own);
    cursor->refuse_changed = p.get<std::string>("on_data_change") == "refuse";
    ctx.own_state("cursor", cursor);
  }

  void run(StepContext& ctx) override {
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));  // slow on purpose
    // The batch is a pure function of the step; the cursor only records how far we got. It
    // must agree: a cursor restored from a checkpoint of step k is followed by step k + 1.
    DataCursor& cursor = ctx.state_as<DataCursor>("cursor");
    cursor.expect_step(ctx.step());
    ctx.out("batch", to_device(sampler_->batch(ctx.step(), rank_, world_), run_device(ctx.run())));
    cursor.batches = ctx.step();
  }

 private:
  std::unique_ptr<TokenShardSampler> sampler_;
  int rank_ = 0, world_ = 1;
  int64_t delay_ms_ = 0;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(token_shards, flowrun::TokenShardsNode)
