// Arrow IPC files through Apache Arrow's C++ library (arrow_file.hpp). The only file that
// includes Arrow's headers (they need C++20): compiled alone into flowrun_arrow, with
// FLOWRUN_ARROW=1 where the library was found, else as the stubs at the end.
#include "formats/arrow_file.hpp"

#include <stdexcept>

#include "formats/files.hpp"

#if FLOWRUN_ARROW
#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/io/memory.h>
#include <arrow/ipc/reader.h>
#include <arrow/ipc/writer.h>
#include <arrow/util/config.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#endif

namespace flowrun {

std::string arrow_missing_message() {
  return "flowrun was built without Apache Arrow (the Arrow files of HunyuanDiT's csv2arrow.py and IndexKits). "
         "Install it into the build's Python (pip install pyarrow; scripts/setup.sh does, from requirements.txt) "
         "or install Arrow's C++ library (libarrow-dev), then re-run cmake and rebuild "
         "(cmake -DFLOWRUN_ARROW=ON makes a missing Arrow an error at configure time)";
}

#if FLOWRUN_ARROW

namespace {
[[noreturn]] void fail(const std::string& path, const std::string& what) { throw std::runtime_error(path + ": " + what); }

ArrowKind kind_of(const arrow::DataType& t) {
  switch (t.id()) {
    case arrow::Type::STRING:
    case arrow::Type::LARGE_STRING:
      return ArrowKind::string;
    case arrow::Type::BINARY:
    case arrow::Type::LARGE_BINARY:
      return ArrowKind::binary;
    case arrow::Type::INT8: case arrow::Type::INT16: case arrow::Type::INT32: case arrow::Type::INT64:
    case arrow::Type::UINT8: case arrow::Type::UINT16: case arrow::Type::UINT32: case arrow::Type::UINT64:
      return ArrowKind::integer;
    case arrow::Type::FLOAT:
    case arrow::Type::DOUBLE:
      return ArrowKind::floating;
    default:
      return ArrowKind::other;
  }
}
}  // namespace

bool arrow_available() { return true; }
std::string arrow_version() { return ARROW_VERSION_STRING; }

struct ArrowFile::Impl {
  std::string path;
  std::shared_ptr<arrow::io::MemoryMappedFile> file;
  std::shared_ptr<arrow::Schema> schema;
  std::vector<std::shared_ptr<arrow::RecordBatch>> batches;
  std::vector<int64_t> starts;  // first row of each batch; starts.back() = rows
  std::vector<ArrowKind> kinds;

  // The batch holding `row` and the row inside it; throws naming file, column and row.
  std::pair<const arrow::Array*, int64_t> at(int col, int64_t row) const {
    if (col < 0 || col >= static_cast<int>(kinds.size()))
      fail(path, "no column #" + std::to_string(col) + " (" + std::to_string(kinds.size()) + " columns)");
    if (row < 0 || row >= starts.back())
      fail(path, "no row " + std::to_string(row) + " (the file has " + std::to_string(starts.back()) + " rows)");
    const size_t b = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), row) - starts.begin()) - 1;
    return {batches[b]->column(col).get(), row - starts[b]};
  }
  std::string where(int col, int64_t row) const {
    return "column '" + schema->field(col)->name() + "' (" + schema->field(col)->type()->ToString() + "), row " + std::to_string(row);
  }
};

ArrowFile::ArrowFile(const std::string& path) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.path = path;
  auto file = arrow::io::MemoryMappedFile::Open(path, arrow::io::FileMode::READ);
  if (!file.ok()) fail(path, "cannot open it as an Arrow file: " + file.status().message());
  m.file = *file;
  auto reader = arrow::ipc::RecordBatchFileReader::Open(m.file);
  if (!reader.ok())
    fail(path, "not an Arrow IPC file, or cut short (" + reader.status().message() +
                   "); HunyuanDiT's csv2arrow.py and `flowrun prep arrow` write whole ones");
  m.schema = (*reader)->schema();
  for (const auto& f : m.schema->fields()) m.kinds.push_back(kind_of(*f->type()));
  m.starts.push_back(0);
  for (int b = 0; b < (*reader)->num_record_batches(); ++b) {
    auto batch = (*reader)->ReadRecordBatch(b);
    if (!batch.ok()) fail(path, "record batch " + std::to_string(b) + " cannot be read (" + batch.status().message() + ")");
    // Offsets and lengths inside their buffers: reads below never leave the mapping. A string
    // column is checked as the binary it is stored as: one caption that is not UTF-8 (Latin-1
    // bytes, say) must not make its file's thousands of rows unreadable; its reader repairs it
    // (formats/utf8.hpp) and says so.
    for (int c = 0; c < (*batch)->num_columns(); ++c) {
      std::shared_ptr<arrow::Array> col = (*batch)->column(c);
      if (col->type_id() == arrow::Type::STRING || col->type_id() == arrow::Type::LARGE_STRING) {
        auto as_bytes = col->View(col->type_id() == arrow::Type::STRING ? arrow::binary() : arrow::large_binary());
        if (!as_bytes.ok()) fail(path, "record batch " + std::to_string(b) + ", column '" + m.schema->field(c)->name() + "': " + as_bytes.status().message());
        col = *as_bytes;
      }
      const arrow::Status st = col->ValidateFull();
      if (!st.ok())
        fail(path, "record batch " + std::to_string(b) + ", column '" + m.schema->field(c)->name() + "' is damaged (" + st.message() +
                       "); write the file again (csv2arrow.py or `flowrun prep arrow`)");
    }
    const arrow::Status st = (*batch)->Validate();
    if (!st.ok()) fail(path, "record batch " + std::to_string(b) + " is damaged (" + st.message() + ")");
    m.starts.push_back(m.starts.back() + (*batch)->num_rows());
    m.batches.push_back(std::move(*batch));
  }
}

ArrowFile::~ArrowFile() = default;

const std::string& ArrowFile::path() const { return impl_->path; }
int64_t ArrowFile::rows() const { return impl_->starts.back(); }

std::vector<std::string> ArrowFile::columns() const { return impl_->schema->field_names(); }

int ArrowFile::column(const std::string& name) const { return impl_->schema->GetFieldIndex(name); }

ArrowKind ArrowFile::kind(int col) const { return impl_->kinds.at(static_cast<size_t>(col)); }

std::string ArrowFile::type_name(int col) const { return impl_->schema->field(col)->type()->ToString(); }

bool ArrowFile::is_null(int col, int64_t row) const {
  const auto [a, r] = impl_->at(col, row);
  return a->IsNull(r);
}

std::string_view ArrowFile::bytes(int col, int64_t row) const {
  const auto [a, r] = impl_->at(col, row);
  if (a->IsNull(r)) fail(impl_->path, impl_->where(col, row) + " is null");
  switch (a->type_id()) {
    case arrow::Type::STRING:
    case arrow::Type::BINARY:
      return static_cast<const arrow::BinaryArray*>(a)->GetView(r);
    case arrow::Type::LARGE_STRING:
    case arrow::Type::LARGE_BINARY:
      return static_cast<const arrow::LargeBinaryArray*>(a)->GetView(r);
    default:
      fail(impl_->path, impl_->where(col, row) + ": expected string or binary values");
  }
}

int64_t ArrowFile::integer(int col, int64_t row) const {
  const auto [a, r] = impl_->at(col, row);
  if (a->IsNull(r)) fail(impl_->path, impl_->where(col, row) + " is null");
  switch (a->type_id()) {
    case arrow::Type::INT8: return static_cast<const arrow::Int8Array*>(a)->Value(r);
    case arrow::Type::INT16: return static_cast<const arrow::Int16Array*>(a)->Value(r);
    case arrow::Type::INT32: return static_cast<const arrow::Int32Array*>(a)->Value(r);
    case arrow::Type::INT64: return static_cast<const arrow::Int64Array*>(a)->Value(r);
    case arrow::Type::UINT8: return static_cast<const arrow::UInt8Array*>(a)->Value(r);
    case arrow::Type::UINT16: return static_cast<const arrow::UInt16Array*>(a)->Value(r);
    case arrow::Type::UINT32: return static_cast<const arrow::UInt32Array*>(a)->Value(r);
    case arrow::Type::UINT64: {
      const uint64_t v = static_cast<const arrow::UInt64Array*>(a)->Value(r);
      if (v > static_cast<uint64_t>(INT64_MAX)) fail(impl_->path, impl_->where(col, row) + ": " + std::to_string(v) + " is too large");
      return static_cast<int64_t>(v);
    }
    case arrow::Type::FLOAT:
    case arrow::Type::DOUBLE: {
      const double v = a->type_id() == arrow::Type::FLOAT ? static_cast<const arrow::FloatArray*>(a)->Value(r)
                                                          : static_cast<const arrow::DoubleArray*>(a)->Value(r);
      if (!std::isfinite(v) || v != std::floor(v) || std::abs(v) > 9.0e15)
        fail(impl_->path, impl_->where(col, row) + ": " + std::to_string(v) + " is not a whole number");
      return static_cast<int64_t>(v);
    }
    default:
      fail(impl_->path, impl_->where(col, row) + ": expected integers");
  }
}

namespace {

// One record batch of the columns (equal lengths), named for errors by `path`.
std::shared_ptr<arrow::RecordBatch> make_batch(const std::string& path, const std::vector<ArrowColumn>& columns) {
  if (columns.empty()) throw std::invalid_argument(path + ": no columns to write");
  const auto length = [](const ArrowColumn& c) { return c.kind == ArrowKind::integer ? c.ints.size() : c.values.size(); };
  const size_t rows = length(columns[0]);
  arrow::FieldVector fields;
  arrow::ArrayVector arrays;
  for (const ArrowColumn& c : columns) {
    if (length(c) != rows)
      throw std::invalid_argument(path + ": column '" + c.name + "' has " + std::to_string(length(c)) + " values, '" +
                                  columns[0].name + "' " + std::to_string(rows));
    std::shared_ptr<arrow::Array> array;
    arrow::Status st;
    if (c.kind == ArrowKind::integer) {
      arrow::Int64Builder b;
      st = b.AppendValues(c.ints);
      if (st.ok()) st = b.Finish(&array);
      fields.push_back(arrow::field(c.name, arrow::int64()));
    } else if (c.kind == ArrowKind::string || c.kind == ArrowKind::binary) {
      std::unique_ptr<arrow::BinaryBuilder> b =
          c.kind == ArrowKind::string ? std::make_unique<arrow::StringBuilder>() : std::make_unique<arrow::BinaryBuilder>();
      for (const std::string& v : c.values)
        if (st.ok()) st = b->Append(v);
      if (st.ok()) st = b->Finish(&array);
      fields.push_back(arrow::field(c.name, c.kind == ArrowKind::string ? arrow::utf8() : arrow::binary()));
    } else {
      throw std::invalid_argument(path + ": column '" + c.name + "': only string, binary and integer columns are written");
    }
    if (!st.ok()) throw std::runtime_error(path + ": column '" + c.name + "': " + st.message());
    arrays.push_back(std::move(array));
  }
  return arrow::RecordBatch::Make(arrow::schema(fields), static_cast<int64_t>(rows), arrays);
}

}  // namespace

struct ArrowFileWriter::Impl {
  std::string path, tmp;
  std::shared_ptr<arrow::io::FileOutputStream> out;
  std::shared_ptr<arrow::ipc::RecordBatchWriter> writer;
  std::shared_ptr<arrow::Schema> schema;
  bool closed = false;

  [[noreturn]] void failed(const arrow::Status& st, const char* doing) const {
    const std::string m = st.message();
    if (m.find("No space left") != std::string::npos || m.find("ENOSPC") != std::string::npos)
      throw std::runtime_error("no space left on the device holding " + tmp + " (while " + doing + "; " + std::to_string(bytes()) +
                               " bytes written of this file): free space or write elsewhere");
    throw std::runtime_error(tmp + ": " + doing + " failed: " + m);
  }
  int64_t bytes() const {
    if (!out) return 0;
    auto t = out->Tell();
    return t.ok() ? *t : 0;
  }
};

ArrowFileWriter::ArrowFileWriter(std::string path) : impl_(std::make_unique<Impl>()) {
  impl_->path = std::move(path);
  impl_->tmp = impl_->path + ".tmp";
  auto out = arrow::io::FileOutputStream::Open(impl_->tmp);
  if (!out.ok()) throw std::runtime_error("cannot write " + impl_->tmp + ": " + out.status().message());
  impl_->out = *out;
}

ArrowFileWriter::~ArrowFileWriter() {
  if (impl_->closed) return;
  if (impl_->out) (void)impl_->out->Close();
  std::error_code ec;
  std::filesystem::remove(impl_->tmp, ec);
}

void ArrowFileWriter::write(const std::vector<ArrowColumn>& columns) {
  Impl& m = *impl_;
  const auto batch = make_batch(m.path, columns);
  if (!m.writer) {
    auto w = arrow::ipc::MakeFileWriter(m.out, batch->schema());
    if (!w.ok()) m.failed(w.status(), "starting the file");
    m.writer = *w, m.schema = batch->schema();
  } else if (!batch->schema()->Equals(*m.schema)) {
    throw std::invalid_argument(m.path + ": a batch of columns " + batch->schema()->ToString() + " after " + m.schema->ToString());
  }
  const arrow::Status st = m.writer->WriteRecordBatch(*batch);
  if (!st.ok()) m.failed(st, "writing a record batch");
}

void ArrowFileWriter::close() {
  Impl& m = *impl_;
  if (!m.writer) throw std::invalid_argument(m.path + ": no record batch written (an Arrow file needs a schema)");
  arrow::Status st = m.writer->Close();
  if (!st.ok()) m.failed(st, "writing the footer");
  const int fd = m.out->file_descriptor();
  if (::fsync(fd) != 0) m.failed(arrow::Status::IOError(std::strerror(errno)), "syncing");
  st = m.out->Close();
  if (!st.ok()) m.failed(st, "closing");
  std::filesystem::rename(m.tmp, m.path);
  m.closed = true;
}

int64_t ArrowFileWriter::bytes() const { return impl_->bytes(); }

void write_arrow_file(const std::string& path, const std::vector<ArrowColumn>& columns) {
  ArrowFileWriter w(path);
  w.write(columns);
  w.close();
}

#else  // built without Arrow

bool arrow_available() { return false; }
std::string arrow_version() { return ""; }

struct ArrowFile::Impl {};
ArrowFile::ArrowFile(const std::string& path) { throw std::runtime_error(path + ": " + arrow_missing_message()); }
ArrowFile::~ArrowFile() = default;
const std::string& ArrowFile::path() const { throw std::logic_error("no Arrow"); }
int64_t ArrowFile::rows() const { return 0; }
std::vector<std::string> ArrowFile::columns() const { return {}; }
int ArrowFile::column(const std::string&) const { return -1; }
ArrowKind ArrowFile::kind(int) const { return ArrowKind::other; }
std::string ArrowFile::type_name(int) const { return ""; }
bool ArrowFile::is_null(int, int64_t) const { return true; }
std::string_view ArrowFile::bytes(int, int64_t) const { return {}; }
int64_t ArrowFile::integer(int, int64_t) const { return 0; }
struct ArrowFileWriter::Impl {};
ArrowFileWriter::ArrowFileWriter(std::string path) { throw std::runtime_error(path + ": " + arrow_missing_message()); }
ArrowFileWriter::~ArrowFileWriter() = default;
void ArrowFileWriter::write(const std::vector<ArrowColumn>&) {}
void ArrowFileWriter::close() {}
int64_t ArrowFileWriter::bytes() const { return 0; }
void write_arrow_file(const std::string& path, const std::vector<ArrowColumn>&) {
  throw std::runtime_error(path + ": " + arrow_missing_message());
}

#endif

}  // namespace flowrun
