// Megatron-LM's indexed dataset (MMapIndexedDataset): token sequences in PREFIX.bin, their
// index in PREFIX.idx. Files written here load in Megatron-LM / NeMo, and theirs load here.
// Torch-free (used by `flowrun prep`).
//
// PREFIX.bin: the tokens of every sequence, one after the other, in the index's dtype.
// PREFIX.idx (little-endian):
//   9 bytes   magic "MMIDIDX\0\0"
//   u64       version = 1
//   u8        dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
//             8 uint16 (megatron/core/datasets/indexed_dataset.py, DType)
//   u64       sequence count S
//   u64       document count D (= documents + 1: doc_idx starts with 0)
//   i32[S]    sizes: tokens per sequence
//   i64[S]    pointers: byte offset of each sequence in .bin
//   i64[D]    doc_idx: the sequence index where each document ends (a prefix list: 0, ..., S)
//   (i8[S]    modes, only in Megatron's multimodal files: accepted and ignored)
// flowrun writes one sequence per document, as Megatron's preprocess_data.py does without
// sentence splitting.
#pragma once
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace flowrun {

enum class TokenDtype : uint8_t {
  UInt8 = 1, Int8 = 2, Int16 = 3, Int32 = 4, Int64 = 5, Float64 = 6, Float32 = 7, UInt16 = 8,
};
size_t dtype_size(TokenDtype d);
const char* dtype_name(TokenDtype d);
bool dtype_is_integer(TokenDtype d);
// Megatron's choice for token ids: uint16 when the vocab has fewer than 65500 ids, else int32.
TokenDtype dtype_for_vocab(int64_t vocab_size);

// Writes PREFIX.bin and PREFIX.idx. Files are written under temporary names and renamed by
// finish(), so an interrupted writer never leaves a shard that looks complete.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(std::string prefix, TokenDtype dtype);
  ~IndexedDatasetWriter();  // without finish(): removes the temporary files
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // One document = one sequence. Throws if a token does not fit the dtype.
  void add_document(const int32_t* tokens, size_t n);
  void add_document(const std::vector<int32_t>& tokens) { add_document(tokens.data(), tokens.size()); }
  // Writes the index and renames both files into place.
  void finish();

  int64_t documents() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t tokens() const { return tokens_; }

 private:
  std::string prefix_;
  TokenDtype dtype_;
  std::ofstream bin_;
  std::vector<int32_t> sizes_;
  std::vector<char> buf_;
  int64_t tokens_ = 0;
  bool finished_ = false;
};

// A read-only memory map of one file (empty files map to nothing).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);  // throws naming the file
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Reads PREFIX.idx + PREFIX.bin through memory maps. The constructor checks the whole index
// (magic, version, dtype, counts against the file size, doc_idx, every pointer and size
// against the .bin), so reads after it need no checks. Errors name the file and the problem.
// Thread-safe: it never changes after construction.
class IndexedDataset {
 public:
  explicit IndexedDataset(const std::string& prefix);
  // Whether PREFIX.idx and PREFIX.bin are there.
  static bool exists(const std::string& prefix);

  const std::string& prefix() const { return prefix_; }
  TokenDtype dtype() const { return dtype_; }
  int64_t num_sequences() const { return static_cast<int64_t>(num_seq_); }
  int64_t num_documents() const { return static_cast<int64_t>(num_doc_idx_) - 1; }
  int64_t num_tokens() const { return total_tokens_; }  // all sequences together
  int32_t sequence_size(int64_t i) const { return load<int32_t>(sizes_, i); }
  int64_t sequence_pointer(int64_t i) const { return load<int64_t>(pointers_, i); }
  int64_t doc_idx(int64_t i) const { return load<int64_t>(doc_idx_, i); }
  // The token stream: every sequence in index order, concatenated. Copies tokens
  // [start, start + n) of it into `out` as int64 (integer dtypes only; the caller keeps the
  // range inside num_tokens()). One memory pass; no allocation.
  void read_tokens(int64_t start, int64_t n, int64_t* out) const;
  std::vector<int64_t> sequence(int64_t i) const;  // convenience for tests and tools

 private:
  std::string prefix_;
  std::unique_ptr<MappedFile> idx_, bin_;
  TokenDtype dtype_ = TokenDtype::Int32;
  uint64_t num_seq_ = 0, num_doc_idx_ = 0;
  // Views into the .idx map. The arrays start at byte 34, so they are not aligned for their
  // types: read them with load(), which compiles to a plain unaligned load.
  const uint8_t* sizes_ = nullptr;
  const uint8_t* pointers_ = nullptr;
  const uint8_t* doc_idx_ = nullptr;
  template <class T>
  static T load(const uint8_t* base, int64_t i) {
    T v;
    std::memcpy(&v, base + i * sizeof(T), sizeof(T));
    return v;
  }
  int64_t total_tokens_ = 0;
  bool contiguous_ = true;           // sequences back to back from byte 0 (what writers do)
  std::vector<int64_t> starts_;      // token offset of each sequence in the stream, if not contiguous
};

}  // namespace flowrun
