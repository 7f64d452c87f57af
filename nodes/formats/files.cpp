#include "formats/files.hpp"

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace flowrun {

std::string trim_space(std::string_view s) {
  const size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
  return a == std::string_view::npos ? std::string() : std::string(s.substr(a, b - a + 1));
}

namespace fs = std::filesystem;

std::string read_file(const std::string& path) {
  // read(2) itself: an iostream's `<< rdbuf()` turns a failing read (EIO) into an empty string.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::invalid_argument(path + ": cannot read it: " + std::strerror(errno));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      out.append(buf, static_cast<size_t>(n));
    } else if (n == 0) {
      break;
    } else if (errno != EINTR) {
      const int e = errno;
      ::close(fd);
      throw std::invalid_argument(path + ": reading it failed: " + std::strerror(e));
    }
  }
  ::close(fd);
  return out;
}

std::string sampled_content(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    const int e = errno;
    if (fd >= 0) ::close(fd);
    throw std::runtime_error(path + ": cannot read it: " + std::strerror(e));
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  constexpr uint64_t kBlock = 4096, kBetween = 16;
  std::vector<uint64_t> starts;
  if (size <= (kBetween + 2) * kBlock) {
    for (uint64_t at = 0; at < size; at += kBlock) starts.push_back(at);
  } else {
    starts.push_back(0);
    for (uint64_t k = 1; k <= kBetween; ++k) starts.push_back((size - kBlock) * k / (kBetween + 1));
    starts.push_back(size - kBlock);
  }
  std::string out(reinterpret_cast<const char*>(&size), sizeof size);
  for (const uint64_t at : starts) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(kBlock, size - at)), from = out.size();
    out.resize(from + want);
    size_t got = 0;
    while (got < want) {
      const ssize_t n = ::pread(fd, out.data() + from + got, want - got, static_cast<off_t>(at + got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int e = n < 0 ? errno : EIO;
        ::close(fd);
        throw std::runtime_error(path + ": reading it failed: " + std::strerror(e));
      }
      got += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  return out;
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
  ok = (::close(fd) == 0) && ok;
  if (!ok) throw std::runtime_error("writing " + tmp + " failed: " + std::strerror(errno));
  fs::rename(tmp, path);
}

std::string read_latest(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_regular_file(dir + "/latest", ec)) return "";
  std::ifstream in(dir + "/latest");
  std::string name;
  if (!in || !std::getline(in, name)) return "";
  return name;
}

std::string resolve_latest(const std::string& path) {
  fs::path out;
  for (const auto& part : fs::path(path)) {
    std::error_code ec;
    if (part == "latest" && fs::is_regular_file(out / part, ec)) {
      const std::string name = read_latest(out.string());
      if (!name.empty()) {
        out /= name;
        continue;
      }
    }
    out /= part;
  }
  return out.string();
}

std::string local_timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", &tm);
  return buf;
}

namespace {

// BASE + SUFFIX for the first try, then BASE-2 + SUFFIX, ...
std::string nth_name(const std::string& base, const std::string& suffix, int n) {
  return base + (n == 1 ? "" : "-" + std::to_string(n)) + suffix;
}

constexpr int kMaxTries = 100000;

}  // namespace

std::string move_aside(const std::string& from, const std::string& base, const std::string& suffix) {
  for (int n = 1; n <= kMaxTries; ++n) {
    const std::string to = nth_name(base, suffix, n);
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return to;
    if (errno == EEXIST) continue;
    if (errno == EINVAL || errno == ENOSYS) {  // a file system without RENAME_NOREPLACE: look first
      std::error_code ec;
      if (std::filesystem::exists(std::filesystem::symlink_status(to, ec))) continue;
      std::filesystem::rename(from, to);
      return to;
    }
    throw std::filesystem::filesystem_error("cannot move it aside", from, to, std::error_code(errno, std::generic_category()));
  }
  throw std::runtime_error("cannot move " + from + " aside: " + nth_name(base, suffix, 1) + " and " +
                           std::to_string(kMaxTries - 1) + " numbered names after it are all taken");
}

std::string make_new_dir(const std::string& base) {
  for (int n = 1; n <= kMaxTries; ++n) {
    const std::string dir = nth_name(base, "", n);
    if (::mkdir(dir.c_str(), 0777) == 0) return dir;
    if (errno != EEXIST)
      throw std::filesystem::filesystem_error("cannot make the folder", dir, std::error_code(errno, std::generic_category()));
  }
  throw std::runtime_error("cannot make a folder " + base + ": it and " + std::to_string(kMaxTries - 1) +
                           " numbered names after it are all taken");
}

}  // namespace flowrun
