// SentencePiece tokenizer (T5 / mT5 spiece.model) on Debian's libsentencepiece
// (libsentencepiece-dev). T5's convention: the pieces' ids, then </s> (the model's eos id,
// 1 in T5's models), truncated to max_length keeping </s>, padded with the model's pad id (0 in
// T5's models; 0 if the model defines none). With lowercase, the text is lowercased (ICU, like
// Python's str.lower()) before encoding; T5 and mT5 models expect lowercase = false.
//
// libsentencepiece is never linked into flowrun: Debian's libsentencepiece.so.0 carries its own
// protobuf-lite 3.14 whose exported symbols clash with libprotobuf.so.32 (3.21, loaded by
// libtorch), which crashes a process that links both at start-up. Instead the small shim
// library flowrun_spm_shim (encode/spm_shim/spm_shim.cpp: a C API, the only thing linking
// libsentencepiece) is opened on first use with dlmopen(LM_ID_NEWLM), in a link namespace of its
// own: it and libsentencepiece bind to their own protobuf (and libstdc++), and nothing of theirs
// is visible to the rest of the process (sentencepiece.cpp says why not RTLD_DEEPBIND). The shim
// is looked up as $FLOWRUN_SPM_SHIM if set, otherwise next to libflowrun_nodes.so, then where the
// build put it. CMake builds it when pkg-config finds libsentencepiece-dev (option
// FLOWRUN_SENTENCEPIECE, on by default then); without it load() and train() throw an error
// saying how to fix it (install libsentencepiece-dev and rebuild).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "formats/text_tokenizer.hpp"

namespace flowrun {

// Whether the SentencePiece shim (and libsentencepiece) loads in this process; opened on the
// first call of this, load() or train().
bool sentencepiece_available();
// Whether this flowrun was built with the shim (libsentencepiece-dev found by CMake).
bool sentencepiece_built();

class SentencePieceTokenizer : public TextTokenizer {
 public:
  // Loads a SentencePiece .model file; errors name the file.
  static std::shared_ptr<SentencePieceTokenizer> load(const std::string& model_file, int64_t max_length = 77,
                                                      bool lowercase = false);
  ~SentencePieceTokenizer() override;

  std::string name() const override { return "sentencepiece"; }
  int64_t vocab_size() const override;
  int64_t pad_id() const override { return pad_; }
  int64_t eos_id() const override { return eos_; }
  std::vector<int64_t> ids(const std::string& text, int64_t max_length) const override;
  // The pieces' ids alone (no </s>, no truncation).
  std::vector<int64_t> piece_ids(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& ids) const override;

  // Trains a small unigram model on a text file (one sentence per line) into PREFIX.model with
  // T5's special ids (pad 0, eos 1, unk 2, no bos): for tests and tiny demos.
  static void train(const std::string& text_file, const std::string& model_prefix, int vocab_size);

 private:
  struct Impl;
  SentencePieceTokenizer(std::unique_ptr<Impl> impl, int64_t max_length, bool lowercase);
  std::unique_ptr<Impl> impl_;
  bool lowercase_;
  int64_t pad_ = 0, eos_ = 1;
};

}  // namespace flowrun
