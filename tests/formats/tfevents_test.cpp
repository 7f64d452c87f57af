// TensorBoard event files: CRC32C against published check values, the record framing, the
// Event protos byte for byte as written out from event.proto by hand here, and the shared file.
// The independent reader of what flowrun writes in a run is tests/tools/read_tfevents.py
// (cli.tensorboard_events).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "formats/files.hpp"
#include "formats/tfevents.hpp"
#include "support/run_graph.hpp"

namespace flowrun::tfevents {
namespace {

namespace fs = std::filesystem;

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s.push_back(static_cast<char>(x));
  return s;
}

uint64_t le(const std::string& s, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(s[at + i])) << (8 * i);
  return v;
}

// The masking over the CRC32C (formats/crc32c.hpp, whose test checks the CRC's published values).
TEST(TfEvents, MaskedCrcRotatesAndOffsetsTheCrc32c) {
  const uint32_t c = 0xe3069283u;  // CRC32C("123456789")
  EXPECT_EQ(masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TfEvents, RecordIsLengthCrcDataCrc) {
  const std::string data = "hello";
  const std::string r = record(data);
  ASSERT_EQ(r.size(), 8 + 4 + 5 + 4u);
  EXPECT_EQ(le(r, 0, 8), 5u);
  EXPECT_EQ(le(r, 8, 4), masked_crc32c(r.data(), 8));
  EXPECT_EQ(r.substr(12, 5), data);
  EXPECT_EQ(le(r, 17, 4), masked_crc32c(data.data(), 5));
}

// Event { wall_time: 1.5, step: 3, summary { value { tag: "loss", simple_value: 0.25 } } }
TEST(TfEvents, ScalarEventBytes) {
  const std::string want = bytes({0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f,  // 1: double 1.5
                                  0x10, 0x03,                          // 2: varint 3
                                  0x2a, 0x0d,                          // 5: Summary, 13 bytes
                                  0x0a, 0x0b,                          //   1: Value, 11 bytes
                                  0x0a, 0x04, 'l', 'o', 's', 's',      //     1: tag "loss"
                                  0x15, 0, 0, 0x80, 0x3e});            //     2: float 0.25
  EXPECT_EQ(scalars_event(1.5, 3, {{"loss", 0.25}}), want);
  // A step over 127 takes two varint bytes (300 = 0xac 0x02); step 0 is proto3's default, left out.
  EXPECT_EQ(scalars_event(1.5, 300, {}).substr(9), bytes({0x10, 0xac, 0x02, 0x2a, 0x00}));
  EXPECT_EQ(file_version_event(1.5).substr(9), bytes({0x1a, 13}) + "brain.Event:2");
}

// Event { wall_time: 0, step: 1, summary { value { tag: "g", image { 2, 3, 3, "PNG" } } } }
TEST(TfEvents, ImageEventBytes) {
  const std::string want = bytes({0x09, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0x01, 0x2a, 0x12, 0x0a, 0x10, 0x0a, 0x01, 'g',
                                  0x22, 0x0b, 0x08, 0x02, 0x10, 0x03, 0x18, 0x03, 0x22, 0x03, 'P', 'N', 'G'});
  EXPECT_EQ(image_event(0.0, 1, "g", "PNG", 2, 3, 3), want);
}

// Records read back with the framing checked; the Event bytes compared with those above.
std::vector<std::string> read_records(const std::string& path) {
  const std::string f = read_file(path);
  std::vector<std::string> out;
  size_t at = 0;
  while (at < f.size()) {
    const uint64_t n = le(f, at, 8);
    EXPECT_EQ(le(f, at + 8, 4), masked_crc32c(f.data() + at, 8));
    out.push_back(f.substr(at + 12, n));
    EXPECT_EQ(le(f, at + 12 + n, 4), masked_crc32c(out.back().data(), n));
    at += 12 + n + 4;
  }
  EXPECT_EQ(at, f.size());
  return out;
}

TEST(TfEvents, OneFilePerFolderSharedByItsWriters) {
  const std::string dir = test::temp_dir("tfevents") + "/tb";
  auto a = EventFile::open(dir), b = EventFile::open(dir);
  EXPECT_EQ(a.get(), b.get());
  EXPECT_NE(fs::path(a->path()).filename().string().find("events.out.tfevents."), std::string::npos);
  a->scalars(5, {{"loss", 2.0}, {"lr", 1e-3}});
  b->image(5, "samples", "PNG", 1, 1, 3);
  a->flush();
  const auto r = read_records(a->path());
  ASSERT_EQ(r.size(), 3u);
  EXPECT_NE(r[0].find("brain.Event:2"), std::string::npos);
  EXPECT_EQ(r[1].substr(9), scalars_event(0.0, 5, {{"loss", 2.0}, {"lr", 1e-3}}).substr(9));  // past wall_time
  EXPECT_EQ(r[2].substr(9), image_event(0.0, 5, "samples", "PNG", 1, 1, 3).substr(9));
  const std::string first = a->path();
  a.reset();
  b.reset();
  EXPECT_NE(EventFile::open(dir)->path(), first);  // all closed: the next run of the process gets its own file
}

TEST(TfEvents, AnUnwritableFolderIsAnErrorNamingIt) {
  try {
    EventFile::open("/proc/nope/tb");
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/proc/nope/tb"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flowrun::tfevents
