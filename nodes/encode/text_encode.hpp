// Frozen text encoders: the state the encoder nodes own (bert_encode: models/bert.hpp;
// t5_encode: models/t5_encoder.hpp; Hugging Face names, loaded from safetensors) and the node
// code they share. The encoder never trains: every parameter has requires_grad false, it runs
// under torch::NoGradGuard in eval mode (no dropout). Not torch::InferenceMode: its outputs
// feed trainable models, which save them for backward (inference tensors cannot be).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/pretrained.hpp"
#include "common/tensor_map.hpp"
#include "formats/text_tokenizer.hpp"
#include "models/model_state.hpp"
#include "node.hpp"

namespace flowrun {

// The ModelState behind an encoder node's `params` port (held as std::shared_ptr<ModelState>).
// forward(tokens) reads "input_ids" and "attention_mask" (optional: all ones) and returns the
// last hidden state [B, L, dim] as float32; its `condition` encodes tokens into PREFIX_emb and
// PREFIX_mask (set_prefix), so readers of the state (samplers, evaluators) need not know its type.
struct TextEncoderState : ModelState {
  std::string prefix = "text";  // output keys PREFIX_emb, PREFIX_mask
  int64_t vocab = 0;             // the ids its embedding has rows for (0: not known)
  using ModelState::ModelState;
  std::shared_ptr<ModelState> clone() const override;
  void set_prefix(const std::string& p);  // prefix, and condition = encode_text(self, tokens, p)
};

// How an encoder module maps (input_ids [B, L], attention_mask [B, L] or undefined) to [B, L, dim].
using EncoderForward = std::function<torch::Tensor(torch::nn::Module&, const torch::Tensor& ids, const torch::Tensor& mask)>;

// A frozen encoder state around a module (already loaded and in its dtype): sets requires_grad
// false everywhere and eval mode. `kind` names it in messages ("bert").
std::shared_ptr<TextEncoderState> make_text_encoder_state(std::shared_ptr<torch::nn::Module> module, EncoderForward f,
                                                          const std::string& kind, const std::string& prefix);
// The same for a module type M with forward(input_ids, attention_mask) (bert::BertImpl,
// t5::T5EncoderImpl).
template <class M>
std::shared_ptr<TextEncoderState> make_text_encoder_state(std::shared_ptr<M> module, const std::string& kind,
                                                          const std::string& prefix = "text") {
  return make_text_encoder_state(
      std::move(module),
      [](torch::nn::Module& m, const torch::Tensor& ids, const torch::Tensor& mask) {
        return dynamic_cast<M&>(m).forward(ids, mask);
      },
      kind, prefix);
}

// tokens {"input_ids": int [B, L], "attention_mask": int [B, L] (optional)} ->
// {PREFIX_emb: float32 [B, L, dim], PREFIX_mask: int64 [B, L]}, on the encoder's device, under
// NoGradGuard. PREFIX: the explicit one, else the state's (its `condition`: a text encoder's
// state says how it encodes; a state without one encodes as "text"). Used by the encoder nodes
// and by samplers and evaluators encoding captions.
TensorMap encode_text(ModelState& encoder, const TensorMap& tokens);
TensorMap encode_text(ModelState& encoder, const TensorMap& tokens, const std::string& prefix);

// Captions into a model's text condition, as training made it: each (tokenizer, encoder) pair
// in turn (HunyuanDiT: the BERT's wordpiece tokenizer and encoder, then the mT5's), their
// outputs merged (PREFIX_emb, PREFIX_mask of each; two encoders with one prefix are an error).
// Used by the evaluator and the sampler, whose `tokenizer` and `encoder` inputs take one or
// more refs, paired in the order written.
struct TextConditioner {
  std::vector<std::pair<const TextTokenizer*, ModelState*>> pairs;
  bool empty() const { return pairs.empty(); }
  TensorMap encode(const std::vector<std::string>& texts) const;
};
// The pairs from a node's `tokenizer` and `encoder` inputs (`many` ports; unconnected: empty):
// as many of one as of the other, else an error naming both lists as written.
TextConditioner text_conditioner(StepContext& ctx);
// The same check at setup, so a graph that pairs them wrongly stops before the first step.
void check_text_pairs(const SetupContext& ctx);

// The encoder nodes' shared part: the parameters of the text_encoder group (pretrained,
// weights, dtype, out_prefix, seed; schemas/groups/text_encoder.yaml), the frozen state on the
// `params` port, the log lines, and run(): tokens -> emb. A node type adds its architecture in
// build() and names its pretrained folder (component, weights file) in pretrained_kind().
class TextEncodeNode : public Node {
 public:
  void setup(SetupContext& ctx) final;
  void run(StepContext& ctx) final;

 protected:
  struct Built {
    std::shared_ptr<TextEncoderState> state;  // make_text_encoder_state(module, ...)
    std::string what;                          // "bert layers=2 dim=64", for the log
    int64_t vocab = 0;                         // rows of its token embedding
  };
  // Where the weights come from: a pretrained folder (its config.json sets the architecture,
  // written: the node's `with:` as the graph wrote it, which must agree), a safetensors file,
  // or neither (initialised from `seed`).
  struct Source {
    const PretrainedFolder* folder = nullptr;
    YAML::Node written;
    std::string weights;
    uint64_t seed = 0;
  };
  // The module from the node's parameters or the folder's config.json, loaded or initialised as
  // `src` says; its size checked before allocating (common/memory.hpp).
  virtual Built build(SetupContext& ctx, const Source& src) = 0;
  // The folder a pipeline keeps this encoder in and its weights' file stem.
  virtual PretrainedKind pretrained_kind() const = 0;
  // The module's weights as `src` says: the folder's, the file's, or initialised from the seed,
  // by the family's load_hf_state_dict / load_hf_safetensors / init_weights (models/bert.hpp,
  // models/t5_encoder.hpp; found by the module's namespace).
  template <class M>
  static void load_or_init(M& module, const Source& src) {
    if (src.folder)
      load_hf_state_dict(module, load_pretrained_weights(*src.folder), weights_source(*src.folder));
    else if (!src.weights.empty())
      load_hf_safetensors(module, src.weights);
    else
      init_weights(module, src.seed);
  }

 private:
  // Refuses a tokenizer feeding `tokens` with more ids than `vocab` (`from`: the encoder's file).
  void check_tokenizer_fits(const SetupContext& ctx, int64_t vocab, const std::string& from) const;
  std::shared_ptr<TextEncoderState> state_;
};

}  // namespace flowrun
