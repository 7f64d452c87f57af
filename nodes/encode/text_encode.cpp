// Frozen text encoder state and the encoder nodes' shared part (text_encode.hpp).
#include "encode/text_encode.hpp"

#include <spdlog/spdlog.h>

#include <optional>
#include <stdexcept>

#include "common/device.hpp"
#include "common/seed.hpp"
#include "encode/tokenize.hpp"
#include "train/precision.hpp"

namespace flowrun {

std::shared_ptr<ModelState> TextEncoderState::clone() const { return clone_frozen(*this); }

std::shared_ptr<TextEncoderState> make_text_encoder_state(std::shared_ptr<torch::nn::Module> module, EncoderForward f,
                                                          const std::string& kind, const std::string& prefix) {
  freeze(*module);
  auto forward = [f = std::move(f)](torch::nn::Module& m, const TensorMap& batch) {
    auto ids = batch.find("input_ids");
    if (ids == batch.end()) throw std::runtime_error("text encoder: the batch has no 'input_ids'");
    const torch::Device dev = m.parameters().empty() ? torch::Device(torch::kCPU) : m.parameters().front().device();
    torch::Tensor mask;
    if (auto it = batch.find("attention_mask"); it != batch.end()) mask = it->second.to(dev);
    return f(m, ids->second.to(dev), mask).to(torch::kFloat);
  };
  auto s = std::make_shared<TextEncoderState>(std::move(module), forward, kind);
  s->set_prefix(prefix);
  return s;
}

void TextEncoderState::set_prefix(const std::string& p) {
  prefix = p;
  condition = [p](ModelState& self, const TensorMap& tokens) { return encode_text(self, tokens, p); };
}

TensorMap encode_text(ModelState& encoder, const TensorMap& host_tokens, const std::string& prefix) {
  torch::NoGradGuard no_grad;
  const TensorMap tokens = to_device(host_tokens, model_device(encoder));  // tokenizers make CPU ids
  auto ids = tokens.find("input_ids");
  if (ids == tokens.end()) throw std::runtime_error("encode_text: the tokens have no 'input_ids'");
  torch::Tensor emb = encoder.forward(tokens);
  torch::Tensor mask;
  if (auto it = tokens.find("attention_mask"); it != tokens.end())
    mask = it->second.to(emb.device(), torch::kLong);
  else
    mask = torch::ones(ids->second.sizes(), emb.options().dtype(torch::kLong));
  return {{prefix + "_emb", emb}, {prefix + "_mask", mask}};
}

TensorMap encode_text(ModelState& encoder, const TensorMap& tokens) {
  return encoder.condition ? encoder.condition(encoder, tokens) : encode_text(encoder, tokens, "text");
}

TensorMap TextConditioner::encode(const std::vector<std::string>& texts) const {
  TensorMap cond;
  for (const auto& [tok, enc] : pairs)
    for (auto& [key, t] : encode_text(*enc, encode_texts(*tok, texts))) {
      if (cond.count(key))
        throw std::runtime_error("two text encoders write " + key + "; give them distinct out_prefix (e.g. text and t5)");
      cond[key] = t;
    }
  return cond;
}

namespace {
std::string refs_text(const std::vector<std::string>& refs) {
  std::string s;
  for (const auto& r : refs) s += (s.empty() ? "" : ", ") + r;
  return "[" + s + "]";
}
template <class Ctx>
void check_pairs(const Ctx& ctx) {
  const auto toks = ctx.connected("tokenizer") ? ctx.refs("tokenizer") : std::vector<std::string>{};
  const auto encs = ctx.connected("encoder") ? ctx.refs("encoder") : std::vector<std::string>{};
  if (toks.size() != encs.size())
    throw std::runtime_error(ctx.who() + ": " + std::to_string(toks.size()) + " tokenizer(s) " + refs_text(toks) + " and " +
                             std::to_string(encs.size()) + " encoder(s) " + refs_text(encs) +
                             ": give one tokenizer per encoder, in the same order (captions are tokenized, then encoded)");
}
}  // namespace

void check_text_pairs(const SetupContext& ctx) { check_pairs(ctx); }

TextConditioner text_conditioner(StepContext& ctx) {
  check_pairs(ctx);
  TextConditioner c;
  if (!ctx.connected("encoder")) return c;
  const std::vector<Value*> toks = ctx.states_all("tokenizer"), encs = ctx.states_all("encoder");
  for (size_t i = 0; i < encs.size(); ++i)
    c.pairs.push_back({toks[i]->as<std::shared_ptr<TextTokenizer>>(ctx.who() + " input tokenizer").get(),
                       encs[i]->as<std::shared_ptr<ModelState>>(ctx.who() + " input encoder").get()});
  return c;
}

// Issue 47: a vocab.txt of 101 words for a BERT of 72 started, and step 1 failed in the
// embedding naming neither file. The tokenizer that makes this node's tokens (the producer of
// `tokens`, when it has a tokenizer state) must not make ids past the embedding's rows.
void TextEncodeNode::check_tokenizer_fits(const SetupContext& ctx, int64_t vocab, const std::string& from) const {
  const Value* v = ctx.producer_state("tokens", "tokenizer");
  if (!v || vocab <= 0) return;
  const auto& tok = v->as<std::shared_ptr<TextTokenizer>>(ctx.who() + " tokens' producer's tokenizer");
  if (tok->vocab_size() <= vocab) return;
  const std::string ref = ctx.refs("tokens").front(), node = ref.substr(0, ref.find('.'));
  std::string file;
  if (const GraphSpec* g = ctx.run().graph; g && g->index_of(node) >= 0) {
    const YAML::Node given = g->nodes[static_cast<size_t>(g->index_of(node))].params["vocab"];
    if (given && given.IsScalar()) file = " (" + given.Scalar() + ")";
  }
  throw std::runtime_error(ctx.who() + ": its tokens come from '" + node + "', whose " + tok->name() + " tokenizer" + file +
                           " has " + std::to_string(tok->vocab_size()) + " ids, more than the " + std::to_string(vocab) +
                           " rows of this encoder's token embedding" + (from.empty() ? "" : " (" + from + ")") +
                           ": ids past " + std::to_string(vocab - 1) +
                           " would index outside it; give the tokenizer that belongs to the encoder (the same folder)");
}

void TextEncodeNode::setup(SetupContext& ctx) {
  const Params& p = ctx.params();
  const std::string dtype = p.get<std::string>("dtype");
  const std::string prefix = p.get<std::string>("out_prefix");
  Source src;
  src.seed = mix_seed({node_seed(ctx), name_seed(ctx.name()), kSeedTagInit});
  src.weights = p.has("weights") ? p.get<std::string>("weights") : "";
  std::optional<PretrainedFolder> folder;
  Built b;
  try {
    if (p.has("pretrained")) {
      if (!src.weights.empty())
        throw pretrained_and_weights(ctx.who());
      folder = open_pretrained(p.get<std::string>("pretrained"), pretrained_kind());
      src.folder = &*folder;
      src.written = written_params(ctx.run(), ctx.name());
    }
    b = build(ctx, src);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error(what.rfind(ctx.who(), 0) == 0 ? what : ctx.who() + ": " + what);
  }
  state_ = b.state;
  state_->set_prefix(prefix);
  state_->vocab = b.vocab;
  check_tokenizer_fits(ctx, b.vocab, folder ? folder->config_path : src.weights);
  state_->module->to(run_device(ctx.run()), dtype == "bfloat16" ? torch::kBFloat16 : torch::kFloat);
  if (ctx.run().rank == 0) {
    int64_t n = 0;
    for (const auto& t : state_->module->parameters()) n += t.numel();
    const std::string from = folder ? "pretrained " + folder->dir : src.weights.empty() ? "random init" : "weights from " + src.weights;
    spdlog::info("{}: frozen {} ({:.2f}M parameters, {}), outputs {}_emb/{}_mask", ctx.who(), b.what,
                 static_cast<double>(n) / 1e6, from, prefix, prefix);
    if (!folder && src.weights.empty())
      spdlog::warn("{}: weights and pretrained are null: the text encoder is randomly initialised (seed {}), so its "
                   "outputs are random, not text embeddings; give a pretrained folder or a safetensors file for real ones",
                   ctx.who(), src.seed);
  }
  ctx.own_state("params", std::static_pointer_cast<ModelState>(state_));
}

void TextEncodeNode::run(StepContext& ctx) { ctx.out("emb", encode_text(*state_, ctx.in<TensorMap>("tokens"))); }

}  // namespace flowrun
