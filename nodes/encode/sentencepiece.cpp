// SentencePiece tokenizer (see sentencepiece.hpp).
#include "encode/sentencepiece.hpp"

#include <unicode/locid.h>
#include <unicode/unistr.h>

#include <stdexcept>

#ifdef FLOWRUN_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#endif

namespace flowrun {

#ifdef FLOWRUN_HAVE_SENTENCEPIECE

bool sentencepiece_available() { return true; }

struct SentencePieceTokenizer::Impl {
  sentencepiece::SentencePieceProcessor sp;
};

SentencePieceTokenizer::SentencePieceTokenizer(std::unique_ptr<Impl> impl, int64_t max_length, bool lowercase)
    : TextTokenizer(max_length), impl_(std::move(impl)), lowercase_(lowercase) {
  const int pad = impl_->sp.pad_id(), eos = impl_->sp.eos_id();
  pad_ = pad >= 0 ? pad : 0;
  eos_ = eos >= 0 ? eos : 1;
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::shared_ptr<SentencePieceTokenizer> SentencePieceTokenizer::load(const std::string& model_file,
                                                                     int64_t max_length, bool lowercase) {
  if (max_length < 1)
    throw std::runtime_error("sentencepiece: max_length must be at least 1 (for </s>), got " +
                             std::to_string(max_length));
  auto impl = std::make_unique<Impl>();
  const auto st = impl->sp.Load(model_file);
  if (!st.ok()) throw std::runtime_error("sentencepiece: cannot load " + model_file + ": " + st.ToString());
  return std::shared_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer(std::move(impl), max_length, lowercase));
}

int64_t SentencePieceTokenizer::vocab_size() const { return impl_->sp.GetPieceSize(); }

std::vector<int64_t> SentencePieceTokenizer::piece_ids(const std::string& text) const {
  std::string t = text;
  if (lowercase_) {
    icu::UnicodeString u = icu::UnicodeString::fromUTF8(text);
    u.toLower(icu::Locale::getRoot());
    t.clear();
    u.toUTF8String(t);
  }
  std::vector<int> ids;
  const auto st = impl_->sp.Encode(t, &ids);
  if (!st.ok()) throw std::runtime_error("sentencepiece: cannot encode a text: " + st.ToString());
  return std::vector<int64_t>(ids.begin(), ids.end());
}

std::vector<int64_t> SentencePieceTokenizer::ids(const std::string& text, int64_t max_length) const {
  if (max_length < 1) throw std::runtime_error("sentencepiece: max_length must be at least 1");
  std::vector<int64_t> out = piece_ids(text);
  if (static_cast<int64_t>(out.size()) > max_length - 1) out.resize(static_cast<size_t>(max_length - 1));
  out.push_back(eos_);
  return out;
}

std::string SentencePieceTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::vector<int> v(ids.begin(), ids.end());
  std::string out;
  const auto st = impl_->sp.Decode(v, &out);
  if (!st.ok()) throw std::runtime_error("sentencepiece: cannot decode: " + st.ToString());
  return out;
}

void SentencePieceTokenizer::train(const std::string& text_file, const std::string& model_prefix, int vocab_size) {
  const std::string args = "--input=" + text_file + " --model_prefix=" + model_prefix +
                           " --vocab_size=" + std::to_string(vocab_size) +
                           " --model_type=unigram --pad_id=0 --eos_id=1 --unk_id=2 --bos_id=-1"
                           " --character_coverage=1.0 --minloglevel=2";
  const auto st = sentencepiece::SentencePieceTrainer::Train(args);
  if (!st.ok()) throw std::runtime_error("sentencepiece: training on " + text_file + " failed: " + st.ToString());
}

#else  // !FLOWRUN_HAVE_SENTENCEPIECE

namespace {
[[noreturn]] void not_built() {
  throw std::runtime_error(
      "sentencepiece: not built. This flowrun was built without SentencePiece (CMake option "
      "FLOWRUN_SENTENCEPIECE, off by default: Debian's libsentencepiece bundles a protobuf that clashes with "
      "libtorch's in one process); use kind: wordpiece");
}
}  // namespace

bool sentencepiece_available() { return false; }
struct SentencePieceTokenizer::Impl {};
SentencePieceTokenizer::SentencePieceTokenizer(std::unique_ptr<Impl> impl, int64_t max_length, bool lowercase)
    : TextTokenizer(max_length), impl_(std::move(impl)), lowercase_(lowercase) {}
SentencePieceTokenizer::~SentencePieceTokenizer() = default;
std::shared_ptr<SentencePieceTokenizer> SentencePieceTokenizer::load(const std::string&, int64_t, bool) { not_built(); }
int64_t SentencePieceTokenizer::vocab_size() const { not_built(); }
std::vector<int64_t> SentencePieceTokenizer::piece_ids(const std::string&) const { not_built(); }
std::vector<int64_t> SentencePieceTokenizer::ids(const std::string&, int64_t) const { not_built(); }
std::string SentencePieceTokenizer::decode(const std::vector<int64_t>&) const { not_built(); }
void SentencePieceTokenizer::train(const std::string&, const std::string&, int) { not_built(); }

#endif

}  // namespace flowrun
