// Tar shards: the input is the whole .tar. index_tar walks the headers (names, prefixes, GNU
// long names, pax records, sizes in octal or base-256); every member it lists must be readable.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "formats/tar.hpp"
#include "fuzz_util.hpp"

using namespace flowrun;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write("t.tar", data, size);
  try {
    TarFile f(path);
    for (const TarMember& m : f.index().members) {
      FUZZ_CHECK(m.offset + m.size <= size);
      const std::string prefix = f.read_prefix(m, 64);
      FUZZ_CHECK(prefix.size() == std::min<uint64_t>(m.size, 64));
      if (m.size <= 1 << 16) FUZZ_CHECK(f.read(m).size() == m.size);
      (void)tar_key(m.name);
      (void)tar_ext(m.name);
    }
  } catch (const std::runtime_error&) {
  }
  return 0;
}
