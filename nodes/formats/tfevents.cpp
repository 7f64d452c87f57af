// TensorBoard event files: the record framing, the Event protos written out by hand, and one
// shared file per folder and process. The format is described in tfevents.hpp.
#include "formats/tfevents.hpp"

#include "formats/crc32c.hpp"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <stdexcept>

namespace flowrun::tfevents {
namespace {

// ---- CRC32C (Castagnoli), table-driven, reflected polynomial 0x82f63b78 ----------------------

// ---- protocol buffer encoding: the three wire types used ------------------------------------
// A field key is (field number << 3) | wire type: 0 varint, 1 fixed64, 2 length-delimited,
// 5 fixed32.

void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void key(std::string& out, int field, int wire) { varint(out, (static_cast<uint64_t>(field) << 3) | wire); }

void little_endian(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void field_varint(std::string& out, int field, uint64_t v) {
  key(out, field, 0);
  varint(out, v);
}

void field_double(std::string& out, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  key(out, field, 1);
  little_endian(out, bits, 8);
}

void field_float(std::string& out, int field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  key(out, field, 5);
  little_endian(out, bits, 4);
}

void field_bytes(std::string& out, int field, const std::string& bytes) {
  key(out, field, 2);
  varint(out, bytes.size());
  out += bytes;
}

// Event { wall_time = 1; step = 2; ... } with `rest` (already encoded fields) appended.
std::string event(double wall_time, int64_t step, const std::string& rest) {
  std::string e;
  field_double(e, 1, wall_time);
  if (step != 0) field_varint(e, 2, static_cast<uint64_t>(step));  // int64: two's complement varint
  return e + rest;
}

std::string summary_field(const std::string& values) {  // Event.summary = 5
  std::string s;
  field_bytes(s, 5, values);
  return s;
}

std::string io_error(const std::string& what, const std::string& path) {
  return what + " " + path + " failed: " + (errno ? std::strerror(errno) : "unknown reason") +
         " (disk full? out_dir removed?)";
}

}  // namespace

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = flowrun::crc32c(data, n);  // formats/crc32c.hpp
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string record(const std::string& data) {
  std::string r;
  little_endian(r, data.size(), 8);
  little_endian(r, masked_crc32c(r.data(), 8), 4);
  r += data;
  little_endian(r, masked_crc32c(data.data(), data.size()), 4);
  return r;
}

std::string file_version_event(double wall_time) {
  std::string rest;
  field_bytes(rest, 3, "brain.Event:2");
  return event(wall_time, 0, rest);
}

std::string scalars_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;  // Summary.Value { tag = 1; simple_value = 2 }
    field_bytes(value, 1, tag);
    field_float(value, 2, static_cast<float>(v));
    field_bytes(summary, 1, value);
  }
  return event(wall_time, step, summary_field(summary));
}

std::string image_event(double wall_time, int64_t step, const std::string& tag, const std::string& png, int height,
                        int width, int channels) {
  std::string image;  // Summary.Image
  field_varint(image, 1, static_cast<uint64_t>(height));
  field_varint(image, 2, static_cast<uint64_t>(width));
  field_varint(image, 3, static_cast<uint64_t>(channels));
  field_bytes(image, 4, png);
  std::string value;  // Summary.Value { tag = 1; image = 4 }
  field_bytes(value, 1, tag);
  field_bytes(value, 4, image);
  std::string summary;
  field_bytes(summary, 1, value);
  return event(wall_time, step, summary_field(summary));
}

std::string text_event(double wall_time, int64_t step, const std::string& tag, const std::string& text) {
  std::string plugin, metadata, dim, shape, tensor, value, summary;
  field_bytes(plugin, 1, "text");     // PluginData.plugin_name
  field_bytes(metadata, 1, plugin);   // SummaryMetadata.plugin_data
  field_varint(dim, 1, 1);            // TensorShapeProto.Dim.size
  field_bytes(shape, 2, dim);         // TensorShapeProto.dim
  field_varint(tensor, 1, 7);         // TensorProto.dtype = DT_STRING
  field_bytes(tensor, 2, shape);      // TensorProto.tensor_shape: [1]
  field_bytes(tensor, 8, text);       // TensorProto.string_val
  field_bytes(value, 1, tag);
  field_bytes(value, 8, tensor);
  field_bytes(value, 9, metadata);
  field_bytes(summary, 1, value);
  return event(wall_time, step, summary_field(summary));
}

double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// ---- EventFile -------------------------------------------------------------------------------

std::shared_ptr<EventFile> EventFile::open(const std::string& dir) {
  static std::mutex registry_mu;
  static std::map<std::string, std::weak_ptr<EventFile>> open_files;  // by folder
  static std::atomic<int> made{0};
  std::lock_guard<std::mutex> lock(registry_mu);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw std::runtime_error("cannot make the TensorBoard folder " + dir + ": " + ec.message());
  const std::string key = std::filesystem::weakly_canonical(dir).string();
  if (auto f = open_files[key].lock()) return f;
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const auto seconds = static_cast<long long>(wall_time_now());
  // The process-wide count keeps two files of one process in one second apart (tests).
  const std::string name = "events.out.tfevents." + std::to_string(seconds) + "." + host + "." +
                           std::to_string(getpid()) + "." + std::to_string(made++);
  std::shared_ptr<EventFile> f(new EventFile((std::filesystem::path(dir) / name).string()));
  open_files[key] = f;
  return f;
}

EventFile::EventFile(std::string path) : path_(std::move(path)) {
  errno = 0;
  f_ = std::fopen(path_.c_str(), "wb");
  if (!f_) throw std::runtime_error(io_error("opening the TensorBoard event file", path_));
  write(file_version_event(wall_time_now()));
  flush();
}

EventFile::~EventFile() {
  if (f_) std::fclose(f_);
}

void EventFile::write(const std::string& event) {
  const std::string r = record(event);
  errno = 0;
  if (std::fwrite(r.data(), 1, r.size(), f_) != r.size()) throw std::runtime_error(io_error("writing", path_));
}

void EventFile::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::lock_guard<std::mutex> lock(mu_);
  write(scalars_event(wall_time_now(), step, values));
}

void EventFile::image(int64_t step, const std::string& tag, const std::string& png, int height, int width,
                      int channels) {
  std::lock_guard<std::mutex> lock(mu_);
  write(image_event(wall_time_now(), step, tag, png, height, width, channels));
}

void EventFile::text(int64_t step, const std::string& tag, const std::string& markdown) {
  std::lock_guard<std::mutex> lock(mu_);
  write(text_event(wall_time_now(), step, tag, markdown));
}

void EventFile::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  errno = 0;
  if (std::fflush(f_) != 0) throw std::runtime_error(io_error("writing", path_));
}

}  // namespace flowrun::tfevents
