// image_io: PNG and JPEG decoding and encoding, resizing, cropping, flipping, atomic PNG writes.
// (Images as tensors and grids: tests/nodes/image_text_shards_test.cpp.)
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "formats/files.hpp"
#include "formats/image_io.hpp"
#include "nodes/data_test_helpers.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace {

namespace fs = std::filesystem;
using test::corrupt_body_png;
using test::gradient;

// A white disk on a colored background: flat regions and edges, like a photo's content.
Image disk(int w, int h) {
  Image img(w, h, 3);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      uint8_t* p = img.at(x, y);
      const int dx = 2 * x - w, dy = 2 * y - h;
      const bool in = dx * dx + dy * dy < (w * h) / 3;
      p[0] = in ? 255 : 200, p[1] = in ? 255 : 40, p[2] = in ? 255 : 90;
    }
  return img;
}

double mean_abs_diff(const Image& a, const Image& b) {
  EXPECT_EQ(a.px.size(), b.px.size());
  double s = 0;
  for (size_t i = 0; i < a.px.size(); ++i) s += std::abs(int(a.px[i]) - int(b.px[i]));
  return s / static_cast<double>(a.px.size());
}

TEST(ImageIo, PngRoundTripIsExactForEveryChannelCount) {
  const Image rgb = disk(24, 24);
  const Image back = decode_image(encode_png(rgb), "shape.png");
  EXPECT_EQ(back.w, 24);
  EXPECT_EQ(back.h, 24);
  EXPECT_EQ(back.c, 3);
  EXPECT_EQ(back.px, rgb.px);
  // Gray: replicated into RGB. Palette and 16-bit come through libpng's transforms likewise.
  Image gray(5, 4, 1);
  for (size_t i = 0; i < gray.px.size(); ++i) gray.px[i] = static_cast<uint8_t>(i * 12);
  const Image g3 = decode_image(encode_png(gray), "gray.png");
  ASSERT_EQ(g3.c, 3);
  for (int i = 0; i < 20; ++i)
    for (int k = 0; k < 3; ++k) EXPECT_EQ(g3.px[static_cast<size_t>(i * 3 + k)], gray.px[static_cast<size_t>(i)]);
  // Alpha: composited onto white (transparent -> white, opaque -> the color).
  Image rgba(2, 1, 4);
  const uint8_t px[8] = {10, 20, 30, 0, 10, 20, 30, 255};
  std::copy(px, px + 8, rgba.px.begin());
  const Image a3 = decode_image(encode_png(rgba), "alpha.png");
  EXPECT_EQ(std::vector<uint8_t>(a3.px.begin(), a3.px.begin() + 3), (std::vector<uint8_t>{255, 255, 255}));
  EXPECT_EQ(std::vector<uint8_t>(a3.px.begin() + 3, a3.px.end()), (std::vector<uint8_t>{10, 20, 30}));
  int w = 0, h = 0;
  EXPECT_TRUE(probe_image_size(encode_png(gradient(7, 5)), &w, &h));
  EXPECT_EQ(w, 7);
  EXPECT_EQ(h, 5);
}

TEST(ImageIo, JpegRoundTripIsClose) {
  const Image img = resize(disk(32, 32), 48, 40);
  const std::string jpg = encode_jpeg(img, 95);
  EXPECT_EQ(sniff_image_format(jpg), "jpeg");
  int w = 0, h = 0;
  ASSERT_TRUE(probe_image_size(jpg, &w, &h));
  EXPECT_EQ(w, 48);
  EXPECT_EQ(h, 40);
  const Image back = decode_image(jpg, "shape.jpg");
  ASSERT_EQ(back.w, 48);
  ASSERT_EQ(back.h, 40);
  EXPECT_LT(mean_abs_diff(back, img), 4.0);
  EXPECT_GT(mean_abs_diff(back, Image(48, 40, 3, 128)), 20.0);  // and not just anything
  Image gray(16, 8, 1, 77);
  const Image g = decode_image(encode_jpeg(gray), "gray.jpg");
  EXPECT_EQ(g.c, 3);
  EXPECT_NEAR(g.at(3, 3)[0], 77, 2);
  EXPECT_NEAR(g.at(3, 3)[2], 77, 2);
}

TEST(ImageIo, CorruptOrTruncatedDataThrowsNamingTheItem) {
  const std::string png = encode_png(gradient(16, 16)), jpg = encode_jpeg(gradient(16, 16));
  auto expect_error = [](const std::string& bytes, const std::string& what) {
    try {
      decode_image(bytes, "shard.tar: 000007.png");
      ADD_FAILURE() << what << ": no error";
    } catch (const ImageError& e) {
      EXPECT_NE(std::string(e.what()).find("shard.tar: 000007.png"), std::string::npos) << e.what();
    }
  };
  expect_error("hello, not an image", "text");
  expect_error(png.substr(0, png.size() / 2), "truncated PNG");
  expect_error(corrupt_body_png(gradient(16, 16)), "corrupt PNG data");
  expect_error(jpg.substr(0, jpg.size() / 2), "truncated JPEG");
  expect_error(jpg.substr(0, 40), "JPEG header only");
  EXPECT_NO_THROW(decode_image(png, "ok"));
}

// A decompression bomb (found by fuzzing): 196 bytes of JPEG that claim 14088 x 16129 pixels
// (680 MB decoded, seconds of work) are refused from the header, before decoding.
TEST(ImageIo, ImagesOverTheSizeLimitAreRefusedFromTheirHeader) {
  // The fuzzer's input, kept in its corpus (replayed there too).
  const std::string bytes =
      read_file(std::string(FLOWRUN_SOURCE_DIR) + "/tests/fuzz/corpus/image/crash-jpeg-decompression-bomb.jpg");
  ASSERT_EQ(bytes.size(), 196u);
  int w = 0, h = 0;
  ASSERT_TRUE(probe_image_size(bytes, &w, &h));
  EXPECT_EQ(w * int64_t{1} * h, 16129 * int64_t{14088});
  try {
    decode_image(bytes, "shard.tar: 000009.jpg");
    FAIL() << "decoded";
  } catch (const ImageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("shard.tar: 000009.jpg"), std::string::npos) << msg;
    EXPECT_NE(msg.find("image too large (14088x16129"), std::string::npos) << msg;
  }
}

// The page of a caption evaluator inlines its images: the data URI's base64 decodes (by a
// decoder written here from RFC 4648) to exactly encode_png's bytes, padding included.
TEST(ImageIo, PngDataUriIsTheBase64OfThePng) {
  for (int w : {1, 2, 3, 7}) {  // byte counts that leave 0, 1 and 2 bytes in the last group
    const Image img(w, 2, 3, static_cast<uint8_t>(40 * w));
    const std::string uri = png_data_uri(img), png = encode_png(img);
    const std::string prefix = "data:image/png;base64,";
    ASSERT_EQ(uri.rfind(prefix, 0), 0u);
    const std::string b64 = uri.substr(prefix.size());
    ASSERT_EQ(b64.size() % 4, 0u);
    std::string bytes;
    uint32_t acc = 0;
    int bits = 0;
    for (char ch : b64) {
      if (ch == '=') break;
      const std::string digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
      acc = (acc << 6) | static_cast<uint32_t>(digits.find(ch));
      bits += 6;
      if (bits >= 8) bytes += static_cast<char>((acc >> (bits -= 8)) & 0xff);
    }
    EXPECT_EQ(bytes, png) << w;
    EXPECT_EQ(b64.size(), (png.size() + 2) / 3 * 4) << w;
  }
}

TEST(ImageIo, ResizeCropAndFlipShapes) {
  // A constant image stays constant at any size.
  const Image flat(40, 30, 3, 200);
  const Image r = resize(flat, 13, 7);
  EXPECT_EQ(r.w, 13);
  EXPECT_EQ(r.h, 7);
  for (uint8_t v : r.px) EXPECT_EQ(v, 200);
  // Downscaling a 1-pixel checkerboard averages it (antialiased), it does not alias to black or white.
  Image checker(32, 32, 1);
  for (int y = 0; y < 32; ++y)
    for (int x = 0; x < 32; ++x) checker.at(x, y)[0] = ((x + y) % 2) ? 255 : 0;
  for (uint8_t v : resize(checker, 8, 8).px) EXPECT_NEAR(v, 127.5, 3);
  // Upscaling keeps the ends.
  const Image up = resize(gradient(4, 4), 16, 16);
  EXPECT_NEAR(up.at(0, 0)[1], 0, 1);
  EXPECT_NEAR(up.at(0, 15)[1], 24, 1);
  // Cover and centre crop: a wide image loses its sides, a tall one its top and bottom.
  Image wide(64, 32, 3, 0);  // left quarter red, right quarter blue, middle green
  for (int y = 0; y < 32; ++y)
    for (int x = 0; x < 64; ++x) wide.at(x, y)[x < 16 ? 0 : x >= 48 ? 2 : 1] = 255;
  const Image c = resize_center_crop(wide, 16, 16);
  ASSERT_EQ(c.w, 16);
  ASSERT_EQ(c.h, 16);
  // (the edge columns blend in a little of the cut-off sides: the filter is 2 pixels wide at 2x)
  EXPECT_EQ(c.at(1, 8)[1], 255);
  EXPECT_EQ(c.at(14, 8)[1], 255);
  EXPECT_EQ(c.at(1, 8)[0], 0);
  EXPECT_EQ(c.at(14, 8)[2], 0);
  EXPECT_LT(c.at(0, 8)[0], 64);  // at most a sliver of the red quarter
  const Image t = resize_center_crop(gradient(10, 30), 10, 10);  // no scaling: rows 10..19
  EXPECT_EQ(t.at(0, 0)[1], 10 * 8);
  EXPECT_EQ(resize_center_crop(gradient(8, 8), 24, 12).w, 24);
  // Flip mirrors rows.
  const Image g = gradient(5, 3), f = hflip(g);
  for (int y = 0; y < 3; ++y)
    for (int x = 0; x < 5; ++x) EXPECT_EQ(std::vector<uint8_t>(f.at(x, y), f.at(x, y) + 3), std::vector<uint8_t>(g.at(4 - x, y), g.at(4 - x, y) + 3));
  EXPECT_THROW(crop(g, 3, 0, 3, 3), std::invalid_argument);
}

// resize_center_crop resizes only the window it keeps: equal, bit for bit, to the whole resize
// cropped, for every channel count, down and up, wide and tall.
TEST(ImageIo, CenterCropResizesOnlyItsWindowYetEqualsResizeThenCrop) {
  for (int c : {1, 2, 3, 4})
    for (const auto& [iw, ih, w, h] : std::vector<std::array<int, 4>>{{97, 61, 32, 32}, {61, 97, 40, 24}, {50, 50, 120, 70}, {33, 80, 33, 40}}) {
      Image img(iw, ih, c);
      for (size_t i = 0; i < img.px.size(); ++i) img.px[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
      const CenterCrop box = center_crop_box(iw, ih, w, h);
      const Image want = crop(resize(img, box.rw, box.rh), box.left, box.top, w, h), got = resize_center_crop(img, w, h);
      EXPECT_EQ(got.px, want.px) << c << " channels, " << iw << "x" << ih << " -> " << w << "x" << h;
    }
}

TEST(ImageIo, WritePngIsAtomicAndReadable) {
  const std::string dir = test::temp_dir("img");
  const Image img = gradient(9, 6);
  write_png(dir + "/sub/a.png", img);
  EXPECT_EQ(decode_image(test::read_text(dir + "/sub/a.png"), "a.png").px, img.px);
  write_png(dir + "/sub/a.png", img.px.data(), 3, 6, 3);  // over an existing file, from a raw buffer
  EXPECT_EQ(decode_image(test::read_text(dir + "/sub/a.png"), "a.png").w, 3);
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir + "/sub")) {
    ++files;
    EXPECT_EQ(e.path().filename(), "a.png");
  }
  EXPECT_EQ(files, 1);  // no temporary left behind
}

// Issue 69: 16-bit PNGs, gamma chunks and CMYK JPEGs decode as PIL.Image.open(f).convert("RGB")
// does (HunyuanDiT's loader, and most PyTorch pipelines), pixel for pixel: PIL's own pixels in
// tests/fixtures/images/expected.json. Before, a 16-bit PNG came out brighter (libpng took its
// samples as linear light: 205 -> 231) and a CMYK JPEG was refused.
TEST(ImageIo, UnusualFormatsDecodeAsPilConvertsThemToRgb) {
  const std::string dir = std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/images/";
  const nlohmann::json files = nlohmann::json::parse(test::read_text(dir + "expected.json"))["files"];
  ASSERT_GE(files.size(), 7u);
  for (const auto& [name, want] : files.items()) {
    std::string converted;
    const Image got = decode_image(test::read_text(dir + name), name, Alpha::drop, &converted);
    ASSERT_EQ(got.w, want["width"].get<int>()) << name;
    ASSERT_EQ(got.h, want["height"].get<int>()) << name;
    ASSERT_EQ(got.c, 3) << name;
    const std::vector<uint8_t> pil = want["rgb"].get<std::vector<uint8_t>>();
    size_t differ = 0;
    for (size_t i = 0; i < pil.size(); ++i) differ += got.px[i] != pil[i];
    EXPECT_EQ(differ, 0u) << name << " (PIL mode " << want["mode"] << "): " << differ << " of " << pil.size() << " samples differ";
    EXPECT_EQ(converted, name.find("16") != std::string::npos ? "16-bit PNG" : name == "cmyk.jpg" ? "CMYK JPEG" : "") << name;
  }
  // The pixel: 205 · 257 in 16 bits is 205 in 8, in either alpha mode.
  EXPECT_EQ(decode_image(test::read_text(dir + "rgb16.png"), "rgb16.png").px[0], 205);
}

// Composited onto white (flowrun's own data), a 16-bit PNG is its high byte too, and its alpha
// blends as 8-bit alpha does: opaque keeps the colour, clear is white, half is halfway.
TEST(ImageIo, SixteenBitAlphaCompositesOntoWhiteFromTheHighByte) {
  const std::string dir = std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/images/";
  const Image dropped = decode_image(test::read_text(dir + "rgba16.png"), "rgba16.png", Alpha::drop);
  const Image white = decode_image(test::read_text(dir + "rgba16.png"), "rgba16.png", Alpha::over_white);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(white.at(1, 0)[k], dropped.at(1, 0)[k]) << "opaque";                                  // alpha 65535
    EXPECT_EQ(white.at(2, 0)[k], 255) << "clear";                                                     // alpha 0
    EXPECT_NEAR(white.at(3, 0)[k], (dropped.at(3, 0)[k] * 128 + 255 * 127) / 255.0, 1.0) << "half";  // alpha 32768
  }
}

}  // namespace
}  // namespace flowrun
