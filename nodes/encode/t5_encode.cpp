// t5_encode: a frozen T5 encoder (Hugging Face T5EncoderModel: T5 v1.0/v1.1, mT5;
// models/t5_encoder.hpp). Schema: schemas/t5_encode.yaml. Test: tests/nodes/text_encode_test.cpp.
#include "common/memory.hpp"
#include "encode/text_encode.hpp"
#include "models/t5_encoder.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

class T5EncodeNode : public TextEncodeNode {
  Built build(SetupContext& ctx, const std::string& weights, uint64_t seed) override {
    const Params& p = ctx.params();
    t5::Config c;
    p.read<int64_t>({{"vocab", &c.vocab}, {"dim", &c.dim}, {"layers", &c.layers}, {"heads", &c.heads}, {"ffn", &c.ffn},
                     {"d_kv", &c.d_kv}, {"relative_attention_num_buckets", &c.buckets},
                     {"relative_attention_max_distance", &c.max_distance}});
    c.gated = p.get<std::string>("feed_forward_proj") == "gated-gelu";
    c.eps = p.get<double>("eps");
    // Embeddings + per block: q, k, v, o (dim x heads*d_kv) and the feed-forward matrices.
    check_model_fits(ctx.who(), "t5, " + std::to_string(c.layers) + " layers of " + std::to_string(c.dim),
                     static_cast<double>(c.vocab) * c.dim +
                         static_cast<double>(c.layers) * (4.0 * c.dim * c.heads * c.d_kv + (c.gated ? 3.0 : 2.0) * c.dim * c.ffn),
                     /*frozen=*/true);
    t5::T5Encoder m(c);
    if (!weights.empty()) t5::load_hf_safetensors(*m, weights); else t5::init_weights(*m, seed);
    return {make_text_encoder_state(m.ptr(), "t5"),
            "t5 encoder layers=" + std::to_string(c.layers) + " dim=" + std::to_string(c.dim)};
  }
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(t5_encode, flowrun::T5EncodeNode)
