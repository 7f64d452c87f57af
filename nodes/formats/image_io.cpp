// Image decode/encode and resampling: see image_io.hpp.
#include "formats/image_io.hpp"

#include <png.h>
#include <unistd.h>

// jpeglib.h needs size_t and FILE declared first.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <csetjmp>
#include <jerror.h>
#include <jpeglib.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>

namespace flowrun {

namespace {

// Decompression bombs: a 200-byte JPEG can claim a huge size (found by fuzzing, 14088 x 16129:
// 680 MB and seconds of work per image). Larger than any training image needs; PIL refuses
// 179M pixels, flowrun 67M (8192 x 8192).
constexpr uint64_t kMaxPixels = uint64_t(1) << 26;

std::string too_large(uint64_t w, uint64_t h) {
  return "image too large (" + std::to_string(w) + "x" + std::to_string(h) + " = " + std::to_string(w * h) +
         " pixels; flowrun decodes at most " + std::to_string(kMaxPixels) +
         ", 8192x8192): shrink the dataset's images before sharding";
}

bool is_png(const std::string& b) { return b.size() >= 8 && std::memcmp(b.data(), "\x89PNG\r\n\x1a\n", 8) == 0; }
bool is_jpeg(const std::string& b) {
  return b.size() >= 3 && static_cast<uint8_t>(b[0]) == 0xFF && static_cast<uint8_t>(b[1]) == 0xD8 && static_cast<uint8_t>(b[2]) == 0xFF;
}

uint32_t be32(const std::string& b, size_t i) {
  return (uint32_t(uint8_t(b[i])) << 24) | (uint32_t(uint8_t(b[i + 1])) << 16) | (uint32_t(uint8_t(b[i + 2])) << 8) | uint8_t(b[i + 3]);
}
uint32_t be16(const std::string& b, size_t i) { return (uint32_t(uint8_t(b[i])) << 8) | uint8_t(b[i + 1]); }

void check_size(uint64_t w, uint64_t h, const std::string& name) {
  if (w == 0 || h == 0) throw ImageError(name + ": image has no pixels (" + std::to_string(w) + "x" + std::to_string(h) + ")");
  if (w * h > kMaxPixels) throw ImageError(name + ": " + too_large(w, h));
}

// ---- PNG ----
//
// Two readers. PIL's (Alpha::drop, and every 16-bit PNG): libpng's classic API with the samples
// as stored — no gamma or colour management (PIL applies none, whatever gAMA, sRGB or iCCP
// say), 16-bit samples cut to their high byte (PIL's "RGB;16B" and kin), palettes and 1/2/4-bit
// grays expanded, and one PIL quirk kept where PIL-compatibility is asked for: 16-bit grayscale
// without alpha opens as PIL's "I;16", whose convert("RGB") clips each sample to 255 (mostly
// white). libpng's simplified API (Alpha::over_white, 8-bit): composites alpha onto white in
// linear light, as flowrun's own data always has. The simplified API must not see 16-bit files:
// it takes their samples as linear light and re-encodes them to sRGB (205 -> 231).

struct PngRead {
  const std::string* bytes;
  size_t at = 0;
  char msg[256] = {0};
};

void png_read_mem(png_structp png, png_bytep out, png_size_t n) {
  auto* r = static_cast<PngRead*>(png_get_io_ptr(png));
  if (n > r->bytes->size() - r->at) png_error(png, "truncated PNG (read past the end of the data)");
  std::memcpy(out, r->bytes->data() + r->at, n);
  r->at += n;
}
void png_fail(png_structp png, png_const_charp msg) {
  auto* r = static_cast<PngRead*>(png_get_error_ptr(png));
  std::snprintf(r->msg, sizeof r->msg, "%s", msg);
  png_longjmp(png, 1);
}
void png_quiet(png_structp, png_const_charp) {}

// Only plain-old-data lives across setjmp here (the buffers are malloc'd, their pointers
// volatile: set after setjmp, freed after a longjmp). RGB or RGBA (alpha kept when keep_alpha
// and the file has any) into *out; returns "" or the error.
std::string decode_png_as_stored(const std::string& bytes, Image* out, bool keep_alpha, bool gray16_clip) {
  PngRead r;
  r.bytes = &bytes;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &r, png_fail, png_quiet);
  if (!png) return "out of memory";
  png_infop info = png_create_info_struct(png);
  png_bytep* volatile rows = nullptr;
  uint8_t* volatile px = nullptr;
  if (!info || setjmp(png_jmpbuf(png))) {
    std::free(rows);
    std::free(px);
    png_destroy_read_struct(&png, info ? &info : nullptr, nullptr);
    return std::string("corrupt PNG: ") + (r.msg[0] ? r.msg : "out of memory");
  }
  png_set_read_fn(png, &r, png_read_mem);
  png_read_info(png, info);
  const png_uint_32 w = png_get_image_width(png, info), h = png_get_image_height(png, info);
  const int depth = png_get_bit_depth(png, info), type = png_get_color_type(png, info);
  if (w == 0 || h == 0 || static_cast<uint64_t>(w) * h > kMaxPixels) {
    png_destroy_read_struct(&png, &info, nullptr);
    return w == 0 || h == 0 ? "image has no pixels" : too_large(w, h);
  }
  const bool clip = gray16_clip && depth == 16 && type == PNG_COLOR_TYPE_GRAY;
  if (!clip) {
    png_set_strip_16(png);  // the high byte
    png_set_expand(png);    // palette -> RGB, 1/2/4-bit gray -> 8, tRNS -> alpha
    png_set_gray_to_rgb(png);
    if (!keep_alpha) png_set_strip_alpha(png);
  }
  png_read_update_info(png, info);
  const size_t row_bytes = png_get_rowbytes(png, info), c = png_get_channels(png, info);
  px = static_cast<uint8_t*>(std::malloc(row_bytes * h));
  rows = static_cast<png_bytep*>(std::malloc(sizeof(png_bytep) * h));
  if (!px || !rows) png_error(png, "out of memory");
  for (png_uint_32 y = 0; y < h; ++y) rows[y] = px + row_bytes * y;
  png_read_image(png, rows);
  png_read_end(png, nullptr);
  png_destroy_read_struct(&png, &info, nullptr);
  const size_t pixels = static_cast<size_t>(w) * h;
  out->w = static_cast<int>(w), out->h = static_cast<int>(h), out->c = clip ? 3 : static_cast<int>(c);
  if (clip) {  // big-endian 16-bit gray -> min(v, 255), replicated
    out->px.resize(pixels * 3);
    for (size_t i = 0; i < pixels; ++i) {
      const unsigned v = (unsigned(px[2 * i]) << 8) | px[2 * i + 1];
      out->px[3 * i] = out->px[3 * i + 1] = out->px[3 * i + 2] = static_cast<uint8_t>(std::min(v, 255u));
    }
  } else {
    out->px.assign(px, px + pixels * c);  // rows are packed: row_bytes = w * c at 8 bits
  }
  std::free(rows);
  std::free(px);
  return "";
}

Image decode_png(const std::string& bytes, const std::string& name, Alpha alpha, std::string* converted) {
  const bool sixteen = bytes.size() > 24 && static_cast<uint8_t>(bytes[24]) == 16;  // IHDR's bit depth
  if (sixteen && converted) *converted = "16-bit PNG";
  if (alpha == Alpha::drop || sixteen) {
    Image out;
    const std::string e = decode_png_as_stored(bytes, &out, alpha == Alpha::over_white, alpha == Alpha::drop);
    if (!e.empty()) throw ImageError(name + ": " + e);
    if (out.c == 4) {  // over white, in 8-bit integers: v·a + 255·(255 − a), rounded
      const size_t n = static_cast<size_t>(out.w) * out.h;
      for (size_t i = 0; i < n; ++i) {
        const unsigned a = out.px[i * 4 + 3];
        for (size_t k = 0; k < 3; ++k) out.px[i * 3 + k] = static_cast<uint8_t>((out.px[i * 4 + k] * a + 255u * (255u - a) + 127u) / 255u);
      }
      out.px.resize(n * 3);
      out.c = 3;
    }
    return out;
  }
  png_image im;
  std::memset(&im, 0, sizeof im);
  im.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&im, bytes.data(), bytes.size()))
    throw ImageError(name + ": corrupt PNG: " + im.message);
  try {
    check_size(im.width, im.height, name);
  } catch (...) {
    png_image_free(&im);
    throw;
  }
  im.format = PNG_FORMAT_RGB;
  Image out(static_cast<int>(im.width), static_cast<int>(im.height), 3);
  png_color white{255, 255, 255};
  if (!png_image_finish_read(&im, &white, out.px.data(), 0, nullptr)) {
    const std::string msg = im.message;
    png_image_free(&im);
    throw ImageError(name + ": corrupt PNG: " + msg);
  }
  png_image_free(&im);
  return out;
}

// ---- JPEG ----

struct JpegErr {
  jpeg_error_mgr mgr;
  jmp_buf jump;
  bool eof = false;  // "premature end of data": a truncated file, which libjpeg only warns about
  char msg[JMSG_LENGTH_MAX];
};

void jpeg_error_exit(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegErr*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->msg);
  longjmp(e->jump, 1);
}
void jpeg_emit(j_common_ptr cinfo, int level) {
  auto* e = reinterpret_cast<JpegErr*>(cinfo->err);
  if (level < 0 && (cinfo->err->msg_code == JWRN_JPEG_EOF || cinfo->err->msg_code == JERR_INPUT_EOF)) e->eof = true;
}

// Only plain-old-data lives across setjmp here. Returns "" or the error.
// A CMYK (or YCCK) JPEG as PIL converts it: its samples taken as Adobe's inverted CMYK (PIL's
// "CMYK;I", whoever wrote the file), then PIL's cmyk2rgb: v = (255 − k) − (255 − c)·(255 − k)/255,
// with PIL's rounding. *cmyk tells the caller a conversion happened.
std::string decode_jpeg_raw(const unsigned char* data, unsigned long n, Image* out, bool* cmyk) {
  jpeg_decompress_struct cinfo;
  JpegErr err;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_error_exit;
  err.mgr.emit_message = jpeg_emit;
  err.msg[0] = 0;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return std::string("corrupt JPEG: ") + err.msg;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, n);
  jpeg_read_header(&cinfo, TRUE);
  *cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  if (cinfo.image_width == 0 || cinfo.image_height == 0) {
    jpeg_destroy_decompress(&cinfo);
    return "bad JPEG size " + std::to_string(cinfo.image_width) + "x" + std::to_string(cinfo.image_height);
  }
  if (static_cast<uint64_t>(cinfo.image_width) * cinfo.image_height > kMaxPixels) {
    jpeg_destroy_decompress(&cinfo);
    return too_large(cinfo.image_width, cinfo.image_height);
  }
  cinfo.out_color_space = *cmyk ? JCS_CMYK : JCS_RGB;
  const int c = *cmyk ? 4 : 3;
  jpeg_start_decompress(&cinfo);
  out->w = static_cast<int>(cinfo.output_width), out->h = static_cast<int>(cinfo.output_height), out->c = 3;
  out->px.resize(static_cast<size_t>(out->w) * out->h * c);
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = out->px.data() + static_cast<size_t>(cinfo.output_scanline) * out->w * c;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  if (err.eof) return "truncated JPEG (premature end of data)";
  if (*cmyk) {
    auto muldiv255 = [](unsigned a, unsigned b) { const unsigned t = a * b + 128; return ((t >> 8) + t) >> 8; };
    const size_t pixels = static_cast<size_t>(out->w) * out->h;
    for (size_t i = 0; i < pixels; ++i) {
      const uint8_t* q = out->px.data() + 4 * i;
      const unsigned nk = q[3];  // 255 − k, k = 255 − stored
      uint8_t rgb[3];
      for (int j = 0; j < 3; ++j) rgb[j] = static_cast<uint8_t>(nk - muldiv255(255u - q[j], nk));
      std::memcpy(out->px.data() + 3 * i, rgb, 3);
    }
    out->px.resize(pixels * 3);
  }
  return "";
}

Image decode_jpeg(const std::string& bytes, const std::string& name, std::string* converted) {
  Image out;
  bool cmyk = false;
  const std::string e = decode_jpeg_raw(reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<unsigned long>(bytes.size()), &out, &cmyk);
  if (!e.empty()) throw ImageError(name + ": " + e);
  if (cmyk && converted) *converted = "CMYK JPEG";
  return out;
}

std::string encode_jpeg_raw(const Image& img, int quality, std::string* out) {
  jpeg_compress_struct cinfo;
  JpegErr err;
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_error_exit;
  err.msg[0] = 0;
  if (setjmp(err.jump)) {
    jpeg_destroy_compress(&cinfo);
    std::free(buf);
    return std::string("JPEG encoding failed: ") + err.msg;
  }
  jpeg_create_compress(&cinfo);
  jpeg_mem_dest(&cinfo, &buf, &size);
  cinfo.image_width = static_cast<JDIMENSION>(img.w), cinfo.image_height = static_cast<JDIMENSION>(img.h);
  cinfo.input_components = img.c;
  cinfo.in_color_space = img.c == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(img.px.data()) + static_cast<size_t>(cinfo.next_scanline) * img.w * img.c;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  out->assign(reinterpret_cast<const char*>(buf), size);
  jpeg_destroy_compress(&cinfo);
  std::free(buf);
  return "";
}

void check_image(const Image& img, const char* what) {
  if (img.w <= 0 || img.h <= 0 || img.c < 1 || img.c > 4 || img.px.size() != static_cast<size_t>(img.w) * img.h * img.c)
    throw std::invalid_argument(std::string(what) + ": bad image (" + std::to_string(img.w) + "x" + std::to_string(img.h) + "x" +
                                std::to_string(img.c) + ", " + std::to_string(img.px.size()) + " bytes)");
}

// ---- resampling ----

// Weights of a triangle filter for one axis: out[i] = sum_k w[i][k] * in[first[i] + k].
struct Taps {
  std::vector<int> first, count;
  std::vector<float> w;  // count[i] weights per output, at offset off[i]
  std::vector<size_t> off;
};

Taps make_taps(int in, int out) {
  Taps t;
  const double scale = static_cast<double>(in) / out, support = std::max(scale, 1.0);
  t.first.resize(out), t.count.resize(out), t.off.resize(out);
  for (int i = 0; i < out; ++i) {
    const double center = (i + 0.5) * scale;  // in input pixel units, edges at integers
    const int lo = std::max(0, static_cast<int>(std::floor(center - support))), hi = std::min(in, static_cast<int>(std::ceil(center + support)));
    t.first[i] = lo, t.off[i] = t.w.size();
    double sum = 0;
    std::vector<double> ws;
    for (int j = lo; j < hi; ++j) {
      const double x = (j + 0.5 - center) / support, v = std::max(0.0, 1.0 - std::abs(x));
      ws.push_back(v), sum += v;
    }
    if (sum <= 0) {  // cannot happen for in >= 1, but keep the nearest pixel if it does
      ws.assign(1, 1.0), sum = 1, t.first[i] = std::min(in - 1, static_cast<int>(center));
    }
    for (double v : ws) t.w.push_back(static_cast<float>(v / sum));
    t.count[i] = static_cast<int>(ws.size());
  }
  return t;
}

}  // namespace

std::string sniff_image_format(const std::string& bytes) { return is_png(bytes) ? "png" : is_jpeg(bytes) ? "jpeg" : ""; }

bool probe_image_size(const std::string& b, int* w, int* h) {
  if (is_png(b)) {
    if (b.size() < 24 || b.compare(12, 4, "IHDR") != 0) return false;
    *w = static_cast<int>(be32(b, 16)), *h = static_cast<int>(be32(b, 20));
    return *w > 0 && *h > 0;
  }
  if (!is_jpeg(b)) return false;
  size_t i = 2;
  while (i + 4 <= b.size()) {
    if (static_cast<uint8_t>(b[i]) != 0xFF) return false;
    const uint8_t m = static_cast<uint8_t>(b[i + 1]);
    if (m == 0xFF) { ++i; continue; }  // fill byte
    if (m == 0xD8 || (m >= 0xD0 && m <= 0xD7) || m == 0x01) { i += 2; continue; }
    const uint32_t len = be16(b, i + 2);
    const bool sof = m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
    if (sof) {
      if (i + 9 > b.size()) return false;
      *h = static_cast<int>(be16(b, i + 5)), *w = static_cast<int>(be16(b, i + 7));
      return *w > 0 && *h > 0;
    }
    if (m == 0xD9 || m == 0xDA || len < 2) return false;  // end or scan data before any frame header
    i += 2 + len;
  }
  return false;
}

Image decode_image(const std::string& bytes, const std::string& name, Alpha alpha, std::string* converted) {
  if (converted) converted->clear();
  if (is_png(bytes)) return decode_png(bytes, name, alpha, converted);
  if (is_jpeg(bytes)) return decode_jpeg(bytes, name, converted);
  throw ImageError(name + ": not a PNG or JPEG image (" + std::to_string(bytes.size()) + " bytes, unknown signature)");
}

std::string encode_png(const Image& img) {
  check_image(img, "encode_png");
  png_image im;
  std::memset(&im, 0, sizeof im);
  im.version = PNG_IMAGE_VERSION;
  im.width = static_cast<png_uint_32>(img.w), im.height = static_cast<png_uint_32>(img.h);
  im.format = img.c == 1 ? PNG_FORMAT_GRAY : img.c == 2 ? PNG_FORMAT_GA : img.c == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_RGBA;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&im, nullptr, &size, 0, img.px.data(), 0, nullptr))
    throw std::runtime_error(std::string("PNG encoding failed: ") + im.message);
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&im, out.data(), &size, 0, img.px.data(), 0, nullptr))
    throw std::runtime_error(std::string("PNG encoding failed: ") + im.message);
  out.resize(size);
  return out;
}

std::string png_data_uri(const Image& img) {
  static const char* kDigits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const std::string b = encode_png(img);
  std::string out = "data:image/png;base64,";
  for (size_t i = 0; i < b.size(); i += 3) {  // 3 bytes -> 4 digits, '=' padding at the end
    const uint32_t n = (uint32_t(uint8_t(b[i])) << 16) | (i + 1 < b.size() ? uint32_t(uint8_t(b[i + 1])) << 8 : 0) |
                       (i + 2 < b.size() ? uint32_t(uint8_t(b[i + 2])) : 0);
    out += kDigits[(n >> 18) & 63];
    out += kDigits[(n >> 12) & 63];
    out += i + 1 < b.size() ? kDigits[(n >> 6) & 63] : '=';
    out += i + 2 < b.size() ? kDigits[n & 63] : '=';
  }
  return out;
}

std::string encode_jpeg(const Image& img, int quality) {
  check_image(img, "encode_jpeg");
  if (img.c != 1 && img.c != 3) throw std::invalid_argument("encode_jpeg: needs 1 or 3 channels, not " + std::to_string(img.c));
  std::string out;
  const std::string e = encode_jpeg_raw(img, std::clamp(quality, 1, 100), &out);
  if (!e.empty()) throw std::runtime_error(e);
  return out;
}

void write_png(const std::string& path, const Image& img) {
  const std::string bytes = encode_png(img);
  namespace fs = std::filesystem;
  const fs::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) fs::create_directories(p.parent_path(), ec);
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw std::runtime_error(path + ": cannot write (" + std::strerror(errno) + ")");
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    f.close();
    if (!f) {
      fs::remove(tmp, ec);
      throw std::runtime_error(path + ": write failed");
    }
  }
  fs::rename(tmp, p, ec);
  if (ec) {
    std::error_code ec2;
    fs::remove(tmp, ec2);
    throw std::runtime_error(path + ": cannot rename the temporary file into place: " + ec.message());
  }
}

void write_png(const std::string& path, const uint8_t* hwc, int w, int h, int c) {
  Image img;
  img.w = w, img.h = h, img.c = c;
  img.px.assign(hwc, hwc + static_cast<size_t>(w) * h * c);
  write_png(path, img);
}

namespace {

// Pixels [x0, x0 + w) x [y0, y0 + h) of `img` resized to rw x rh: the horizontal pass into floats
// (only the rows the vertical taps read, only the columns kept), then the vertical one. Every
// output pixel is computed as the whole resize computes it (the same taps, the same order), so a
// crop of the resize and the resize of a window are equal bit for bit. C: the channel count
// known at compile time (0: img.c at run time).
template <int C>
Image resize_window(const Image& img, int rw, int rh, int x0, int y0, int w, int h) {
  const int c = C ? C : img.c;
  const Taps tx = make_taps(img.w, rw), ty = make_taps(img.h, rh);
  int row_lo = img.h, row_hi = 0;  // the input rows the kept output rows read
  for (int y = y0; y < y0 + h; ++y)
    row_lo = std::min(row_lo, ty.first[y]), row_hi = std::max(row_hi, ty.first[y] + ty.count[y]);
  std::vector<float> mid(static_cast<size_t>(std::max(0, row_hi - row_lo)) * w * c);
  for (int y = row_lo; y < row_hi; ++y)
    for (int x = 0; x < w; ++x) {
      float acc[4] = {0, 0, 0, 0};
      const float* wt = tx.w.data() + tx.off[x0 + x];
      const uint8_t* s = img.at(tx.first[x0 + x], y);
      for (int k = 0; k < tx.count[x0 + x]; ++k, s += c)
        for (int ch = 0; ch < c; ++ch) acc[ch] += wt[k] * s[ch];
      float* d = mid.data() + (static_cast<size_t>(y - row_lo) * w + x) * c;
      for (int ch = 0; ch < c; ++ch) d[ch] = acc[ch];
    }
  Image out(w, h, c);
  for (int y = 0; y < h; ++y) {
    const float* wt = ty.w.data() + ty.off[y0 + y];
    const int first = ty.first[y0 + y] - row_lo, count = ty.count[y0 + y];
    for (int x = 0; x < w; ++x) {
      float acc[4] = {0, 0, 0, 0};
      for (int k = 0; k < count; ++k) {
        const float* s = mid.data() + (static_cast<size_t>(first + k) * w + x) * c;
        for (int ch = 0; ch < c; ++ch) acc[ch] += wt[k] * s[ch];
      }
      uint8_t* d = out.at(x, y);
      for (int ch = 0; ch < c; ++ch) d[ch] = static_cast<uint8_t>(std::clamp(std::lround(acc[ch]), 0L, 255L));
    }
  }
  return out;
}

Image resize_window(const Image& img, int rw, int rh, int x0, int y0, int w, int h) {
  return img.c == 3 ? resize_window<3>(img, rw, rh, x0, y0, w, h) : resize_window<0>(img, rw, rh, x0, y0, w, h);
}

}  // namespace

Image resize(const Image& img, int w, int h) {
  check_image(img, "resize");
  if (w < 1 || h < 1) throw std::invalid_argument("resize: bad target size " + std::to_string(w) + "x" + std::to_string(h));
  if (w == img.w && h == img.h) return img;
  return resize_window(img, w, h, 0, 0, w, h);
}

Image crop(const Image& img, int x0, int y0, int w, int h) {
  check_image(img, "crop");
  if (x0 < 0 || y0 < 0 || w < 1 || h < 1 || x0 + w > img.w || y0 + h > img.h)
    throw std::invalid_argument("crop: rectangle " + std::to_string(w) + "x" + std::to_string(h) + "+" + std::to_string(x0) + "+" +
                                std::to_string(y0) + " is not inside a " + std::to_string(img.w) + "x" + std::to_string(img.h) + " image");
  Image out(w, h, img.c);
  for (int y = 0; y < h; ++y) std::memcpy(out.at(0, y), img.at(x0, y0 + y), static_cast<size_t>(w) * img.c);
  return out;
}

Image resize_center_crop(const Image& img, int w, int h) {
  check_image(img, "resize_center_crop");
  if (w < 1 || h < 1) throw std::invalid_argument("resize_center_crop: bad target size");
  const CenterCrop c = center_crop_box(img.w, img.h, w, h);
  if (c.rw == img.w && c.rh == img.h) return c.rw == w && c.rh == h ? img : crop(img, c.left, c.top, w, h);
  return resize_window(img, c.rw, c.rh, c.left, c.top, w, h);  // only the kept window: equal to resize, then crop
}

CenterCrop center_crop_box(int iw, int ih, int w, int h) {
  const double s = std::max(static_cast<double>(w) / iw, static_cast<double>(h) / ih);
  const int rw = std::max(w, static_cast<int>(std::lround(iw * s))), rh = std::max(h, static_cast<int>(std::lround(ih * s)));
  return {rw, rh, (rw - w) / 2, (rh - h) / 2};
}

Image hflip(const Image& img) {
  Image out(img.w, img.h, img.c);
  for (int y = 0; y < img.h; ++y)
    for (int x = 0; x < img.w; ++x) std::memcpy(out.at(img.w - 1 - x, y), img.at(x, y), static_cast<size_t>(img.c));
  return out;
}

Image zoom(const Image& img, int z) {
  if (z <= 1) return img;
  Image out(img.w * z, img.h * z, img.c);
  for (int y = 0; y < out.h; ++y)
    for (int x = 0; x < out.w; ++x) std::memcpy(out.at(x, y), img.at(x / z, y / z), static_cast<size_t>(img.c));
  return out;
}

}  // namespace flowrun
