// Megatron indexed dataset: writer, memory-mapped reader and its checks. Format: see the header.
#include "formats/indexed_dataset.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <stdexcept>
#include <string>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the indexed dataset format is little-endian; add byte swaps");

namespace flowrun {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype, S, D = 34

template <class T>
void put(std::ofstream& out, T v) {
  out.write(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <class T>
T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Tokens of one dtype to int64, n of them. A plain loop the compiler vectorizes.
template <class T>
void widen(const uint8_t* src, int64_t n, int64_t* out) {
  const T* s = reinterpret_cast<const T*>(src);  // aligned: pointers are multiples of sizeof(T)
  for (int64_t k = 0; k < n; ++k) out[k] = static_cast<int64_t>(s[k]);
}

void widen_any(TokenDtype d, const uint8_t* src, int64_t n, int64_t* out) {
  switch (d) {
    case TokenDtype::UInt8: return widen<uint8_t>(src, n, out);
    case TokenDtype::Int8: return widen<int8_t>(src, n, out);
    case TokenDtype::Int16: return widen<int16_t>(src, n, out);
    case TokenDtype::Int32: return widen<int32_t>(src, n, out);
    case TokenDtype::Int64: return widen<int64_t>(src, n, out);
    case TokenDtype::UInt16: return widen<uint16_t>(src, n, out);
    default: throw std::logic_error(std::string("dtype ") + dtype_name(d) + " holds no token ids");
  }
}

// Narrow a token to the file's dtype, or throw if it does not fit.
template <class T>
void narrow(const int32_t* in, size_t n, char* out, const std::string& prefix) {
  for (size_t k = 0; k < n; ++k) {
    const int64_t v = in[k];
    if (v < static_cast<int64_t>(std::numeric_limits<T>::min()) || v > static_cast<int64_t>(std::numeric_limits<T>::max()))
      throw std::runtime_error(prefix + ".bin: token " + std::to_string(v) + " does not fit the index dtype");
    const T t = static_cast<T>(v);
    std::memcpy(out + k * sizeof(T), &t, sizeof(T));
  }
}

}  // namespace

size_t dtype_size(TokenDtype d) {
  switch (d) {
    case TokenDtype::UInt8:
    case TokenDtype::Int8: return 1;
    case TokenDtype::Int16:
    case TokenDtype::UInt16: return 2;
    case TokenDtype::Int32:
    case TokenDtype::Float32: return 4;
    case TokenDtype::Int64:
    case TokenDtype::Float64: return 8;
  }
  return 0;
}

const char* dtype_name(TokenDtype d) {
  switch (d) {
    case TokenDtype::UInt8: return "uint8";
    case TokenDtype::Int8: return "int8";
    case TokenDtype::Int16: return "int16";
    case TokenDtype::Int32: return "int32";
    case TokenDtype::Int64: return "int64";
    case TokenDtype::Float64: return "float64";
    case TokenDtype::Float32: return "float32";
    case TokenDtype::UInt16: return "uint16";
  }
  return "?";
}

bool dtype_is_integer(TokenDtype d) { return d != TokenDtype::Float32 && d != TokenDtype::Float64; }

TokenDtype dtype_for_vocab(int64_t vocab_size) { return vocab_size < 65500 ? TokenDtype::UInt16 : TokenDtype::Int32; }

// ---- writer --------------------------------------------------------------------------------

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, TokenDtype dtype) : prefix_(std::move(prefix)), dtype_(dtype) {
  if (!dtype_is_integer(dtype)) throw std::invalid_argument(std::string("token shards need an integer dtype, not ") + dtype_name(dtype));
  bin_.open(prefix_ + ".bin.tmp", std::ios::binary | std::ios::trunc);
  if (!bin_) throw std::runtime_error(prefix_ + ".bin.tmp: cannot create: " + std::strerror(errno));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (finished_) return;
  bin_.close();
  std::remove((prefix_ + ".bin.tmp").c_str());
  std::remove((prefix_ + ".idx.tmp").c_str());
}

void IndexedDatasetWriter::add_document(const int32_t* tokens, size_t n) {
  if (finished_) throw std::logic_error(prefix_ + ": add_document after finish");
  if (n > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    throw std::runtime_error(prefix_ + ": a document of " + std::to_string(n) + " tokens is longer than the format's int32 sizes allow");
  const size_t k = dtype_size(dtype_);
  buf_.resize(n * k);
  switch (dtype_) {
    case TokenDtype::UInt8: narrow<uint8_t>(tokens, n, buf_.data(), prefix_); break;
    case TokenDtype::Int8: narrow<int8_t>(tokens, n, buf_.data(), prefix_); break;
    case TokenDtype::Int16: narrow<int16_t>(tokens, n, buf_.data(), prefix_); break;
    case TokenDtype::UInt16: narrow<uint16_t>(tokens, n, buf_.data(), prefix_); break;
    case TokenDtype::Int32: narrow<int32_t>(tokens, n, buf_.data(), prefix_); break;
    case TokenDtype::Int64: narrow<int64_t>(tokens, n, buf_.data(), prefix_); break;
    default: throw std::logic_error("float dtype");
  }
  bin_.write(buf_.data(), static_cast<std::streamsize>(buf_.size()));
  if (!bin_) throw std::runtime_error(prefix_ + ".bin.tmp: write failed: " + std::strerror(errno));
  sizes_.push_back(static_cast<int32_t>(n));
  tokens_ += static_cast<int64_t>(n);
}

void IndexedDatasetWriter::finish() {
  if (finished_) return;
  bin_.close();
  if (!bin_) throw std::runtime_error(prefix_ + ".bin.tmp: write failed: " + std::strerror(errno));
  const std::string idx_tmp = prefix_ + ".idx.tmp";
  {
    std::ofstream idx(idx_tmp, std::ios::binary | std::ios::trunc);
    if (!idx) throw std::runtime_error(idx_tmp + ": cannot create: " + std::strerror(errno));
    const uint64_t S = sizes_.size();
    idx.write(kMagic, sizeof(kMagic));
    put<uint64_t>(idx, 1);
    put<uint8_t>(idx, static_cast<uint8_t>(dtype_));
    put<uint64_t>(idx, S);
    put<uint64_t>(idx, S + 1);  // doc_idx: 0, 1, ..., S (one sequence per document)
    idx.write(reinterpret_cast<const char*>(sizes_.data()), static_cast<std::streamsize>(S * sizeof(int32_t)));
    std::vector<int64_t> v(S);
    int64_t ptr = 0;
    for (uint64_t i = 0; i < S; ++i) v[i] = ptr, ptr += static_cast<int64_t>(sizes_[i]) * static_cast<int64_t>(dtype_size(dtype_));
    idx.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(S * sizeof(int64_t)));
    v.resize(S + 1);
    for (uint64_t i = 0; i <= S; ++i) v[i] = static_cast<int64_t>(i);
    idx.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>((S + 1) * sizeof(int64_t)));
    idx.close();
    if (!idx) throw std::runtime_error(idx_tmp + ": write failed: " + std::strerror(errno));
  }
  // .bin first: a crash between the renames leaves a .bin without .idx, which no reader takes.
  if (std::rename((prefix_ + ".bin.tmp").c_str(), (prefix_ + ".bin").c_str()) != 0 ||
      std::rename(idx_tmp.c_str(), (prefix_ + ".idx").c_str()) != 0)
    throw std::runtime_error(prefix_ + ": cannot rename the finished files into place: " + std::strerror(errno));
  finished_ = true;
}

// ---- mapped file ---------------------------------------------------------------------------

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw std::runtime_error(path + ": cannot stat: " + std::strerror(e));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      throw std::runtime_error(path + ": cannot map: " + std::strerror(e));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

// ---- reader --------------------------------------------------------------------------------

bool IndexedDataset::exists(const std::string& prefix) {
  std::error_code ec;
  return std::filesystem::exists(prefix + ".idx", ec) && std::filesystem::exists(prefix + ".bin", ec);
}

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  idx_ = std::make_unique<MappedFile>(idx_path);
  auto bad_idx = [&](const std::string& what) { return std::runtime_error(idx_path + ": " + what); };

  const uint8_t* p = idx_->data();
  const uint64_t size = idx_->size();
  if (size < kHeaderBytes)
    throw bad_idx("truncated: " + std::to_string(size) + " bytes, but the header alone is " + std::to_string(kHeaderBytes));
  if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0)
    throw bad_idx("bad magic: not a Megatron indexed dataset index (it must start with \"MMIDIDX\\0\\0\")");
  const uint64_t version = get<uint64_t>(p + 9);
  if (version != 1) throw bad_idx("unsupported version " + std::to_string(version) + " (only version 1 exists)");
  const uint8_t code = p[17];
  if (code < 1 || code > 8) throw bad_idx("unknown dtype code " + std::to_string(code) + " (known: 1..8)");
  dtype_ = static_cast<TokenDtype>(code);
  num_seq_ = get<uint64_t>(p + 18);
  num_doc_idx_ = get<uint64_t>(p + 26);

  // Sizes of the arrays, without overflow for absurd counts.
  const uint64_t body = size - kHeaderBytes;
  const std::string counts = std::to_string(num_seq_) + " sequences and " + std::to_string(num_doc_idx_) + " document indices";
  if (num_seq_ > body / 12 || num_doc_idx_ > (body - 12 * num_seq_) / 8)
    throw bad_idx("truncated: the header says " + counts + ", which do not fit in the file's " + std::to_string(size) + " bytes");
  const uint64_t need = kHeaderBytes + 12 * num_seq_ + 8 * num_doc_idx_;
  if (size != need && size != need + num_seq_)  // + num_seq_: Megatron's multimodal files add an int8 mode per sequence
    throw bad_idx(std::to_string(size - need) + " unexpected bytes after the arrays (the header says " + counts + ": " +
                  std::to_string(need) + " bytes)");
  if (num_doc_idx_ < 1) throw bad_idx("no document indices (doc_idx must at least hold 0)");
  sizes_ = p + kHeaderBytes;
  pointers_ = sizes_ + 4 * num_seq_;
  doc_idx_ = pointers_ + 8 * num_seq_;

  if (doc_idx(0) != 0) throw bad_idx("doc_idx[0] is " + std::to_string(doc_idx(0)) + ", not 0");
  for (uint64_t i = 1; i < num_doc_idx_; ++i) {
    const int64_t d = doc_idx(i);
    if (d < doc_idx(i - 1) || d > static_cast<int64_t>(num_seq_))
      throw bad_idx("doc_idx[" + std::to_string(i) + "] = " + std::to_string(d) + " is out of order or past the " +
                    std::to_string(num_seq_) + " sequences");
  }

  bin_ = std::make_unique<MappedFile>(bin_path);
  const int64_t bin_size = static_cast<int64_t>(bin_->size());
  const auto item = static_cast<int64_t>(dtype_size(dtype_));
  int64_t expect_ptr = 0;
  for (uint64_t i = 0; i < num_seq_; ++i) {
    const int64_t n = sequence_size(static_cast<int64_t>(i)), ptr = sequence_pointer(static_cast<int64_t>(i));
    const std::string seq = "sequence " + std::to_string(i) + " (pointer " + std::to_string(ptr) + ", " + std::to_string(n) + " tokens)";
    if (n < 0) throw bad_idx(seq + ": negative size");
    if (ptr < 0 || ptr % item != 0)
      throw bad_idx(seq + ": pointer is negative or not a multiple of the " + dtype_name(dtype_) + " size " + std::to_string(item));
    if (ptr > bin_size || n > (bin_size - ptr) / item)
      throw std::runtime_error(bin_path + ": " + seq + " ends at byte " + std::to_string(ptr + n * item) + ", past the end of the file (" +
                               std::to_string(bin_size) + " bytes): the .bin is truncated or belongs to another .idx");
    if (ptr != expect_ptr) contiguous_ = false;
    expect_ptr = ptr + n * item;
    total_tokens_ += n;
  }
  if (contiguous_ && expect_ptr != bin_size)
    throw std::runtime_error(bin_path + ": " + std::to_string(bin_size) + " bytes, but " + idx_path + " describes " +
                             std::to_string(total_tokens_) + " tokens x " + std::to_string(item) + " bytes = " +
                             std::to_string(expect_ptr) + ": the two files do not belong together");
  if (!contiguous_) {
    // Sequences elsewhere in the .bin (other writers may reorder): map stream offsets to them.
    starts_.resize(num_seq_ + 1);
    starts_[0] = 0;
    for (uint64_t i = 0; i < num_seq_; ++i) starts_[i + 1] = starts_[i] + sequence_size(static_cast<int64_t>(i));
  }
}

void IndexedDataset::read_tokens(int64_t start, int64_t n, int64_t* out) const {
  if (start < 0 || n < 0 || start + n > total_tokens_)
    throw std::out_of_range(prefix_ + ": tokens [" + std::to_string(start) + ", " + std::to_string(start + n) +
                            ") are outside the stream of " + std::to_string(total_tokens_));
  const auto item = static_cast<int64_t>(dtype_size(dtype_));
  if (contiguous_) return widen_any(dtype_, bin_->data() + start * item, n, out);
  // Piece by piece over the sequences the range touches.
  auto it = std::upper_bound(starts_.begin(), starts_.end(), start) - 1;
  for (int64_t seq = it - starts_.begin(); n > 0; ++seq) {
    const int64_t off = start - starts_[seq];
    const int64_t take = std::min<int64_t>(n, sequence_size(seq) - off);
    if (take <= 0) continue;  // empty sequence
    widen_any(dtype_, bin_->data() + sequence_pointer(seq) + off * item, take, out);
    out += take, start += take, n -= take;
  }
}

std::vector<int64_t> IndexedDataset::sequence(int64_t i) const {
  if (i < 0 || i >= num_sequences()) throw std::out_of_range(prefix_ + ": no sequence " + std::to_string(i));
  std::vector<int64_t> out(static_cast<size_t>(sequence_size(i)));
  widen_any(dtype_, bin_->data() + sequence_pointer(i), sequence_size(i), out.data());
  return out;
}

}  // namespace flowrun
