// The attention every model family runs (models/attention.hpp): what it computes, written out
// here as the textbook formula, and the options the families need.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "models/attention.hpp"

namespace flowrun {
namespace {

// softmax(q kᵀ · scale + bias) v, heads side by side: [B, H, Lq, D] -> [B, Lq, H*D].
torch::Tensor textbook(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& bias,
                       double scale) {
  torch::Tensor s = torch::matmul(q.to(torch::kDouble), k.to(torch::kDouble).transpose(-1, -2)) * scale;
  if (bias.defined()) s = s + bias.to(torch::kDouble);
  torch::Tensor y = torch::matmul(torch::softmax(s, -1), v.to(torch::kDouble));
  return y.transpose(1, 2).reshape({q.size(0), q.size(2), q.size(1) * v.size(3)}).to(torch::kFloat);
}

TEST(Attention, IsSoftmaxOfScaledScoresPlusBiasTimesValuesWithHeadsSideBySide) {
  torch::manual_seed(1);
  torch::Tensor q = torch::randn({2, 3, 5, 8}), k = torch::randn({2, 3, 7, 8}), v = torch::randn({2, 3, 7, 4});
  torch::Tensor mask = torch::zeros({2, 1, 1, 7});  // a padding mask, as BERT's: the last two keys of row 1 hidden
  mask.index_put_({1, 0, 0, torch::indexing::Slice(5, 7)}, -1e9);
  torch::Tensor y = attention(q, k, v, {mask});
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 5, 12}));
  EXPECT_TRUE(torch::allclose(y, textbook(q, k, v, mask, 1.0 / std::sqrt(8.0)), 1e-5, 1e-6));
  AttentionOptions t5;  // T5: no 1/sqrt(d), softmax in float32
  t5.scale = 1.0;
  t5.fp32_softmax = true;
  EXPECT_TRUE(torch::allclose(attention(q, k, v, t5), textbook(q, k, v, {}, 1.0), 1e-5, 1e-6));
}

TEST(Attention, CausalQueriesSeeOnlyTheKeysUpToTheirOwnPosition) {
  torch::manual_seed(2);
  torch::Tensor q = torch::randn({1, 2, 6, 4}), k = torch::randn({1, 2, 6, 4}), v = torch::randn({1, 2, 6, 4});
  AttentionOptions causal;
  causal.causal = true;
  const torch::Tensor above = torch::ones({6, 6}).triu(1).to(torch::kBool);
  const torch::Tensor bias = torch::zeros({6, 6}).masked_fill(above, -INFINITY);
  EXPECT_TRUE(torch::allclose(attention(q, k, v, causal), textbook(q, k, v, bias, 0.5), 1e-5, 1e-6));
  // The first query sees the first key only: its output is that key's value.
  EXPECT_TRUE(torch::allclose(attention(q, k, v, causal).select(1, 0).view({2, 4}), v.select(2, 0).view({2, 4})));
}

// Past 2^25 scores the query rows go in chunks (a 1024-px VAE has 16384 positions): the same
// result, gradients included, each row's bias with its row.
TEST(Attention, LongSequencesGoInChunksOfQueryRowsWithTheSameResult) {
  torch::manual_seed(3);
  const int64_t H = 16, Lq = 1024, Lk = 4096;  // 2^26 scores: two chunks of 512 rows
  torch::Tensor q = torch::randn({1, H, Lq, 2}).requires_grad_(), k = torch::randn({1, H, Lk, 2}), v = torch::randn({1, H, Lk, 2});
  torch::Tensor bias = torch::randn({1, 1, Lq, Lk});
  torch::Tensor y = attention(q, k, v, {bias});
  torch::Tensor ref;
  {
    torch::NoGradGuard no_grad;  // in float: 2^26 scores in double would be half a gigabyte
    ref = torch::matmul(torch::softmax(torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(2.0) + bias, -1), v)
              .transpose(1, 2)
              .reshape({1, Lq, H * 2});
  }
  EXPECT_TRUE(torch::allclose(y, ref, 1e-4, 1e-5)) << (y - ref).abs().max();
  y.sum().backward();
  EXPECT_TRUE(q.grad().defined());
  EXPECT_TRUE(torch::isfinite(q.grad()).all().item<bool>());
}

// GPT's self-attention from its fused projection: on the CPU a kernel of its own (reading q, k
// and v out of the projection, the causal half skipped) whose output and gradient are the
// written-out attention's, for any length (one block of query rows, several, a partial last one)
// and with or without the mask.
TEST(Attention, SelfAttentionFromAFusedProjectionIsTheWrittenOutOneValuesAndGradients) {
  torch::manual_seed(4);
  for (const bool causal : {true, false}) {
    for (const int64_t L : {1, 5, 64, 130}) {
      const int64_t B = 2, H = 3, D = 8;
      AttentionOptions o;
      o.causal = causal;
      ASSERT_TRUE(cpu_attention_kernel_applies(torch::zeros({1, 1, 3 * H * D}), o));
      torch::Tensor qkv = torch::randn({B * L, 3 * H * D}).requires_grad_();
      torch::Tensor ref_qkv = qkv.detach().clone().requires_grad_();
      torch::Tensor y = self_attention(qkv, B, L, H, o);
      const std::vector<torch::Tensor> parts = ref_qkv.view({B, L, 3 * H * D}).split(H * D, 2);
      auto heads = [&](const torch::Tensor& t) { return t.view({B, L, H, D}).transpose(1, 2); };
      torch::Tensor ref = attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), o);
      ASSERT_EQ(y.sizes(), ref.sizes());
      EXPECT_TRUE(torch::allclose(y, ref, 1e-5, 1e-6)) << "causal " << causal << " L " << L << ": " << (y - ref).abs().max();
      const torch::Tensor g = torch::randn(y.sizes());
      y.backward(g);
      ref.backward(g);
      EXPECT_TRUE(torch::allclose(qkv.grad(), ref_qkv.grad(), 1e-4, 1e-5))
          << "causal " << causal << " L " << L << ": " << (qkv.grad() - ref_qkv.grad()).abs().max();
    }
  }
  // Under the mask the first query sees the first key only: its output is that key's value.
  AttentionOptions causal;
  causal.causal = true;
  torch::Tensor qkv = torch::randn({1, 70, 3 * 16});
  EXPECT_TRUE(torch::allclose(self_attention(qkv, 1, 70, 2, causal).select(1, 0), qkv.select(1, 0).narrow(1, 32, 16)));
  // What the kernel does not take goes the written-out way, with the same result: a bias.
  AttentionOptions biased;
  biased.bias = torch::zeros({1, 1, 1, 70});
  EXPECT_FALSE(cpu_attention_kernel_applies(qkv, biased));
  EXPECT_TRUE(torch::allclose(self_attention(qkv, 1, 70, 2, biased), self_attention(qkv, 1, 70, 2), 1e-5, 1e-6));
}

}  // namespace
}  // namespace flowrun
