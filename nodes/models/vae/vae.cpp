// diffusers AutoencoderKL (see vae.hpp).
#include "models/vae/vae.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "common/memory.hpp"
#include "common/safetensors.hpp"
#include "common/seed.hpp"
#include "models/attention.hpp"
#include "models/load_by_name.hpp"

namespace flowrun::vae {
namespace F = torch::nn::functional;

namespace {

constexpr double kEps = 1e-6;

torch::nn::GroupNorm group_norm(int64_t groups, int64_t channels) {
  return torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, channels).eps(kEps).affine(true));
}

torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1, int64_t padding = -1) {
  if (padding < 0) padding = k / 2;
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(padding).bias(true));
}

std::string list(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

void Config::check() const {
  auto positive = [](const char* what, int64_t v) {
    if (v < 1) throw std::invalid_argument(std::string("vae: ") + what + " must be >= 1, got " + std::to_string(v));
  };
  positive("in_channels", in_channels);
  positive("out_channels", out_channels);
  positive("layers_per_block", layers_per_block);
  positive("latent_channels", latent_channels);
  positive("norm_num_groups", norm_num_groups);
  if (block_out_channels.empty()) throw std::invalid_argument("vae: block_out_channels is empty");
  if (block_out_channels.size() > 8)
    throw std::invalid_argument("vae: at most 8 blocks (a downsampling factor of 128), got " +
                                std::to_string(block_out_channels.size()));
  for (int64_t c : block_out_channels) {
    positive("each of block_out_channels", c);
    if (c % norm_num_groups != 0)
      throw std::invalid_argument("vae: block_out_channels " + list(block_out_channels) + ": " + std::to_string(c) +
                                  " is not divisible by norm_num_groups " + std::to_string(norm_num_groups));
  }
  if (!(scaling_factor > 0)) throw std::invalid_argument("vae: scaling_factor must be > 0");
}

std::string describe(const Config& c) {
  std::ostringstream o;
  o << "vae (block_out_channels=" << list(c.block_out_channels) << " layers_per_block=" << c.layers_per_block
    << " latent_channels=" << c.latent_channels << " norm_num_groups=" << c.norm_num_groups << ")";
  return o.str();
}

const char* to_string(Part p) {
  switch (p) {
    case Part::encoder: return "encoder";
    case Part::decoder: return "decoder";
    default: return "encoder+decoder";
  }
}

// ---- blocks ----

void ResnetBlockImpl::reset() {
  norm1 = register_module("norm1", group_norm(groups_, in_));
  conv1 = register_module("conv1", conv(in_, out_, 3));
  norm2 = register_module("norm2", group_norm(groups_, out_));
  conv2 = register_module("conv2", conv(out_, out_, 3));
  conv_shortcut = nullptr;
  if (in_ != out_) conv_shortcut = register_module("conv_shortcut", conv(in_, out_, 1));
}

torch::Tensor ResnetBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = conv1(torch::silu(norm1(x)));
  h = conv2(torch::silu(norm2(h)));
  return (conv_shortcut ? conv_shortcut(x) : x) + h;
}

void AttentionImpl::reset() {
  group_norm = register_module("group_norm", vae::group_norm(groups_, c_));
  to_q = register_module("to_q", torch::nn::Linear(c_, c_));
  to_k = register_module("to_k", torch::nn::Linear(c_, c_));
  to_v = register_module("to_v", torch::nn::Linear(c_, c_));
  to_out = register_module("to_out", torch::nn::ModuleList());
  to_out->push_back(torch::nn::Linear(c_, c_));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), L = H * W;
  torch::Tensor h = group_norm(x).view({B, C, L}).transpose(1, 2);  // [B, L, C]
  // One head over the H*W positions; softmax in float32 where written out (upcast_softmax).
  AttentionOptions opts;
  opts.fp32_softmax = true;
  torch::Tensor o = attention(to_q(h).unsqueeze(1), to_k(h).unsqueeze(1), to_v(h).unsqueeze(1), opts);  // [B, L, C]
  o = to_out[0]->as<torch::nn::LinearImpl>()->forward(o);
  return o.transpose(1, 2).reshape({B, C, H, W}) + x;
}

void DownsampleImpl::reset() { conv = register_module("conv", vae::conv(c_, c_, 3, 2, 0)); }

torch::Tensor DownsampleImpl::forward(const torch::Tensor& x) {
  return conv(F::pad(x, F::PadFuncOptions({0, 1, 0, 1}).mode(torch::kConstant).value(0)));
}

void UpsampleImpl::reset() { conv = register_module("conv", vae::conv(c_, c_, 3)); }

torch::Tensor UpsampleImpl::forward(const torch::Tensor& x) {
  // Nearest 2x, written as an expand (exact, any dtype): out[y][x] = in[y / 2][x / 2].
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  torch::Tensor up = x.view({B, C, H, 1, W, 1}).expand({B, C, H, 2, W, 2}).reshape({B, C, 2 * H, 2 * W});
  return conv(up);
}

void MidBlockImpl::reset() {
  attentions = register_module("attentions", torch::nn::ModuleList());
  attentions->push_back(Attention(c_, groups_));
  resnets = register_module("resnets", torch::nn::ModuleList());
  resnets->push_back(ResnetBlock(c_, c_, groups_));
  resnets->push_back(ResnetBlock(c_, c_, groups_));
}

torch::Tensor MidBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = resnets[0]->as<ResnetBlockImpl>()->forward(x);
  h = attentions[0]->as<AttentionImpl>()->forward(h);
  return resnets[1]->as<ResnetBlockImpl>()->forward(h);
}

void BlockImpl::reset() {
  resnets = register_module("resnets", torch::nn::ModuleList());
  for (int64_t j = 0; j < layers_; ++j) resnets->push_back(ResnetBlock(j == 0 ? in_ : out_, out_, groups_));
  downsamplers = nullptr;
  upsamplers = nullptr;
  if (resample_) {
    if (kind_ == down) {
      downsamplers = register_module("downsamplers", torch::nn::ModuleList());
      downsamplers->push_back(Downsample(out_));
    } else {
      upsamplers = register_module("upsamplers", torch::nn::ModuleList());
      upsamplers->push_back(Upsample(out_));
    }
  }
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  for (size_t j = 0; j < resnets->size(); ++j) x = resnets->ptr<ResnetBlockImpl>(j)->forward(x);
  if (downsamplers) x = downsamplers->ptr<DownsampleImpl>(0)->forward(x);
  if (upsamplers) x = upsamplers->ptr<UpsampleImpl>(0)->forward(x);
  return x;
}

// ---- encoder, decoder ----

void EncoderImpl::reset() {
  const auto& C = c_.block_out_channels;
  const int64_t G = c_.norm_num_groups;
  conv_in = register_module("conv_in", conv(c_.in_channels, C[0], 3));
  down_blocks = register_module("down_blocks", torch::nn::ModuleList());
  int64_t out = C[0];
  for (size_t i = 0; i < C.size(); ++i) {
    const int64_t in = out;
    out = C[i];
    down_blocks->push_back(Block(BlockImpl::down, in, out, c_.layers_per_block, i + 1 < C.size(), G));
  }
  mid_block = register_module("mid_block", MidBlock(C.back(), G));
  conv_norm_out = register_module("conv_norm_out", group_norm(G, C.back()));
  conv_out = register_module("conv_out", conv(C.back(), 2 * c_.latent_channels, 3));
}

// Module m's forward on h as block i (run_block).
template <class M>
torch::Tensor maybe_checkpointed(const CheckpointPolicy& policy, int64_t i, M* m, const torch::Tensor& h) {
  return run_block(policy, i, *m, {h}, [m](const std::vector<torch::Tensor>& in) { return m->forward(in[0]); });
}

torch::Tensor EncoderImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = conv_in(x);
  int64_t i = 0;
  for (size_t b = 0; b < down_blocks->size(); ++b) h = maybe_checkpointed(c_.checkpoint, i++, down_blocks->ptr<BlockImpl>(b).get(), h);
  h = maybe_checkpointed(c_.checkpoint, i, mid_block.get(), h);
  return conv_out(torch::silu(conv_norm_out(h)));
}

void DecoderImpl::reset() {
  const auto& C = c_.block_out_channels;
  const int64_t G = c_.norm_num_groups;
  conv_in = register_module("conv_in", conv(c_.latent_channels, C.back(), 3));
  up_blocks = register_module("up_blocks", torch::nn::ModuleList());
  mid_block = register_module("mid_block", MidBlock(C.back(), G));
  const std::vector<int64_t> rev(C.rbegin(), C.rend());
  int64_t out = rev[0];
  for (size_t i = 0; i < rev.size(); ++i) {
    const int64_t in = out;
    out = rev[i];
    up_blocks->push_back(Block(BlockImpl::up, in, out, c_.layers_per_block + 1, i + 1 < rev.size(), G));
  }
  conv_norm_out = register_module("conv_norm_out", group_norm(G, C[0]));
  conv_out = register_module("conv_out", conv(C[0], c_.out_channels, 3));
}

torch::Tensor DecoderImpl::forward(const torch::Tensor& z) {
  torch::Tensor h = maybe_checkpointed(c_.checkpoint, 0, mid_block.get(), conv_in(z));
  for (size_t b = 0; b < up_blocks->size(); ++b)
    h = maybe_checkpointed(c_.checkpoint, static_cast<int64_t>(b) + 1, up_blocks->ptr<BlockImpl>(b).get(), h);
  return conv_out(torch::silu(conv_norm_out(h)));
}

// ---- activation memory ----

ActivationEstimate estimate_activations(const Config& c, Part part, int64_t rows, int64_t height, int64_t width,
                                        int64_t bytes, bool fused_attention, const CheckpointPolicy& policy) {
  // Elements kept per image, counted at the op that saves them for its backward: GroupNorm,
  // SiLU and a convolution each save their input, so a resnet keeps three tensors of its input
  // width and three of its output width.
  auto resnet = [](double cin, double cout, double hw) { return 3 * cin * hw + 3 * cout * hw; };
  auto attention = [&](double ch, double hw) {
    // GroupNorm's input, the normalized rows (each projection's matmul copies them), q, k, v and
    // the output before to_out; the scores [L, L] in float32 where no fused kernel runs (the
    // softmax's output: chunking the rows does not help backward, which keeps every chunk).
    const double kept = 8 * ch * hw;
    return fused_attention ? kept + ch * hw : kept + hw * hw * 4.0 / static_cast<double>(bytes);
  };
  struct Unit {
    double all, input;  // elements kept plain; its input (what a recomputed unit keeps)
    bool recomputed;
  };
  std::vector<Unit> units;  // the encoder's down blocks and mid block, the decoder's mid and up blocks
  double outside = 0;       // conv_in, conv_norm_out, conv_out, the latents, the loss: always kept
  const auto& C = c.block_out_channels;
  const int64_t blocks = static_cast<int64_t>(C.size());
  const double layers = static_cast<double>(c.layers_per_block), f = static_cast<double>(c.downsample_factor());
  const double h = static_cast<double>(height), w = static_cast<double>(width), low = (h / f) * (w / f);
  const double latent = static_cast<double>(c.latent_channels), top = static_cast<double>(C.back());
  if (has_encoder(part)) {
    outside += static_cast<double>(c.in_channels) * h * w;  // conv_in's input
    double ch = static_cast<double>(C[0]), rh = h, rw = w;
    for (int64_t i = 0; i < blocks; ++i) {
      const double out = static_cast<double>(C[static_cast<size_t>(i)]);
      Unit u{resnet(ch, out, rh * rw) + (layers - 1) * resnet(out, out, rh * rw), ch * rh * rw, policy.recompute(i)};
      if (i + 1 < blocks) {  // the padded input of the stride-2 conv
        u.all += out * (rh + 1) * (rw + 1);
        rh = std::floor(rh / 2), rw = std::floor(rw / 2);
      }
      units.push_back(u);
      ch = out;
    }
    units.push_back({2 * resnet(top, top, low) + attention(top, low), top * low, policy.recompute(blocks)});
    outside += 3 * top * low + 3 * 2 * latent * low;  // conv_norm_out, SiLU, conv_out; quant_conv, the sample
  }
  if (has_decoder(part)) {
    outside += 2 * latent * low;  // post_quant_conv's and conv_in's inputs
    units.push_back({2 * resnet(top, top, low) + attention(top, low), top * low, policy.recompute(0)});
    double ch = top, rh = h / f, rw = w / f;
    for (int64_t i = 0; i < blocks; ++i) {
      const double out = static_cast<double>(C[static_cast<size_t>(blocks - 1 - i)]);
      Unit u{resnet(ch, out, rh * rw) + layers * resnet(out, out, rh * rw), ch * rh * rw, policy.recompute(i + 1)};
      if (i + 1 < blocks) {  // the nearest-2x copy the conv saves
        u.all += out * 4 * rh * rw;
        rh *= 2, rw *= 2;
      }
      units.push_back(u);
      ch = out;
    }
    const double first = static_cast<double>(C[0]), out = static_cast<double>(c.out_channels);
    outside += 3 * first * h * w + 4 * out * h * w;  // conv_norm_out, SiLU, conv_out; the loss
  }
  // Recomputed: a unit keeps its input only, and the largest one is live again in backward.
  double plain = outside, kept = outside, largest = 0;
  for (const Unit& u : units) {
    plain += u.all;
    kept += u.recomputed ? u.input : u.all;
    if (u.recomputed) largest = std::max(largest, u.all);
  }
  const double scale = static_cast<double>(rows) * static_cast<double>(bytes);
  return {plain * scale, (kept + largest) * scale, largest * scale};
}

// ---- the autoencoder ----

AutoencoderKLImpl::AutoencoderKLImpl(Config c, Part part) : cfg_(std::move(c)), part_(part) {
  cfg_.check();
  reset();
}

void AutoencoderKLImpl::reset() {
  const int64_t z = cfg_.latent_channels;
  encoder = nullptr;
  decoder = nullptr;
  quant_conv = nullptr;
  post_quant_conv = nullptr;
  if (has_encoder(part_)) encoder = register_module("encoder", Encoder(cfg_));
  if (has_decoder(part_)) decoder = register_module("decoder", Decoder(cfg_));
  if (has_encoder(part_)) quant_conv = register_module("quant_conv", conv(2 * z, 2 * z, 1));
  if (has_decoder(part_)) post_quant_conv = register_module("post_quant_conv", conv(z, z, 1));
}

std::pair<torch::Tensor, torch::Tensor> AutoencoderKLImpl::encode(const torch::Tensor& images) {
  if (!encoder) throw std::runtime_error("vae: this module holds only the decoder; it cannot encode");
  const int64_t f = cfg_.downsample_factor();
  if (images.dim() != 4 || images.size(1) != cfg_.in_channels)
    throw std::runtime_error("vae: encode expects images [B, " + std::to_string(cfg_.in_channels) + ", H, W], got " +
                             shape_str(images));
  if (images.size(2) % f != 0 || images.size(3) % f != 0)
    throw std::runtime_error("vae: image size " + std::to_string(images.size(2)) + "x" + std::to_string(images.size(3)) +
                             " is not divisible by the downsampling factor " + std::to_string(f));
  torch::Tensor moments = quant_conv(encoder(images));
  auto mv = moments.chunk(2, 1);
  return {mv[0], mv[1].clamp(-30.0, 20.0)};
}

torch::Tensor AutoencoderKLImpl::decode(const torch::Tensor& latents) {
  if (!decoder) throw std::runtime_error("vae: this module holds only the encoder; it cannot decode");
  if (latents.dim() != 4 || latents.size(1) != cfg_.latent_channels)
    throw std::runtime_error("vae: decode expects latents [B, " + std::to_string(cfg_.latent_channels) +
                             ", h, w], got " + shape_str(latents));
  return decoder(post_quant_conv(latents));
}

torch::Tensor sample(const torch::Tensor& mean, const torch::Tensor& logvar, at::Generator& gen) {
  torch::Tensor eps = torch::randn(mean.sizes(), gen, torch::TensorOptions().dtype(torch::kFloat));
  eps = eps.to(mean.device(), mean.scalar_type());
  return mean + torch::exp(0.5 * logvar) * eps;
}

void init_weights(AutoencoderKLImpl& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator g = make_cpu_generator(seed);
  auto params = model.named_parameters(true);
  for (auto& item : params) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    const bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    torch::Tensor w = is_bias ? *params.find(name.substr(0, name.size() - 5) + ".weight") : p;
    if (w.dim() < 2) {  // GroupNorm
      p.fill_(is_bias ? 0.0 : 1.0);
      continue;
    }
    const double bound = 1.0 / std::sqrt(static_cast<double>(w.numel() / w.size(0)));
    torch::Tensor r = torch::rand(p.sizes(), g, torch::TensorOptions().dtype(torch::kFloat));
    p.copy_(r.mul_(2 * bound).sub_(bound));
  }
}

void load_state_dict(AutoencoderKLImpl& model, const std::map<std::string, torch::Tensor>& tensors,
                     const std::string& source) {
  // diffusers' _convert_deprecated_attention_blocks: query/key/value/proj_attn -> to_q/to_k/to_v/to_out.0.
  static const std::vector<std::pair<std::string, std::string>> renames = {
      {".query.", ".to_q."}, {".key.", ".to_k."}, {".value.", ".to_v."}, {".proj_attn.", ".to_out.0."}};
  std::map<std::string, torch::Tensor> in;
  for (const auto& [raw, t] : tensors) {
    std::string name = raw;
    torch::Tensor v = t;
    if (name.find(".attentions.") != std::string::npos) {
      for (const auto& [from, to] : renames)
        if (auto at = name.find(from); at != std::string::npos) {
          name.replace(at, from.size(), to);
          break;
        }
      // Old 1x1-conv attention weights [C, C, 1, 1].
      if (v.dim() == 4 && v.size(2) == 1 && v.size(3) == 1 && name.find(".to_") != std::string::npos)
        v = v.flatten(1);
    }
    in[name] = v;
  }
  const Part part = model.part();
  LoadByNameOptions o;
  o.model = describe(model.config()) + " " + to_string(part);
  o.prefixes = {"vae."};
  o.ignore = [part](const std::string& n) {
    auto starts = [&](const char* p) { return n.rfind(p, 0) == 0; };
    if (!has_encoder(part) && (starts("encoder.") || starts("quant_conv."))) return true;
    if (!has_decoder(part) && (starts("decoder.") || starts("post_quant_conv."))) return true;
    return false;
  };
  load_by_name(model, in, source, o);
}

void load_safetensors(AutoencoderKLImpl& model, const std::string& path) {
  load_state_dict(model, safetensors::load(path).tensors, path);
}

double parameter_count(const Config& c, Part part) {
  c.check();
  const std::vector<int64_t>& C = c.block_out_channels;
  const double L = static_cast<double>(c.latent_channels);
  auto conv = [](double in, double out, double k) { return in * out * k * k + out; };
  auto norm = [](double ch) { return 2 * ch; };
  auto resnet = [&](double in, double out) {
    return norm(in) + conv(in, out, 3) + norm(out) + conv(out, out, 3) + (in != out ? conv(in, out, 1) : 0.0);
  };
  auto mid = [&](double ch) { return 2 * resnet(ch, ch) + norm(ch) + 4 * (ch * ch + ch); };
  const double last = static_cast<double>(C.back()), first = static_cast<double>(C.front());
  double n = 0;
  if (has_encoder(part)) {
    n += conv(static_cast<double>(c.in_channels), first, 3);
    double out = first;
    for (size_t i = 0; i < C.size(); ++i) {
      const double in = out;
      out = static_cast<double>(C[i]);
      for (int64_t j = 0; j < c.layers_per_block; ++j) n += resnet(j == 0 ? in : out, out);
      if (i + 1 < C.size()) n += conv(out, out, 3);
    }
    n += mid(last) + norm(last) + conv(last, 2 * L, 3) + conv(2 * L, 2 * L, 1);
  }
  if (has_decoder(part)) {
    n += conv(L, L, 1) + conv(L, last, 3) + mid(last);
    double out = last;
    for (size_t i = C.size(); i-- > 0;) {
      const double in = out;
      out = static_cast<double>(C[i]);
      for (int64_t j = 0; j < c.layers_per_block + 1; ++j) n += resnet(j == 0 ? in : out, out);
      if (i > 0) n += conv(out, out, 3);
    }
    n += norm(first) + conv(first, static_cast<double>(c.out_channels), 3);
  }
  return n;
}

AutoencoderKL make_autoencoder(const Config& c, Part part, const std::string& weights, uint64_t seed, bool trainable) {
  check_model_fits(std::string("AutoencoderKL ") + to_string(part), describe(c), parameter_count(c, part), !trainable,
                   c.layers_per_block * static_cast<int64_t>(c.block_out_channels.size()));
  AutoencoderKL m(c, part);
  if (!weights.empty())
    load_safetensors(*m, weights);
  else
    init_weights(*m, seed);
  return m;
}

// ---- the state ----

AutoencoderKLImpl& VaeState::vae() const {
  auto* m = module ? module->as<AutoencoderKLImpl>() : nullptr;
  if (!m) throw std::runtime_error("vae: the state's module is not an AutoencoderKL");
  return *m;
}

std::shared_ptr<ModelState> VaeState::clone() const {
  if (frozen) return clone_frozen(*this);
  auto copy = std::make_shared<VaeState>(*this);
  copy->module = ModelState::clone()->module;  // new tensors, each parameter's requires_grad kept
  copy->kept.clear();
  return copy;
}

std::shared_ptr<VaeState> make_vae_state(AutoencoderKL model, bool frozen) {
  if (frozen) freeze(*model);
  ModelState::ForwardFn fwd = [frozen](torch::nn::Module& m, const TensorMap& batch) {
    auto* vae = m.as<AutoencoderKLImpl>();
    if (!vae) throw std::runtime_error("vae: the module is not an AutoencoderKL");
    std::optional<torch::NoGradGuard> no_grad;
    if (frozen) no_grad.emplace();
    const double s = vae->config().scaling_factor;
    torch::Tensor w = vae->parameters().front();
    if (auto it = batch.find("latents"); it != batch.end() && vae->decoder)
      return vae->decode(it->second.to(w.device(), w.scalar_type()) / s).to(torch::kFloat);
    auto it = batch.find("image");
    if (it == batch.end()) throw std::runtime_error("vae: the batch has no 'image' (nor 'latents' to decode)");
    return (vae->encode(it->second.to(w.device(), w.scalar_type())).first * s).to(torch::kFloat);
  };
  auto s = std::make_shared<VaeState>(std::static_pointer_cast<torch::nn::Module>(model.ptr()), fwd,
                                      std::string("vae/") + to_string(model->part()));
  s->config = model->config();
  s->part = model->part();
  s->frozen = frozen;
  auto ae = std::make_shared<ModelState::Autoencoder>();
  ae->in_channels = s->config.in_channels;
  ae->downsample = s->config.downsample_factor();
  ae->scaling_factor = s->config.scaling_factor;
  ae->latent_channels = s->config.latent_channels;
  auto vae_of = [](ModelState& self) -> AutoencoderKLImpl& {
    auto* vae = self.module ? self.module->as<AutoencoderKLImpl>() : nullptr;
    if (!vae) throw std::runtime_error("vae: model '" + self.kind + "' has no AutoencoderKL module");
    return *vae;
  };
  if (s->part != Part::decoder) ae->encode = [vae_of](ModelState& self, const torch::Tensor& x) { return vae_of(self).encode(x); };
  if (s->part != Part::encoder) ae->decode = [vae_of](ModelState& self, const torch::Tensor& z) { return vae_of(self).decode(z); };
  s->autoencoder = std::move(ae);
  if (!frozen) {  // trained (the vae node): what backward keeps of a micro-batch of images
    s->checkpoint = s->config.checkpoint;
    s->activations = [c = s->config, part = s->part](const TensorMap& b, int64_t bytes, const CheckpointPolicy& policy) {
      auto it = b.find("image");
      if (it == b.end() || it->second.dim() != 4) throw std::runtime_error("vae: the batch has no 'image' [B, C, H, W]");
      const torch::Tensor& x = it->second;
      return estimate_activations(c, part, x.size(0), x.size(2), x.size(3), bytes, fused_attention_available(x), policy);
    };
  }
  return s;
}

}  // namespace flowrun::vae
