// metrics: logs scalars by name to OUT_DIR/metrics.jsonl and the console, and with
// `tensorboard: true` to OUT_DIR/tb/ (formats/tfevents.hpp).
// Schema: schemas/metrics.yaml. Tests: tests/nodes/metrics_test.cpp, cli.tensorboard_events.
//
// Several ranks: every rank runs the node and reads its inputs at the same log points; one
// all-reduce per log point (on the node's own channel) sums the numeric values and the
// per_second counters, so the line rank 0 writes holds the mean over ranks of each value and
// the job-wide rate of each counter. Strings and bools are rank 0's.
#include <torch/torch.h>
#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "comm.hpp"
#include "common/named_scalars.hpp"
#include "common/tensor_map.hpp"
#include "formats/tfevents.hpp"
#include "parallel/mesh.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

using Clock = std::chrono::steady_clock;

// A scalar input as JSON. Tensors are read from the device here, and only here.
nlohmann::ordered_json scalar_json(const Value& v, const std::string& what) {
  if (const auto* t = v.get_if<torch::Tensor>()) {
    if (!t->defined()) return nullptr;
    if (t->numel() != 1)
      throw std::runtime_error(what + ": expected a scalar, got a tensor of shape " + shape_str(*t));
    if (t->scalar_type() == torch::kBool) return t->item<bool>();
    if (at::isIntegralType(t->scalar_type(), /*includeBool=*/false)) return t->item<int64_t>();
    return t->item<double>();
  }
  if (const auto* d = v.get_if<double>()) return *d;
  if (const auto* f = v.get_if<float>()) return static_cast<double>(*f);
  if (const auto* i = v.get_if<int64_t>()) return *i;
  if (const auto* i = v.get_if<int>()) return *i;
  if (const auto* b = v.get_if<bool>()) return *b;
  if (const auto* s = v.get_if<std::string>()) return *s;
  throw std::runtime_error(what + ": cannot log a " + v.type_name() +
                           " (metrics takes 0-d tensors, double, float, int64, int, bool, string or NamedScalars)");
}

// One input as the fields of the line: {port: scalar}, or for named scalars (a per-prompt
// score) {port/name: number} for each entry, in order.
using Fields = std::vector<std::pair<std::string, nlohmann::ordered_json>>;
void add_fields(const Value& v, const std::string& port, const std::string& what, Fields& fields) {
  if (const auto* named = v.get_if<NamedScalars>()) {
    for (const auto& [name, x] : *named) fields.emplace_back(port + "/" + name, x);
    return;
  }
  fields.emplace_back(port, scalar_json(v, what));
}

// A value that takes part in the mean over ranks: numbers, not bools or strings (nor null).
bool averaged(const nlohmann::ordered_json& j) { return j.is_number(); }

std::string text(const nlohmann::ordered_json& j) {
  if (j.is_number_float()) return fmt::format("{:.4g}", j.get<double>());
  if (j.is_string()) return j.get<std::string>();
  return j.dump();
}

class MetricsNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const RunInfo& run = ctx.run();
    ports_ = ctx.input_ports();
    for (const auto& p : ports_)
      if (p == "step" || p == "time" || p == "steps_per_s")
        throw std::runtime_error(ctx.who() + ": input name '" + p + "' is taken by a field metrics writes itself");
    log_every_ = run.log_every;
    every_run_ = ctx.schedule().periodic();  // a periodic metrics node logs each time it runs
    for (const auto& name : ctx.params().get<std::vector<std::string>>("per_second")) {
      if (std::find(ports_.begin(), ports_.end(), name) == ports_.end())
        throw std::runtime_error(ctx.who() + ": per_second names '" + name + "', which is not one of its inputs");
      sums_[name] = 0.0;
    }
    last_ = run.last_step;
    rank0_ = run.rank == 0;
    t0_ = last_time_ = Clock::now();
    last_logged_ = run.first_step - 1;
    ch_ = comm::Channel::create(ctx.name());  // collective: setup runs in file order on every rank
    // Counters (tokens, images) are per replica: its tp and pp ranks all count the same batch.
    const parallel::Replica replica = parallel::replica_of(run);
    counter_share_ = static_cast<double>(replica.count) / static_cast<double>(run.world);
    if (!rank0_) return;
    std::filesystem::path dir = run.out_dir.empty() ? std::filesystem::path(".") : std::filesystem::path(run.out_dir);
    std::filesystem::create_directories(dir);
    path_ = (dir / "metrics.jsonl").string();
    file_.open(path_, std::ios::out | std::ios::app);
    if (!file_) throw std::runtime_error(ctx.who() + ": cannot open " + path_ + " for writing: " + std::strerror(errno));
    if (ctx.params().get<bool>("tensorboard")) tb_ = tfevents::EventFile::open((dir / "tb").string());
  }

  void run(StepContext& ctx) override {
    const int64_t s = ctx.step();
    // Counters (tokens, images) are summed every step; they are host numbers, no device read.
    for (auto& [name, sum] : sums_) {
      nlohmann::ordered_json v = scalar_json(ctx.in(name), "input '" + name + "' of " + ctx.who());
      if (v.is_number()) sum += v.get<double>();
    }
    // Log points are the same steps on every rank, so every rank joins the all-reduce below.
    if (!every_run_ && !((log_every_ > 0 && s % log_every_ == 0) || s == last_)) return;
    const auto now = Clock::now();
    const double since_start = std::chrono::duration<double>(now - t0_).count();
    const double window = std::chrono::duration<double>(now - last_time_).count();
    const double rate = window > 0 ? static_cast<double>(s - last_logged_) / window : 0.0;
    last_time_ = now;
    last_logged_ = s;

    Fields fields;
    for (const auto& port : ports_) {
      ctx.sync(port);  // on a device: the host waits for this producer, on logged steps only
      add_fields(ctx.in(port), port, "input '" + port + "' of " + ctx.who(), fields);
    }
    std::vector<double> totals = reduce_over_ranks(fields, s);  // counter sums of all ranks, in sums_ order
    if (!rank0_) {
      for (auto& [name, sum] : sums_) sum = 0.0;
      return;
    }

    nlohmann::ordered_json j;  // keys in the order written: step, time, steps_per_s, ports
    j["step"] = s;
    j["time"] = since_start;
    j["steps_per_s"] = rate;
    std::string line = fmt::format("step {}/{}", s, last_);
    for (auto& [key, v] : fields) {
      line += " " + key + " " + text(v);
      j[key] = std::move(v);
    }
    size_t k = 0;
    for (auto& [name, sum] : sums_) {
      const double per_s = window > 0 ? totals[k++] * counter_share_ / window : 0.0;
      j[name + "_per_s"] = per_s;
      line += fmt::format(" {}/s {:.4g}", name, per_s);
      sum = 0.0;
    }
    line += fmt::format(" ({:.1f} steps/s)", rate);
    errno = 0;
    file_ << j.dump() << '\n';
    file_.flush();
    if (!file_)
      throw std::runtime_error(ctx.who() + ": writing " + path_ + " failed: " +
                               (errno ? std::strerror(errno) : "unknown reason") + " (disk full? out_dir removed?)");
    if (tb_) {  // every number of the line as NODE/NAME; flushed so TensorBoard sees the step
      std::vector<std::pair<std::string, double>> scalars;
      for (const auto& [name, v] : j.items())
        if (name != "step" && name != "time" && v.is_number()) scalars.emplace_back(ctx.name() + "/" + name, v.get<double>());
      tb_->scalars(s, scalars);
      tb_->flush();
    }
    spdlog::info("{}", line);
  }

  void finish(ContextBase&) override {
    if (file_.is_open()) file_.close();
    if (tb_) tb_->flush();
    tb_.reset();
  }

 private:
  // One f64 sum over ranks of [value_0, count_0, value_1, count_1, ..., counter sums...]:
  // count_i = 1 where field i holds a number on that rank (the fields line up: every rank has
  // the same ports, and a port's named scalars the same names). Replaces each numeric value by its
  // mean over the ranks that logged a number; returns the counters' job-wide sums. With one
  // rank (count 1) the value is left as it was, so a single process writes it unchanged
  // (an int64 stays an integer, bit for bit).
  std::vector<double> reduce_over_ranks(Fields& fields, int64_t step) {
    const size_t n = fields.size();
    std::vector<double> buf(2 * n + sums_.size(), 0.0);
    for (size_t i = 0; i < n; ++i)
      if (averaged(fields[i].second)) buf[2 * i] = fields[i].second.get<double>(), buf[2 * i + 1] = 1.0;
    size_t k = 2 * n;
    for (const auto& [name, sum] : sums_) buf[k++] = sum;
    comm::allreduce(*ch_, buf.data(), buf.size(), comm::Op::sum, "metrics of step " + std::to_string(step));
    for (size_t i = 0; i < n; ++i) {
      nlohmann::ordered_json& value = fields[i].second;
      const double count = buf[2 * i + 1];
      if (!averaged(value) || count <= 1) continue;  // rank 0's own value (string, bool, or world 1)
      const double mean = buf[2 * i] / count;
      // An integer (a token count) stays one when the ranks' mean is whole.
      if (value.is_number_integer() && std::floor(mean) == mean && std::fabs(mean) < 9.0e15)
        value = static_cast<int64_t>(mean);
      else
        value = mean;
    }
    return std::vector<double>(buf.begin() + static_cast<std::ptrdiff_t>(2 * n), buf.end());
  }

  std::shared_ptr<comm::Channel> ch_;
  std::vector<std::string> ports_;
  int64_t log_every_ = 10, last_ = 0, last_logged_ = 0;
  bool every_run_ = false;
  std::map<std::string, double> sums_;  // per_second inputs, summed since the last log
  double counter_share_ = 1.0;          // replicas / ranks: the counters' sum over ranks counts each replica's once
  bool rank0_ = true;
  Clock::time_point t0_, last_time_;
  std::string path_;
  std::ofstream file_;
  std::shared_ptr<tfevents::EventFile> tb_;  // rank 0 with tensorboard: true
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(metrics, flowrun::MetricsNode)
