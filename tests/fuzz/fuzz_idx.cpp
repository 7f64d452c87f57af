// Megatron .idx files: the input is the index, beside a .bin of 4096 bytes. The constructor
// checks the whole index; every sequence it accepts must lie inside the .bin (checked below:
// AddressSanitizer does not see the bounds of a memory map) and be readable.
#include <stdexcept>
#include <string>
#include <vector>

#include "formats/indexed_dataset.hpp"
#include "fuzz_util.hpp"

using namespace flowrun;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string bin = [] {
    std::string b(4096, '\0');
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<char>(i * 7);
    return fuzz::write("d.bin", b);
  }();
  const std::string prefix = fuzz::scratch() + "/d";
  fuzz::write("d.idx", data, size);
  try {
    IndexedDataset ds(prefix);
    const size_t item = dtype_size(ds.dtype());  // (sequences may overlap: no bound on the total)
    for (int64_t i = 0; i < ds.num_sequences() && i < 64; ++i) {
      FUZZ_CHECK(ds.sequence_pointer(i) >= 0 && ds.sequence_size(i) >= 0);
      FUZZ_CHECK(static_cast<uint64_t>(ds.sequence_pointer(i)) + uint64_t(ds.sequence_size(i)) * item <= 4096);
      if (dtype_is_integer(ds.dtype())) (void)ds.sequence(i);
    }
    if (dtype_is_integer(ds.dtype()) && ds.num_tokens() > 0) {
      std::vector<int64_t> out(static_cast<size_t>(std::min<int64_t>(ds.num_tokens(), 512)));
      ds.read_tokens(ds.num_tokens() - static_cast<int64_t>(out.size()), static_cast<int64_t>(out.size()), out.data());
    }
  } catch (const std::runtime_error&) {
  }
  return 0;
}
