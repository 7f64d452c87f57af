// vae_encode and the AutoencoderKL behind it (nodes/models/vae/vae.hpp): diffusers' parameter names
// and shapes, encoder and decoder against references composed from plain tensor ops (GroupNorm by
// hand, convolutions as unfold + matmul, attention as matmul + softmax), safetensors by name (round
// trip, partial modules, deprecated attention names, one error listing the problems and naming
// the file), latent sampling as a function of (seed, step, row), and the node in a tiny graph.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <mutex>

#include "common/safetensors.hpp"
#include "common/seed.hpp"
#include "encode/vae_encode.hpp"
#include "models/vae/vae.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

using Named = std::map<std::string, torch::Tensor>;

vae::Config tiny() {
  vae::Config c;
  c.block_out_channels = {8, 16};
  c.layers_per_block = 1;
  c.norm_num_groups = 4;
  c.latent_channels = 4;
  return c;
}

// Every parameter random and of a sane scale, so that every bias and gain matters.
void randomize_vae(torch::nn::Module& m, uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator g = make_cpu_generator(seed);
  for (auto& item : m.named_parameters(true)) {
    torch::Tensor& p = item.value();
    torch::Tensor r = torch::randn(p.sizes(), g);
    const bool bias = item.key().size() > 5 && item.key().compare(item.key().size() - 5, 5, ".bias") == 0;
    if (p.dim() >= 2)
      p.copy_(r / std::sqrt(static_cast<double>(p.numel() / p.size(0))));
    else
      p.copy_(bias ? 0.2 * r : 1.0 + 0.2 * r);
  }
}


// ---- references: plain ops on the named tensors ----

torch::Tensor gn_ref(const torch::Tensor& x, Named& P, const std::string& n, int64_t G) {
  const int64_t B = x.size(0), C = x.size(1);
  torch::Tensor v = x.reshape({B, G, -1});
  torch::Tensor mu = v.mean(-1, true), var = (v - mu).pow(2).mean(-1, true);
  torch::Tensor y = ((v - mu) / torch::sqrt(var + 1e-6)).reshape(x.sizes());
  return y * P[n + ".weight"].view({1, C, 1, 1}) + P[n + ".bias"].view({1, C, 1, 1});
}

torch::Tensor silu_ref(const torch::Tensor& x) { return x / (1 + torch::exp(-x)); }

// A convolution as im2col (unfold) and a matrix product.
torch::Tensor conv_ref(const torch::Tensor& x, Named& P, const std::string& n, int64_t stride, int64_t pad) {
  const torch::Tensor& w = P[n + ".weight"];
  const int64_t B = x.size(0), O = w.size(0), k = w.size(2);
  const int64_t Ho = (x.size(2) + 2 * pad - k) / stride + 1, Wo = (x.size(3) + 2 * pad - k) / stride + 1;
  namespace F = torch::nn::functional;
  torch::Tensor cols = F::unfold(x, F::UnfoldFuncOptions({k, k}).padding(pad).stride(stride));  // [B, C*k*k, L]
  return (torch::matmul(w.reshape({O, -1}), cols) + P[n + ".bias"].view({1, O, 1})).view({B, O, Ho, Wo});
}

torch::Tensor resnet_ref(const torch::Tensor& x, Named& P, const std::string& n, int64_t G) {
  torch::Tensor h = conv_ref(silu_ref(gn_ref(x, P, n + ".norm1", G)), P, n + ".conv1", 1, 1);
  h = conv_ref(silu_ref(gn_ref(h, P, n + ".norm2", G)), P, n + ".conv2", 1, 1);
  const torch::Tensor sc = P.count(n + ".conv_shortcut.weight") ? conv_ref(x, P, n + ".conv_shortcut", 1, 0) : x;
  return sc + h;
}

torch::Tensor attention_ref(const torch::Tensor& x, Named& P, const std::string& n, int64_t G) {
  const int64_t B = x.size(0), C = x.size(1);
  torch::Tensor h = gn_ref(x, P, n + ".group_norm", G).reshape({B, C, -1}).transpose(1, 2);  // [B, L, C]
  auto lin = [&](const std::string& m) { return torch::matmul(h, P[n + "." + m + ".weight"].t()) + P[n + "." + m + ".bias"]; };
  torch::Tensor q = lin("to_q"), k = lin("to_k"), v = lin("to_v");
  torch::Tensor w = torch::softmax(torch::matmul(q, k.transpose(1, 2)) / std::sqrt(static_cast<double>(C)), -1);
  torch::Tensor o = torch::matmul(torch::matmul(w, v), P[n + ".to_out.0.weight"].t()) + P[n + ".to_out.0.bias"];
  return o.transpose(1, 2).reshape(x.sizes()) + x;
}

torch::Tensor downsample_ref(const torch::Tensor& x, Named& P, const std::string& n) {
  torch::Tensor padded = torch::zeros({x.size(0), x.size(1), x.size(2) + 1, x.size(3) + 1});
  padded.narrow(2, 0, x.size(2)).narrow(3, 0, x.size(3)).copy_(x);  // one zero row below, one column right
  return conv_ref(padded, P, n + ".conv", 2, 0);
}

torch::Tensor upsample_ref(const torch::Tensor& x, Named& P, const std::string& n) {
  return conv_ref(x.repeat_interleave(2, 2).repeat_interleave(2, 3), P, n + ".conv", 1, 1);
}

torch::Tensor mid_ref(const torch::Tensor& x, Named& P, const std::string& n, int64_t G) {
  torch::Tensor h = resnet_ref(x, P, n + ".resnets.0", G);
  h = attention_ref(h, P, n + ".attentions.0", G);
  return resnet_ref(h, P, n + ".resnets.1", G);
}

std::pair<torch::Tensor, torch::Tensor> encode_ref(const torch::Tensor& x, Named& P, const vae::Config& c) {
  const int64_t G = c.norm_num_groups, nb = static_cast<int64_t>(c.block_out_channels.size());
  torch::Tensor h = conv_ref(x, P, "encoder.conv_in", 1, 1);
  for (int64_t i = 0; i < nb; ++i) {
    const std::string b = "encoder.down_blocks." + std::to_string(i);
    for (int64_t j = 0; j < c.layers_per_block; ++j) h = resnet_ref(h, P, b + ".resnets." + std::to_string(j), G);
    if (i + 1 < nb) h = downsample_ref(h, P, b + ".downsamplers.0");
  }
  h = mid_ref(h, P, "encoder.mid_block", G);
  h = conv_ref(silu_ref(gn_ref(h, P, "encoder.conv_norm_out", G)), P, "encoder.conv_out", 1, 1);
  h = conv_ref(h, P, "quant_conv", 1, 0);
  return {h.narrow(1, 0, c.latent_channels), h.narrow(1, c.latent_channels, c.latent_channels).clamp(-30, 20)};
}

torch::Tensor decode_ref(const torch::Tensor& z, Named& P, const vae::Config& c) {
  const int64_t G = c.norm_num_groups, nb = static_cast<int64_t>(c.block_out_channels.size());
  torch::Tensor h = conv_ref(conv_ref(z, P, "post_quant_conv", 1, 0), P, "decoder.conv_in", 1, 1);
  h = mid_ref(h, P, "decoder.mid_block", G);
  for (int64_t i = 0; i < nb; ++i) {
    const std::string b = "decoder.up_blocks." + std::to_string(i);
    for (int64_t j = 0; j <= c.layers_per_block; ++j) h = resnet_ref(h, P, b + ".resnets." + std::to_string(j), G);
    if (i + 1 < nb) h = upsample_ref(h, P, b + ".upsamplers.0");
  }
  return conv_ref(silu_ref(gn_ref(h, P, "decoder.conv_norm_out", G)), P, "decoder.conv_out", 1, 1);
}

torch::Tensor images(int64_t B, int64_t H, int64_t W, uint64_t seed) {
  at::Generator g = make_cpu_generator(seed);
  return torch::rand({B, 3, H, W}, g) * 2 - 1;
}

std::vector<std::string> names_of(torch::nn::Module& m) {
  std::vector<std::string> n;
  for (const auto& item : m.named_parameters(true)) n.push_back(item.key());
  return n;
}

// ---- the module ----

TEST(Vae, ParameterNamesAreDiffusers) {
  // diffusers AutoencoderKL(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
  // latent_channels=4, down_block_types=2x DownEncoderBlock2D, up_block_types=2x UpDecoderBlock2D)
  // .named_parameters(), in its order; every module listed has a weight and a bias.
  const std::vector<std::string> modules = {
      "encoder.conv_in",
      "encoder.down_blocks.0.resnets.0.norm1",
      "encoder.down_blocks.0.resnets.0.conv1",
      "encoder.down_blocks.0.resnets.0.norm2",
      "encoder.down_blocks.0.resnets.0.conv2",
      "encoder.down_blocks.0.downsamplers.0.conv",
      "encoder.down_blocks.1.resnets.0.norm1",
      "encoder.down_blocks.1.resnets.0.conv1",
      "encoder.down_blocks.1.resnets.0.norm2",
      "encoder.down_blocks.1.resnets.0.conv2",
      "encoder.down_blocks.1.resnets.0.conv_shortcut",
      "encoder.mid_block.attentions.0.group_norm",
      "encoder.mid_block.attentions.0.to_q",
      "encoder.mid_block.attentions.0.to_k",
      "encoder.mid_block.attentions.0.to_v",
      "encoder.mid_block.attentions.0.to_out.0",
      "encoder.mid_block.resnets.0.norm1",
      "encoder.mid_block.resnets.0.conv1",
      "encoder.mid_block.resnets.0.norm2",
      "encoder.mid_block.resnets.0.conv2",
      "encoder.mid_block.resnets.1.norm1",
      "encoder.mid_block.resnets.1.conv1",
      "encoder.mid_block.resnets.1.norm2",
      "encoder.mid_block.resnets.1.conv2",
      "encoder.conv_norm_out",
      "encoder.conv_out",
      "decoder.conv_in",
      "decoder.up_blocks.0.resnets.0.norm1",
      "decoder.up_blocks.0.resnets.0.conv1",
      "decoder.up_blocks.0.resnets.0.norm2",
      "decoder.up_blocks.0.resnets.0.conv2",
      "decoder.up_blocks.0.resnets.1.norm1",
      "decoder.up_blocks.0.resnets.1.conv1",
      "decoder.up_blocks.0.resnets.1.norm2",
      "decoder.up_blocks.0.resnets.1.conv2",
      "decoder.up_blocks.0.upsamplers.0.conv",
      "decoder.up_blocks.1.resnets.0.norm1",
      "decoder.up_blocks.1.resnets.0.conv1",
      "decoder.up_blocks.1.resnets.0.norm2",
      "decoder.up_blocks.1.resnets.0.conv2",
      "decoder.up_blocks.1.resnets.0.conv_shortcut",
      "decoder.up_blocks.1.resnets.1.norm1",
      "decoder.up_blocks.1.resnets.1.conv1",
      "decoder.up_blocks.1.resnets.1.norm2",
      "decoder.up_blocks.1.resnets.1.conv2",
      "decoder.mid_block.attentions.0.group_norm",
      "decoder.mid_block.attentions.0.to_q",
      "decoder.mid_block.attentions.0.to_k",
      "decoder.mid_block.attentions.0.to_v",
      "decoder.mid_block.attentions.0.to_out.0",
      "decoder.mid_block.resnets.0.norm1",
      "decoder.mid_block.resnets.0.conv1",
      "decoder.mid_block.resnets.0.norm2",
      "decoder.mid_block.resnets.0.conv2",
      "decoder.mid_block.resnets.1.norm1",
      "decoder.mid_block.resnets.1.conv1",
      "decoder.mid_block.resnets.1.norm2",
      "decoder.mid_block.resnets.1.conv2",
      "decoder.conv_norm_out",
      "decoder.conv_out",
      "quant_conv",
      "post_quant_conv",
  };
  std::vector<std::string> want;
  for (const auto& m : modules) {
    want.push_back(m + ".weight");
    want.push_back(m + ".bias");
  }
  vae::AutoencoderKL m(tiny());
  EXPECT_EQ(names_of(*m), want);
  EXPECT_TRUE(m->named_buffers(true).is_empty());

  auto shape = [&](const std::string& n) { return m->named_parameters()[n].sizes().vec(); };
  using S = std::vector<int64_t>;
  EXPECT_EQ(shape("encoder.conv_in.weight"), (S{8, 3, 3, 3}));
  EXPECT_EQ(shape("encoder.down_blocks.0.downsamplers.0.conv.weight"), (S{8, 8, 3, 3}));
  EXPECT_EQ(shape("encoder.down_blocks.1.resnets.0.conv1.weight"), (S{16, 8, 3, 3}));
  EXPECT_EQ(shape("encoder.down_blocks.1.resnets.0.conv_shortcut.weight"), (S{16, 8, 1, 1}));
  EXPECT_EQ(shape("encoder.mid_block.attentions.0.to_q.weight"), (S{16, 16}));
  EXPECT_EQ(shape("encoder.mid_block.attentions.0.to_out.0.bias"), (S{16}));
  EXPECT_EQ(shape("encoder.conv_out.weight"), (S{8, 16, 3, 3}));
  EXPECT_EQ(shape("quant_conv.weight"), (S{8, 8, 1, 1}));
  EXPECT_EQ(shape("post_quant_conv.weight"), (S{4, 4, 1, 1}));
  EXPECT_EQ(shape("decoder.conv_in.weight"), (S{16, 4, 3, 3}));
  EXPECT_EQ(shape("decoder.up_blocks.0.upsamplers.0.conv.weight"), (S{16, 16, 3, 3}));
  EXPECT_EQ(shape("decoder.up_blocks.1.resnets.0.conv_shortcut.weight"), (S{8, 16, 1, 1}));
  EXPECT_EQ(shape("decoder.conv_norm_out.weight"), (S{8}));
  EXPECT_EQ(shape("decoder.conv_out.weight"), (S{3, 8, 3, 3}));

  // The parts: exactly the encoder's (encoder.*, quant_conv.*) or the decoder's tensors.
  auto starts = [](const std::string& s, const char* p) { return s.rfind(p, 0) == 0; };
  std::vector<std::string> enc, dec;
  for (const auto& n : want) (starts(n, "encoder.") || starts(n, "quant_conv.") ? enc : dec).push_back(n);
  vae::AutoencoderKL e(tiny(), vae::Part::encoder), d(tiny(), vae::Part::decoder);
  EXPECT_EQ(names_of(*e), enc);
  EXPECT_EQ(names_of(*d), dec);
  EXPECT_EQ(d->part(), vae::Part::decoder);
}

TEST(Vae, DefaultConfigHasTheSdVaesParameterCounts) {
  // diffusers' SD VAE (stabilityai/sd-vae-ft-mse, SDXL's and HunyuanDiT's have the same layout):
  // 83,653,863 parameters, of which the encoder 34,163,592 and the decoder 49,490,179.
  auto count = [](vae::Part part, const char* prefix) {
    vae::AutoencoderKL m(vae::Config{}, part);
    int64_t n = 0;
    for (const auto& item : m->named_parameters(true))
      if (item.key().rfind(prefix, 0) == 0) n += item.value().numel();
    return n;
  };
  EXPECT_EQ(count(vae::Part::encoder, "encoder."), 34163592);
  EXPECT_EQ(count(vae::Part::decoder, "decoder."), 49490179);
  EXPECT_EQ(count(vae::Part::encoder, "") + count(vae::Part::decoder, ""), 83653863);
}

// The count the size check uses (from the config, before anything is allocated) is the module's.
TEST(Vae, ParameterCountFromTheConfigIsTheModules) {
  vae::Config demo;
  demo.block_out_channels = {16, 32, 32};
  demo.layers_per_block = 1;
  demo.norm_num_groups = 8;
  for (const vae::Config& c : {vae::Config{}, demo})
    for (vae::Part part : {vae::Part::encoder, vae::Part::decoder, vae::Part::both}) {
      vae::AutoencoderKL m(c, part);
      int64_t n = 0;
      for (const auto& t : m->parameters()) n += t.numel();
      EXPECT_EQ(vae::parameter_count(c, part), static_cast<double>(n)) << vae::describe(c) << " " << vae::to_string(part);
    }
  EXPECT_EQ(vae::parameter_count(vae::Config{}, vae::Part::both), 83653863.0);
}

// A VAE that cannot fit in memory is refused from its config, before anything is allocated.
TEST(Vae, AConfigTooLargeForMemoryIsRefusedBeforeAllocating) {
  vae::Config huge;
  huge.block_out_channels = {65536, 65536};  // ~10^11 parameters: far over any machine's memory
  huge.norm_num_groups = 32;
  try {
    vae::make_autoencoder(huge, vae::Part::encoder, "", 1);
    FAIL() << "accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("AutoencoderKL encoder"), std::string::npos) << e.what();
  }
}

TEST(Vae, ShapesFollowTheDownsamplingFactor) {
  torch::NoGradGuard no_grad;
  vae::AutoencoderKL m(tiny());
  vae::init_weights(*m, 1);
  EXPECT_EQ(m->config().downsample_factor(), 2);
  auto [mean, logvar] = m->encode(images(2, 16, 12, 2));
  EXPECT_EQ(mean.sizes().vec(), (std::vector<int64_t>{2, 4, 8, 6}));
  EXPECT_EQ(logvar.sizes().vec(), (std::vector<int64_t>{2, 4, 8, 6}));
  EXPECT_EQ(m->decode(mean).sizes().vec(), (std::vector<int64_t>{2, 3, 16, 12}));

  vae::Config c3 = tiny();
  c3.block_out_channels = {8, 8, 16};  // factor 4
  c3.latent_channels = 3;
  vae::AutoencoderKL m3(c3);
  vae::init_weights(*m3, 1);
  EXPECT_EQ(c3.downsample_factor(), 4);
  auto [mean3, lv3] = m3->encode(images(1, 16, 24, 3));
  EXPECT_EQ(mean3.sizes().vec(), (std::vector<int64_t>{1, 3, 4, 6}));
  EXPECT_EQ(m3->decode(mean3).sizes().vec(), (std::vector<int64_t>{1, 3, 16, 24}));
  try {
    m3->encode(images(1, 18, 24, 3));
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("not divisible by the downsampling factor 4"), std::string::npos) << e.what();
  }
  // A part cannot do the other's job; a bad config is refused.
  vae::AutoencoderKL enc(tiny(), vae::Part::encoder);
  EXPECT_THROW(enc->decode(mean), std::runtime_error);
  vae::Config bad = tiny();
  bad.block_out_channels = {8, 10};
  EXPECT_THROW(vae::AutoencoderKL{bad}, std::invalid_argument);
}

TEST(Vae, EncoderAndDecoderMatchReferencesComposedFromPlainOps) {
  const vae::Config c = tiny();
  vae::AutoencoderKL m(c);
  randomize_vae(*m, 4);
  Named P = test::snapshot(*m);
  torch::NoGradGuard no_grad;
  const torch::Tensor x = images(2, 16, 12, 5);
  auto [mean, logvar] = m->encode(x);
  auto [mean_ref, logvar_ref] = encode_ref(x, P, c);
  EXPECT_TRUE(torch::allclose(mean, mean_ref, 1e-4, 1e-4)) << (mean - mean_ref).abs().max();
  EXPECT_TRUE(torch::allclose(logvar, logvar_ref, 1e-4, 1e-4)) << (logvar - logvar_ref).abs().max();
  EXPECT_GT(mean.std().item<double>(), 1e-2);  // not a degenerate comparison

  const torch::Tensor z = torch::randn({2, 4, 8, 6});
  torch::Tensor y = m->decode(z), y_ref = decode_ref(z, P, c);
  EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{2, 3, 16, 12}));
  EXPECT_TRUE(torch::allclose(y, y_ref, 1e-4, 1e-4)) << (y - y_ref).abs().max();

  // The logvar clamp: a huge conv_out bias on the logvar half saturates at 20.
  m->encoder->conv_out->bias.narrow(0, 4, 4).fill_(1e4);
  m->quant_conv->weight.zero_();
  m->quant_conv->bias.zero_();
  for (int64_t i = 0; i < 4; ++i) m->quant_conv->weight[4 + i][4 + i][0][0] = 1.0;
  EXPECT_EQ(m->encode(x).second.max().item<double>(), 20.0);
}

TEST(Vae, AttentionOverManyPositionsMatchesTheReference) {
  // 80 x 80 = 6400 positions: the attention works through query rows in chunks.
  vae::Attention a(8, 4);
  randomize_vae(*a, 6);
  Named P;
  for (const auto& [k, v] : test::snapshot(*a)) P["a." + k] = v;
  torch::NoGradGuard no_grad;
  const torch::Tensor x = torch::randn({1, 8, 80, 80}, make_cpu_generator(7));
  torch::Tensor got = a->forward(x), want = attention_ref(x, P, "a", 4);
  EXPECT_TRUE(torch::allclose(got, want, 1e-4, 1e-4)) << (got - want).abs().max();
}

TEST(Vae, SafetensorsRoundTripFullAndPartialModules) {
  const vae::Config c = tiny();
  vae::AutoencoderKL a(c);
  randomize_vae(*a, 8);
  const std::string dir = test::temp_dir("vae");
  const std::string file = dir + "/diffusion_pytorch_model.safetensors";
  safetensors::save(file, test::snapshot(*a));
  torch::NoGradGuard no_grad;
  const torch::Tensor x = images(2, 8, 8, 9), z = torch::randn({2, 4, 4, 4});
  const auto want = a->encode(x);
  const torch::Tensor want_img = a->decode(z);

  vae::AutoencoderKL b(c);
  vae::init_weights(*b, 10);
  vae::load_safetensors(*b, file);
  EXPECT_TRUE(torch::equal(b->encode(x).first, want.first));
  EXPECT_TRUE(torch::equal(b->encode(x).second, want.second));
  EXPECT_TRUE(torch::equal(b->decode(z), want_img));

  // A full file loads into each part; an encoder-only file into the encoder part.
  vae::AutoencoderKL e(c, vae::Part::encoder), d(c, vae::Part::decoder);
  vae::load_safetensors(*e, file);
  vae::load_safetensors(*d, file);
  EXPECT_TRUE(torch::equal(e->encode(x).first, want.first));
  EXPECT_TRUE(torch::equal(d->decode(z), want_img));
  const std::string enc_file = dir + "/encoder_only.safetensors";
  safetensors::save(enc_file, test::snapshot(*e));
  vae::AutoencoderKL e2(c, vae::Part::encoder);
  vae::load_safetensors(*e2, enc_file);
  EXPECT_TRUE(torch::equal(e2->encode(x).first, want.first));

  // Older diffusers files: query/key/value/proj_attn as 1x1 convolutions, a "vae." prefix.
  safetensors::Tensors old;
  for (const auto& [k, v] : test::snapshot(*a)) {
    std::string n = k;
    for (auto [from, to] : std::vector<std::pair<std::string, std::string>>{
             {".to_q.", ".query."}, {".to_k.", ".key."}, {".to_v.", ".value."}, {".to_out.0.", ".proj_attn."}})
      if (auto at = n.find(from); at != std::string::npos) n.replace(at, from.size(), to);
    old["vae." + n] = (n != k && v.dim() == 2) ? v.view({v.size(0), v.size(1), 1, 1}) : v;
  }
  ASSERT_TRUE(old.count("vae.decoder.mid_block.attentions.0.proj_attn.weight"));
  const std::string old_file = dir + "/old_names.safetensors";
  safetensors::save(old_file, old);
  vae::AutoencoderKL o(c);
  vae::load_safetensors(*o, old_file);
  EXPECT_TRUE(torch::equal(o->encode(x).first, want.first));
  EXPECT_TRUE(torch::equal(o->decode(z), want_img));
}

TEST(Vae, LoadingListsEveryProblemAndNamesTheFile) {
  const vae::Config c = tiny();
  vae::AutoencoderKL a(c);
  safetensors::Tensors t = test::snapshot(*a);
  t.erase("encoder.mid_block.attentions.0.to_k.bias");
  t["encoder.conv_out.weight"] = torch::zeros({6, 16, 3, 3});
  t["encoder.mid_block.attentions.1.to_q.weight"] = torch::zeros({16, 16});
  const std::string file = test::temp_dir("vae") + "/bad_vae.safetensors";
  safetensors::save(file, t);
  vae::AutoencoderKL b(c, vae::Part::encoder);
  try {
    vae::load_safetensors(*b, file);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(file, 0), 0u) << msg;
    EXPECT_NE(msg.find("1 missing, 1 unexpected, 1 mis-shaped"), std::string::npos) << msg;
    EXPECT_NE(msg.find("missing: encoder.mid_block.attentions.0.to_k.bias"), std::string::npos) << msg;
    EXPECT_NE(msg.find("mis-shaped: encoder.conv_out.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("unexpected: encoder.mid_block.attentions.1.to_q.weight"), std::string::npos) << msg;
  }
  // A decoder-only file cannot make an encoder: every encoder tensor is listed as missing.
  vae::AutoencoderKL d(c, vae::Part::decoder);
  const std::string dec_file = test::temp_dir("vae") + "/decoder_only.safetensors";
  safetensors::save(dec_file, test::snapshot(*d));
  vae::AutoencoderKL e(c, vae::Part::encoder);
  try {
    vae::load_safetensors(*e, dec_file);
    FAIL() << "no error";
  } catch (const std::runtime_error& err) {
    const std::string msg = err.what();
    EXPECT_NE(msg.find(dec_file), std::string::npos) << msg;
    EXPECT_NE(msg.find("missing: quant_conv.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("missing: encoder.conv_in.weight"), std::string::npos) << msg;
  }
}

// ---- latent sampling ----

std::shared_ptr<vae::VaeState> encoder_state(uint64_t seed) {
  vae::AutoencoderKL m(tiny(), vae::Part::encoder);
  randomize_vae(*m, seed);
  return vae::make_vae_state(m);
}

TEST(VaeEncode, SamplingIsAFunctionOfSeedStepAndRow) {
  auto s = encoder_state(11);
  EXPECT_TRUE(s->trainable_parameters().empty());
  const torch::Tensor x = images(3, 8, 8, 12);
  VaeEncodeOptions o;
  o.seed = 5;
  o.step = 7;
  o.first_row = 10;
  const torch::Tensor z = encode_latents(*s, x, o);
  EXPECT_EQ(z.sizes().vec(), (std::vector<int64_t>{3, 4, 4, 4}));
  EXPECT_EQ(z.scalar_type(), torch::kFloat);
  EXPECT_FALSE(z.requires_grad());
  EXPECT_TRUE(torch::equal(z, encode_latents(*s, x, o)));  // repeatable

  // z = (mean + exp(logvar / 2) * eps_row) * scaling, eps_row from (seed, step, global row) alone.
  torch::NoGradGuard no_grad;
  auto [mean, logvar] = s->vae().encode(x);
  const double sf = s->config.scaling_factor;
  EXPECT_DOUBLE_EQ(sf, 0.18215);
  for (int64_t i = 0; i < 3; ++i) {
    at::Generator g = make_cpu_generator(vae_latent_seed(5, 7, 10 + i));
    torch::Tensor eps = torch::randn({4, 4, 4}, g);
    torch::Tensor want = (mean[i] + torch::exp(0.5 * logvar[i]) * eps) * sf;
    EXPECT_TRUE(torch::allclose(z[i], want, 1e-5, 1e-6)) << i;
  }
  // A row alone (another batch split, another rank) gets the same latents.
  VaeEncodeOptions one = o;
  one.first_row = 11;
  EXPECT_TRUE(torch::allclose(encode_latents(*s, x.narrow(0, 1, 1), one)[0], z[1], 1e-5, 1e-6));
  // Another step or seed: other noise.
  VaeEncodeOptions other = o;
  other.step = 8;
  EXPECT_FALSE(torch::allclose(encode_latents(*s, x, other), z));
  other = o;
  other.seed = 6;
  EXPECT_FALSE(torch::allclose(encode_latents(*s, x, other), z));
  // sample false: the scaled mean, whatever the seed.
  VaeEncodeOptions m = o;
  m.sample = false;
  EXPECT_TRUE(torch::allclose(encode_latents(*s, x, m), mean * sf, 1e-6, 1e-7));
  // The state's forward: scaled mean latents; a clone is frozen and equal.
  EXPECT_TRUE(torch::allclose(s->forward({{"image", x}}), mean * sf, 1e-6, 1e-7));
  auto copy = std::dynamic_pointer_cast<vae::VaeState>(s->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(copy->trainable_parameters().empty());
  EXPECT_TRUE(torch::equal(encode_latents(*copy, x, o), z));
}

// ---- the node ----

class Images : public Node {
 public:
  void setup(SetupContext& c) override { size_ = c.params().get<int64_t>("size"); }
  void run(StepContext& c) override {
    TensorMap b{{"image", images(2, size_, size_, 100 + static_cast<uint64_t>(c.step()))},
                {"label", torch::full({2}, c.step(), torch::kInt64)}};
    c.out("batch", std::move(b));
  }

 private:
  int64_t size_ = 8;
};

void register_images() {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry::global().add(R"(type: t_vae_images
doc: two seeded images and labels per step
outputs: { batch: { kind: value, type: batch, doc: "{image [2, 3, size, size], label [2]}" } }
params: { size: { type: int, default: 8, doc: side } })",
                           [] { return std::make_unique<Images>(); }, "tests");
  });
}

TEST(VaeEncodeNode, LatentsInAGraphArePassedOnWithTheOtherKeys) {
  register_images();
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 3, seed: 5, prefetch: 2 }
nodes:
  data: { type: t_vae_images }
  enc: { type: vae_encode, in: { batch: data.batch },
         with: { block_out_channels: [8, 16], layers_per_block: 1, norm_num_groups: 4, seed: 3 } }
  mean: { type: vae_encode, in: { batch: data.batch },
          with: { block_out_channels: [8, 16], layers_per_block: 1, norm_num_groups: 4, seed: 3, sample: false,
                  out_key: z, scaling_factor: 0.13025, dtype: bfloat16 } }
  probe: { type: t_batch_probe, in: { batch: enc.latents } }
)");
  {
    std::lock_guard<std::mutex> l(test::BatchProbe::mu());
    test::BatchProbe::seen().clear();
  }
  g->run();
  auto& enc = dynamic_cast<vae::VaeState&>(g->state<ModelState>("enc", "params"));
  auto& mean = dynamic_cast<vae::VaeState&>(g->state<ModelState>("mean", "params"));
  EXPECT_EQ(enc.part, vae::Part::encoder);
  for (ModelState* s : {static_cast<ModelState*>(&enc), static_cast<ModelState*>(&mean)}) {
    EXPECT_TRUE(s->trainable_parameters().empty());
    for (const auto& [n, p] : s->named_parameters()) EXPECT_FALSE(p.requires_grad()) << n;
  }
  EXPECT_DOUBLE_EQ(mean.config.scaling_factor, 0.13025);
  EXPECT_EQ(mean.named_parameters()[0].second.scalar_type(), torch::kBFloat16);
  // Seeded by (seed, node name): the two nodes' random inits differ.
  EXPECT_FALSE(torch::equal(enc.named_parameters()[0].second, mean.named_parameters()[0].second.to(torch::kFloat)));

  std::lock_guard<std::mutex> l(test::BatchProbe::mu());
  ASSERT_EQ(test::BatchProbe::seen().size(), 3u);
  for (int64_t step = 1; step <= 3; ++step) {
    const TensorMap& b = test::BatchProbe::seen().at(step);
    ASSERT_EQ(b.size(), 2u) << "latents and label; the image is not passed on";
    const torch::Tensor& z = b.at("latents");
    EXPECT_EQ(z.sizes().vec(), (std::vector<int64_t>{2, 4, 4, 4}));
    EXPECT_EQ(z.scalar_type(), torch::kFloat);
    EXPECT_FALSE(z.requires_grad());
    EXPECT_TRUE(torch::equal(b.at("label"), torch::full({2}, step, torch::kInt64)));
    // Exactly what encode_latents gives for (seed 3, this step, rows 0 and 1).
    VaeEncodeOptions o;
    o.seed = 3;
    o.step = step;
    EXPECT_TRUE(torch::equal(z, encode_latents(enc, images(2, 8, 8, 100 + static_cast<uint64_t>(step)), o))) << step;
  }
}

TEST(VaeEncodeNode, MissingKeyAndIndivisibleSizeAreErrorsNamingTheNode) {
  register_images();
  auto run = [](const std::string& with, const std::string& data_with) {
    try {
      test::load_graph_text(R"(
flowrun: 1
run: { steps: 1 }
nodes:
  data: { type: t_vae_images, with: { )" + data_with + R"( } }
  enc: { type: vae_encode, in: { batch: data.batch },
         with: { block_out_channels: [8, 8, 16], layers_per_block: 1, norm_num_groups: 4, )" + with + R"( } }
  probe: { type: t_batch_probe, in: { batch: enc.latents } }
)")->run();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string msg = run("in_key: pixels", "size: 8");
  EXPECT_NE(msg.find("'enc'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("no 'pixels' (in_key)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("image, label"), std::string::npos) << msg;
  msg = run("seed: 1", "size: 10");
  EXPECT_NE(msg.find("'enc'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("10x10, not divisible by the VAE's downsampling factor 4"), std::string::npos) << msg;
  msg = run("out_key: label", "size: 8");
  EXPECT_NE(msg.find("already has a key 'label'"), std::string::npos) << msg;
  // A weights file without the encoder: a setup error naming the node, the file and a tensor.
  vae::AutoencoderKL d(tiny(), vae::Part::decoder);
  const std::string file = test::temp_dir("vae") + "/dec.safetensors";
  safetensors::save(file, test::snapshot(*d));
  msg = run("weights: " + file, "size: 8");
  EXPECT_NE(msg.find("'enc'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(file), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing: encoder.conv_in.weight"), std::string::npos) << msg;
}

}  // namespace
}  // namespace flowrun
