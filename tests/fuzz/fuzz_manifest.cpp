// Checkpoint manifests: the input is manifest.json of a checkpoint folder. read_manifest checks
// field by field; what it accepts must keep its promise: a step >= 1, files that are plain names
// inside the folder, and (version 2) chunks inside their tensors, in listed files, holding each
// tensor's elements exactly.
#include <stdexcept>
#include <string>

#include "fuzz_util.hpp"
#include "formats/checkpoint_io.hpp"

using namespace flowrun;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::write("manifest.json", data, size);
  try {
    const ckpt::Manifest m = ckpt::read_manifest(fuzz::scratch());
    FUZZ_CHECK(m.step >= 1);
    auto plain = [](const std::string& f) { return !f.empty() && f.find('/') == std::string::npos && f != "." && f != ".."; };
    for (const auto& [ref, file] : m.states) {
      FUZZ_CHECK(m.version == 2 || plain(file));  // version 2: the files are the ranks' (below)
      FUZZ_CHECK(ref.find('.') != std::string::npos);
    }
    FUZZ_CHECK(m.rng_file.find('/') == std::string::npos);
    // Version 2: every file a plain name with a size; every chunk in a listed file and inside its
    // tensor, and a tensor's chunks holding exactly its elements.
    for (const auto& [name, f] : m.files) FUZZ_CHECK(plain(name) && f.bytes >= 0);
    for (const auto& [ref, tensors] : m.tensors)
      for (const auto& [name, t] : tensors) {
        int64_t numel = 1, held = 0;
        for (int64_t d : t.shape) numel *= d;
        for (const auto& c : t.chunks) {
          FUZZ_CHECK(m.files.count(c.file) == 1);
          FUZZ_CHECK(c.offsets.size() == t.shape.size() && c.sizes.size() == t.shape.size());
          for (size_t d = 0; d < t.shape.size(); ++d) FUZZ_CHECK(c.offsets[d] + c.sizes[d] <= t.shape[d]);
          held += c.numel();
        }
        FUZZ_CHECK(held == numel);
      }
  } catch (const std::runtime_error&) {
  }
  return 0;
}
