// bert_encode: a frozen BERT text encoder (Hugging Face BertModel, models/bert.hpp).
// Schema: schemas/bert_encode.yaml. Test: tests/nodes/text_encode_test.cpp.
#include "common/memory.hpp"
#include "encode/text_encode.hpp"
#include "models/bert.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

// A transformers BertModel's config.json (BertConfig) into the config: each key by its
// parameter (transformers' default where the file lacks it); keys that change the math must
// hold what this BERT computes with.
void apply_pretrained(const PretrainedFolder& f, const YAML::Node& written, bert::Config& c) {
  const std::string type = config_value<std::string>(f, "model_type", "bert");
  if (type != "bert")
    throw std::runtime_error(f.config_path + ": model_type is " + type + "; bert_encode reads a BERT (model_type bert)");
  c.vocab = config_agreed<int64_t>(f, written, "vocab", "vocab_size", 30522);
  c.dim = config_agreed<int64_t>(f, written, "dim", "hidden_size", 768);
  c.layers = config_agreed<int64_t>(f, written, "layers", "num_hidden_layers", 12);
  c.heads = config_agreed<int64_t>(f, written, "heads", "num_attention_heads", 12);
  c.ffn = config_agreed<int64_t>(f, written, "ffn", "intermediate_size", 3072);
  c.max_positions = config_agreed<int64_t>(f, written, "max_positions", "max_position_embeddings", 512);
  c.type_vocab = config_agreed<int64_t>(f, written, "type_vocab", "type_vocab_size", 2);
  c.eps = config_agreed<double>(f, written, "eps", "layer_norm_eps", 1e-12);
  const std::map<std::string, nlohmann::json> fixed = {
      {"hidden_act", "gelu"}, {"position_embedding_type", "absolute"}, {"is_decoder", false}, {"add_cross_attention", false}};
  // Read above, or not about the encoder's math (training-time dropout and init, the pooler,
  // token ids, bookkeeping).
  const std::set<std::string> known = {
      "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
      "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "architectures", "attention_probs_dropout_prob",
      "hidden_dropout_prob", "classifier_dropout", "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id",
      "transformers_version", "torch_dtype", "dtype", "use_cache", "directionality", "output_past", "pooler_fc_size",
      "pooler_num_attention_heads", "pooler_num_fc_layers", "pooler_size_per_head", "pooler_type",
      "gradient_checkpointing", "id2label", "label2id",
      "tie_word_embeddings"};  // transformers 5 writes it; BertModel has no LM head to tie
  check_config_keys(f, known, fixed, "BertModel", "this BERT");
}

class BertEncodeNode : public TextEncodeNode {
  PretrainedKind pretrained_kind() const override { return {"text_encoder", "", "model"}; }

  Built build(SetupContext& ctx, const Source& src) override {
    const Params& p = ctx.params();
    bert::Config c;
    if (src.folder) {
      apply_pretrained(*src.folder, src.written, c);
    } else {
      p.read<int64_t>({{"vocab", &c.vocab}, {"dim", &c.dim}, {"layers", &c.layers}, {"heads", &c.heads}, {"ffn", &c.ffn},
                       {"max_positions", &c.max_positions}, {"type_vocab", &c.type_vocab}});
      c.eps = p.get<double>("eps");
    }
    // Embeddings (tokens, positions, token types) + per layer: q, k, v, o (dim x dim) and the
    // two feed-forward matrices.
    check_model_fits(ctx.who(), "bert, " + std::to_string(c.layers) + " layers of " + std::to_string(c.dim),
                     (static_cast<double>(c.vocab) + c.max_positions + c.type_vocab) * c.dim +
                         static_cast<double>(c.layers) * (4.0 * c.dim * c.dim + 2.0 * c.dim * c.ffn),
                     /*frozen=*/true, c.layers);
    bert::Bert m(c);
    load_or_init(*m, src);
    return {make_text_encoder_state(m.ptr(), "bert"),
            "bert layers=" + std::to_string(c.layers) + " dim=" + std::to_string(c.dim), c.vocab};
  }
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(bert_encode, flowrun::BertEncodeNode)
