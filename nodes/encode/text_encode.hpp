// Frozen text encoders (text_encode node): BERT (models/bert.hpp) or a T5 encoder
// (models/t5_encoder.hpp), Hugging Face names, loaded from safetensors. The encoder never
// trains: every parameter has requires_grad false, it runs under torch::NoGradGuard in eval
// mode (no dropout). Not torch::InferenceMode: its outputs feed trainable models, which save
// them for backward (inference tensors cannot be).
#pragma once
#include <memory>
#include <string>

#include "common/tensor_map.hpp"
#include "models/model_state.hpp"

namespace flowrun {

// The ModelState behind text_encode's `params` port (held as std::shared_ptr<ModelState>;
// dynamic_pointer_cast to this for arch and prefix). forward(tokens) reads "input_ids" and
// "attention_mask" (optional: all ones) and returns the last hidden state [B, L, dim] as float32.
struct TextEncoderState : ModelState {
  std::string arch;            // "bert" or "t5"
  std::string prefix = "text"; // output keys PREFIX_emb, PREFIX_mask
  using ModelState::ModelState;
  std::shared_ptr<ModelState> clone() const override;
};

// A frozen encoder state around a bert::Bert or t5::T5Encoder module (already loaded and in its
// dtype): sets requires_grad false everywhere and eval mode.
std::shared_ptr<TextEncoderState> make_text_encoder_state(std::shared_ptr<torch::nn::Module> module,
                                                          const std::string& arch, const std::string& prefix = "text");

// tokens {"input_ids": int [B, L], "attention_mask": int [B, L] (optional)} ->
// {PREFIX_emb: float32 [B, L, dim], PREFIX_mask: int64 [B, L]}, on the encoder's device, under
// NoGradGuard. PREFIX: the state's prefix if it is a TextEncoderState, else "text" (or the
// explicit one). Used by the text_encode node and by samplers encoding prompts.
TensorMap encode_text(ModelState& encoder, const TensorMap& tokens);
TensorMap encode_text(ModelState& encoder, const TensorMap& tokens, const std::string& prefix);

}  // namespace flowrun
