// text_encode node (see text_encode.hpp and schemas/text_encode.yaml).
#include "encode/text_encode.hpp"

#include <spdlog/spdlog.h>

#include <stdexcept>

#include "common/device.hpp"
#include "common/memory.hpp"
#include "common/seed.hpp"
#include "models/bert.hpp"
#include "models/t5_encoder.hpp"
#include "node.hpp"
#include "registry.hpp"
#include "train/precision.hpp"

namespace flowrun {
namespace {

torch::Tensor module_forward(torch::nn::Module& m, const TensorMap& batch) {
  auto ids = batch.find("input_ids");
  if (ids == batch.end()) throw std::runtime_error("text encoder: the batch has no 'input_ids'");
  torch::Device dev = torch::kCPU;
  for (const auto& p : m.parameters()) {
    dev = p.device();
    break;
  }
  torch::Tensor input_ids = ids->second.to(dev);
  torch::Tensor mask;
  if (auto it = batch.find("attention_mask"); it != batch.end()) mask = it->second.to(dev);
  torch::Tensor out;
  if (auto* b = m.as<bert::BertImpl>()) {
    out = b->forward(input_ids, mask);
  } else if (auto* t = m.as<t5::T5EncoderImpl>()) {
    out = t->forward(input_ids, mask);
  } else {
    throw std::runtime_error("text encoder: the module is neither BERT nor a T5 encoder");
  }
  return out.to(torch::kFloat);
}

}  // namespace

std::shared_ptr<ModelState> TextEncoderState::clone() const {
  if (!module) throw std::runtime_error("text encoder: no module to clone");
  torch::NoGradGuard no_grad;
  auto copy = std::make_shared<TextEncoderState>(*this);
  copy->module = module->clone();
  for (auto& p : copy->module->parameters()) p.set_requires_grad(false);
  copy->module->eval();
  return copy;
}

std::shared_ptr<TextEncoderState> make_text_encoder_state(std::shared_ptr<torch::nn::Module> module,
                                                          const std::string& arch, const std::string& prefix) {
  for (auto& p : module->parameters()) p.set_requires_grad(false);
  module->eval();
  auto s = std::make_shared<TextEncoderState>(std::move(module), module_forward, "text_encode/" + arch);
  s->arch = arch;
  s->prefix = prefix;
  return s;
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
  auto* s = dynamic_cast<TextEncoderState*>(&encoder);
  return encode_text(encoder, tokens, s ? s->prefix : std::string("text"));
}

namespace {

class TextEncodeNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    const std::string arch = p.get<std::string>("arch");
    const std::string dtype = p.get<std::string>("dtype");
    const std::string prefix = p.get<std::string>("out_prefix");
    const uint64_t seed = mix_seed({p.has("seed") ? p.get<uint64_t>("seed") : ctx.run().seed, name_seed(ctx.name()),
                                    kSeedTagInit});
    auto size = [&](const char* key, int64_t fallback) { return p.has(key) ? p.get<int64_t>(key) : fallback; };
    const std::string weights = p.has("weights") ? p.get<std::string>("weights") : "";

    std::shared_ptr<torch::nn::Module> module;
    std::string what;
    try {
      if (arch == "bert") {
        bert::Config c;
        c.vocab = size("vocab", 30522);
        c.dim = size("dim", 768);
        c.layers = size("layers", 12);
        c.heads = size("heads", 12);
        c.ffn = size("ffn", 3072);
        c.max_positions = size("max_positions", 512);
        c.type_vocab = size("type_vocab", 2);
        c.eps = p.has("eps") ? p.get<double>("eps") : 1e-12;
        check_model_fits(ctx.who(), "bert, " + std::to_string(c.layers) + " layers of " + std::to_string(c.dim),
                         static_cast<double>(c.vocab) * c.dim + static_cast<double>(c.layers) * (4.0 * c.dim * c.dim + 2.0 * c.dim * c.ffn),
                         /*frozen=*/true);
        bert::Bert m(c);
        if (!weights.empty()) bert::load_hf_safetensors(*m, weights); else bert::init_weights(*m, seed);
        module = m.ptr();
        what = "bert layers=" + std::to_string(c.layers) + " dim=" + std::to_string(c.dim);
      } else if (arch == "t5") {
        t5::Config c;
        c.vocab = size("vocab", 32128);
        c.dim = size("dim", 768);
        c.layers = size("layers", 12);
        c.heads = size("heads", 12);
        c.ffn = size("ffn", 2048);
        c.d_kv = size("d_kv", 64);
        c.buckets = size("relative_attention_num_buckets", 32);
        c.max_distance = size("relative_attention_max_distance", 128);
        c.gated = p.get<std::string>("feed_forward_proj") == "gated-gelu";
        c.eps = p.has("eps") ? p.get<double>("eps") : 1e-6;
        check_model_fits(ctx.who(), "t5, " + std::to_string(c.layers) + " layers of " + std::to_string(c.dim),
                         static_cast<double>(c.vocab) * c.dim +
                             static_cast<double>(c.layers) * (4.0 * c.dim * c.heads * c.d_kv + (c.gated ? 3.0 : 2.0) * c.dim * c.ffn),
                         /*frozen=*/true);
        t5::T5Encoder m(c);
        if (!weights.empty()) t5::load_hf_safetensors(*m, weights); else t5::init_weights(*m, seed);
        module = m.ptr();
        what = "t5 encoder layers=" + std::to_string(c.layers) + " dim=" + std::to_string(c.dim);
      } else {
        throw std::invalid_argument("unknown arch '" + arch + "' (bert or t5)");
      }
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    module->to(run_device(ctx.run()), dtype == "bfloat16" ? torch::kBFloat16 : torch::kFloat);
    state_ = make_text_encoder_state(module, arch, prefix);
    if (ctx.run().rank == 0) {
      int64_t n = 0;
      for (const auto& t : module->parameters()) n += t.numel();
      spdlog::info("{}: frozen {} ({:.2f}M parameters, {}), outputs {}_emb/{}_mask", ctx.who(), what,
                   static_cast<double>(n) / 1e6, weights.empty() ? "random init" : "weights from " + weights, prefix,
                   prefix);
      if (weights.empty())
        spdlog::warn("{}: weights is null: the text encoder is randomly initialised (seed {}), so its outputs are "
                     "random, not text embeddings; give a safetensors file for real ones",
                     ctx.who(), seed);
    }
    ctx.own_state("params", std::static_pointer_cast<ModelState>(state_));
  }

  void run(StepContext& ctx) override { ctx.out("emb", encode_text(*state_, ctx.in<TensorMap>("tokens"))); }

 private:
  std::shared_ptr<TextEncoderState> state_;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(text_encode, flowrun::TextEncodeNode)
