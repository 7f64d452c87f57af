// safetensors reading and writing (nodes/common/safetensors.hpp): round trips, and every kind
// of damaged file rejected with a clear error instead of an out-of-bounds read.
#include "common/safetensors.hpp"

#include <gtest/gtest.h>

#include <fstream>

#include "support/memory.hpp"
#include "support/run_graph.hpp"

using namespace flowrun;

namespace {

std::string raw_file(const std::string& header, const std::string& data, int64_t size_field = -1) {
  std::string f = test::temp_dir("st") + "/x.safetensors";
  std::ofstream o(f, std::ios::binary);
  uint64_t n = size_field >= 0 ? static_cast<uint64_t>(size_field) : header.size();
  for (int i = 0; i < 8; ++i) o.put(static_cast<char>(n >> (8 * i)));
  o << header << data;
  return f;
}

// The error of load(path); map(path) must give the same one.
std::string load_error(const std::string& path) {
  std::string errors[2];
  for (int mapped = 0; mapped < 2; ++mapped) try {
      mapped ? safetensors::map(path) : safetensors::load(path);
    } catch (const std::exception& e) {
      errors[mapped] = e.what();
    }
  EXPECT_EQ(errors[1], errors[0]) << "map() checks a file as load() does";
  return errors[0];
}

// This process's resident pages of files (kB): what reading a mapped file takes (RssFile, and
// RssShmem for a file on a tmpfs /tmp).
int64_t rss_file_kb() { return test::proc_status_kb("RssFile") + test::proc_status_kb("RssShmem"); }

}  // namespace

TEST(Safetensors, RoundTripAllDtypesAndMetadata) {
  safetensors::Tensors t;
  t["f32"] = torch::randn({3, 4});
  t["bf16"] = torch::randn({5}).to(torch::kBFloat16);
  t["f16"] = torch::randn({2, 2}).to(torch::kHalf);
  t["i64"] = torch::arange(7, torch::kInt64);
  t["u8"] = torch::randint(0, 255, {9}, torch::kUInt8);
  t["bool"] = torch::rand({4}) > 0.5;
  t["scalar"] = torch::tensor(3.5);
  t["empty"] = torch::zeros({0, 3});
  t["strided"] = torch::randn({4, 4}).t();  // non-contiguous input
  std::string f = test::temp_dir("st") + "/a.safetensors";
  safetensors::save(f, t, {{"format", "pt"}});
  auto back = safetensors::load(f);
  ASSERT_EQ(back.tensors.size(), t.size());
  for (const auto& [k, v] : t) {
    EXPECT_EQ(back.tensors[k].scalar_type(), v.scalar_type()) << k;
    EXPECT_TRUE(torch::equal(back.tensors[k], v)) << k;
  }
  EXPECT_EQ(back.metadata["format"], "pt");
  // The header is padded so tensor data starts 8-byte aligned (as the reference writer does).
  std::ifstream in(f, std::ios::binary);
  unsigned char n8[8];
  in.read(reinterpret_cast<char*>(n8), 8);
  EXPECT_EQ(n8[0] % 8, 0);
}

TEST(Safetensors, ReadsAFileWrittenByTheReferenceLayout) {
  // {"a": F32 [2] at [0, 8]} followed by 1.0f, 2.0f (little endian), as safetensors' Python writes.
  std::string data("\x00\x00\x80\x3f\x00\x00\x00\x40", 8);
  auto f = safetensors::load(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data));
  EXPECT_TRUE(torch::equal(f.tensors["a"], torch::tensor({1.0f, 2.0f})));
}

TEST(Safetensors, MapGivesTheSameTensorsReadOnlyWhenTouchedAndNeverWritesTheFile) {
  safetensors::Tensors t;
  t["big"] = torch::randn({2048, 2048});  // 16 MB
  t["bf16"] = torch::randn({5}).to(torch::kBFloat16);
  t["empty"] = torch::zeros({0, 3});
  const std::string f = test::temp_dir("st") + "/m.safetensors";
  safetensors::save(f, t, {{"format", "pt"}});
  const int64_t before = rss_file_kb();
  safetensors::File m = safetensors::map(f);
  EXPECT_EQ(m.metadata["format"], "pt");
  for (const auto& [k, v] : t) EXPECT_TRUE(torch::equal(m.tensors[k], v)) << k;
  // Read: its pages are resident; given back, they are not, and the values are read again.
  const torch::Tensor& big = m.tensors["big"];
  EXPECT_GT(rss_file_kb() - before, 15000) << "touching a mapped tensor reads its pages";
  safetensors::release_pages(big);
  EXPECT_LT(rss_file_kb() - before, 1000) << "release_pages gives them back";
  EXPECT_TRUE(torch::equal(big, t["big"]));
  // Copy on write: a mapped tensor changed in memory leaves the file as it was.
  m.tensors["bf16"].add_(1);
  EXPECT_TRUE(torch::equal(safetensors::load(f).tensors["bf16"], t["bf16"]));
  // Any other tensor is left alone (its memory is not the file's to give back).
  torch::Tensor own = torch::randn({1024, 1024}), same = own.clone();
  safetensors::release_pages(own);
  safetensors::release_pages(torch::Tensor());
  EXPECT_TRUE(torch::equal(own, same));
  // A writer that did not pad its header: F32 data at an odd offset is read, not mapped.
  std::string data("\x00\x00\x80\x3f\x00\x00\x00\x40", 8);
  const std::string odd = raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} )", data);
  EXPECT_TRUE(torch::equal(safetensors::map(odd).tensors["a"], torch::tensor({1.0f, 2.0f})));
}

TEST(Safetensors, DamagedFilesAreRejectedClearly) {
  const std::string ok_header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data(8, '\0');
  EXPECT_NE(load_error("/nonexistent.safetensors").find("no such file"), std::string::npos);
  // shorter than the size field
  std::string f = test::temp_dir("st") + "/short.safetensors";
  std::ofstream(f) << "abc";
  EXPECT_NE(load_error(f).find("truncated: 3 bytes"), std::string::npos) << load_error(f);
  // header size beyond the file
  EXPECT_NE(load_error(raw_file(ok_header, data, 5000)).find("truncated: header says 5000 bytes"), std::string::npos);
  // absurd header size
  EXPECT_NE(load_error(raw_file(ok_header, data, int64_t(1) << 40)).find("implausible"), std::string::npos);
  // not JSON
  EXPECT_NE(load_error(raw_file("{not json", data)).find("bad header JSON"), std::string::npos);
  // data cut off (truncated tensor bytes)
  EXPECT_NE(load_error(raw_file(ok_header, data.substr(0, 5))).find("outside the 5 data bytes"), std::string::npos);
  // offsets out of range / reversed
  EXPECT_NE(load_error(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", data)).find("data_offsets [8, 0]"),
            std::string::npos);
  // size does not match the shape
  EXPECT_NE(load_error(raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data)).find("8 bytes for a shape needing 12"),
            std::string::npos);
  // overlapping tensors
  EXPECT_NE(load_error(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                              data))
                .find("overlap"),
            std::string::npos);
  // unknown dtype, negative shape
  EXPECT_NE(load_error(raw_file(R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", data)).find("unsupported dtype 'Q7'"),
            std::string::npos);
  EXPECT_NE(load_error(raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data)).find("negative"),
            std::string::npos);
  // every message names the file
  EXPECT_EQ(load_error(raw_file("{not json", data)).rfind("safetensors file /", 0), 0u);
  // a folder (e.g. a checkpoint folder given as weights) was "bad header JSON"; a device
  const std::string dir = test::temp_dir("st_dir");
  EXPECT_NE(load_error(dir).find("is a folder, not a .safetensors file"), std::string::npos) << load_error(dir);
  EXPECT_NE(load_error("/dev/zero").find("not a regular file"), std::string::npos) << load_error("/dev/zero");
}
