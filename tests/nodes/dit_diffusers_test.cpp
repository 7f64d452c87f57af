// dit against diffusers' HunyuanDiT2DModel, written out here independently of nodes/models/dit:
//   - every tensor name and shape diffusers' module structure creates (HunyuanDiT2DModel.__init__,
//     HunyuanCombinedTimestepTextSizeStyleEmbedding, HunyuanDiTAttentionPool,
//     PixArtAlphaTextProjection, HunyuanDiTBlock, AdaLayerNormShift / Continuous, Attention with
//     qk_norm, FeedForward), for small configs with and without T5 and size/style conditioning;
//   - a checkpoint of exactly those tensors loads strictly (nothing missing, nothing left over);
//   - the forward equals a plain-op transcription of diffusers' forward (HunyuanDiT2DModel.forward
//     with HunyuanAttnProcessor2_0, the pipeline's RoPE for a grid at the base size), padded prompts
//     (mask 0 -> text_embedding_padding), pooled T5 and image-size/style embeddings included.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "common/safetensors.hpp"
#include "common/seed.hpp"
#include "models/dit/dit.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

using Shapes = std::map<std::string, std::vector<int64_t>>;
using Tensors = std::map<std::string, torch::Tensor>;

// diffusers' HunyuanDiT2DModel config (the names of its __init__ arguments). t5 == 0 is flowrun's
// one-encoder variant: diffusers' structure without text_embedder and pooler.
struct HyConfig {
  int64_t num_attention_heads = 2, attention_head_dim = 16, in_channels = 4, patch_size = 2;
  int64_t num_layers = 6;  // even, as diffusers' skip rule needs (odd counts pop an empty list there)
  double mlp_ratio = 2.0;
  bool learn_sigma = true;
  int64_t cross_attention_dim = 12, cross_attention_dim_t5 = 16, pooled_projection_dim = 24;
  int64_t text_len = 5, text_len_t5 = 4;
  bool use_style_cond_and_image_meta_size = true;
  int64_t hidden() const { return num_attention_heads * attention_head_dim; }  // hidden_size == inner_dim
};

dit::Config to_flowrun(const HyConfig& h) {
  dit::Config c;
  c.patch = h.patch_size, c.in_channels = h.in_channels, c.hidden = h.hidden(), c.depth = h.num_layers;
  c.heads = h.num_attention_heads, c.mlp_ratio = h.mlp_ratio, c.text_dim = h.cross_attention_dim;
  c.t5_dim = h.cross_attention_dim_t5, c.text_len = h.text_len, c.text_len_t5 = h.text_len_t5;
  c.pooled_projection_dim = h.pooled_projection_dim;
  c.use_style_cond_and_image_meta_size = h.use_style_cond_and_image_meta_size, c.learn_sigma = h.learn_sigma;
  c.rope_base_grid = 0;  // the transcribed forward below takes integer patch positions, as the model's own default did
  return c;
}

// The state dict diffusers' modules register, module by module.
Shapes diffusers_shapes(const HyConfig& h) {
  Shapes s;
  const int64_t D = h.hidden(), t5 = h.cross_attention_dim_t5, X = h.cross_attention_dim, hd = h.attention_head_dim;
  auto linear = [&](const std::string& n, int64_t in, int64_t out) {
    s[n + ".weight"] = {out, in};
    s[n + ".bias"] = {out};
  };
  auto layer_norm = [&](const std::string& n, int64_t dim) {
    s[n + ".weight"] = {dim};
    s[n + ".bias"] = {dim};
  };
  if (t5 > 0) {  // PixArtAlphaTextProjection(t5, 4*t5, X)
    linear("text_embedder.linear_1", t5, 4 * t5);
    linear("text_embedder.linear_2", 4 * t5, X);
  }
  s["text_embedding_padding"] = {h.text_len + (t5 > 0 ? h.text_len_t5 : 0), X};
  s["pos_embed.proj.weight"] = {D, h.in_channels, h.patch_size, h.patch_size};  // PatchEmbed, pos_embed_type None
  s["pos_embed.proj.bias"] = {D};
  // HunyuanCombinedTimestepTextSizeStyleEmbedding (time_proj, size_proj: Timesteps, no parameters)
  linear("time_extra_emb.timestep_embedder.linear_1", 256, D);
  linear("time_extra_emb.timestep_embedder.linear_2", D, D);
  int64_t extra_in = 0;
  if (t5 > 0) {  // HunyuanDiTAttentionPool(text_len_t5, t5, heads 8, pooled_projection_dim)
    s["time_extra_emb.pooler.positional_embedding"] = {h.text_len_t5 + 1, t5};
    linear("time_extra_emb.pooler.k_proj", t5, t5);
    linear("time_extra_emb.pooler.q_proj", t5, t5);
    linear("time_extra_emb.pooler.v_proj", t5, t5);
    linear("time_extra_emb.pooler.c_proj", t5, h.pooled_projection_dim);
    extra_in += h.pooled_projection_dim;
  }
  if (h.use_style_cond_and_image_meta_size) {
    s["time_extra_emb.style_embedder.weight"] = {1, D};
    extra_in += 256 * 6 + D;
  }
  if (extra_in > 0) {
    linear("time_extra_emb.extra_embedder.linear_1", extra_in, 4 * D);
    linear("time_extra_emb.extra_embedder.linear_2", 4 * D, D);
  }
  const int64_t ff = static_cast<int64_t>(static_cast<double>(D) * h.mlp_ratio);
  for (int64_t i = 0; i < h.num_layers; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    linear(b + "norm1.linear", D, D);  // AdaLayerNormShift
    layer_norm(b + "norm1.norm", D);
    for (const char* a : {"attn1", "attn2"}) {
      const int64_t kv = std::string(a) == "attn1" ? D : X;
      linear(b + a + ".to_q", D, D);
      linear(b + a + ".to_k", kv, D);
      linear(b + a + ".to_v", kv, D);
      linear(b + a + ".to_out.0", D, D);
      layer_norm(b + a + ".norm_q", hd);
      layer_norm(b + a + ".norm_k", hd);
    }
    layer_norm(b + "norm2", D);
    layer_norm(b + "norm3", D);
    linear(b + "ff.net.0.proj", D, ff);  // GELU(approximate="tanh") with its projection
    linear(b + "ff.net.2", ff, D);
    if (i > h.num_layers / 2) {  // skip=layer > num_layers // 2
      layer_norm(b + "skip_norm", 2 * D);
      linear(b + "skip_linear", 2 * D, D);
    }
  }
  linear("norm_out.linear", D, 2 * D);  // AdaLayerNormContinuous, elementwise_affine False
  const int64_t out = h.learn_sigma ? 2 * h.in_channels : h.in_channels;
  linear("proj_out", D, h.patch_size * h.patch_size * out);
  return s;
}

Tensors random_tensors(const Shapes& shapes, uint64_t seed) {
  at::Generator g = make_cpu_generator(seed);
  Tensors t;
  for (const auto& [name, shape] : shapes) t[name] = torch::randn(shape, g) * 0.3;
  return t;
}

// ---- diffusers' forward with plain ops, reading the tensors by name.

struct Ref {
  const HyConfig& h;
  const Tensors& w;

  torch::Tensor linear(const torch::Tensor& x, const std::string& n) const {
    return torch::matmul(x, w.at(n + ".weight").t()) + w.at(n + ".bias");
  }
  static torch::Tensor norm(const torch::Tensor& x) {  // LayerNorm without affine, eps 1e-6
    torch::Tensor mu = x.mean(-1, true), var = (x - mu).pow(2).mean(-1, true);
    return (x - mu) / torch::sqrt(var + 1e-6);
  }
  torch::Tensor layer_norm(const torch::Tensor& x, const std::string& n) const {
    return norm(x) * w.at(n + ".weight") + w.at(n + ".bias");
  }
  static torch::Tensor silu(const torch::Tensor& x) { return x * torch::sigmoid(x); }
  static torch::Tensor gelu_tanh(const torch::Tensor& x) {
    return 0.5 * x * (1 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x.pow(3))));
  }
  // Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0) of a vector v [n] -> [n, 256],
  // in get_timestep_embedding's order of float32 operations (sizes of 1024 make rounding show).
  static torch::Tensor timesteps(const torch::Tensor& v) {
    torch::Tensor k = torch::arange(128, torch::kFloat);
    torch::Tensor a = v.to(torch::kFloat).unsqueeze(1) * torch::exp(-std::log(10000.0) * k / 128.0).unsqueeze(0);
    return torch::cat({torch::cos(a), torch::sin(a)}, 1);
  }
  // get_2d_rotary_pos_embed(head_dim, ((0, 0), (gh, gw)), (gh, gw), use_real=True): first half
  // from the meshgrid's first array (the column), second half the row; pairs repeated.
  static std::pair<torch::Tensor, torch::Tensor> rope(int64_t hd, int64_t gh, int64_t gw) {
    torch::Tensor cosv = torch::empty({gh * gw, hd}), sinv = torch::empty({gh * gw, hd});
    const int64_t half = hd / 2;
    for (int64_t r = 0; r < gh; ++r)
      for (int64_t c = 0; c < gw; ++c)
        for (int64_t i = 0; i < hd; ++i) {
          const int64_t j = (i % half) / 2;  // frequency index within the half
          const double pos = i < half ? double(c) : double(r);
          const double a = pos / std::pow(10000.0, double(2 * j) / double(half));
          cosv[r * gw + c][i] = std::cos(a);
          sinv[r * gw + c][i] = std::sin(a);
        }
    return {cosv, sinv};
  }
  static torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& c, const torch::Tensor& s) {
    torch::Tensor pairs = x.reshape({x.size(0), x.size(1), x.size(2), -1, 2});
    torch::Tensor rot = torch::stack({-pairs.select(-1, 1), pairs.select(-1, 0)}, -1).flatten(3);
    return x * c + rot * s;
  }
  // Attention with HunyuanAttnProcessor2_0: heads, qk LayerNorm, RoPE on q (and k unless cross).
  torch::Tensor attention(const torch::Tensor& x, const torch::Tensor& ctx, const std::string& n,
                          const std::pair<torch::Tensor, torch::Tensor>& rope) const {
    const bool cross = ctx.defined();
    const torch::Tensor& kv = cross ? ctx : x;
    const int64_t B = x.size(0), H = h.num_attention_heads, hd = h.attention_head_dim;
    auto heads = [&](const torch::Tensor& t) { return t.view({B, -1, H, hd}).transpose(1, 2); };
    torch::Tensor q = layer_norm(heads(linear(x, n + ".to_q")), n + ".norm_q");
    torch::Tensor k = layer_norm(heads(linear(kv, n + ".to_k")), n + ".norm_k");
    torch::Tensor v = heads(linear(kv, n + ".to_v"));
    q = apply_rotary(q, rope.first, rope.second);
    if (!cross) k = apply_rotary(k, rope.first, rope.second);
    torch::Tensor a = torch::softmax(torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(double(hd)), -1);
    return linear(torch::matmul(a, v).transpose(1, 2).reshape({B, -1, H * hd}), n + ".to_out.0");
  }
  // HunyuanDiTAttentionPool: F.multi_head_attention_forward with the mean token as the query.
  torch::Tensor pool(const torch::Tensor& t5) const {
    const std::string n = "time_extra_emb.pooler";
    torch::Tensor x = torch::cat({t5.mean(1, true), t5}, 1) + w.at(n + ".positional_embedding");  // [B, L+1, C]
    const int64_t B = x.size(0), C = x.size(2), H = 8, hd = C / H;
    torch::Tensor q = linear(x.narrow(1, 0, 1), n + ".q_proj").view({B, 1, H, hd}).transpose(1, 2);
    torch::Tensor k = linear(x, n + ".k_proj").view({B, -1, H, hd}).transpose(1, 2);
    torch::Tensor v = linear(x, n + ".v_proj").view({B, -1, H, hd}).transpose(1, 2);
    torch::Tensor a = torch::softmax(torch::matmul(q / std::sqrt(double(hd)), k.transpose(-1, -2)), -1);
    return linear(torch::matmul(a, v).transpose(1, 2).reshape({B, C}), n + ".c_proj");
  }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text,
                        const torch::Tensor& text_mask, const torch::Tensor& t5, const torch::Tensor& t5_mask,
                        const torch::Tensor& meta, const torch::Tensor& style) const {
    const int64_t B = x.size(0), p = h.patch_size, gh = x.size(2) / p, gw = x.size(3) / p;
    const int64_t outc = h.learn_sigma ? 2 * h.in_channels : h.in_channels;
    torch::Tensor hs = torch::conv2d(x, w.at("pos_embed.proj.weight"), w.at("pos_embed.proj.bias"), {p, p})
                           .flatten(2)
                           .transpose(1, 2);
    // temb = timestep_embedder(t) + extra_embedder(cat(pooled, size, style))
    const std::string te = "time_extra_emb.";
    torch::Tensor temb =
        linear(silu(linear(timesteps(t), te + "timestep_embedder.linear_1")), te + "timestep_embedder.linear_2");
    std::vector<torch::Tensor> extra;
    if (h.cross_attention_dim_t5 > 0) extra.push_back(pool(t5));
    if (h.use_style_cond_and_image_meta_size) {
      extra.push_back(timesteps(meta.reshape({-1})).view({-1, 6 * 256}));
      extra.push_back(w.at(te + "style_embedder.weight").index_select(0, style));
    }
    if (!extra.empty())
      temb = temb + linear(silu(linear(torch::cat(extra, 1), te + "extra_embedder.linear_1")),
                           te + "extra_embedder.linear_2");
    // text: cat(text, text_embedder(t5)), where(mask, ., text_embedding_padding)
    torch::Tensor ehs = text, mask = text_mask;
    if (h.cross_attention_dim_t5 > 0) {
      torch::Tensor proj = linear(silu(linear(t5, "text_embedder.linear_1")), "text_embedder.linear_2");
      ehs = torch::cat({text, proj}, 1);
      mask = torch::cat({text_mask, t5_mask}, -1);
    }
    ehs = torch::where(mask.unsqueeze(2).to(torch::kBool), ehs, w.at("text_embedding_padding"));
    const auto rope_tables = rope(h.attention_head_dim, gh, gw);
    std::vector<torch::Tensor> skips;
    for (int64_t layer = 0; layer < h.num_layers; ++layer) {
      const std::string b = "blocks." + std::to_string(layer) + ".";
      if (layer > h.num_layers / 2) {
        torch::Tensor skip = skips.back();
        skips.pop_back();
        hs = linear(layer_norm(torch::cat({hs, skip}, -1), b + "skip_norm"), b + "skip_linear");
      }
      torch::Tensor shift = linear(silu(temb), b + "norm1.linear");
      hs = hs + attention(layer_norm(hs, b + "norm1.norm") + shift.unsqueeze(1), torch::Tensor(), b + "attn1", rope_tables);
      hs = hs + attention(layer_norm(hs, b + "norm2"), ehs, b + "attn2", rope_tables);
      hs = hs + linear(gelu_tanh(linear(layer_norm(hs, b + "norm3"), b + "ff.net.0.proj")), b + "ff.net.2");
      if (layer < h.num_layers / 2 - 1) skips.push_back(hs);
    }
    std::vector<torch::Tensor> ss = linear(silu(temb), "norm_out.linear").chunk(2, 1);
    hs = linear(norm(hs) * (1 + ss[0]).unsqueeze(1) + ss[1].unsqueeze(1), "proj_out");
    // unpatchify: "nhwpqc->nchpwq"
    return hs.reshape({B, gh, gw, p, p, outc}).permute({0, 5, 1, 3, 2, 4}).reshape({B, outc, gh * p, gw * p});
  }
};

struct Case {
  const char* what;
  HyConfig h;
};

std::vector<Case> cases() {
  std::vector<Case> c;
  c.push_back({"T5 + size/style (HunyuanDiT v1.0/v1.1), learn_sigma", HyConfig{}});
  HyConfig v12;
  v12.use_style_cond_and_image_meta_size = false;  // HunyuanDiT v1.2
  v12.num_layers = 4;
  c.push_back({"T5, no size/style (v1.2)", v12});
  HyConfig one;
  one.cross_attention_dim_t5 = 0;  // flowrun's one-encoder variant
  one.learn_sigma = false;
  c.push_back({"no T5, size/style", one});
  HyConfig bare = one;
  bare.use_style_cond_and_image_meta_size = false;
  c.push_back({"no T5, no size/style (the demo graphs' kind)", bare});
  return c;
}

TEST(DitDiffusers, EveryTensorOfHunyuanDiT2DModelAndNothingElse) {
  for (const auto& [what, h] : cases()) {
    SCOPED_TRACE(what);
    dit::Dit m(to_flowrun(h));
    Shapes mine;
    for (const auto& p : m->named_parameters()) mine[p.key()] = p.value().sizes().vec();
    const Shapes theirs = diffusers_shapes(h);
    for (const auto& [n, shape] : theirs) {
      auto it = mine.find(n);
      if (it == mine.end()) {
        ADD_FAILURE() << "flowrun lacks " << n;
        continue;
      }
      EXPECT_EQ(it->second, shape) << n;
    }
    for (const auto& [n, _] : mine) EXPECT_TRUE(theirs.count(n)) << "flowrun has " << n << ", diffusers does not";
  }
}

TEST(DitDiffusers, ACheckpointOfDiffusersTensorsLoadsStrictlyAndComputesDiffusersForward) {
  const std::string dir = test::temp_dir("dit_diffusers");
  uint64_t seed = 40;
  for (const auto& [what, h] : cases()) {
    SCOPED_TRACE(what);
    const Tensors w = random_tensors(diffusers_shapes(h), ++seed);
    const std::string file = dir + "/diffusion_pytorch_model.safetensors";
    safetensors::save(file, w);
    dit::Dit m(to_flowrun(h));
    dit::load_safetensors(*m, file);  // strict: throws on anything missing, extra or mis-shaped

    // Padded prompts: row 0 has every token, row 1 three text and two T5 tokens, row 2 none.
    const int64_t B = 3, H = 8, W = 12;
    at::Generator g = make_cpu_generator(seed * 7);
    dit::DitImpl::Inputs in;
    in.x = torch::randn({B, h.in_channels, H, W}, g);
    in.t = torch::tensor({999, 500, 3}, torch::kLong);
    in.text = torch::randn({B, h.text_len, h.cross_attention_dim}, g);
    in.text_mask = torch::ones({B, h.text_len}, torch::kLong);
    in.text_mask[1].narrow(0, 3, h.text_len - 3).zero_();
    in.text_mask[2].zero_();
    if (h.cross_attention_dim_t5 > 0) {
      in.t5 = torch::randn({B, h.text_len_t5, h.cross_attention_dim_t5}, g);
      in.t5_mask = torch::ones({B, h.text_len_t5}, torch::kLong);
      in.t5_mask[1].narrow(0, 2, h.text_len_t5 - 2).zero_();
      in.t5_mask[2].zero_();
    }
    if (h.use_style_cond_and_image_meta_size) {
      in.image_meta_size = torch::tensor({1024.f, 768.f, 8.f, 12.f, 0.f, 0.f, 512.f, 512.f, 8.f, 12.f, 3.f, 1.f,
                                          64.f, 96.f, 8.f, 12.f, 0.f, 2.f})
                               .view({B, 6});
      in.style = torch::zeros({B}, torch::kLong);
    }
    torch::NoGradGuard no_grad;
    const torch::Tensor ours = m->forward(in);
    const torch::Tensor ref =
        Ref{h, w}.forward(in.x, in.t, in.text, in.text_mask, in.t5, in.t5_mask, in.image_meta_size, in.style);
    ASSERT_EQ(ours.sizes(), ref.sizes());
    // float32 throughout (fused attention, other summation orders, the BLAS's kernels per CPU):
    // within 1e-5 of the output scale (measured 1.02e-6 on an AMD EPYC with OpenBLAS's Zen
    // kernels; a CPU's kernels move it, float_compare.hpp); a wrong formula is off by 1e-4 and
    // more (the RoPE grid's mistake was 7.3e-4, hf_fixtures_test.cpp).
    const double scale = ref.abs().max().item<double>();
    EXPECT_LT((ours - ref).abs().max().item<double>(), 1e-5 * scale) << "max |ref| " << scale;
    EXPECT_GT(ref.abs().max().item<double>(), 0.1);  // not a comparison of zeros

    // The padding is what padded tokens become: their states do not matter, the learned rows do.
    dit::DitImpl::Inputs other = in;
    other.text = in.text.clone();
    other.text[2].fill_(5.0);                                // row 2 is all padding
    other.text[1].narrow(0, 3, h.text_len - 3).fill_(-5.0);  // row 1's padded tail
    EXPECT_LT((m->forward(other) - ours).abs().max().item<double>(), 1e-6);
    if (h.cross_attention_dim_t5 == 0) {  // (T5 states also feed the pooler, padded tokens included)
      const torch::Tensor kept = m->text_embedding_padding.clone();
      m->text_embedding_padding.add_(0.5);
      const torch::Tensor moved = m->forward(in);
      EXPECT_GT((moved - ours).select(0, 2).abs().max().item<double>(), 1e-4);
      m->text_embedding_padding.copy_(kept);
    }
    // The objectives' view: with learn_sigma the first in_channels (the prediction).
    TensorMap batch{{"x", in.x}, {"t", in.t}, {"text_emb", in.text}, {"text_mask", in.text_mask}};
    if (in.t5.defined()) batch["t5_emb"] = in.t5, batch["t5_mask"] = in.t5_mask;
    if (in.image_meta_size.defined()) batch["image_meta_size"] = in.image_meta_size, batch["style"] = in.style;
    EXPECT_TRUE(torch::equal(m->forward_batch(batch), ours.narrow(1, 0, h.in_channels)));
  }
}

TEST(DitDiffusers, ConditioningInputsAreRequiredAndCheckedWithTheirFix) {
  HyConfig h;
  dit::Dit m(to_flowrun(h));
  at::Generator g = make_cpu_generator(3);
  TensorMap b{{"x", torch::randn({2, 4, 4, 4}, g)},
              {"t", torch::tensor({1, 2})},
              {"text_emb", torch::randn({2, h.text_len, h.cross_attention_dim}, g)},
              {"t5_emb", torch::randn({2, h.text_len_t5, h.cross_attention_dim_t5}, g)}};
  auto error = [&](const TensorMap& batch) {
    try {
      m->forward_batch(batch);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error(b).find("use_style_cond_and_image_meta_size"), std::string::npos) << error(b);
  b["image_meta_size"] = torch::zeros({2, 6});
  b["style"] = torch::zeros({2}, torch::kLong);
  EXPECT_EQ(error(b), "no error");
  b["style"] = torch::ones({2}, torch::kLong);
  EXPECT_NE(error(b).find("style must be 0"), std::string::npos) << error(b);
  b["style"] = torch::zeros({2}, torch::kLong);
  b["text_emb"] = torch::randn({2, h.text_len + 1, h.cross_attention_dim}, g);
  const std::string e = error(b);
  EXPECT_NE(e.find("text_emb has 6 tokens but the model's text_len is 5"), std::string::npos) << e;
  EXPECT_NE(e.find("max_length"), std::string::npos) << e;
  HyConfig odd;
  odd.cross_attention_dim_t5 = 12;  // the pooler has 8 heads
  EXPECT_THROW(dit::Dit(to_flowrun(odd)), std::runtime_error);
}

}  // namespace
}  // namespace flowrun
