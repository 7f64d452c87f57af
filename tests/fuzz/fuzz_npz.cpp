// NumPy .npz files (the indices_file of IndexKits' Index V2: a zip of .npy arrays, stored or
// deflated, zip64 headers): every input is read or refused with std::runtime_error, and what is
// read is whole arrays.
#include <stdexcept>
#include <string>

#include "formats/index_v2.hpp"
#include "fuzz_util.hpp"

using namespace flowrun;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write("d.npz", data, size);
  try {
    for (const auto& [name, values] : read_npz_int_arrays(path)) FUZZ_CHECK(values.size() <= size * 1100 + 1024);
  } catch (const std::runtime_error&) {
  }
  return 0;
}
