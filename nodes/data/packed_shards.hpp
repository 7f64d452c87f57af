// The pieces behind the packed_shards node (schemas/packed_shards.yaml), usable on their own.
//
// Documents (conversations of `flowrun prep chat`, or any token shards) are packed whole into
// rows of seq_len + 1 tokens, best-fit decreasing (TRL's default "bfd"): pieces longest first,
// each into the row with the least room that holds it, a new row when none does. A document
// longer than a row is split into row-long pieces (overlong: split) or left out (drop); a piece of
// one token teaches nothing and is left out. With packing none, each document is a row of its
// own, the batch padded to its longest row.
//
// A row's batch tensors, for T = the row length - 1 positions:
//   tokens     int64 [B, T+1]   the pieces one after another, then the pad id
//   loss_mask  uint8 [B, T]     1 where position i's target (token i+1) is counted: token i+1 is in
//                               the same piece as token i and its mask (PREFIX.SPLIT.mask, e.g. the
//                               assistant's tokens) is 1; so no target crosses a document boundary
//   positions  int64 [B, T]     each token's index in its piece: the rotary positions restart
//   segments   int64 [B, T]     the piece each token belongs to (0, 1, ...; padding its own): the
//                               model attends only within a segment (a block-diagonal causal mask);
//                               these two with packing bfd only (one document per row needs neither)
//   loss_scale float [B]        world x batch / (the targets counted in the whole step, over all
//                               ranks): lm_loss sums its counted targets' losses times this and
//                               divides by the rows, so the gradient averaged over micro-batches
//                               and ranks is the sum over the global batch's targets divided by
//                               their count (as TRL's num_items_in_batch); the evaluator's batches
//                               get rows / their own targets (their mean)
// The model computes each document as if it were alone in the row.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/tensor_map.hpp"
#include "data/dataset.hpp"
#include "data/epoch_order.hpp"
#include "formats/indexed_dataset.hpp"

namespace flowrun {

struct PackingStats {
  int64_t documents = 0, rows = 0, tokens = 0, targets = 0, row_len = 0;
  int64_t split = 0, dropped = 0;  // documents longer than a row
  double fill() const;             // tokens / (rows x row_len): 1 - the padding's share
};

class PackedRows {
 public:
  // `mask`: a uint8 dataset beside `tokens` with the same document sizes, or null (every target
  // counts). `bfd`: pack, else one document per row. `split_overlong`: else drop. `pad`: the id
  // padding takes (its targets never count).
  PackedRows(std::shared_ptr<const IndexedDataset> tokens, std::shared_ptr<const IndexedDataset> mask, int64_t seq_len, bool bfd,
             bool split_overlong, int64_t pad);
  int64_t count() const { return static_cast<int64_t>(rows_.size()); }
  int64_t targets(int64_t row) const { return targets_.at(static_cast<size_t>(row)); }
  const PackingStats& stats() const { return stats_; }
  const IndexedDataset& data() const { return *tokens_; }
  // The rows' tensors (above) with loss_scale = `scale` for every row.
  TensorMap batch(const std::vector<int64_t>& rows, double scale) const;

 private:
  struct Piece {
    int64_t doc, offset, len;
  };
  std::shared_ptr<const IndexedDataset> tokens_, mask_;
  int64_t row_len_, pad_;
  bool bfd_;
  std::vector<std::vector<Piece>> rows_;
  std::vector<int64_t> targets_;
  std::vector<int64_t> doc_start_;  // each document's offset in the token stream
  PackingStats stats_;
};

// The `dataset` state: fixed passes over each split's rows in order, sharded by rank as
// token_shards' (batch i of rank r: rows i*world*batch + r*batch + [0, batch)), each batch's
// loss_scale its rows over its own targets.
class PackedShardsDataset : public Dataset {
 public:
  explicit PackedShardsDataset(std::vector<std::pair<std::string, std::shared_ptr<const PackedRows>>> splits)
      : splits_(std::move(splits)) {}
  std::vector<std::string> splits() const override;
  int64_t num_batches(const std::string& split, int64_t batch, int rank, int world) const override;
  TensorMap batch(const std::string& split, int64_t index, int64_t batch, int rank, int world) const override;

 private:
  const PackedRows& find(const std::string& split) const;
  std::vector<std::pair<std::string, std::shared_ptr<const PackedRows>>> splits_;
};

}  // namespace flowrun
