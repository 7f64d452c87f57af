// A minimal POSIX ustar reader and writer, for WebDataset shards (torch-free).
//
// Reader: index_tar() walks the 512-byte headers (seeking over the data) and lists the regular
// files with their data offsets, so a member is read later with one pread. It understands
// ustar's name prefix, GNU long names ('L') and pax 'path' records; directories, links and
// other entries are skipped. A member whose data runs past the end of the file is "truncated"
// (not listed, named in TarIndex::truncated); a header with a bad checksum ends the walk with
// TarIndex::error set (the members before it are kept).
//
// WebDataset: the members of one sample share a key, the member name up to the first dot of
// its basename ("a/000012.png", "a/000012.txt" -> key "a/000012", extensions "png", "txt").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace flowrun {

struct TarMember {
  std::string name;
  uint64_t offset = 0;  // of the data, from the start of the file
  uint64_t size = 0;
};

struct TarIndex {
  std::vector<TarMember> members;  // regular files, in file order
  std::string truncated;           // name of a member cut short by the end of the file ("" if none)
  std::string error;               // why the walk stopped early ("" if it reached the end)
};

// Throws std::runtime_error when the file cannot be opened.
TarIndex index_tar(const std::string& path);

// Random access to one tar's members (pread: safe from several threads at once).
class TarFile {
 public:
  explicit TarFile(const std::string& path);  // opens and indexes
  ~TarFile();
  TarFile(const TarFile&) = delete;
  TarFile& operator=(const TarFile&) = delete;
  const std::string& path() const { return path_; }
  const TarIndex& index() const { return index_; }
  // The member's bytes; throws std::runtime_error naming the file and member on a short read.
  std::string read(const TarMember& m) const;
  // The first min(n, size) bytes.
  std::string read_prefix(const TarMember& m, uint64_t n) const;

 private:
  std::string path_;
  int fd_ = -1;
  TarIndex index_;
};

// Writes a tar to PATH.tmp, renamed to PATH by finish() (a shard is complete or absent).
// Names up to 255 bytes (ustar prefix + name); regular files only, mode 0644, mtime 0.
class TarWriter {
 public:
  explicit TarWriter(const std::string& path);
  ~TarWriter();  // without finish(): removes the temporary file
  TarWriter(const TarWriter&) = delete;
  TarWriter& operator=(const TarWriter&) = delete;
  void add(const std::string& name, const std::string& bytes);
  void finish();
  int64_t members() const { return members_; }

 private:
  std::string path_, tmp_;
  void* f_ = nullptr;  // FILE*
  int64_t members_ = 0;
};

// WebDataset key and extension of a member name (see above).
std::string tar_key(const std::string& name);
std::string tar_ext(const std::string& name);

}  // namespace flowrun
