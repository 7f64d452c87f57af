// bert_encode: a frozen BERT text encoder (Hugging Face BertModel, models/bert.hpp).
// Schema: schemas/bert_encode.yaml. Test: tests/nodes/text_encode_test.cpp.
#include "common/memory.hpp"
#include "encode/text_encode.hpp"
#include "models/bert.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

class BertEncodeNode : public TextEncodeNode {
  Built build(SetupContext& ctx, const std::string& weights, uint64_t seed) override {
    const Params& p = ctx.params();
    bert::Config c;
    p.read<int64_t>({{"vocab", &c.vocab}, {"dim", &c.dim}, {"layers", &c.layers}, {"heads", &c.heads}, {"ffn", &c.ffn},
                     {"max_positions", &c.max_positions}, {"type_vocab", &c.type_vocab}});
    c.eps = p.get<double>("eps");
    // Embeddings + per layer: q, k, v, o (dim x dim) and the two feed-forward matrices.
    check_model_fits(ctx.who(), "bert, " + std::to_string(c.layers) + " layers of " + std::to_string(c.dim),
                     static_cast<double>(c.vocab) * c.dim + static_cast<double>(c.layers) * (4.0 * c.dim * c.dim + 2.0 * c.dim * c.ffn),
                     /*frozen=*/true);
    bert::Bert m(c);
    if (!weights.empty()) bert::load_hf_safetensors(*m, weights); else bert::init_weights(*m, seed);
    return {make_text_encoder_state(m.ptr(), "bert"),
            "bert layers=" + std::to_string(c.layers) + " dim=" + std::to_string(c.dim)};
  }
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(bert_encode, flowrun::BertEncodeNode)
