// tar: the ustar writer and reader of WebDataset shards (long names, truncation, bad checksums).
#include <gtest/gtest.h>

#include <filesystem>

#include "formats/tar.hpp"
#include "nodes/data_test_helpers.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace {

namespace fs = std::filesystem;

TEST(Tar, WriterReaderRoundTrip) {
  const std::string dir = test::temp_dir("tar"), path = dir + "/a.tar";
  const std::string long_name = std::string(120, 'd') + "/000001.png";  // needs ustar's prefix field
  std::string binary(1000, '\0');
  for (size_t i = 0; i < binary.size(); ++i) binary[i] = static_cast<char>(i * 7);
  {
    TarWriter w(path);
    w.add("000000.png", binary);
    w.add("000000.txt", "a caption");
    w.add("empty.txt", "");
    w.add(long_name, "x");
    EXPECT_FALSE(fs::exists(path));  // not before finish
    w.finish();
  }
  EXPECT_EQ(fs::file_size(path) % 512, 0u);
  TarFile f(path);
  const TarIndex& idx = f.index();
  EXPECT_TRUE(idx.truncated.empty());
  EXPECT_TRUE(idx.error.empty());
  ASSERT_EQ(idx.members.size(), 4u);
  EXPECT_EQ(idx.members[0].name, "000000.png");
  EXPECT_EQ(f.read(idx.members[0]), binary);
  EXPECT_EQ(f.read(idx.members[1]), "a caption");
  EXPECT_EQ(f.read(idx.members[2]), "");
  EXPECT_EQ(idx.members[3].name, long_name);
  EXPECT_EQ(f.read(idx.members[3]), "x");
  EXPECT_EQ(f.read_prefix(idx.members[0], 10), binary.substr(0, 10));
  EXPECT_EQ(tar_key("dir.x/000012.seg.png"), "dir.x/000012");
  EXPECT_EQ(tar_ext("dir.x/000012.seg.png"), "seg.png");
  EXPECT_EQ(tar_key("000012"), "000012");
  // An unfinished writer leaves nothing.
  { TarWriter w(dir + "/b.tar"); w.add("x.txt", "y"); }
  EXPECT_FALSE(fs::exists(dir + "/b.tar"));
  EXPECT_FALSE(fs::exists(dir + "/b.tar.tmp"));
}

TEST(Tar, TruncatedMemberAndCorruptHeaderAreReported) {
  const std::string dir = test::temp_dir("tar");
  {
    TarWriter w(dir + "/t.tar");
    w.add("a.txt", "first");
    w.add("b.png", std::string(3000, 'p'));
    w.finish();
  }
  fs::resize_file(dir + "/t.tar", 512 + 512 + 512 + 1000);  // cut inside b.png's data
  const TarIndex t = index_tar(dir + "/t.tar");
  ASSERT_EQ(t.members.size(), 1u);
  EXPECT_EQ(t.truncated, "b.png");
  std::string bytes = test::read_text(dir + "/t.tar");
  bytes[512 + 512 + 3] ^= 1;  // b.png's header: checksum fails
  test::write_text(dir + "/c.tar", bytes);
  const TarIndex c = index_tar(dir + "/c.tar");
  EXPECT_EQ(c.members.size(), 1u);
  EXPECT_NE(c.error.find("checksum"), std::string::npos) << c.error;
  EXPECT_THROW(index_tar(dir + "/missing.tar"), std::runtime_error);
}

}  // namespace
}  // namespace flowrun
