// Checkpoint manifests: the input is manifest.json of a checkpoint folder. read_manifest checks
// field by field; what it accepts must keep its promise: a step >= 1 and state files that are
// plain names inside the folder.
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
    for (const auto& [ref, file] : m.states) {
      FUZZ_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..");
      FUZZ_CHECK(ref.find('.') != std::string::npos);
    }
    FUZZ_CHECK(m.rng_file.find('/') == std::string::npos);
  } catch (const std::runtime_error&) {
  }
  return 0;
}
