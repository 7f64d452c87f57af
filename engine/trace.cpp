#include "trace.hpp"

#include <tbb/task_arena.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace flowrun {

Tracer::Tracer(int pid) : pid_(pid), t0_(std::chrono::steady_clock::now()) {}

double Tracer::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0_).count();
}

double Tracer::us(std::chrono::steady_clock::time_point t) const {
  return std::chrono::duration<double, std::micro>(t - t0_).count();
}

static int thread_id() {
  int i = tbb::this_task_arena::current_thread_index();
  return i < 0 ? 999 : i;  // 999: a thread outside the executor's arena (main, background writers)
}

void Tracer::span(const std::string& name, const std::string& cat, double t0_us, double t1_us, int64_t step,
                  const std::string& stream) {
  if (!record_) return;
  std::lock_guard<std::mutex> l(mu_);
  events_.push_back({'X', name, cat, stream, t0_us, t1_us - t0_us, thread_id(), step, 0});
}

void Tracer::node_span(const std::string& node, const std::string& type, double t0_us, double t1_us, int64_t step,
                       const std::string& stream, TraceDeps deps) {
  std::lock_guard<std::mutex> l(mu_);
  if (tally_) {
    auto& [us, runs] = tally_us_[node];
    us += t1_us - t0_us;
    ++runs;
  }
  if (record_)
    events_.push_back({'X', node, type, stream, t0_us, t1_us - t0_us, thread_id(), step, 0, true, std::move(deps)});
}

Tracer::Busiest Tracer::take_busiest() {
  std::lock_guard<std::mutex> l(mu_);
  Busiest b;
  for (const auto& [node, t] : tally_us_)
    if (t.first > b.us) b = {node, t.first, t.second};
  tally_us_.clear();
  return b;
}

std::vector<TraceSpan> Tracer::node_spans() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<TraceSpan> out;
  for (const auto& e : events_)
    if (e.node) out.push_back({e.name, e.cat, e.stream, e.step, e.ts, e.ts + e.dur, e.tid, e.deps});
  return out;
}

void Tracer::counter(const std::string& name, double value) {
  if (!record_) return;
  double t = now_us();
  std::lock_guard<std::mutex> l(mu_);
  events_.push_back({'C', name, "counter", "", t, 0, 0, -1, value});
}

static std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o;
}

void Tracer::write(const std::string& path) const {
  std::lock_guard<std::mutex> l(mu_);
  std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  const std::string tmp = path + ".tmp";
  {
    std::ofstream o(tmp);
    if (!o) throw std::runtime_error("trace: cannot write " + tmp);
    o << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
    bool first = true;
    for (const auto& e : events_) {
      if (!first) o << ",\n";
      first = false;
      char buf[96];
      if (e.ph == 'X') {
        std::snprintf(buf, sizeof buf, "\"ts\":%.3f,\"dur\":%.3f", e.ts, e.dur);
        o << "{\"ph\":\"X\",\"name\":\"" << esc(e.name) << "\",\"cat\":\"" << esc(e.cat) << "\",\"pid\":" << pid_
          << ",\"tid\":" << e.tid << "," << buf << ",\"args\":{\"step\":" << e.step;
        if (!e.stream.empty()) o << ",\"stream\":\"" << esc(e.stream) << "\"";
        if (e.node) {  // what it waited for: [["data",5],["opt",4]]
          o << ",\"deps\":[";
          for (size_t k = 0; k < e.deps.size(); ++k)
            o << (k ? "," : "") << "[\"" << esc(e.deps[k].first) << "\"," << e.deps[k].second << "]";
          o << "]";
        }
        o << "}}";
      } else {
        std::snprintf(buf, sizeof buf, "\"ts\":%.3f", e.ts);
        o << "{\"ph\":\"C\",\"name\":\"" << esc(e.name) << "\",\"pid\":" << pid_ << "," << buf
          << ",\"args\":{\"value\":" << e.value << "}}";
      }
    }
    o << "\n]}\n";
    if (!o.flush()) {
      std::filesystem::remove(tmp);
      throw std::runtime_error("trace: writing " + tmp + " failed (disk full?)");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {  // e.g. a folder of that name: no .tmp left behind
    std::filesystem::remove(tmp);
    throw std::runtime_error("trace: cannot write " + path + ": " + ec.message());
  }
}

}  // namespace flowrun
