// t5_encode: a frozen T5 encoder (Hugging Face T5EncoderModel: T5 v1.0/v1.1, mT5;
// models/t5_encoder.hpp). Schema: schemas/t5_encode.yaml. Test: tests/nodes/text_encode_test.cpp.
#include "common/memory.hpp"
#include "encode/text_encode.hpp"
#include "models/t5_encoder.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

// A transformers T5EncoderModel's config.json (T5Config / MT5Config) into the config: each key
// by its parameter (the config class's default where the file lacks it: T5's or mT5's); keys
// that change the math must hold what this encoder computes with.
void apply_pretrained(const PretrainedFolder& f, const YAML::Node& written, t5::Config& c) {
  const std::string type = config_value<std::string>(f, "model_type", "t5");
  if (type != "t5" && type != "mt5")
    throw std::runtime_error(f.config_path + ": model_type is " + type + "; t5_encode reads a T5 or an mT5 " +
                             "(model_type t5 or mt5; umT5's per-layer position biases are not built)");
  const bool mt5 = type == "mt5";
  c.vocab = config_agreed<int64_t>(f, written, "vocab", "vocab_size", mt5 ? 250112 : 32128);
  c.dim = config_agreed<int64_t>(f, written, "dim", "d_model", 512);
  c.layers = config_agreed<int64_t>(f, written, "layers", "num_layers", mt5 ? 8 : 6);
  c.heads = config_agreed<int64_t>(f, written, "heads", "num_heads", mt5 ? 6 : 8);
  c.ffn = config_agreed<int64_t>(f, written, "ffn", "d_ff", mt5 ? 1024 : 2048);
  c.d_kv = config_agreed<int64_t>(f, written, "d_kv", "d_kv", 64);
  c.buckets = config_agreed<int64_t>(f, written, "relative_attention_num_buckets", "relative_attention_num_buckets", 32);
  c.max_distance = config_agreed<int64_t>(f, written, "relative_attention_max_distance", "relative_attention_max_distance", 128);
  c.eps = config_agreed<double>(f, written, "eps", "layer_norm_epsilon", 1e-6);
  const std::string proj = config_agreed<std::string>(f, written, "feed_forward_proj", "feed_forward_proj",
                                                      mt5 ? "gated-gelu" : "relu");
  if (proj != "gated-gelu" && proj != "relu")
    throw std::runtime_error(f.config_path + ": feed_forward_proj = " + proj + " is not built (gated-gelu or relu)");
  c.gated = proj == "gated-gelu";
  // What transformers derives from feed_forward_proj, saved beside it: must say the same.
  const std::map<std::string, nlohmann::json> fixed = {{"dense_act_fn", c.gated ? "gelu_new" : "relu"},
                                                       {"is_gated_act", c.gated}, {"is_decoder", false}};
  // Read above, or not about the encoder's math (the decoder, dropout, init, token ids,
  // bookkeeping).
  const std::set<std::string> known = {
      "model_type", "vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "d_kv", "relative_attention_num_buckets",
      "relative_attention_max_distance", "layer_norm_epsilon", "feed_forward_proj", "architectures",
      "num_decoder_layers", "decoder_start_token_id", "dropout_rate", "classifier_dropout", "initializer_factor",
      "is_encoder_decoder", "tie_word_embeddings", "pad_token_id", "eos_token_id", "tokenizer_class",
      "transformers_version", "torch_dtype", "dtype", "use_cache", "output_past", "n_positions",
      "task_specific_params", "gradient_checkpointing", "bos_token_id",
      "scale_decoder_outputs"};  // transformers 5: the tied LM head's rescaling, decoder side only
  check_config_keys(f, known, fixed, mt5 ? "MT5EncoderModel" : "T5EncoderModel", "this encoder");
}

class T5EncodeNode : public TextEncodeNode {
  PretrainedKind pretrained_kind() const override { return {"text_encoder_2", "", "model"}; }

  Built build(SetupContext& ctx, const Source& src) override {
    const Params& p = ctx.params();
    t5::Config c;
    if (src.folder) {
      apply_pretrained(*src.folder, src.written, c);
    } else {
      p.read<int64_t>({{"vocab", &c.vocab}, {"dim", &c.dim}, {"layers", &c.layers}, {"heads", &c.heads}, {"ffn", &c.ffn},
                       {"d_kv", &c.d_kv}, {"relative_attention_num_buckets", &c.buckets},
                       {"relative_attention_max_distance", &c.max_distance}});
      c.gated = p.get<std::string>("feed_forward_proj") == "gated-gelu";
      c.eps = p.get<double>("eps");
    }
    // Embeddings + the relative position bias (buckets x heads) + per block: q, k, v, o (dim x
    // heads*d_kv) and the feed-forward matrices.
    check_model_fits(ctx.who(), "t5, " + std::to_string(c.layers) + " layers of " + std::to_string(c.dim),
                     static_cast<double>(c.vocab) * c.dim + static_cast<double>(c.buckets) * c.heads +
                         static_cast<double>(c.layers) * (4.0 * c.dim * c.heads * c.d_kv + (c.gated ? 3.0 : 2.0) * c.dim * c.ffn),
                     /*frozen=*/true, c.layers);
    t5::T5Encoder m(c);
    load_or_init(*m, src);
    return {make_text_encoder_state(m.ptr(), "t5"),
            "t5 encoder layers=" + std::to_string(c.layers) + " dim=" + std::to_string(c.dim), c.vocab};
  }
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(t5_encode, flowrun::T5EncodeNode)
