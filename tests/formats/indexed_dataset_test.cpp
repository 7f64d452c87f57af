// Megatron indexed dataset: what the writer writes is byte-for-byte Megatron's layout, the
// reader reads it (and sequences placed anywhere in the .bin), and a corrupt or truncated
// shard is an error naming the file and what is wrong.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <numeric>

#include "formats/indexed_dataset.hpp"
#include "nodes/data_test_helpers.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace {

namespace fs = std::filesystem;

const std::vector<std::vector<int32_t>> kDocs = {{1, 2, 3}, {}, {40000, 5}, {6, 7, 8, 9, 10, 11, 12}};

std::string write_shard(const std::string& prefix, TokenDtype dtype = TokenDtype::UInt16,
                        const std::vector<std::vector<int32_t>>& docs = kDocs) {
  IndexedDatasetWriter w(prefix, dtype);
  for (const auto& d : docs) w.add_document(d);
  w.finish();
  return prefix;
}

template <class T>
T at(const std::string& bytes, size_t off) {
  T v;
  std::memcpy(&v, bytes.data() + off, sizeof(T));
  return v;
}

// The error message of opening PREFIX (or "no error").
std::string open_error(const std::string& prefix) {
  try {
    IndexedDataset d(prefix);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

void patch(const std::string& path, size_t off, const void* bytes, size_t n) {
  std::string s = test::read_text(path);
  ASSERT_LE(off + n, s.size());
  std::memcpy(s.data() + off, bytes, n);
  test::write_text(path, s);
}

void truncate_to(const std::string& path, size_t n) { fs::resize_file(path, n); }

TEST(IndexedDataset, WritesMegatronsLayoutByteForByte) {
  const std::string p = write_shard(test::temp_dir("idx") + "/shard");
  const std::string idx = test::read_text(p + ".idx"), bin = test::read_text(p + ".bin");
  const size_t S = 4;
  ASSERT_EQ(idx.size(), 34 + 4 * S + 8 * S + 8 * (S + 1));
  EXPECT_EQ(idx.substr(0, 9), std::string("MMIDIDX\0\0", 9));
  EXPECT_EQ(at<uint64_t>(idx, 9), 1u);   // version
  EXPECT_EQ(static_cast<uint8_t>(idx[17]), 8);  // uint16
  EXPECT_EQ(at<uint64_t>(idx, 18), S);   // sequences
  EXPECT_EQ(at<uint64_t>(idx, 26), S + 1);  // doc_idx entries
  const int32_t sizes[] = {3, 0, 2, 7};
  const int64_t pointers[] = {0, 6, 6, 10};
  for (size_t i = 0; i < S; ++i) {
    EXPECT_EQ(at<int32_t>(idx, 34 + 4 * i), sizes[i]) << i;
    EXPECT_EQ(at<int64_t>(idx, 34 + 4 * S + 8 * i), pointers[i]) << i;
  }
  for (size_t i = 0; i <= S; ++i) EXPECT_EQ(at<int64_t>(idx, 34 + 12 * S + 8 * i), static_cast<int64_t>(i));
  ASSERT_EQ(bin.size(), 12u * 2);
  EXPECT_EQ(at<uint16_t>(bin, 0), 1);
  EXPECT_EQ(at<uint16_t>(bin, 6), 40000);
  // No temporary files left behind.
  EXPECT_FALSE(fs::exists(p + ".bin.tmp"));
  EXPECT_FALSE(fs::exists(p + ".idx.tmp"));
}

TEST(IndexedDataset, ReadsBackWhatWasWritten) {
  for (TokenDtype dt : {TokenDtype::UInt16, TokenDtype::Int32, TokenDtype::Int64}) {
    const std::string p = write_shard(test::temp_dir("idx") + "/shard", dt);
    IndexedDataset d(p);
    EXPECT_EQ(d.dtype(), dt);
    ASSERT_EQ(d.num_sequences(), 4);
    EXPECT_EQ(d.num_documents(), 4);
    EXPECT_EQ(d.num_tokens(), 12);
    for (size_t i = 0; i < kDocs.size(); ++i)
      EXPECT_EQ(d.sequence(static_cast<int64_t>(i)), std::vector<int64_t>(kDocs[i].begin(), kDocs[i].end()));
    // The token stream crosses sequence boundaries (and the empty one).
    std::vector<int64_t> got(6);
    d.read_tokens(1, 6, got.data());
    EXPECT_EQ(got, (std::vector<int64_t>{2, 3, 40000, 5, 6, 7}));
    EXPECT_THROW(d.read_tokens(10, 3, got.data()), std::out_of_range);
  }
}

TEST(IndexedDataset, TokensThatDoNotFitTheDtypeAreRefused) {
  IndexedDatasetWriter w(test::temp_dir("idx") + "/shard", TokenDtype::UInt16);
  EXPECT_THROW(w.add_document({1, 70000}), std::runtime_error);
  EXPECT_THROW(w.add_document({-1}), std::runtime_error);
  EXPECT_EQ(dtype_for_vocab(50257), TokenDtype::UInt16);
  EXPECT_EQ(dtype_for_vocab(65500), TokenDtype::Int32);
  EXPECT_EQ(dtype_for_vocab(256), TokenDtype::UInt16);
}

TEST(IndexedDataset, AnUnfinishedWriterLeavesNoShard) {
  const std::string p = test::temp_dir("idx") + "/shard";
  {
    IndexedDatasetWriter w(p, TokenDtype::UInt16);
    w.add_document({1, 2});
  }  // no finish(): e.g. an exception while tokenizing
  EXPECT_FALSE(fs::exists(p + ".bin"));
  EXPECT_FALSE(fs::exists(p + ".idx"));
  EXPECT_FALSE(fs::exists(p + ".bin.tmp"));
}

TEST(IndexedDataset, ReadsSequencesStoredOutOfOrder) {
  // Other writers may place sequences anywhere in the .bin: the stream follows the index.
  const std::string p = write_shard(test::temp_dir("idx") + "/shard", TokenDtype::UInt16, {{1, 2, 3}, {4, 5}});
  const int64_t swapped[] = {4, 0};  // sequence 0 (3 tokens) after sequence 1 (2 tokens)
  const std::vector<uint16_t> bin = {4, 5, 1, 2, 3};
  patch(p + ".idx", 34 + 4 * 2, swapped, sizeof(swapped));
  test::write_text(p + ".bin", std::string(reinterpret_cast<const char*>(bin.data()), bin.size() * 2));
  IndexedDataset d(p);
  std::vector<int64_t> got(5);
  d.read_tokens(0, 5, got.data());
  EXPECT_EQ(got, (std::vector<int64_t>{1, 2, 3, 4, 5}));
  d.read_tokens(2, 2, got.data());
  EXPECT_EQ(got[0], 3);
  EXPECT_EQ(got[1], 4);
}

// ---- corruption: each is an error naming the file and the problem --------------------------

TEST(IndexedDatasetErrors, MissingFiles) {
  const std::string p = test::temp_dir("idx") + "/nothing";
  EXPECT_NE(open_error(p).find(p + ".idx: cannot open"), std::string::npos) << open_error(p);
  write_shard(p);
  fs::remove(p + ".bin");
  EXPECT_NE(open_error(p).find(p + ".bin: cannot open"), std::string::npos) << open_error(p);
}

TEST(IndexedDatasetErrors, TruncatedIndex) {
  const std::string p = write_shard(test::temp_dir("idx") + "/shard");
  truncate_to(p + ".idx", 20);  // inside the header
  EXPECT_NE(open_error(p).find(p + ".idx: truncated: 20 bytes"), std::string::npos) << open_error(p);
  write_shard(p);
  truncate_to(p + ".idx", 34 + 30);  // inside the arrays
  EXPECT_NE(open_error(p).find(p + ".idx: truncated: the header says 4 sequences"), std::string::npos) << open_error(p);
}

TEST(IndexedDatasetErrors, BadMagicVersionOrDtype) {
  const std::string p = write_shard(test::temp_dir("idx") + "/shard");
  patch(p + ".idx", 0, "NOTANIDX", 8);
  EXPECT_NE(open_error(p).find(p + ".idx: bad magic"), std::string::npos) << open_error(p);
  write_shard(p);
  const uint64_t v2 = 2;
  patch(p + ".idx", 9, &v2, 8);
  EXPECT_NE(open_error(p).find(p + ".idx: unsupported version 2"), std::string::npos) << open_error(p);
  write_shard(p);
  const uint8_t code = 9;
  patch(p + ".idx", 17, &code, 1);
  EXPECT_NE(open_error(p).find(p + ".idx: unknown dtype code 9"), std::string::npos) << open_error(p);
}

TEST(IndexedDatasetErrors, TrailingBytesInTheIndex) {
  const std::string p = write_shard(test::temp_dir("idx") + "/shard");
  test::write_text(p + ".idx", test::read_text(p + ".idx") + "xx");
  EXPECT_NE(open_error(p).find(p + ".idx: 2 unexpected bytes"), std::string::npos) << open_error(p);
}

TEST(IndexedDatasetErrors, TruncatedBin) {
  const std::string p = write_shard(test::temp_dir("idx") + "/shard");
  truncate_to(p + ".bin", 20);  // 24 bytes written
  const std::string e = open_error(p);
  EXPECT_NE(e.find(p + ".bin: sequence 3"), std::string::npos) << e;
  EXPECT_NE(e.find("past the end of the file (20 bytes)"), std::string::npos) << e;
}

TEST(IndexedDatasetErrors, PointerOutOfRange) {
  const std::string p = write_shard(test::temp_dir("idx") + "/shard");
  const int64_t far = 1 << 20;
  patch(p + ".idx", 34 + 4 * 4 + 8 * 2, &far, 8);  // pointer of sequence 2
  const std::string e = open_error(p);
  EXPECT_NE(e.find(p + ".bin: sequence 2 (pointer 1048576, 2 tokens)"), std::string::npos) << e;
  const int64_t odd = 3;  // not a multiple of sizeof(uint16)
  write_shard(p);
  patch(p + ".idx", 34 + 4 * 4 + 8 * 2, &odd, 8);
  EXPECT_NE(open_error(p).find("not a multiple"), std::string::npos) << open_error(p);
}

TEST(IndexedDatasetErrors, BinOfAnotherIndex) {
  const std::string p = write_shard(test::temp_dir("idx") + "/shard");
  test::write_text(p + ".bin", test::read_text(p + ".bin") + std::string(10, '\0'));
  EXPECT_NE(open_error(p).find("do not belong together"), std::string::npos) << open_error(p);
}

TEST(IndexedDatasetErrors, BadDocIdx) {
  const std::string p = write_shard(test::temp_dir("idx") + "/shard");
  const int64_t back = 7;
  patch(p + ".idx", 34 + 12 * 4 + 8 * 2, &back, 8);  // doc_idx[2] past the 4 sequences
  EXPECT_NE(open_error(p).find(p + ".idx: doc_idx[2] = 7"), std::string::npos) << open_error(p);
}

}  // namespace
}  // namespace flowrun
