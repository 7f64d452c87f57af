// flowrun_spm_shim: a tiny C API over Debian's libsentencepiece (libsentencepiece-dev), built as
// its own MODULE library and opened by nodes/encode/sentencepiece.cpp with
// dlmopen(LM_ID_NEWLM), in a link namespace of its own. Why: libsentencepiece.so.0 carries its
// own protobuf-lite 3.14 whose exported symbols clash with libprotobuf.so.32 (3.21) loaded by
// libtorch. Linked into libflowrun_nodes it crashes every binary at start-up; opened this way it
// binds to its own protobuf (and its own libstdc++ and libc), and nothing of it is visible to the
// rest of the process. No torch and no flowrun headers here: only the extern "C" functions below
// are exported (-fvisibility=hidden), and no C++ object, exception or allocation crosses the
// boundary (the namespaces have separate heaps): callers pass their own buffers.
//
// Conventions: errors are written (NUL-terminated, truncated) to ERR[ERRLEN] when ERR is not
// null. Functions returning sizes use a two-call protocol: they return the full size and write
// at most CAP items; call again with a larger buffer when the result exceeds CAP.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#define FLOWRUN_SPM_API extern "C" __attribute__((visibility("default")))

namespace {

void set_err(char* err, size_t errlen, const std::string& msg) {
  if (!err || errlen == 0) return;
  const size_t n = msg.size() < errlen - 1 ? msg.size() : errlen - 1;
  std::memcpy(err, msg.data(), n);
  err[n] = '\0';
}

sentencepiece::SentencePieceProcessor* proc(void* h) { return static_cast<sentencepiece::SentencePieceProcessor*>(h); }

}  // namespace

// The version of this C API; sentencepiece.cpp refuses a shim with another one.
FLOWRUN_SPM_API int flowrun_spm_abi_version() { return 1; }

// Loads a .model file: a handle, or null with ERR set.
FLOWRUN_SPM_API void* flowrun_spm_load(const char* path, char* err, size_t errlen) {
  try {
    auto* sp = new sentencepiece::SentencePieceProcessor();
    const auto st = sp->Load(path);
    if (!st.ok()) {
      set_err(err, errlen, st.ToString());
      delete sp;
      return nullptr;
    }
    return sp;
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
  } catch (...) {
    set_err(err, errlen, "unknown error");
  }
  return nullptr;
}

FLOWRUN_SPM_API void flowrun_spm_free(void* h) { delete proc(h); }

FLOWRUN_SPM_API int flowrun_spm_vocab_size(void* h) { return proc(h)->GetPieceSize(); }
// -1 when the model defines none.
FLOWRUN_SPM_API int flowrun_spm_pad_id(void* h) { return proc(h)->pad_id(); }
FLOWRUN_SPM_API int flowrun_spm_eos_id(void* h) { return proc(h)->eos_id(); }

// Encodes TEXT[LEN] (UTF-8) to piece ids: the number of ids (at most CAP written to OUT), or -1
// with ERR set.
FLOWRUN_SPM_API long flowrun_spm_encode(void* h, const char* text, size_t len, int32_t* out, size_t cap, char* err,
                                        size_t errlen) {
  try {
    std::vector<int> ids;
    const auto st = proc(h)->Encode(absl::string_view(text, len), &ids);
    if (!st.ok()) {
      set_err(err, errlen, st.ToString());
      return -1;
    }
    for (size_t i = 0; i < ids.size() && i < cap; ++i) out[i] = ids[i];
    return static_cast<long>(ids.size());
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
  } catch (...) {
    set_err(err, errlen, "unknown error");
  }
  return -1;
}

// Decodes IDS[N] to UTF-8 text: its length in bytes (at most CAP bytes written to OUT, no NUL),
// or -1 with ERR set.
FLOWRUN_SPM_API long flowrun_spm_decode(void* h, const int32_t* ids, size_t n, char* out, size_t cap, char* err,
                                        size_t errlen) {
  try {
    const std::vector<int> v(ids, ids + n);
    std::string text;
    const auto st = proc(h)->Decode(v, &text);
    if (!st.ok()) {
      set_err(err, errlen, st.ToString());
      return -1;
    }
    if (cap > 0) std::memcpy(out, text.data(), text.size() < cap ? text.size() : cap);
    return static_cast<long>(text.size());
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
  } catch (...) {
    set_err(err, errlen, "unknown error");
  }
  return -1;
}

// SentencePieceTrainer::Train with a command-line string ("--input=... --model_prefix=..."):
// 0, or -1 with ERR set.
FLOWRUN_SPM_API int flowrun_spm_train(const char* args, char* err, size_t errlen) {
  try {
    const auto st = sentencepiece::SentencePieceTrainer::Train(args);
    if (!st.ok()) {
      set_err(err, errlen, st.ToString());
      return -1;
    }
    return 0;
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
  } catch (...) {
    set_err(err, errlen, "unknown error");
  }
  return -1;
}
