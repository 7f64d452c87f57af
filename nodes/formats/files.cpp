#include "formats/files.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace flowrun {

namespace fs = std::filesystem;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(path + ": cannot read it: " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw std::invalid_argument(path + ": reading it failed: " + std::strerror(errno));
  return ss.str();
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

}  // namespace flowrun
