// packed_shards: documents packed whole into rows, with a loss mask, restarting positions and
// segments for a block-diagonal attention mask. Schema: schemas/packed_shards.yaml. Test:
// tests/nodes/packed_shards_test.cpp. Packing and the batch's tensors: packed_shards.hpp.
#include "data/packed_shards.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <numeric>
#include <stdexcept>

#include "common/device.hpp"
#include "common/memory.hpp"
#include "common/seed.hpp"
#include "data/cursor.hpp"
#include "hash.hpp"
#include "parallel/mesh.hpp"
#include "registry.hpp"

#include <spdlog/spdlog.h>

namespace flowrun {

double PackingStats::fill() const {
  return rows > 0 ? static_cast<double>(tokens) / (static_cast<double>(rows) * static_cast<double>(row_len)) : 0.0;
}

// ---- packing ------------------------------------------------------------------------------

PackedRows::PackedRows(std::shared_ptr<const IndexedDataset> tokens, std::shared_ptr<const IndexedDataset> mask, int64_t seq_len,
                       bool bfd, bool split_overlong, int64_t pad)
    : tokens_(std::move(tokens)), mask_(std::move(mask)), row_len_(seq_len + 1), pad_(pad), bfd_(bfd) {
  if (seq_len < 1) throw std::invalid_argument("seq_len must be >= 1");
  const IndexedDataset& d = *tokens_;
  const int64_t docs = d.num_sequences();
  if (mask_ && (mask_->num_sequences() != docs || mask_->num_tokens() != d.num_tokens()))
    throw std::runtime_error(mask_->prefix() + ": " + std::to_string(mask_->num_sequences()) + " masks for " +
                             std::to_string(docs) + " documents in " + d.prefix() + " (made by another prep run?)");
  stats_.documents = docs, stats_.row_len = row_len_;

  // The pieces: whole documents, or row-long parts of longer ones.
  std::vector<Piece> pieces;
  for (int64_t doc = 0; doc < docs; ++doc) {
    const int64_t n = d.sequence_size(doc);
    if (mask_ && mask_->sequence_size(doc) != n)
      throw std::runtime_error(mask_->prefix() + ": document " + std::to_string(doc) + " has " +
                               std::to_string(mask_->sequence_size(doc)) + " mask values for " + std::to_string(n) + " tokens");
    if (n > row_len_) {
      if (!split_overlong) {
        ++stats_.dropped;
        continue;
      }
      ++stats_.split;
    }
    for (int64_t off = 0; off < n; off += row_len_)
      if (std::min(row_len_, n - off) >= 2) pieces.push_back({doc, off, std::min(row_len_, n - off)});
  }
  if (bfd_) {
    // Best-fit decreasing: longest first (ties in document order), each into the fullest row it fits.
    std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.len > b.len; });
    std::multimap<int64_t, size_t> room;  // space left -> row
    for (const Piece& p : pieces) {
      auto it = room.lower_bound(p.len);
      size_t row;
      int64_t left;
      if (it == room.end()) {
        row = rows_.size(), left = row_len_;
        rows_.emplace_back();
      } else {
        row = it->second, left = it->first;
        room.erase(it);
      }
      rows_[row].push_back(p);
      if (left - p.len > 1) room.emplace(left - p.len, row);  // one token more would teach nothing
    }
  } else {
    for (const Piece& p : pieces) rows_.push_back({p});
  }

  // Each row's counted targets: token t of a piece (t >= 1) when its mask is 1.
  std::vector<int64_t> start(static_cast<size_t>(docs) + 1, 0);  // each document's offset in the token stream
  for (int64_t doc = 0; doc < docs; ++doc) start[doc + 1] = start[doc] + d.sequence_size(doc);
  std::vector<int64_t> m;
  targets_.assign(rows_.size(), 0);
  for (size_t r = 0; r < rows_.size(); ++r) {
    for (const Piece& p : rows_[r]) {
      int64_t counted = p.len - 1;
      if (mask_) {
        m.resize(static_cast<size_t>(p.len));
        mask_->read_tokens(start[p.doc] + p.offset, p.len, m.data());
        counted = std::count_if(m.begin() + 1, m.end(), [](int64_t v) { return v != 0; });
      }
      targets_[r] += counted;
      stats_.tokens += p.len;
    }
    stats_.targets += targets_[r];
  }
  stats_.rows = count();
  doc_start_ = std::move(start);
}

TensorMap PackedRows::batch(const std::vector<int64_t>& rows, double scale) const {
  const int64_t B = static_cast<int64_t>(rows.size());
  // packing none: the batch is as long as its longest row
  int64_t len = row_len_;
  if (!bfd_) {
    len = 2;
    for (int64_t r : rows) len = std::max(len, rows_.at(static_cast<size_t>(r))[0].len);
  }
  const int64_t T = len - 1;
  torch::Tensor tokens = torch::full({B, len}, pad_, torch::kInt64);
  torch::Tensor loss_mask = torch::zeros({B, T}, torch::kUInt8);
  torch::Tensor positions = torch::zeros({B, T}, torch::kInt64), segments = torch::empty({B, T}, torch::kInt64);
  int64_t* tk = tokens.data_ptr<int64_t>();
  uint8_t* lm = loss_mask.data_ptr<uint8_t>();
  int64_t *pos = positions.data_ptr<int64_t>(), *seg = segments.data_ptr<int64_t>();
  std::vector<int64_t> m;
  for (int64_t b = 0; b < B; ++b) {
    if (rows[b] < 0 || rows[b] >= count())
      throw std::out_of_range(tokens_->prefix() + ": no packed row " + std::to_string(rows[b]) + " (" + std::to_string(count()) + ")");
    const auto& pieces = rows_[static_cast<size_t>(rows[b])];
    int64_t at = 0, s = 0;
    for (const Piece& p : pieces) {
      tokens_->read_tokens(doc_start_[p.doc] + p.offset, p.len, tk + b * len + at);
      if (mask_) {
        m.resize(static_cast<size_t>(p.len));
        mask_->read_tokens(doc_start_[p.doc] + p.offset, p.len, m.data());
      }
      for (int64_t t = 0; t < p.len; ++t) {
        const int64_t i = at + t;  // position in the row
        if (i < T) pos[b * T + i] = t, seg[b * T + i] = s;
        if (t >= 1) lm[b * T + i - 1] = mask_ ? (m[t] != 0) : 1;  // position i-1's target is token t
      }
      at += p.len, ++s;
    }
    for (int64_t i = at; i < T; ++i) seg[b * T + i] = s;  // padding: a segment of its own
  }
  TensorMap out{{"tokens", tokens}, {"loss_mask", loss_mask}, {"loss_scale", torch::full({B}, scale, torch::kFloat32)}};
  if (bfd_) out["positions"] = positions, out["segments"] = segments;  // one document per row: positions 0.., causal is enough
  return out;
}

// ---- dataset state -------------------------------------------------------------------------

std::vector<std::string> PackedShardsDataset::splits() const {
  std::vector<std::string> names;
  for (const auto& [name, r] : splits_) names.push_back(name);
  return names;
}

const PackedRows& PackedShardsDataset::find(const std::string& split) const {
  for (const auto& [name, r] : splits_)
    if (name == split) return *r;
  throw std::invalid_argument("packed_shards dataset: no split '" + split + "' (a split is there when PREFIX." + split +
                              ".{bin,idx} exist)");
}

int64_t PackedShardsDataset::num_batches(const std::string& split, int64_t batch, int rank, int world) const {
  return fixed_pass_batches(find(split).count(), batch, rank, world, "packed_shards dataset");
}

TensorMap PackedShardsDataset::batch(const std::string& split, int64_t index, int64_t batch, int rank, int world) const {
  const PackedRows& rows = find(split);
  const std::vector<int64_t> ids = fixed_pass_rows(rows.count(), split, index, batch, rank, world, "packed_shards dataset");
  int64_t targets = 0;
  for (int64_t r : ids) targets += rows.targets(r);
  return rows.batch(ids, targets > 0 ? static_cast<double>(batch) / static_cast<double>(targets) : 0.0);
}

// ---- the node ------------------------------------------------------------------------------

namespace {

std::shared_ptr<const PackedRows> open_rows(const std::string& path, const std::string& split, int64_t seq_len, bool bfd,
                                            bool split_overlong, int64_t pad) {
  const std::string prefix = path + "." + split;
  if (!IndexedDataset::exists(prefix))
    throw std::runtime_error("no token shards at " + prefix + ".{bin,idx} (path is relative to the current folder; make them with "
                             "`flowrun prep chat --out " + path + " ...` or `flowrun prep text`)");
  auto tokens = std::make_shared<const IndexedDataset>(prefix);
  std::shared_ptr<const IndexedDataset> mask;
  if (IndexedDataset::exists(prefix + ".mask")) mask = std::make_shared<const IndexedDataset>(prefix + ".mask");
  return std::make_shared<const PackedRows>(tokens, mask, seq_len, bfd, split_overlong, pad);
}

// What the cursor reads: the rows, over a hash of every row's pieces' sizes and targets.
DataFingerprint fingerprint(const PackedRows& rows) {
  const IndexedDataset& d = rows.data();
  uint64_t h = fnv1a(std::to_string(d.num_sequences()) + " " + std::to_string(d.num_tokens()) + " " + std::to_string(rows.count()));
  for (int64_t r = 0; r < rows.count(); ++r) {
    const int64_t t = rows.targets(r);
    h = fnv1a(std::string_view(reinterpret_cast<const char*>(&t), sizeof t), h);
  }
  return {rows.count(), 3, static_cast<int64_t>(h)};
}

class PackedShardsNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    const std::string path = p.get<std::string>("path"), split = p.get<std::string>("split");
    const int64_t seq_len = p.get<int64_t>("seq_len"), batch = p.get<int64_t>("batch");
    const bool bfd = p.get<std::string>("packing") == "bfd", split_overlong = p.get<std::string>("overlong") == "split";
    const int64_t pad = p.get<int64_t>("pad_id");
    check_batch_fits(ctx.who(), std::to_string(batch) + " rows of " + std::to_string(seq_len + 1) + " tokens",
                     static_cast<double>(batch) * static_cast<double>(seq_len + 1) * 8 * 4);
    const parallel::Replica replica = parallel::replica_of(ctx.run());
    rank_ = replica.index, world_ = replica.count, batch_ = batch;

    rows_ = open_rows(path, split, seq_len, bfd, split_overlong, pad);
    const PackingStats& st = rows_->stats();
    order_ = std::make_unique<EpochOrder>(rows_->count(), batch, node_seed(ctx),
                                          path + "." + split + ": " + std::to_string(st.documents) + " documents make " +
                                              std::to_string(rows_->count()) + " rows of seq_len+1 = " +
                                              std::to_string(seq_len + 1) + " tokens");
    order_->steps_per_epoch(world_);
    spdlog::info("{}: {} documents -> {} rows of {} tokens ({}), {:.1f}% filled, {} targets counted; longer than a row: {} "
                   "{}",
                   ctx.who(), st.documents, st.rows, seq_len + 1, bfd ? "best-fit decreasing" : "one per row",
                   100.0 * st.fill(), st.targets, split_overlong ? st.split : st.dropped,
                   split_overlong ? "split" : "dropped");

    std::vector<std::pair<std::string, std::shared_ptr<const PackedRows>>> splits;
    for (const char* name : {"train", "val"}) {
      if (name == split)
        splits.emplace_back(name, rows_);
      else if (IndexedDataset::exists(path + "." + name))
        splits.emplace_back(name, open_rows(path, name, seq_len, bfd, split_overlong, pad));
    }
    ctx.own_state("dataset", std::shared_ptr<Dataset>(std::make_shared<PackedShardsDataset>(std::move(splits))));
    auto cursor = std::make_shared<DataCursor>();
    cursor->data = fingerprint(*rows_);
    cursor->refuse_changed = p.get<std::string>("on_data_change") == "refuse";
    ctx.own_state("cursor", cursor);
  }

  void run(StepContext& ctx) override {
    DataCursor& cursor = ctx.state_as<DataCursor>("cursor");
    cursor.expect_step(ctx.step());
    // The whole step's targets (every rank's rows: the order is a pure function of the step).
    int64_t targets = 0;
    for (int64_t r : order_->for_step(ctx.step(), -1, world_)) targets += rows_->targets(r);
    const double scale = targets > 0 ? static_cast<double>(world_ * batch_) / static_cast<double>(targets) : 0.0;
    ctx.out("batch", to_device(rows_->batch(order_->for_step(ctx.step(), rank_, world_), scale), run_device(ctx.run())));
    cursor.batches = ctx.step();
  }

 private:
  std::shared_ptr<const PackedRows> rows_;
  std::unique_ptr<EpochOrder> order_;
  int rank_ = 0, world_ = 1;
  int64_t batch_ = 1;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(packed_shards, flowrun::PackedShardsNode)
