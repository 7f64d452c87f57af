// Images in memory, torch-free: decode PNG (libpng) and JPEG (libjpeg-turbo) from bytes,
// encode PNG (and JPEG, for tests and tools), resize, center crop, flip.
//
// An Image is 8-bit, row-major HWC: pixel (x, y) channel k is px[(y * w + x) * c + k].
// decode_image always gives c = 3 (RGB): grayscale is replicated, palettes expanded, 16-bit
// reduced to 8 (the high byte), CMYK converted, and alpha composited onto white or dropped. Torch conversions (to a float CHW tensor in
// [-1, 1] and back) are in image_text_shards.hpp.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace flowrun {

struct Image {
  int w = 0, h = 0, c = 3;
  std::vector<uint8_t> px;  // h * w * c bytes

  Image() = default;
  Image(int w_, int h_, int c_ = 3, uint8_t fill = 0) : w(w_), h(h_), c(c_), px(static_cast<size_t>(w_) * h_ * c_, fill) {}
  uint8_t* at(int x, int y) { return px.data() + (static_cast<size_t>(y) * w + x) * c; }
  const uint8_t* at(int x, int y) const { return px.data() + (static_cast<size_t>(y) * w + x) * c; }
  bool empty() const { return w == 0 || h == 0; }
};

// What decode_image throws: the message names the item (`name`) and what is wrong with it.
struct ImageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// "png", "jpeg" or "" from the first bytes (magic numbers), whatever the file is called.
std::string sniff_image_format(const std::string& bytes);

// Width and height from the header alone (PNG's IHDR, JPEG's SOF marker); `bytes` may be just
// the start of the file. False when they are not there (not an image, or too short a prefix).
bool probe_image_size(const std::string& bytes, int* w, int* h);

// What becomes of a PNG's alpha channel: composited onto white (flowrun's own data), or
// dropped, the colours kept as stored (PIL's convert("RGB"), which HunyuanDiT's loader uses).
enum class Alpha { over_white, drop };

// Decodes PNG or JPEG (found by magic number) into RGB, the samples as stored (no gamma or colour
// profile applied, as PIL): 16-bit samples cut to their high byte, CMYK JPEGs converted as PIL's
// convert("RGB") does; with Alpha::drop the pixels equal PIL.Image.open(f).convert("RGB")'s
// (tests/fixtures/images/), 16-bit grayscale included, which PIL clips to 255 instead. Throws
// ImageError naming `name` on anything else, on corrupt or truncated data and on images over
// 8192x8192 pixels (decompression bombs), the last from the header, before decoding.
// *converted (if given): "" or what needed converting ("16-bit PNG", "CMYK JPEG").
Image decode_image(const std::string& bytes, const std::string& name, Alpha alpha = Alpha::over_white,
                   std::string* converted = nullptr);

// PNG bytes of an image with 1 (gray), 2 (gray+alpha), 3 (RGB) or 4 (RGBA) channels.
std::string encode_png(const Image& img);
// "data:image/png;base64,..." of encode_png(img): an image inlined in an HTML page.
std::string png_data_uri(const Image& img);
// JPEG bytes (c = 1 or 3), quality 1..100.
std::string encode_jpeg(const Image& img, int quality = 95);
// Writes encode_png(img) to path atomically: a temporary file in the same folder, renamed
// over path (readers never see half a file). Creates missing folders. Throws std::runtime_error.
void write_png(const std::string& path, const Image& img);
// The same from a raw HWC buffer of h * w * c bytes.
void write_png(const std::string& path, const uint8_t* hwc, int w, int h, int c);

// Resampled to w x h with a triangle (bilinear) filter that widens when downscaling, so it
// averages like an area filter instead of aliasing (as PIL's BILINEAR resize). Any channels.
Image resize(const Image& img, int w, int h);
// Scaled (keeping the aspect ratio) to the smallest size that covers w x h, then the centre
// w x h cut out: what image_text_shards feeds the model.
Image resize_center_crop(const Image& img, int w, int h);
// What resize_center_crop does to an iw x ih image: the scaled size rw x rh and the top-left
// corner (left, top) of the cut, in scaled pixels (HunyuanDiT's crops_coords_top_left).
struct CenterCrop {
  int rw, rh, left, top;
};
CenterCrop center_crop_box(int iw, int ih, int w, int h);
// The x0, y0, w x h rectangle (must lie inside the image).
Image crop(const Image& img, int x0, int y0, int w, int h);
// Mirrored left to right.
Image hflip(const Image& img);
// Each pixel as a z x z block (z <= 1: the image itself), so small images stay sharp when viewed.
Image zoom(const Image& img, int z);

}  // namespace flowrun
