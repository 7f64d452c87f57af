// Images (PNG, JPEG) as they come out of a shard: format sniffing, the size probe and the
// decoder (libpng, libjpeg; refused: more than 2^26 pixels). What decodes must be an RGB image
// of the probed size.
#include <stdexcept>
#include <string>

#include "formats/image_io.hpp"
#include "fuzz_util.hpp"

using namespace flowrun;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  (void)sniff_image_format(bytes);
  int w = 0, h = 0;
  const bool probed = probe_image_size(bytes, &w, &h);
  try {
    const Image img = decode_image(bytes, "fuzz: 000000.img");
    FUZZ_CHECK(img.c == 3 && img.w > 0 && img.h > 0);
    FUZZ_CHECK(img.px.size() == static_cast<size_t>(img.w) * img.h * 3);
    if (probed) FUZZ_CHECK(img.w == w && img.h == h);
    // The training path resizes and crops what decoded.
    (void)resize_center_crop(img, 16, 16);
  } catch (const std::runtime_error&) {
  }
  return 0;
}
