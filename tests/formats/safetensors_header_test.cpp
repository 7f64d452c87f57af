// safetensors headers (nodes/formats/safetensors_header.hpp): what a valid header gives, and every
// way a header can lie about the bytes behind it, refused before anything is allocated. (Loading
// into tensors and saving: tests/nodes/safetensors_test.cpp.)
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "formats/safetensors_header.hpp"

namespace flowrun::safetensors {
namespace {

std::string error_of(const std::string& json, uint64_t data_size) {
  try {
    parse_header(json, data_size, "w.safetensors");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

TEST(SafetensorsHeader, ValidHeaderGivesEntriesByNameAndMetadata) {
  const std::string json = R"({"__metadata__": {"format": "pt"},
    "b": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
    "a": {"dtype": "BF16", "shape": [], "data_offsets": [24, 26]},
    "e": {"dtype": "I64", "shape": [0, 5], "data_offsets": [26, 26]}})";
  const Header h = parse_header(json, 26, "w.safetensors");
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.json_size, json.size());
  EXPECT_EQ(h.metadata.at("format"), "pt");
  EXPECT_EQ(h.tensors[0].name, "a");
  EXPECT_EQ(h.tensors[0].item_size, 2u);
  EXPECT_TRUE(h.tensors[0].shape.empty());  // a scalar: one element
  EXPECT_EQ(h.tensors[1].dtype, "F32");
  EXPECT_EQ(h.tensors[1].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(h.tensors[1].begin, 0u);
  EXPECT_EQ(h.tensors[2].end - h.tensors[2].begin, 0u);
}

TEST(SafetensorsHeader, HeaderSizeMustFitTheFileAndBePlausible) {
  unsigned char n8[8] = {16, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(header_json_size(n8, 8 + 16, "w"), 16u);
  EXPECT_THROW(header_json_size(n8, 8 + 15, "w"), std::runtime_error);  // truncated
  EXPECT_THROW(header_json_size(n8, 7, "w"), std::runtime_error);       // not even the size
  unsigned char huge[8] = {0, 0, 0, 0, 0, 0, 0, 1};                    // 2^56
  try {
    header_json_size(huge, uint64_t(1) << 60, "w");
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("implausible"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsHeader, EveryLieIsAnErrorNamingTheTensor) {
  const auto t = [](const std::string& body) { return R"({"w": )" + body + "}"; };
  struct Case {
    std::string json, expect;
  } cases[] = {
      {"[1, 2]", "not a JSON object"},
      {"{nope", "bad header JSON"},
      {t(R"({"dtype": "F32", "shape": [1]})"), "needs dtype, shape and data_offsets"},
      {t(R"({"dtype": "F8", "shape": [1], "data_offsets": [0, 1]})"), "unsupported dtype 'F8'"},
      {t(R"({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]})"), "negative or non-integer"},
      {t(R"({"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]})"), "negative or non-integer"},
      {t(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]})"), "4 bytes for a shape needing 8"},
      {t(R"({"dtype": "F32", "shape": [1], "data_offsets": [60, 64]})"), "outside the 16 data bytes"},
      {t(R"({"dtype": "F32", "shape": [1], "data_offsets": [8, 4]})"), "outside"},
      {t(R"({"dtype": "F32", "shape": [1], "data_offsets": [0]})"), "data_offsets must be [begin, end]"},
      // Shapes whose byte count overflows 64 bits used to wrap around to a small number.
      {t(R"({"dtype": "F64", "shape": [2305843009213693952, 8], "data_offsets": [0, 0]})"), "needing 2^64 or more"},
      {t(R"({"dtype": "F64", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]})"), "0 bytes for a shape needing 2^64 or more"},
      {t(R"({"dtype": "I64", "shape": [2305843009213693952], "data_offsets": [0, 0]})"), "0 bytes for a shape needing 2^64 or more"},
      {R"({"__metadata__": {"k": 1}})", "__metadata__.k is not a string"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", "'a' and 'b' overlap"},
  };
  for (const Case& c : cases) {
    const std::string msg = error_of(c.json, 16);
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.json << "\n  gave: " << msg;
    EXPECT_NE(msg.find("safetensors file w.safetensors"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace flowrun::safetensors
