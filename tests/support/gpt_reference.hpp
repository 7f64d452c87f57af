// A line-by-line transcription of Hugging Face transformers' GPT2LMHeadModel forward (eval
// mode, no cache) over a flowrun gpt module's parameters: 4-D [B, H, T, D] heads made by
// split/view/permute, matmul, division by sqrt(D), torch.where with the [context, context]
// bool `attn.bias` buffer and finfo.min, NewGELUActivation written out, addmm Conv1D.
// The fast path in nodes/models/gpt/gpt.cpp must give the same logits and grads
// (tests/nodes/gpt_test.cpp); bench/gpt_bench.cpp measures what it saves.
#pragma once
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "models/gpt/gpt.hpp"

namespace flowrun::test {

inline torch::Tensor hf_gpt2_reference_forward(gpt::GptImpl& m, const torch::Tensor& input_ids) {
  const gpt::Config& c = m.config();
  const int64_t B = input_ids.size(0), T = input_ids.size(1), C = c.dim, H = c.heads, D = C / H;
  auto conv1d = [](const torch::Tensor& x, lora::LinearImpl& l) {  // HF Conv1D.forward
    auto size_out = x.sizes().vec();
    size_out.back() = l.weight.size(1);
    return torch::addmm(l.bias, x.view({-1, x.size(-1)}), l.weight).view(size_out);
  };
  auto split_heads = [&](const torch::Tensor& t) { return t.view({B, T, H, D}).permute({0, 2, 1, 3}); };
  auto new_gelu = [](const torch::Tensor& x) {
    return 0.5 * x * (1.0 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * torch::pow(x, 3.0))));
  };
  const torch::Tensor bias = torch::ones({c.context, c.context}, torch::kBool).tril();  // h.N.attn.bias

  torch::Tensor position_ids = torch::arange(T, torch::kLong).unsqueeze(0);
  torch::Tensor hidden = torch::embedding(m.wte->weight, input_ids) + torch::embedding(m.wpe->weight, position_ids);
  for (const auto& mod : *m.h) {
    auto& blk = *mod->as<gpt::BlockImpl>();
    torch::Tensor residual = hidden;
    hidden = torch::layer_norm(hidden, {C}, blk.ln_1->weight, blk.ln_1->bias, 1e-5);
    auto qkv = conv1d(hidden, *blk.attn->c_attn).split(C, 2);
    torch::Tensor q = split_heads(qkv[0]), k = split_heads(qkv[1]), v = split_heads(qkv[2]);
    torch::Tensor w = torch::matmul(q, k.transpose(-1, -2));
    w = w / std::sqrt(static_cast<double>(D));
    torch::Tensor causal = bias.narrow(0, 0, T).narrow(1, 0, T);
    w = torch::where(causal, w, torch::full({}, std::numeric_limits<float>::lowest(), w.options()));
    w = torch::softmax(w, -1);
    torch::Tensor a = torch::matmul(w, v).permute({0, 2, 1, 3}).contiguous().view({B, T, C});
    a = conv1d(a, *blk.attn->c_proj);
    hidden = a + residual;
    residual = hidden;
    hidden = torch::layer_norm(hidden, {C}, blk.ln_2->weight, blk.ln_2->bias, 1e-5);
    hidden = conv1d(new_gelu(conv1d(hidden, *blk.mlp->fc1)), *blk.mlp->fc2);
    hidden = residual + hidden;
  }
  hidden = torch::layer_norm(hidden, {C}, m.ln_f->weight, m.ln_f->bias, 1e-5);
  return torch::matmul(hidden, m.wte->weight.t());  // lm_head, tied
}

}  // namespace flowrun::test
