// SentencePiece tokenizer (see sentencepiece.hpp): Debian's libsentencepiece behind the
// flowrun_spm_shim library (encode/spm_shim/spm_shim.cpp), opened with dlmopen in a link
// namespace of its own so that its bundled protobuf-lite never meets libtorch's libprotobuf.
// Nothing here links libsentencepiece.
#include "encode/sentencepiece.hpp"

#include <dlfcn.h>
#include <unicode/locid.h>
#include <unicode/unistr.h>

#include <cstdlib>
#include <stdexcept>

namespace flowrun {

namespace {

constexpr int kShimAbi = 1;

#ifdef FLOWRUN_SPM_SHIM_NAME
constexpr const char* kShimName = FLOWRUN_SPM_SHIM_NAME;
#else
constexpr const char* kShimName = "libflowrun_spm_shim.so";
#endif

// The shim's C API (see spm_shim.cpp).
struct Shim {
  void* lib = nullptr;
  std::string error;  // why it did not load (lib == nullptr)
  int (*abi_version)() = nullptr;
  void* (*load)(const char*, char*, size_t) = nullptr;
  void (*free)(void*) = nullptr;
  int (*vocab_size)(void*) = nullptr;
  int (*pad_id)(void*) = nullptr;
  int (*eos_id)(void*) = nullptr;
  long (*encode)(void*, const char*, size_t, int32_t*, size_t, char*, size_t) = nullptr;
  long (*decode)(void*, const int32_t*, size_t, char*, size_t, char*, size_t) = nullptr;
  int (*train)(const char*, char*, size_t) = nullptr;
};

// The folder of the library holding this code (libflowrun_nodes.so), "" if unknown.
std::string this_library_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&this_library_dir), &info) == 0 || info.dli_fname == nullptr) return "";
  const std::string f = info.dli_fname;
  const auto slash = f.rfind('/');
  return slash == std::string::npos ? "." : f.substr(0, slash);
}

template <typename F>
bool bind(void* lib, const char* name, F& fn, std::string& error) {
  void* p = dlsym(lib, name);
  if (p == nullptr) {
    error = std::string("no symbol ") + name;
    return false;
  }
  fn = reinterpret_cast<F>(p);
  return true;
}

// Opens one candidate; on failure returns false with ERROR set.
//
// dlmopen(LM_ID_NEWLM): the shim, libsentencepiece and their own copies of libstdc++, libc, ...
// live in a fresh link namespace, where every reference binds inside it: libsentencepiece's to
// its protobuf-lite 3.14, never to the libprotobuf 3.21 that libtorch put in the main one, and
// none of their symbols is visible to the process. Not dlopen(RTLD_LOCAL | RTLD_DEEPBIND): that
// binds libsentencepiece's std::cerr to libstdc++'s own, never-constructed object whenever the
// executable holds a copy relocation of it (node_tests does), and its first log line crashes.
// Only plain C types cross (spm_shim.cpp): each side frees what it allocates.
bool open_at(const std::string& path, Shim& s, std::string& error) {
  void* lib = dlmopen(LM_ID_NEWLM, path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    error = e ? e : ("cannot open " + path);
    return false;
  }
  Shim t;
  t.lib = lib;
  std::string why;
  const bool ok = bind(lib, "flowrun_spm_abi_version", t.abi_version, why) && bind(lib, "flowrun_spm_load", t.load, why) &&
                  bind(lib, "flowrun_spm_free", t.free, why) && bind(lib, "flowrun_spm_vocab_size", t.vocab_size, why) &&
                  bind(lib, "flowrun_spm_pad_id", t.pad_id, why) && bind(lib, "flowrun_spm_eos_id", t.eos_id, why) &&
                  bind(lib, "flowrun_spm_encode", t.encode, why) && bind(lib, "flowrun_spm_decode", t.decode, why) &&
                  bind(lib, "flowrun_spm_train", t.train, why);
  if (ok && t.abi_version() != kShimAbi)
    why = "C API version " + std::to_string(t.abi_version()) + ", this flowrun needs " + std::to_string(kShimAbi);
  if (!why.empty()) {
    dlclose(lib);
    error = path + ": not a flowrun SentencePiece shim of this version (" + why + ")";
    return false;
  }
  s = t;
  return true;
}

// Looks for the shim: $FLOWRUN_SPM_SHIM alone if set; otherwise next to libflowrun_nodes.so,
// then where the build put it. Opened once per process, never closed.
Shim open_shim() {
  Shim s;
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("FLOWRUN_SPM_SHIM"); env != nullptr && *env != '\0') {
    candidates.push_back(env);
  } else {
    const std::string dir = this_library_dir();
    if (!dir.empty()) candidates.push_back(dir + "/" + kShimName);
#ifdef FLOWRUN_SPM_SHIM_PATH
    if (candidates.empty() || candidates.back() != FLOWRUN_SPM_SHIM_PATH) candidates.push_back(FLOWRUN_SPM_SHIM_PATH);
#endif
  }
  std::string errors;
  for (const auto& c : candidates) {
    std::string e;
    if (open_at(c, s, e)) return s;
    errors += (errors.empty() ? "" : "; ") + e;
  }
  s.error = errors.empty() ? std::string("no shim library to try") : errors;
  return s;
}

const Shim& shim() {
  static const Shim s = open_shim();
  return s;
}

const Shim& require_shim() {
  const Shim& s = shim();
  if (s.lib == nullptr)
    throw std::runtime_error(
        "sentencepiece: SentencePiece is not available in this flowrun (" + s.error +
        "). It needs Debian's libsentencepiece-dev when flowrun is configured (scripts/setup.sh installs it: "
        "apt-get install libsentencepiece-dev, then re-run cmake and rebuild; CMake option FLOWRUN_SENTENCEPIECE "
        "builds " + std::string(kShimName) + " next to libflowrun_nodes.so), or FLOWRUN_SPM_SHIM=/path/to/" +
        std::string(kShimName) + "; otherwise tokenize with wordpiece_tokenize");
  return s;
}

}  // namespace

bool sentencepiece_available() { return shim().lib != nullptr; }

bool sentencepiece_built() {
#ifdef FLOWRUN_SPM_SHIM_PATH
  return true;
#else
  return false;
#endif
}

struct SentencePieceTokenizer::Impl {
  void* handle = nullptr;
  ~Impl() {
    if (handle != nullptr) shim().free(handle);
  }
};

SentencePieceTokenizer::SentencePieceTokenizer(std::unique_ptr<Impl> impl, int64_t max_length, bool lowercase)
    : TextTokenizer(max_length), impl_(std::move(impl)), lowercase_(lowercase) {
  const int pad = shim().pad_id(impl_->handle), eos = shim().eos_id(impl_->handle);
  pad_ = pad >= 0 ? pad : 0;
  eos_ = eos >= 0 ? eos : 1;
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::shared_ptr<SentencePieceTokenizer> SentencePieceTokenizer::load(const std::string& model_file,
                                                                     int64_t max_length, bool lowercase) {
  if (max_length < 1)
    throw std::runtime_error("sentencepiece: max_length must be at least 1 (for </s>), got " +
                             std::to_string(max_length));
  const Shim& s = require_shim();
  char err[1024] = "";
  auto impl = std::make_unique<Impl>();
  impl->handle = s.load(model_file.c_str(), err, sizeof err);
  if (impl->handle == nullptr) throw std::runtime_error("sentencepiece: cannot load " + model_file + ": " + err);
  return std::shared_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer(std::move(impl), max_length, lowercase));
}

int64_t SentencePieceTokenizer::vocab_size() const { return shim().vocab_size(impl_->handle); }

std::vector<int64_t> SentencePieceTokenizer::piece_ids(const std::string& text) const {
  std::string t = text;
  if (lowercase_) {
    icu::UnicodeString u = icu::UnicodeString::fromUTF8(text);
    u.toLower(icu::Locale::getRoot());
    t.clear();
    u.toUTF8String(t);
  }
  // Pieces are rarely more than one per byte (byte fallback: up to 4 per character, plus "▁").
  std::vector<int32_t> ids(t.size() + 16);
  char err[1024] = "";
  for (int attempt = 0; attempt < 2; ++attempt) {
    const long n = shim().encode(impl_->handle, t.data(), t.size(), ids.data(), ids.size(), err, sizeof err);
    if (n < 0) throw std::runtime_error(std::string("sentencepiece: cannot encode a text: ") + err);
    if (static_cast<size_t>(n) <= ids.size()) return std::vector<int64_t>(ids.begin(), ids.begin() + n);
    ids.resize(static_cast<size_t>(n));
  }
  throw std::runtime_error("sentencepiece: cannot encode a text: the number of pieces changed between calls");
}

std::vector<int64_t> SentencePieceTokenizer::ids(const std::string& text, int64_t max_length) const {
  if (max_length < 1) throw std::runtime_error("sentencepiece: max_length must be at least 1");
  std::vector<int64_t> out = piece_ids(text);
  if (static_cast<int64_t>(out.size()) > max_length - 1) out.resize(static_cast<size_t>(max_length - 1));
  out.push_back(eos_);
  return out;
}

std::string SentencePieceTokenizer::decode(const std::vector<int64_t>& ids) const {
  const std::vector<int32_t> v(ids.begin(), ids.end());
  std::string out(v.size() * 8 + 16, '\0');
  char err[1024] = "";
  for (int attempt = 0; attempt < 2; ++attempt) {
    const long n = shim().decode(impl_->handle, v.data(), v.size(), out.data(), out.size(), err, sizeof err);
    if (n < 0) throw std::runtime_error(std::string("sentencepiece: cannot decode: ") + err);
    if (static_cast<size_t>(n) <= out.size()) {
      out.resize(static_cast<size_t>(n));
      return out;
    }
    out.resize(static_cast<size_t>(n));
  }
  throw std::runtime_error("sentencepiece: cannot decode: the text's length changed between calls");
}

void SentencePieceTokenizer::train(const std::string& text_file, const std::string& model_prefix, int vocab_size) {
  const Shim& s = require_shim();
  const std::string args = "--input=" + text_file + " --model_prefix=" + model_prefix +
                           " --vocab_size=" + std::to_string(vocab_size) +
                           " --model_type=unigram --pad_id=0 --eos_id=1 --unk_id=2 --bos_id=-1"
                           " --character_coverage=1.0 --minloglevel=2";
  char err[1024] = "";
  if (s.train(args.c_str(), err, sizeof err) != 0)
    throw std::runtime_error("sentencepiece: training on " + text_file + " failed: " + err);
}

}  // namespace flowrun
