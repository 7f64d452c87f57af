// Apache Arrow IPC files — the "file" format pyarrow's RecordBatchFileWriter writes, as
// HunyuanDiT's hydit/data_loader/csv2arrow.py does (columns text_zh, md5, width, height, image;
// 5000 rows a file) — read memory-mapped and written, through Arrow's own C++ library.
//
//   ArrowFile f("dataset/arrows/00000.arrow");        // footer, schema, batches: no data read
//   int img = f.column("image"), cap = f.column("text_zh");
//   std::string_view png = f.bytes(img, 17);          // a view into the mapping, no copy
//
// Arrow is optional (cmake FLOWRUN_ARROW, found from an installed Arrow or the pyarrow wheel of
// the build's Python: nodes/CMakeLists.txt). Its headers need C++20 and never reach this
// header: arrow_file.cpp, the one file that includes them, is the flowrun_arrow library. Built
// without Arrow, arrow_available() is false and every constructor and writer here throws
// std::runtime_error with arrow_missing_message().
//
// Reading: the file is mapped (mmap) and its record batches are validated at open (offsets
// inside their buffers, so a damaged file cannot make a read leave the mapping; string columns
// as bytes: a value that is not UTF-8 costs only its own row, whose reader repairs it); only the
// pages a read touches are loaded. Reads are const and thread-safe. Every error names the file, and
// for a value its column and row.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace flowrun {

bool arrow_available();
std::string arrow_version();          // "26.0.1" (empty without Arrow)
std::string arrow_missing_message();  // what to install and re-run, for errors

// How flowrun reads a column: text and bytes (string, large_string, binary, large_binary),
// integers (int8 .. uint64), floats (float, double), or anything else.
enum class ArrowKind { string, binary, integer, floating, other };

class ArrowFile {
 public:
  // Opens and validates PATH. Throws std::runtime_error naming it: missing, not an Arrow IPC
  // file (or cut short: the footer is at the end), or a batch that fails validation.
  explicit ArrowFile(const std::string& path);
  ~ArrowFile();
  ArrowFile(const ArrowFile&) = delete;
  ArrowFile& operator=(const ArrowFile&) = delete;

  const std::string& path() const;
  int64_t rows() const;
  std::vector<std::string> columns() const;
  int column(const std::string& name) const;  // -1 when there is none
  ArrowKind kind(int col) const;
  std::string type_name(int col) const;       // Arrow's: "string", "int64", "binary", ...

  bool is_null(int col, int64_t row) const;
  // A string or binary value, viewing the mapping (valid while this ArrowFile lives).
  std::string_view bytes(int col, int64_t row) const;
  // An integer value; a float value that is a whole number is taken too.
  int64_t integer(int col, int64_t row) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One column to write: text (kind string: UTF-8), bytes (kind binary) or integers (kind
// integer: int64).
struct ArrowColumn {
  std::string name;
  ArrowKind kind = ArrowKind::string;
  std::vector<std::string> values;  // string, binary
  std::vector<int64_t> ints;        // integer
};

// An Arrow IPC file written record batch by record batch, streamed to PATH.tmp and renamed over
// PATH by close(): memory holds one batch, never the file, and a file may pass 2 GiB (each
// batch's 32-bit offsets stay in range: keep a batch under 2 GiB of values). Destroyed without
// close() (an exception on the way), it removes PATH.tmp: nothing half-written is left.
//
//   ArrowFileWriter w(path);
//   w.write(columns);  // a batch; the first fixes the schema (names, kinds)
//   w.close();
class ArrowFileWriter {
 public:
  explicit ArrowFileWriter(std::string path);
  ~ArrowFileWriter();
  ArrowFileWriter(const ArrowFileWriter&) = delete;
  ArrowFileWriter& operator=(const ArrowFileWriter&) = delete;
  // Throws std::invalid_argument for unequal or unsupported columns or another schema than the
  // first batch's, std::runtime_error when writing fails (naming PATH; "no space left on
  // device" when that is why).
  void write(const std::vector<ArrowColumn>& columns);
  void close();  // the footer, fsync, rename; a file of no batch has the schema of none
  int64_t bytes() const;  // written so far

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes the columns (equal lengths) as one record batch of an Arrow IPC file at PATH,
// atomically (PATH.tmp renamed over PATH). Throws std::invalid_argument for unequal or
// unsupported columns, std::runtime_error when writing fails.
void write_arrow_file(const std::string& path, const std::vector<ArrowColumn>& columns);

}  // namespace flowrun
