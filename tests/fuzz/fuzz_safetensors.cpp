// safetensors files: the 8-byte size and the JSON header, checked against the bytes behind it.
// What parse_header accepts must keep its promise: every tensor's bytes inside the data, and
// exactly shape x dtype size of them (safetensors.cpp then reads them without further checks).
#include <cstring>
#include <stdexcept>
#include <string>

#include "formats/safetensors_header.hpp"
#include "fuzz_util.hpp"

using namespace flowrun::safetensors;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  unsigned char first8[8] = {};
  std::memcpy(first8, data, size < 8 ? size : 8);
  try {
    const uint64_t n = header_json_size(first8, size, "fuzz.safetensors");
    const std::string json(reinterpret_cast<const char*>(data) + 8, n);
    const uint64_t data_size = size - 8 - n;
    const Header h = parse_header(json, data_size, "fuzz.safetensors");
    for (const Entry& e : h.tensors) {
      FUZZ_CHECK(e.begin <= e.end && e.end <= data_size);
      unsigned __int128 bytes = e.item_size;
      for (int64_t d : e.shape) {
        FUZZ_CHECK(d >= 0);
        bytes *= static_cast<uint64_t>(d);
        if (bytes > data_size) bytes = data_size + 1;  // no overflow of the 128-bit product
      }
      FUZZ_CHECK(bytes == e.end - e.begin);
    }
  } catch (const std::runtime_error&) {
  }
  return 0;
}
