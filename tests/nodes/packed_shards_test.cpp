// packed_shards: documents packed best-fit decreasing into rows, each row's tokens, loss mask,
// positions and segments as packed_shards.hpp says; and the point of it all: a packed batch's loss
// and gradients are the documents' own, computed one by one (no attention or target crosses a
// document), the loss normalized by the counted targets.
#include <gtest/gtest.h>

#include "data/packed_shards.hpp"
#include "data_test_helpers.hpp"
#include "formats/indexed_dataset.hpp"
#include "models/model_state.hpp"
#include "support/memory.hpp"
#include "support/run_graph.hpp"
#include "train/losses.hpp"

namespace flowrun {
namespace packed_shards_test {

// Documents (and masks) written as prep chat writes them; returns the prefix.
std::string write_docs(const std::vector<std::vector<int32_t>>& docs, const std::vector<std::vector<int32_t>>& masks) {
  const std::string p = test::temp_dir("packed") + "/chat.train";
  IndexedDatasetWriter ids(p, TokenDtype::Int32), mask(p + ".mask", TokenDtype::UInt8);
  for (size_t i = 0; i < docs.size(); ++i) ids.add_document(docs[i]), mask.add_document(masks[i]);
  ids.finish(), mask.finish();
  return p;
}

std::vector<int64_t> row(const torch::Tensor& t, int64_t r) {
  const torch::Tensor x = t[r].to(torch::kLong).contiguous();
  return std::vector<int64_t>(x.data_ptr<int64_t>(), x.data_ptr<int64_t>() + x.numel());
}

TEST(PackedRows, BestFitDecreasingKeepsDocumentsWholeAndApart) {
  // lengths 5, 3, 7, 2, 4 into rows of 8: [7], [5, 3], [4, 2] (longest first, each into the fullest row it fits)
  std::vector<std::vector<int32_t>> docs = {{10, 11, 12, 13, 14}, {20, 21, 22}, {30, 31, 32, 33, 34, 35, 36}, {40, 41}, {50, 51, 52, 53}};
  std::vector<std::vector<int32_t>> masks = {{0, 0, 1, 1, 1}, {0, 1, 1}, {1, 1, 1, 1, 1, 1, 1}, {0, 1}, {0, 0, 0, 1}};
  const std::string p = write_docs(docs, masks);
  PackedRows rows(std::make_shared<IndexedDataset>(p), std::make_shared<IndexedDataset>(p + ".mask"), /*seq_len=*/7, /*bfd=*/true,
                  /*split_overlong=*/true, /*pad=*/0);
  ASSERT_EQ(rows.count(), 3);
  EXPECT_EQ(rows.stats().tokens, 21);
  EXPECT_NEAR(rows.stats().fill(), 21.0 / 24.0, 1e-12);
  const TensorMap b = rows.batch({0, 1, 2}, 0.5);
  EXPECT_EQ(row(b.at("tokens"), 1), (std::vector<int64_t>{10, 11, 12, 13, 14, 20, 21, 22}));
  EXPECT_EQ(row(b.at("positions"), 1), (std::vector<int64_t>{0, 1, 2, 3, 4, 0, 1}));
  EXPECT_EQ(row(b.at("segments"), 1), (std::vector<int64_t>{0, 0, 0, 0, 0, 1, 1}));
  // position i's target is token i+1: counted when it is in the same document and masked in
  EXPECT_EQ(row(b.at("loss_mask"), 1), (std::vector<int64_t>{0, 1, 1, 1, 0, 1, 1}));
  EXPECT_EQ(row(b.at("tokens"), 2), (std::vector<int64_t>{50, 51, 52, 53, 40, 41, 0, 0}));
  EXPECT_EQ(row(b.at("segments"), 2), (std::vector<int64_t>{0, 0, 0, 0, 1, 1, 2}));  // padding: a segment of its own
  EXPECT_EQ(row(b.at("loss_mask"), 2), (std::vector<int64_t>{0, 0, 1, 0, 1, 0, 0}));
  EXPECT_EQ(rows.targets(0) + rows.targets(1) + rows.targets(2), 6 + 5 + 2);
  EXPECT_FLOAT_EQ(b.at("loss_scale")[0].item<float>(), 0.5f);

  // too long for a row: split into row-long pieces, or dropped
  PackedRows small(std::make_shared<IndexedDataset>(p), std::make_shared<IndexedDataset>(p + ".mask"), 3, true, true, 0);
  EXPECT_EQ(small.stats().split, 2);  // 5 -> 4 + 1 (a lone token is left out), 7 -> 4 + 3
  EXPECT_EQ(small.stats().tokens, 4 + 3 + 4 + 3 + 2 + 4);
  PackedRows dropped(std::make_shared<IndexedDataset>(p), std::make_shared<IndexedDataset>(p + ".mask"), 3, true, false, 0);
  EXPECT_EQ(dropped.stats().dropped, 2);
  EXPECT_EQ(dropped.stats().tokens, 3 + 2 + 4);
  // packing none: a document per row, the batch as long as its longest, no positions or segments
  PackedRows one(std::make_shared<IndexedDataset>(p), std::make_shared<IndexedDataset>(p + ".mask"), 7, false, true, 0);
  const TensorMap n = one.batch({1, 3}, 1.0);
  EXPECT_EQ(n.at("tokens").sizes(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(n.count("segments"), 0u);
}

// A packed batch of a tiny llama: its loss is the sum over the documents' counted targets, each
// document run alone, divided by their count; its gradients are those of that sum.
TEST(PackedRows, APackedBatchsLossAndGradientsAreTheDocumentsOwn) {
  torch::manual_seed(3);
  std::vector<std::vector<int32_t>> docs, masks;
  for (int64_t n : {9, 5, 12, 3, 7, 14, 6}) {
    const torch::Tensor t = torch::randint(0, 256, {n}, torch::kInt32), m = torch::randint(0, 2, {n}, torch::kInt32);
    docs.emplace_back(t.data_ptr<int32_t>(), t.data_ptr<int32_t>() + n);
    masks.emplace_back(m.data_ptr<int32_t>(), m.data_ptr<int32_t>() + n);
  }
  const std::string p = write_docs(docs, masks);
  PackedRows rows(std::make_shared<IndexedDataset>(p), std::make_shared<IndexedDataset>(p + ".mask"), 19, true, true, 0);
  ASSERT_LT(rows.count(), static_cast<int64_t>(docs.size()));  // documents do share rows
  std::vector<int64_t> all(static_cast<size_t>(rows.count()));
  std::iota(all.begin(), all.end(), 0);
  int64_t counted = 0;
  for (int64_t r : all) counted += rows.targets(r);
  const TensorMap batch = rows.batch(all, static_cast<double>(rows.count()) / static_cast<double>(counted));

  auto g = test::load_graph_text(R"(flowrun: 1
run: { steps: 1 }
nodes:
  model: { type: llama, with: { layers: 2, dim: 64, heads: 4, kv_heads: 2, mlp_dim: 160, vocab: 256, context: 32 } }
)");
  ModelState& s = g->state<ModelState>("model", "params");
  auto grads = [&] {
    std::vector<torch::Tensor> out;
    for (auto& q : s.trainable_parameters()) out.push_back(q.grad().clone()), q.mutable_grad() = torch::Tensor();
    return out;
  };
  torch::Tensor packed = LmLoss().loss(s, batch);
  packed.backward();
  const std::vector<torch::Tensor> packed_grads = grads();
  EXPECT_EQ(LmLoss().targets(batch), counted);

  // each document alone, its counted targets' summed losses
  torch::Tensor sum = torch::zeros({}, torch::kDouble);
  for (size_t d = 0; d < docs.size(); ++d) {
    const torch::Tensor tok = torch::tensor(std::vector<int64_t>(docs[d].begin(), docs[d].end())).unsqueeze(0);
    const torch::Tensor logits = s.forward({{"tokens", tok}}).squeeze(0);  // [n - 1, V]
    const torch::Tensor nll = torch::nn::functional::cross_entropy(
        logits, tok.squeeze(0).narrow(0, 1, tok.size(1) - 1), torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    const torch::Tensor m = torch::tensor(std::vector<int64_t>(masks[d].begin() + 1, masks[d].end())).to(torch::kFloat);
    sum = sum + (nll * m).sum().to(torch::kDouble);
  }
  const torch::Tensor alone = sum / static_cast<double>(counted);
  alone.backward();
  const std::vector<torch::Tensor> alone_grads = grads();
  EXPECT_NEAR(packed.item<double>(), alone.item<double>(), 1e-6);
  for (size_t i = 0; i < packed_grads.size(); ++i)
    EXPECT_LT((packed_grads[i] - alone_grads[i]).abs().max().item<double>(), 1e-6 + 1e-4 * alone_grads[i].abs().max().item<double>())
        << "parameter " << i;
  std::printf("%zu documents in %lld rows, %lld counted targets: packed loss %.9f, the documents alone %.9f\n", docs.size(),
              static_cast<long long>(rows.count()), static_cast<long long>(counted), packed.item<double>(), alone.item<double>());
}

// With a loss mask the model computes its head on the counted rows only (lm_loss passes them as
// loss_rows): a chat batch whose prompts are 70 % of its tokens keeps a third of the logits a batch
// scored whole keeps, with a vocabulary of Qwen 3's size (what TRL's chunked NLL is for).
TEST(PackedRows, AMaskedBatchComputesTheLogitsOfItsCountedRowsOnly) {
  auto g = test::load_graph_text(R"(flowrun: 1
run: { steps: 1 }
nodes:
  model: { type: llama, with: { layers: 1, dim: 16, heads: 2, kv_heads: 1, mlp_dim: 32, vocab: 151669, context: 128 } }
)");
  ModelState& s = g->state<ModelState>("model", "params");
  const int64_t B = 4, T = 64;
  TensorMap whole = {{"tokens", torch::randint(0, 151669, {B, T + 1}, make_cpu_generator(2), torch::kLong)}};
  TensorMap masked = whole;
  masked["loss_mask"] = (torch::arange(T) >= static_cast<int64_t>(0.7 * T)).to(torch::kUInt8).expand({B, T}).contiguous();
  masked["loss_scale"] = torch::full({B}, static_cast<double>(B) / static_cast<double>(masked["loss_mask"].sum().item<int64_t>()));
  double kept[2];
  for (int k = 0; k < 2; ++k) {
    const double before = test::malloc_in_use();
    torch::Tensor loss = LmLoss().loss(s, k == 0 ? whole : masked);
    kept[k] = test::malloc_in_use() - before;
    loss.backward();
  }
  std::printf("vocabulary 151,669, %lld x %lld tokens, 30 %% of them counted: the loss's forward keeps %.1f MB, %.1f MB scored whole\n",
              static_cast<long long>(B), static_cast<long long>(T), kept[1] / 1e6, kept[0] / 1e6);
  EXPECT_LT(kept[1], 0.45 * kept[0]);
}

}  // namespace packed_shards_test
}  // namespace flowrun
