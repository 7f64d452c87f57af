// ustar reader and writer: see tar.hpp.
#include "formats/tar.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace flowrun {

namespace {

constexpr size_t kBlock = 512;

std::string field(const char* p, size_t n) {
  size_t len = 0;
  while (len < n && p[len]) ++len;
  return std::string(p, len);
}

// Octal numeric field (space/NUL padded); base-256 (GNU, high bit set) for large sizes.
bool parse_number(const char* p, size_t n, uint64_t* out) {
  if (n > 0 && (static_cast<uint8_t>(p[0]) & 0x80)) {
    uint64_t v = static_cast<uint8_t>(p[0]) & 0x7F;
    for (size_t i = 1; i < n; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
    *out = v;
    return true;
  }
  uint64_t v = 0;
  size_t i = 0;
  while (i < n && p[i] == ' ') ++i;
  bool any = false;
  for (; i < n && p[i] >= '0' && p[i] <= '7'; ++i) v = v * 8 + static_cast<uint64_t>(p[i] - '0'), any = true;
  for (; i < n; ++i)
    if (p[i] != ' ' && p[i] != '\0') return false;
  *out = v;
  (void)any;  // an empty field reads as 0
  return true;
}

bool checksum_ok(const char* h) {
  uint64_t want = 0;
  if (!parse_number(h + 148, 8, &want)) return false;
  uint64_t sum = 0;
  for (size_t i = 0; i < kBlock; ++i) sum += (i >= 148 && i < 156) ? uint64_t(' ') : static_cast<uint8_t>(h[i]);
  return sum == want;
}

bool all_zero(const char* h) {
  for (size_t i = 0; i < kBlock; ++i)
    if (h[i]) return false;
  return true;
}

uint64_t padded(uint64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

bool pread_all(int fd, char* buf, uint64_t n, uint64_t off) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, buf, n, static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    buf += r, n -= static_cast<uint64_t>(r), off += static_cast<uint64_t>(r);
  }
  return true;
}

// "path=..." from pax extended header records ("LEN key=value\n", LEN counting the whole
// record). LEN is read strictly (digits, then a space, within what is left): a lenient parse
// (strtoull skips blanks and saturates) let a record's length wrap the position around and
// loop forever (found by tests/fuzz/fuzz_tar.cpp).
std::string pax_path(const std::string& data) {
  size_t i = 0;
  while (i < data.size()) {
    size_t j = i;
    uint64_t len = 0;
    while (j < data.size() && data[j] >= '0' && data[j] <= '9' && len <= data.size())
      len = len * 10 + static_cast<uint64_t>(data[j++] - '0');
    // At least the digits, the space and the newline; at most what is left.
    if (j == i || j >= data.size() || data[j] != ' ' || len > data.size() - i || len < j - i + 2) break;
    const std::string rec = data.substr(j + 1, i + len - j - 2);  // without the trailing newline
    if (rec.rfind("path=", 0) == 0) return rec.substr(5);
    i += len;
  }
  return "";
}

TarIndex index_fd(int fd, const std::string& path) {
  TarIndex idx;
  struct stat st;
  if (::fstat(fd, &st) != 0) throw std::runtime_error(path + ": cannot stat");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  uint64_t off = 0;
  char h[kBlock];
  std::string long_name;
  while (true) {
    if (off + kBlock > file_size) {
      if (off != file_size) idx.truncated = long_name.empty() ? "(a header cut short at byte " + std::to_string(off) + ")" : long_name;
      break;  // end of file without the two zero blocks: accepted
    }
    if (!pread_all(fd, h, kBlock, off)) {
      idx.error = "read error at byte " + std::to_string(off);
      break;
    }
    if (all_zero(h)) break;  // end-of-archive marker
    if (!checksum_ok(h)) {
      idx.error = "bad header checksum at byte " + std::to_string(off) + " (not a tar, or corrupt)";
      break;
    }
    uint64_t size = 0;
    parse_number(h + 124, 12, &size);
    const char type = h[156];
    std::string name = field(h, 100);
    if (std::memcmp(h + 257, "ustar", 5) == 0) {
      const std::string prefix = field(h + 345, 155);
      if (!prefix.empty()) name = prefix + "/" + name;
    }
    if (!long_name.empty()) name = long_name, long_name.clear();
    const uint64_t data = off + kBlock;
    if (data + size > file_size) {
      idx.truncated = name;
      break;
    }
    if (type == 'L' || type == 'x') {  // GNU long name / pax header: applies to the next entry
      std::string buf(size, '\0');
      if (!pread_all(fd, buf.data(), size, data)) {
        idx.error = "read error at byte " + std::to_string(data);
        break;
      }
      long_name = type == 'L' ? field(buf.data(), buf.size()) : pax_path(buf);
    } else if (type == '0' || type == '\0' || type == '7') {
      idx.members.push_back({name, data, size});
    }  // directories, links, global pax headers, ...: skipped
    off = data + padded(size);
  }
  return idx;
}

void put_octal(char* p, size_t n, uint64_t v) {
  // n-1 octal digits and a NUL.
  std::snprintf(p, n, "%0*llo", static_cast<int>(n - 1), static_cast<unsigned long long>(v));
}

}  // namespace

TarIndex index_tar(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(path + ": cannot open (" + std::strerror(errno) + ")");
  try {
    TarIndex idx = index_fd(fd, path);
    ::close(fd);
    return idx;
  } catch (...) {
    ::close(fd);
    throw;
  }
}

TarFile::TarFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw std::runtime_error(path + ": cannot open (" + std::strerror(errno) + ")");
  try {
    index_ = index_fd(fd_, path);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

TarFile::~TarFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string TarFile::read_prefix(const TarMember& m, uint64_t n) const {
  const uint64_t k = std::min(n, m.size);
  std::string out(k, '\0');
  if (!pread_all(fd_, out.data(), k, m.offset))
    throw std::runtime_error(path_ + ": member " + m.name + ": short read (" + std::strerror(errno) + ")");
  return out;
}

std::string TarFile::read(const TarMember& m) const { return read_prefix(m, m.size); }

TarWriter::TarWriter(const std::string& path) : path_(path), tmp_(path + ".tmp") {
  const std::filesystem::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  f_ = std::fopen(tmp_.c_str(), "wb");
  if (!f_) throw std::runtime_error(tmp_ + ": cannot write (" + std::strerror(errno) + ")");
}

TarWriter::~TarWriter() {
  if (f_) {
    std::fclose(static_cast<FILE*>(f_));
    std::remove(tmp_.c_str());
  }
}

void TarWriter::add(const std::string& name, const std::string& bytes) {
  if (!f_) throw std::logic_error(path_ + ": add after finish");
  char h[kBlock];
  std::memset(h, 0, kBlock);
  std::string prefix, base = name;
  if (name.size() > 100) {  // split at a '/' so that prefix <= 155 and name <= 100
    size_t cut = name.rfind('/', std::min<size_t>(name.size() - 1, 155));
    while (cut != std::string::npos && name.size() - cut - 1 > 100) cut = std::string::npos;
    if (cut == std::string::npos || cut == 0) throw std::invalid_argument("tar: member name too long for ustar: " + name);
    prefix = name.substr(0, cut), base = name.substr(cut + 1);
  }
  std::memcpy(h, base.data(), base.size());
  put_octal(h + 100, 8, 0644);
  put_octal(h + 108, 8, 0);
  put_octal(h + 116, 8, 0);
  put_octal(h + 124, 12, bytes.size());
  put_octal(h + 136, 12, 0);
  h[156] = '0';
  std::memcpy(h + 257, "ustar", 6);  // magic "ustar\0"
  std::memcpy(h + 263, "00", 2);
  std::memcpy(h + 345, prefix.data(), prefix.size());
  std::memset(h + 148, ' ', 8);
  uint64_t sum = 0;
  for (size_t i = 0; i < kBlock; ++i) sum += static_cast<uint8_t>(h[i]);
  std::snprintf(h + 148, 8, "%06llo", static_cast<unsigned long long>(sum));  // 6 digits, NUL, space
  h[155] = ' ';
  FILE* f = static_cast<FILE*>(f_);
  static const char zeros[kBlock] = {};
  const size_t pad = padded(bytes.size()) - bytes.size();
  if (std::fwrite(h, 1, kBlock, f) != kBlock || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() ||
      std::fwrite(zeros, 1, pad, f) != pad)
    throw std::runtime_error(tmp_ + ": write failed (" + std::strerror(errno) + ")");
  ++members_;
}

void TarWriter::finish() {
  if (!f_) return;
  FILE* f = static_cast<FILE*>(f_);
  static const char zeros[2 * kBlock] = {};
  const bool ok = std::fwrite(zeros, 1, sizeof zeros, f) == sizeof zeros;
  const bool closed = std::fclose(f) == 0;
  f_ = nullptr;
  if (!ok || !closed) {
    std::remove(tmp_.c_str());
    throw std::runtime_error(tmp_ + ": write failed");
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    std::remove(tmp_.c_str());
    throw std::runtime_error(path_ + ": cannot rename " + tmp_ + " into place (" + std::strerror(errno) + ")");
  }
}

std::string tar_key(const std::string& name) {
  const size_t slash = name.rfind('/'), start = slash == std::string::npos ? 0 : slash + 1;
  const size_t dot = name.find('.', start);
  return dot == std::string::npos ? name : name.substr(0, dot);
}

std::string tar_ext(const std::string& name) {
  const size_t slash = name.rfind('/'), start = slash == std::string::npos ? 0 : slash + 1;
  const size_t dot = name.find('.', start);
  return dot == std::string::npos ? "" : name.substr(dot + 1);
}

}  // namespace flowrun
