// The CapPa module (cappa.hpp).
#include "models/cappa/cappa.hpp"

#include <cmath>
#include <limits>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>

#include "common/safetensors.hpp"
#include "common/seed.hpp"
#include "models/attention.hpp"
#include "models/load_by_name.hpp"

namespace flowrun::cappa {

void Config::check() const {
  auto positive = [&](int64_t v, const char* name) {
    if (v < 1) throw std::invalid_argument(std::string("cappa: ") + name + " must be >= 1, got " + std::to_string(v));
  };
  positive(image_size, "image_size"), positive(patch, "patch"), positive(channels, "channels");
  positive(width, "width"), positive(depth, "depth"), positive(heads, "heads"), positive(mlp_dim, "mlp_dim");
  positive(dec_width, "dec_width"), positive(dec_depth, "dec_depth"), positive(dec_heads, "dec_heads");
  positive(dec_mlp_dim, "dec_mlp_dim"), positive(vocab, "vocab"), positive(max_len, "max_len");
  if (image_size % patch != 0)
    throw std::invalid_argument("cappa: image_size " + std::to_string(image_size) + " is not a multiple of patch " +
                                std::to_string(patch));
  if (width % heads != 0 || dec_width % dec_heads != 0)
    throw std::invalid_argument("cappa: width must be divisible by heads and dec_width by dec_heads (" + describe(*this) +
                                ")");
  if (posemb != "learn" && posemb != "sincos2d")
    throw std::invalid_argument("cappa: posemb is learn or sincos2d, not '" + posemb + "'");
  if (posemb == "sincos2d" && width % 4 != 0)
    throw std::invalid_argument("cappa: posemb sincos2d needs a width divisible by 4");
  if (tp) {
    const int64_t n = tp->size();
    if (heads % n != 0 || dec_heads % n != 0 || mlp_dim % n != 0 || dec_mlp_dim % n != 0)
      throw std::invalid_argument("cappa: heads " + std::to_string(heads) + ", dec_heads " + std::to_string(dec_heads) +
                                  ", mlp_dim " + std::to_string(mlp_dim) + " and dec_mlp_dim " + std::to_string(dec_mlp_dim) +
                                  " do not all split into " + std::to_string(n) +
                                  " tensor-parallel parts; choose run.parallel.tp dividing each");
  }
  if (stages) stages->check(depth + dec_depth, "cappa");
}

parallel::TpSplit tp_split(const std::string& name) {
  if (lora::is_adapter(name)) return lora::adapter_tp_split(name, tp_split, /*fan_in_fan_out=*/false);
  auto ends_with = [&](const char* e) {
    const size_t n = std::char_traits<char>::length(e);
    return name.size() >= n && name.compare(name.size() - n, n, e) == 0;
  };
  if (name.find(".blocks.") == std::string::npos) return {};  // embeddings, positions, final norms, the head
  if (ends_with(".attn.qkv.weight") || ends_with(".attn.qkv.bias")) return {0, 3};  // [3W, W]: q | k | v rows
  for (const char* column : {"_attn.q.weight", "_attn.k.weight", "_attn.v.weight", ".mlp.fc1.weight", ".mlp.fc1.bias"})
    if (ends_with(column)) return {0, 1};
  if (ends_with(".attn.proj.weight") || ends_with("_attn.proj.weight") || ends_with(".mlp.fc2.weight")) return {1, 1};
  return {};  // norms, the row-split layers' biases
}

double Config::parameter_count() const {
  const double W = static_cast<double>(width), D = static_cast<double>(dec_width);
  const double enc = W * (channels * patch * patch + 1) + (posemb == "learn" ? tokens() * W : 0.0) +
                     depth * (4 * W * W + 4 * W + 2 * W * mlp_dim + mlp_dim + W + 4 * W) + 2 * W;
  const double dec = (vocab + 1.0) * D + max_len * D +
                     dec_depth * (4 * D * D + 2 * D * D + 2 * D * W + 2 * D * dec_mlp_dim + 6 * D) + 2 * D +
                     vocab * (D + 1.0);
  return enc + dec;
}

Family family(const Config& c) {
  Family f;
  f.tp = c.tp, f.stages = c.stages;
  f.tp_split = tp_split;
  const double W = static_cast<double>(c.width), D = static_cast<double>(c.dec_width);
  const double N = static_cast<double>(c.tokens()), L = static_cast<double>(c.max_len);
  f.block_costs.assign(static_cast<size_t>(c.depth), N * (4 * W * W + 2 * W * static_cast<double>(c.mlp_dim)));
  f.block_costs.resize(static_cast<size_t>(c.depth + c.dec_depth),
                       L * (6 * D * D + 2 * D * static_cast<double>(c.dec_mlp_dim)) + N * 2 * D * W);
  f.embedding_cost = N * W * static_cast<double>(c.channels * c.patch * c.patch);
  f.head_cost = L * D * static_cast<double>(c.vocab);
  return f;
}

std::string describe(const Config& c) {
  std::ostringstream s;
  s << "vit " << c.width << "x" << c.depth << " (patch " << c.patch << ", " << c.image_size << " px, " << c.heads
    << " heads, mlp " << c.mlp_dim << ", posemb " << c.posemb << "), decoder " << c.dec_width << "x" << c.dec_depth
    << " (" << c.dec_heads << " heads, mlp " << c.dec_mlp_dim << (c.decoder_bias ? "" : ", no biases")
    << "), vocab " << c.vocab << ", max_len " << c.max_len;
  return s.str();
}

// ---- leaf modules ------------------------------------------------------------------------

namespace {

// [B, L, heads*hd] -> [B, heads, L, hd]
torch::Tensor split_heads(const torch::Tensor& x, int64_t heads) {
  return x.view({x.size(0), x.size(1), heads, x.size(2) / heads}).transpose(1, 2);
}

}  // namespace

void EncoderAttentionImpl::reset() {
  const int64_t width = layers::tp_share(dim_, tp_, "cappa: the encoder attention's width");  // this rank's heads
  qkv = register_module("qkv", lora::split(lora::Linear(dim_, 3 * width), tp_, lora::TpRole::outputs));
  proj = register_module("proj", lora::split(lora::Linear(width, dim_), tp_, lora::TpRole::inputs));
}

torch::Tensor EncoderAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t H = heads_ / (tp_ ? tp_->size() : 1);
  auto parts = qkv(parallel::copy_to_tp(x, tp_)).chunk(3, -1);
  return layers::row_parallel(*proj, attention(split_heads(parts[0], H), split_heads(parts[1], H), split_heads(parts[2], H)), tp_);
}

void EncoderBlockImpl::reset() {
  norm1 = register_module("norm1", flax_norm(dim_, true));
  attn = register_module("attn", EncoderAttention(dim_, heads_, tp_));
  norm2 = register_module("norm2", flax_norm(dim_, true));
  mlp = register_module("mlp", Mlp(dim_, mlp_, mlp_options(true, tp_)));
}

torch::Tensor EncoderBlockImpl::forward(torch::Tensor x) {
  x = x + attn(norm1(x));
  return x + mlp(norm2(x));
}

void DecoderAttentionImpl::reset() {
  auto lin = [](int64_t in, int64_t out) { return lora::Linear(in, out, /*bias=*/false); };
  const int64_t width = layers::tp_share(dim_, tp_, "cappa: the decoder attention's width");  // this rank's heads
  q = register_module("q", lora::split(lin(dim_, width), tp_, lora::TpRole::outputs));
  k = register_module("k", lora::split(lin(kv_dim_, width), tp_, lora::TpRole::outputs));
  v = register_module("v", lora::split(lin(kv_dim_, width), tp_, lora::TpRole::outputs));
  proj = register_module("proj", lora::split(lin(width, dim_), tp_, lora::TpRole::inputs));
}

torch::Tensor DecoderAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& kv, const torch::Tensor& bias) {
  const int64_t H = heads_ / (tp_ ? tp_->size() : 1);
  const torch::Tensor xs = parallel::copy_to_tp(x, tp_);
  const torch::Tensor& kvs = kv.is_same(x) ? xs : kv;  // self-attention: the one copy
  return layers::row_parallel(*proj, attention(split_heads(q(xs), H), split_heads(k(kvs), H), split_heads(v(kvs), H), {bias}), tp_);
}

void DecoderBlockImpl::reset() {
  const bool b = c_.decoder_bias;
  norm1 = register_module("norm1", flax_norm(c_.dec_width, b));
  self_attn = register_module("self_attn", DecoderAttention(c_.dec_width, c_.dec_width, c_.dec_heads, c_.tp));
  norm2 = register_module("norm2", flax_norm(c_.dec_width, b));
  cross_attn = register_module("cross_attn", DecoderAttention(c_.dec_width, c_.width, c_.dec_heads, c_.tp));
  norm3 = register_module("norm3", flax_norm(c_.dec_width, b));
  mlp = register_module("mlp", Mlp(c_.dec_width, c_.dec_mlp_dim, mlp_options(b, c_.tp)));
}

torch::Tensor DecoderBlockImpl::forward(torch::Tensor x, const torch::Tensor& encoded, const torch::Tensor& self_bias) {
  torch::Tensor h = norm1(x);
  x = x + self_attn(h, h, self_bias);
  x = x + cross_attn(norm2(x), encoded, torch::Tensor());
  return x + mlp(norm3(x));
}

// ---- encoder and decoder -----------------------------------------------------------------

namespace {

// big_vision's posemb_sincos_2d: for a gh x gw grid, W/4 frequencies omega_k = 1/10000^(k/(W/4-1)),
// [sin(x w), cos(x w), sin(y w), cos(y w)] per token (x the column, y the row). [1, N, W]
torch::Tensor sincos2d(int64_t gh, int64_t gw, int64_t width) {
  const int64_t q = width / 4;
  torch::Tensor omega = torch::arange(q, torch::kDouble) / std::max<int64_t>(q - 1, 1);
  omega = 1.0 / torch::pow(10000.0, omega);
  torch::Tensor y = torch::arange(gh, torch::kDouble).repeat_interleave(gw);
  torch::Tensor x = torch::arange(gw, torch::kDouble).repeat({gh});
  torch::Tensor xo = x.unsqueeze(1) * omega.unsqueeze(0), yo = y.unsqueeze(1) * omega.unsqueeze(0);
  return torch::cat({xo.sin(), xo.cos(), yo.sin(), yo.cos()}, 1).to(torch::kFloat).unsqueeze(0);
}

}  // namespace

// Staged (pipeline parallel): what this rank's chunks use (cappa.hpp); load_state_dict names the
// rest as another chunk's: keep them alike.
void EncoderImpl::reset() {
  if (c_.holds_block(0)) {
    patch_embed = register_module("patch_embed", PatchEmbed(c_.channels, c_.width, c_.patch));
    const int64_t g = c_.image_size / c_.patch;
    if (c_.posemb == "learn")
      pos_embed = register_parameter("pos_embed", torch::zeros({1, g * g, c_.width}));
    else
      pos_embed = register_buffer("pos_embed", sincos2d(g, g, c_.width));
  }
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c_.depth; ++i) {
    if (c_.holds_block(i)) blocks->push_back(EncoderBlock(c_.width, c_.heads, c_.mlp_dim, c_.tp));
    else blocks->push_back(torch::nn::Identity());
  }
  if (c_.holds_block(c_.depth - 1)) norm = register_module("norm", flax_norm(c_.width, true));
}

torch::Tensor EncoderImpl::forward(const torch::Tensor& images) { return norm(run_blocks(embed(images), 0, c_.depth)); }

torch::Tensor EncoderImpl::embed(const torch::Tensor& images) {
  if (images.dim() != 4 || images.size(1) != c_.channels || images.size(2) != c_.image_size ||
      images.size(3) != c_.image_size)
    throw std::runtime_error("cappa: images must be [batch, " + std::to_string(c_.channels) + ", " +
                             std::to_string(c_.image_size) + ", " + std::to_string(c_.image_size) + "] (image_size " +
                             std::to_string(c_.image_size) + "), got " + shape_str(images) +
                             "; make the data node's size equal the model's image_size");
  torch::Tensor x = patch_embed(images.to(pos_embed.scalar_type()));  // [B, N, W]
  return x + pos_embed;
}

torch::Tensor EncoderImpl::run_blocks(torch::Tensor x, int64_t first, int64_t last) {
  // The ModuleList itself, never a cached vector of blocks: clone() replaces its items.
  for (int64_t i = first; i < last; ++i) {
    EncoderBlockImpl* block = (*blocks)[static_cast<size_t>(i)]->as<EncoderBlockImpl>();
    if (!block) throw std::logic_error("cappa: encoder block " + std::to_string(i) + " is another pipeline stage's");
    x = run_block(c_.checkpoint, i, *block, {x}, [block](const std::vector<torch::Tensor>& in) { return block->forward(in[0]); });
  }
  return x;
}

void DecoderImpl::reset() {
  if (c_.holds_block(c_.depth)) {
    embed = register_module("embed", torch::nn::Embedding(c_.vocab + 1, c_.dec_width));
    pos_embed = register_parameter("pos_embed", torch::zeros({1, c_.max_len, c_.dec_width}));
  }
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c_.dec_depth; ++i) {
    if (c_.holds_block(c_.depth + i)) blocks->push_back(DecoderBlock(c_));
    else blocks->push_back(torch::nn::Identity());
  }
  if (c_.holds_block(c_.depth + c_.dec_depth - 1)) {
    norm = register_module("norm", flax_norm(c_.dec_width, true));
    head = register_module("head", lora::Linear(c_.dec_width, c_.vocab));
  }
}

torch::Tensor DecoderImpl::forward(const torch::Tensor& encoded, const torch::Tensor& ids, const torch::Tensor& parallel) {
  torch::Tensor x = embed_inputs(ids);
  return output(run_blocks(x, encoded, self_attention_bias(parallel, ids.size(0), ids.size(1), x.options()), 0, c_.dec_depth));
}

torch::Tensor DecoderImpl::embed_inputs(const torch::Tensor& ids) {
  if (ids.dim() != 2 || ids.size(1) < 1 || ids.size(1) > c_.max_len)
    throw std::runtime_error("cappa: decoder inputs must be [batch, L] with 1 <= L <= max_len " +
                             std::to_string(c_.max_len) + ", got " + shape_str(ids) +
                             "; raise the model's max_len or lower the tokenizer's max_length");
  return embed(ids.to(torch::kLong)) + pos_embed.narrow(1, 0, ids.size(1));
}

torch::Tensor DecoderImpl::run_blocks(torch::Tensor x, const torch::Tensor& encoded, const torch::Tensor& bias,
                                      int64_t first, int64_t last) {
  // Under tp every cross-attention reads its heads' keys and values of the image: one copy, so
  // the image's gradient is summed over the ranks once for all blocks.
  const torch::Tensor image = parallel::copy_to_tp(encoded, c_.tp);
  for (int64_t i = first; i < last; ++i) {
    DecoderBlockImpl* block = (*blocks)[static_cast<size_t>(i)]->as<DecoderBlockImpl>();
    if (!block) throw std::logic_error("cappa: decoder block " + std::to_string(i) + " is another pipeline stage's");
    x = run_block(c_.checkpoint, i, *block, {x, image, bias},
                  [block](const std::vector<torch::Tensor>& in) { return block->forward(in[0], in[1], in[2]); });
  }
  return x;
}

CappaImpl::CappaImpl(Config c) : c_(std::move(c)) {
  c_.check();
  reset();
}

void CappaImpl::reset() {
  encoder = register_module("encoder", Encoder(c_));
  decoder = register_module("decoder", Decoder(c_));
}

torch::Tensor CappaImpl::encode(const torch::Tensor& images) {
  if (c_.staged()) return staged(Pass::encode, {images}, images.device());
  return encoder->forward(images);
}

torch::Tensor CappaImpl::decode(const torch::Tensor& encoded, const torch::Tensor& ids, const torch::Tensor& parallel) {
  if (c_.staged()) return staged(Pass::decode, {{}, encoded, ids, parallel}, ids.device());
  return decoder->forward(encoded, ids, parallel);
}

torch::Tensor CappaImpl::staged(Pass pass, const Inputs& in, const c10::Device& device) {
  return staged_forward(*c_.stages, device, [&](int k, const TensorMap& prev) { return chunk(k, pass, in, prev); });
}

// Blocks [first, last) of the run: encoder blocks below E = depth, decoder blocks from E.
TensorMap CappaImpl::chunk(int k, Pass pass, const Inputs& in, const TensorMap& prev) {
  if (!c_.stages || !c_.stages->holds(k)) throw std::logic_error("cappa: pipeline chunk " + std::to_string(k) + " is another rank's");
  const int64_t E = c_.depth;
  const auto [first, last] = c_.stages->blocks.at(static_cast<size_t>(k));
  const bool final_chunk = k + 1 == c_.stages->chunks();
  // The encoder's part: its stream, and once its last block ran, the encoded image.
  torch::Tensor x, encoded = pass == Pass::decode ? in.encoded : torch::Tensor();
  if (pass != Pass::decode) {
    if (first < E) {
      x = first == 0 ? encoder->embed(in.images) : prev.at("x");
      x = encoder->run_blocks(x, first, std::min<int64_t>(last, E));
      if (last >= E) encoded = encoder->norm(x);
    } else {
      encoded = prev.at("encoded");
    }
    if (pass == Pass::encode) {
      if (final_chunk) return {{"output", encoded}};
      if (last < E) return {{"x", x}};
      return {{"encoded", encoded}};  // passed on to the last stage
    }
  }
  if (last <= E) {  // no decoder block here
    if (pass == Pass::decode) return {};  // the decoder starts on a later chunk
    return last < E ? TensorMap{{"x", x}} : TensorMap{{"encoded", encoded}};
  }
  // The decoder's part: its stream from its embeddings or the previous chunk.
  torch::Tensor h = first <= E ? decoder->embed_inputs(in.ids) : prev.at("h");
  const torch::Tensor bias = self_attention_bias(in.parallel, in.ids.size(0), in.ids.size(1), h.options());
  h = decoder->run_blocks(h, encoded, bias, std::max<int64_t>(first, E) - E, last - E);
  if (final_chunk) return {{"output", decoder->output(h)}};
  if (pass == Pass::decode) return {{"h", h}};
  return {{"encoded", encoded}, {"h", h}};
}

torch::Tensor CappaImpl::forward_batch(const TensorMap& batch) {
  auto get = [&](const char* k, bool required) {
    auto it = batch.find(k);
    if (it == batch.end() || !it->second.defined()) {
      if (!required) return torch::Tensor();
      std::string have;
      for (const auto& [key, _] : batch) have += (have.empty() ? "" : ", ") + key;
      throw std::runtime_error(std::string("cappa: the batch has no '") + k + "' (it has {" + have + "})");
    }
    return it->second;
  };
  const torch::Tensor ids = decoder_inputs(get("decoder_input", true), get("decoder_masked", false), c_.vocab);
  if (c_.staged()) return staged(Pass::whole, {get("image", true), {}, ids, get("parallel", false)}, ids.device());
  return decode(encode(get("image", true)), ids, get("parallel", false));
}

torch::Tensor decoder_inputs(const torch::Tensor& ids, const torch::Tensor& masked, int64_t vocab) {
  if (!masked.defined()) return ids;
  if (!masked.sizes().equals(ids.sizes()))
    throw std::runtime_error("cappa: decoder_masked " + shape_str(masked) + " must be shaped like the inputs " +
                             shape_str(ids));
  return torch::where(masked.to(torch::kBool), torch::full_like(ids, vocab), ids);
}

torch::Tensor self_attention_bias(const torch::Tensor& parallel, int64_t B, int64_t L, const torch::TensorOptions& o) {
  torch::Tensor causal = torch::full({L, L}, -std::numeric_limits<float>::infinity(), o).triu(1);
  if (!parallel.defined()) return causal.view({1, 1, L, L}).expand({B, 1, L, L});
  const torch::Tensor par = parallel.to(o.device(), torch::kBool).view({B, 1, 1, 1});
  return torch::where(par, torch::zeros({1, 1, L, L}, o), causal.view({1, 1, L, L}));
}

// ---- init, load, state -------------------------------------------------------------------

namespace {

// x ~ N(0, std^2) truncated to +-2 std (redrawn), as flax's truncated_normal.
void truncated_normal_(torch::Tensor t, double std, at::Generator& g) {
  torch::Tensor v = torch::randn(t.sizes(), g, torch::TensorOptions().dtype(torch::kFloat));
  for (torch::Tensor bad = v.abs() > 2.0; bad.any().item<bool>(); bad = v.abs() > 2.0)
    v = torch::where(bad, torch::randn(t.sizes(), g, torch::TensorOptions().dtype(torch::kFloat)), v);
  t.copy_(v * std);
}

void xavier_uniform_(torch::Tensor w, at::Generator& g) {  // w [out, in]
  const double a = std::sqrt(6.0 / static_cast<double>(w.size(0) + w.size(1)));
  w.copy_(torch::rand(w.sizes(), g) * (2 * a) - a);
}

void lecun_normal_(torch::Tensor w, int64_t fan_in, at::Generator& g) {
  truncated_normal_(w, std::sqrt(1.0 / static_cast<double>(fan_in)) / 0.87962566103423978, g);
}

}  // namespace

void init_weights(CappaImpl& m, uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator g = make_cpu_generator(mix_seed({seed, kSeedTagInit}));
  const Config& c = m.config();
  auto& e = *m.encoder;
  lecun_normal_(e.patch_embed->proj->weight, c.channels * c.patch * c.patch, g);
  e.patch_embed->proj->bias.zero_();
  if (c.posemb == "learn") e.pos_embed.copy_(torch::randn(e.pos_embed.sizes(), g) / std::sqrt(double(c.width)));
  auto mlp_init = [&](layers::MlpImpl& mlp) {
    for (auto* lin : {&mlp.fc1, &mlp.fc2}) {
      xavier_uniform_((*lin)->weight, g);
      if ((*lin)->bias.defined()) (*lin)->bias.copy_(torch::randn((*lin)->bias.sizes(), g) * 1e-6);
    }
  };
  for (const auto& b : *e.blocks) {
    auto& blk = *b->as<EncoderBlockImpl>();
    for (int64_t j = 0; j < 3; ++j) xavier_uniform_(blk.attn->qkv->weight.narrow(0, j * c.width, c.width), g);
    blk.attn->qkv->bias.zero_();
    xavier_uniform_(blk.attn->proj->weight, g);
    blk.attn->proj->bias.zero_();
    mlp_init(*blk.mlp);
  }
  auto& d = *m.decoder;
  d.embed->weight.copy_(torch::randn(d.embed->weight.sizes(), g));
  d.pos_embed.copy_(torch::randn(d.pos_embed.sizes(), g) / std::sqrt(double(c.dec_width)));
  for (const auto& b : *d.blocks) {
    auto& blk = *b->as<DecoderBlockImpl>();
    for (auto* a : {&blk.self_attn, &blk.cross_attn})
      for (auto* lin : {&(*a)->q, &(*a)->k, &(*a)->v, &(*a)->proj}) lecun_normal_((*lin)->weight, (*lin)->weight.size(1), g);
    mlp_init(*blk.mlp);
  }
  d.head->weight.zero_();
  d.head->bias.zero_();
  // Norms: ones and zeros, as constructed.
}

void load_state_dict(CappaImpl& model, const std::map<std::string, torch::Tensor>& tensors, const std::string& source) {
  LoadByNameOptions o;
  o.model = "cappa (" + describe(model.config()) + ")";
  // A sincos2d position table is a fixed function of the config, not a weight; a base file
  // loads into a LoRA-adapted model (the adapters keep their init).
  o.optional = [&](const std::string& n) {
    return (model.config().posemb == "sincos2d" && n == "encoder.pos_embed") || lora::is_adapter(n);
  };
  if (model.config().staged()) {  // pipeline parallel: another chunk's tensors (whole-model names) are skipped
    const auto held = model.named_parameters(true);
    const Config& c = model.config();
    o.ignore = [held, c](const std::string& n) {
      if (held.contains(n)) return false;
      static const std::regex kBlock(R"((encoder|decoder)\.blocks\.(\d+)\..*)");
      std::smatch m;
      if (std::regex_match(n, m, kBlock)) return std::stoll(m[2].str()) < (m[1].str() == "encoder" ? c.depth : c.dec_depth);
      static const std::set<std::string> kOutside{"encoder.patch_embed.proj.weight", "encoder.patch_embed.proj.bias",
                                                  "encoder.pos_embed", "encoder.norm.weight", "encoder.norm.bias",
                                                  "decoder.embed.weight", "decoder.pos_embed", "decoder.norm.weight",
                                                  "decoder.norm.bias", "decoder.head.weight", "decoder.head.bias"};
      return kOutside.count(n) > 0;
    };
  }
  const std::shared_ptr<parallel::Group>& tp = model.config().tp;
  if (!tp || tp->size() == 1) return load_by_name(model, tensors, source, o);
  load_by_name(model, parallel::TpLayout{tp, tp_split}.parts(tensors, nullptr, source), source, o);  // this rank's parts
}

void load_safetensors(CappaImpl& model, const std::string& path) {
  load_state_dict(model, safetensors::load(path).tensors, path);
}

std::shared_ptr<ModelState> make_state(Cappa model) {
  ModelState::ForwardFn fwd = [](torch::nn::Module& m, const TensorMap& batch) {
    auto* c = m.as<CappaImpl>();
    if (!c) throw std::runtime_error("cappa: the model's module is not a CapPa");
    return c->forward_batch(batch);
  };
  auto state = std::make_shared<ModelState>(std::static_pointer_cast<torch::nn::Module>(model.ptr()), fwd, "cappa");
  state->stages = model->config().stages;
  return state;
}

CappaImpl& module_of(ModelState& state) {
  auto* c = state.module ? state.module->as<CappaImpl>() : nullptr;
  if (!c) throw std::runtime_error("model '" + state.kind + "' is not a cappa model (its params must come from a cappa node)");
  return *c;
}

torch::Tensor greedy_decode(CappaImpl& model, const torch::Tensor& encoded, const torch::Tensor& start, int64_t steps,
                            int64_t eos) {
  torch::NoGradGuard no_grad;
  torch::Tensor seq = start.to(encoded.device(), torch::kLong).view({-1, 1});
  torch::Tensor done = torch::zeros({seq.size(0)}, seq.options().dtype(torch::kBool));
  for (int64_t t = 0; t < steps; ++t) {
    const torch::Tensor logits = model.decode(encoded, seq);  // causal
    torch::Tensor next = logits.select(1, logits.size(1) - 1).argmax(-1);
    next = torch::where(done, torch::full_like(next, eos), next);
    done = done | (next == eos);
    seq = torch::cat({seq, next.unsqueeze(1)}, 1);
  }
  return seq.narrow(1, 1, steps);
}

torch::Tensor parallel_decode(CappaImpl& model, const torch::Tensor& encoded, int64_t steps) {
  torch::NoGradGuard no_grad;
  const int64_t B = encoded.size(0);
  const torch::Tensor ids = torch::full({B, steps}, model.config().vocab, encoded.options().dtype(torch::kLong));
  const torch::Tensor parallel = torch::ones({B}, encoded.options().dtype(torch::kBool));
  return model.decode(encoded, ids, parallel).argmax(-1);
}

}  // namespace flowrun::cappa
