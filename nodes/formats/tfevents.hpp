// TensorBoard event files, torch-free: what `metrics` (scalars), `sampler` (PNG grids) and
// `generate` (its completions as text) write
// to OUT_DIR/tb/ with `tensorboard: true`. Test: tests/formats/tfevents_test.cpp; read back by
// an independent reader in tests/tools/read_tfevents.py (cli.tensorboard_events).
//
// The file is a sequence of records (TFRecord framing):
//
//   uint64 length          little endian
//   uint32 masked_crc32c(length's 8 bytes)
//   byte   data[length]    a serialized tensorflow.Event protocol buffer
//   uint32 masked_crc32c(data)
//
// masked_crc32c(x) = rotate_right(crc32c(x), 15) + 0xa282ead8 (mod 2^32), crc32c the Castagnoli
// CRC (polynomial 0x82f63b78 reflected). The first record is an Event with file_version
// "brain.Event:2". The Event fields written (tensorflow/core/util/event.proto, summary.proto):
//
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; Image image = 4; TensorProto tensor = 8;
//             SummaryMetadata metadata = 9; }
//   Image   { int32 height = 1; int32 width = 2; int32 colorspace = 3; bytes encoded_image_string = 4; }
//   SummaryMetadata { PluginData plugin_data = 1 { string plugin_name = 1; } }   ("text" for text)
//   TensorProto { DataType dtype = 1 (DT_STRING: 7); TensorShapeProto tensor_shape = 2
//                 { Dim dim = 2 { int64 size = 1; } }; bytes string_val = 8; }
//
// encoded by hand below (varints, fixed64/fixed32 little endian, length-delimited fields).
// TensorBoard reads every file whose name contains "tfevents" in a run folder.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace flowrun::tfevents {

uint32_t masked_crc32c(const void* data, size_t n);
std::string record(const std::string& data);  // the framing above around one serialized Event

// Serialized Event protos.
std::string file_version_event(double wall_time);
std::string scalars_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, double>>& values);
// png: the encoded image; channels 1 (gray), 3 (RGB) or 4 (RGBA) as TensorBoard's colorspace.
std::string image_event(double wall_time, int64_t step, const std::string& tag, const std::string& png, int height,
                        int width, int channels);

// text: Markdown, which TensorBoard's text plugin renders (a table of prompts and completions).
std::string text_event(double wall_time, int64_t step, const std::string& tag, const std::string& text);

double wall_time_now();  // seconds since the Unix epoch

// One event file of this process in a folder: events.out.tfevents.<unix seconds>.<host>.<pid>,
// made (with the folder) by the first open() of that folder and shared by every caller after,
// so the metrics nodes and the sampler of one run write one file. Thread-safe. Writes are
// buffered; flush() makes them visible (metrics flushes on each logged step). Errors throw
// std::runtime_error naming the file and the reason.
class EventFile {
 public:
  static std::shared_ptr<EventFile> open(const std::string& dir);
  ~EventFile();
  EventFile(const EventFile&) = delete;
  EventFile& operator=(const EventFile&) = delete;

  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  void image(int64_t step, const std::string& tag, const std::string& png, int height, int width, int channels);
  void text(int64_t step, const std::string& tag, const std::string& markdown);
  void flush();
  const std::string& path() const { return path_; }

 private:
  explicit EventFile(std::string path);
  void write(const std::string& event);  // with mu_ held
  std::mutex mu_;
  std::string path_;
  std::FILE* f_ = nullptr;
};

}  // namespace flowrun::tfevents
