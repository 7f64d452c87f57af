#include "support/test_nodes.hpp"

#include <chrono>
#include <memory>
#include <random>
#include <stdexcept>
#include <thread>

#include "comm.hpp"
#include "registry.hpp"
#include "support/thread_streams.hpp"

namespace flowrun::test {

Recorder& Recorder::get() {
  static Recorder r;
  return r;
}
void Recorder::clear() {
  std::lock_guard<std::mutex> l(mu_);
  ev_.clear();
  violations_ = 0;
  t0_ = std::chrono::steady_clock::now();
}
void Recorder::add(Event e) {
  e.thread = std::this_thread::get_id();
  std::lock_guard<std::mutex> l(mu_);
  ev_.push_back(std::move(e));
}
std::vector<Event> Recorder::events() const {
  std::lock_guard<std::mutex> l(mu_);
  return ev_;
}
double Recorder::now_ms() const {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
}

namespace {

void sleep_us(int64_t us) {
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

// Sleep `base` µs plus up to `jitter` µs, different per (node, step) but reproducible.
int64_t jittered(const std::string& node, int64_t step, int64_t base, int64_t jitter) {
  if (jitter <= 0) return base;
  std::seed_seq seq(node.begin(), node.end());
  std::mt19937 g(seq);
  g.discard(static_cast<unsigned long long>(step) % 97);
  return base + static_cast<int64_t>(g() % static_cast<uint32_t>(jitter + 1));
}

class Source : public Node {
  int64_t k_ = 0, sleep_ms_ = 0;

 public:
  void setup(SetupContext& c) override {
    k_ = c.params().get<int64_t>("k");
    sleep_ms_ = c.params().get<int64_t>("sleep_ms");
  }
  void run(StepContext& c) override {
    double t0 = Recorder::get().now_ms();
    sleep_us(sleep_ms_ * 1000);
    int64_t v = c.step() * 1000 + k_;
    c.out("out", v);
    Recorder::get().add({c.name(), c.step(), "out", v, t0, Recorder::get().now_ms()});
  }
};

class Op : public Node {
  int64_t sleep_us_ = 0, jitter_us_ = 0, fail_at_ = 0;

 public:
  void setup(SetupContext& c) override {
    sleep_us_ = c.params().get<int64_t>("sleep_us");
    jitter_us_ = c.params().get<int64_t>("jitter_us");
    if (c.params().has("fail_at")) fail_at_ = c.params().get<int64_t>("fail_at");
  }
  void run(StepContext& c) override {
    if (c.step() == fail_at_) throw std::runtime_error("boom (test failure)");
    double t0 = Recorder::get().now_ms();
    sleep_us(jittered(c.name(), c.step(), sleep_us_, jitter_us_));
    int64_t sum = 0;
    if (c.connected("in"))
      for (const Value* v : c.in_all("in")) sum += v->as<int64_t>("input 'in'");
    int64_t out = c.step() * 1000 + sum % 1000;
    c.out("out", out);
    Recorder::get().add({c.name(), c.step(), "out", out, t0, Recorder::get().now_ms()});
  }
};

class CellOwner : public Node {
 public:
  void setup(SetupContext& c) override { c.own_state("cell", std::make_shared<Cell>()); }
  void run(StepContext&) override {}
};

class Access : public Node {
  bool write_;
  int64_t sleep_us_ = 0, jitter_us_ = 0;

 public:
  explicit Access(bool write) : write_(write) {}
  void setup(SetupContext& c) override {
    sleep_us_ = c.params().get<int64_t>("sleep_us");
    jitter_us_ = c.params().get<int64_t>("jitter_us");
  }
  void run(StepContext& c) override {
    Cell& cell = c.state_as<Cell>("s");
    Recorder& r = Recorder::get();
    double t0 = r.now_ms();
    if (write_) {
      if (cell.writers.fetch_add(1) != 0 || cell.readers.load() != 0) r.violation();
    } else {
      cell.readers.fetch_add(1);
      if (cell.writers.load() != 0) r.violation();
    }
    int64_t seen = cell.version;
    sleep_us(jittered(c.name(), c.step(), sleep_us_, jitter_us_));
    if (cell.version != seen) r.violation();  // someone wrote while we held it
    if (write_) {
      cell.version = seen + 1;
      cell.writers.fetch_sub(1);
    } else {
      cell.readers.fetch_sub(1);
    }
    int64_t sum = 0;
    if (c.connected("in"))
      for (const Value* v : c.in_all("in")) sum += v->as<int64_t>("input 'in'");
    c.out("out", c.step() * 1000 + (sum + seen) % 1000);
    r.add({c.name(), c.step(), write_ ? "write" : "read", seen, t0, r.now_ms()});
  }
};

class Fail : public Node {
  int64_t at_ = 0;

 public:
  void setup(SetupContext& c) override { at_ = c.params().get<int64_t>("at"); }
  void run(StepContext& c) override {
    if (c.step() == at_) throw std::runtime_error("boom (test failure)");
  }
};

// Opens a channel over `group` in setup (its schema declares dp only).
class Channel : public Node {
  std::shared_ptr<comm::Channel> ch_;

 public:
  void setup(SetupContext& c) override {
    const auto group = c.params().get<std::string>("group");
    ch_ = group == "world" ? comm::Channel::create(c.name()) : comm::Channel::create_split(c.name(), 0, 0, group);
  }
  void run(StepContext&) override {}
};

class Stream : public Node {
  int count_ = 0;
  int64_t sleep_ms_ = 0;

 public:
  void setup(SetupContext& c) override {
    count_ = c.params().get<int>("count");
    sleep_ms_ = c.params().get<int64_t>("sleep_ms");
  }
  void run(StepContext& c) override {
    Recorder& r = Recorder::get();
    for (int i = 0; i < count_; ++i) {
      double t0 = r.now_ms();
      sleep_us(sleep_ms_ * 1000);
      r.add({c.name(), c.step(), "emit", i, t0, r.now_ms()});
      c.emit("items", static_cast<int64_t>(i), i, count_);
    }
  }
};

class Sink : public Node {
  int64_t seen_ = 0, sleep_ms_ = 0;

 public:
  void setup(SetupContext& c) override { sleep_ms_ = c.params().get<int64_t>("sleep_ms"); }
  void on_item(StepContext& c, const std::string&, const Value& v, int, int) override {
    Recorder& r = Recorder::get();
    double t0 = r.now_ms();
    sleep_us(sleep_ms_ * 1000);
    ++seen_;
    r.add({c.name(), c.step(), "item", v.as<int64_t>(), t0, r.now_ms()});
  }
  void run(StepContext& c) override {
    Recorder::get().add({c.name(), c.step(), "run", seen_, Recorder::get().now_ms(), Recorder::get().now_ms()});
    c.out("out", seen_);
    seen_ = 0;
  }
};

// ---- device-stream test nodes: their "kernels" run on ThreadStreams' stream threads ----

// Queue `work` on the node's current device stream, or run it now without device streams.
void on_device(std::function<void()> work) {
  if (ThreadStreams::current())
    ThreadStreams::enqueue_current(std::move(work));
  else
    work();
}

constexpr int64_t kPoison = -1;  // what a buffer holds while its producer's kernel runs

class DevSource : public Node {
  int64_t k_ = 0, sleep_us_ = 0;

 public:
  void setup(SetupContext& c) override {
    k_ = c.params().get<int64_t>("k");
    sleep_us_ = c.params().get<int64_t>("sleep_us");
  }
  void run(StepContext& c) override {
    auto buf = std::make_shared<DevBuf>();
    buf->v = kPoison;
    const int64_t v = c.step() * 1000 + k_, us = sleep_us_;
    on_device([buf, v, us] {
      sleep_us(us);
      buf->v = v;
    });
    c.out("out", buf);
  }
};

// Checks, on its stream, that its input buffer holds its step's finished value; on steps that
// are multiples of `host_every` it also reads it on the host after sync("in").
class DevCheck : public Node {
  int64_t host_every_ = 0, sleep_us_ = 0;

 public:
  void setup(SetupContext& c) override {
    host_every_ = c.params().get<int64_t>("host_every");
    sleep_us_ = c.params().get<int64_t>("sleep_us");
  }
  void run(StepContext& c) override {
    auto buf = c.in<std::shared_ptr<DevBuf>>("in");
    const int64_t step = c.step(), us = sleep_us_;
    const std::string name = c.name();
    on_device([buf, step, us, name] {
      Recorder& r = Recorder::get();
      const double t0 = r.now_ms();
      const int64_t v = buf->v;
      if (v == kPoison || v / 1000 != step) r.violation();
      sleep_us(us);
      r.add({name, step, "device", v, t0, r.now_ms()});
    });
    if (host_every_ > 0 && step % host_every_ == 0) {
      c.sync("in");
      const int64_t v = buf->v;
      Recorder& r = Recorder::get();
      if (v == kPoison || v / 1000 != step) r.violation();
      r.add({name, step, "host", v, r.now_ms(), r.now_ms()});
    }
  }
};

class DevCellOwner : public Node {
 public:
  void setup(SetupContext& c) override { c.own_state("cell", std::make_shared<DevCell>()); }
  void run(StepContext&) override {}
};

// t_dev_write poisons the cell, "computes" for sleep_us, then stores version + 1; t_dev_read
// reads it at the start and the end of its kernel and records what it saw.
class DevAccess : public Node {
  bool write_;
  int64_t sleep_us_ = 0;

 public:
  explicit DevAccess(bool write) : write_(write) {}
  void setup(SetupContext& c) override { sleep_us_ = c.params().get<int64_t>("sleep_us"); }
  void run(StepContext& c) override {
    DevCell* cell = &c.state_as<DevCell>("s");
    const int64_t step = c.step(), us = sleep_us_;
    const std::string name = c.name();
    const bool write = write_;
    on_device([cell, step, us, name, write] {
      Recorder& r = Recorder::get();
      const double t0 = r.now_ms();
      const int64_t seen = cell->version;
      if (seen == kPoison) r.violation();  // a write's kernel is still running
      if (write) cell->version = kPoison;
      sleep_us(us);
      if (write) {
        cell->version = seen + 1;
      } else if (cell->version != seen) {
        r.violation();  // written while we read
      }
      r.add({name, step, write ? "write" : "read", seen, t0, r.now_ms()});
    });
  }
};

// Emits `count` buffers on stream `items`, each written by a kernel queued just before it.
class DevStream : public Node {
  int count_ = 0;
  int64_t sleep_us_ = 0;

 public:
  void setup(SetupContext& c) override {
    count_ = c.params().get<int>("count");
    sleep_us_ = c.params().get<int64_t>("sleep_us");
  }
  void run(StepContext& c) override {
    for (int i = 0; i < count_; ++i) {
      auto buf = std::make_shared<DevBuf>();
      buf->v = kPoison;
      const int64_t v = c.step() * 1000 + i, us = sleep_us_;
      on_device([buf, v, us] {
        sleep_us(us);
        buf->v = v;
      });
      c.emit("items", buf, i, count_);
    }
  }
};

class DevSink : public Node {
 public:
  void on_item(StepContext& c, const std::string&, const Value& v, int index, int) override {
    auto buf = v.as<std::shared_ptr<DevBuf>>();
    const int64_t step = c.step();
    const std::string name = c.name();
    on_device([buf, step, index, name] {
      Recorder& r = Recorder::get();
      const int64_t got = buf->v;
      if (got != step * 1000 + index) r.violation();
      r.add({name, step, "item", got, r.now_ms(), r.now_ms()});
    });
  }
  void run(StepContext&) override {}
};

const char* kSleepParams = R"(
  sleep_us: { type: int, default: 0, min: 0, doc: "sleep per step" }
  jitter_us: { type: int, default: 0, min: 0, doc: "extra random sleep per step, reproducible" })";

}  // namespace

void register_test_nodes() {
  static bool done = false;
  if (done) return;
  done = true;
  Registry& r = Registry::global();
  const std::string origin = "tests";
  r.add(R"(type: t_source
doc: test source
outputs: { out: { kind: value, type: int } }
params:
  k: { type: int, default: 0 }
  sleep_ms: { type: int, default: 0, min: 0 })",
        [] { return std::make_unique<Source>(); }, origin);
  const std::string op_ports = R"(
inputs: { in: { kind: value, type: int, many: true, optional: true } }
outputs: { out: { kind: value, type: int } }
params:)";
  r.add("type: t_op\ndoc: test op" + op_ports + kSleepParams, [] { return std::make_unique<Op>(); }, origin);
  r.add("type: t_par\nstateless: true\ndoc: stateless test op" + op_ports + kSleepParams,
        [] { return std::make_unique<Op>(); }, origin);
  r.add("type: t_math\ncompute: true\ndoc: test op of a compute type (runs on the compute thread)" + op_ports +
            kSleepParams + "\n  fail_at: { type: int, default: 0, min: 0, doc: \"throw at this step (0: never)\" }",
        [] { return std::make_unique<Op>(); }, origin);
  r.add(R"(type: t_cell
doc: owns a test state cell
outputs: { cell: { kind: state, access: none, type: cell } })",
        [] { return std::make_unique<CellOwner>(); }, origin);
  const std::string access_tail = R"(
  in: { kind: value, type: int, many: true, optional: true }
outputs: { out: { kind: value, type: int } }
params:)";
  r.add("type: t_read\ndoc: reads a cell\ninputs:\n  s: { kind: state, access: read, type: cell }" + access_tail +
            kSleepParams,
        [] { return std::make_unique<Access>(false); }, origin);
  r.add("type: t_write\ndoc: writes a cell\ninputs:\n  s: { kind: state, access: write, type: cell }" + access_tail +
            kSleepParams,
        [] { return std::make_unique<Access>(true); }, origin);
  r.add(R"(type: t_fail
doc: throws at step `at`
inputs: { in: { kind: value, type: int, many: true, optional: true } }
params: { at: { type: int, default: 1 } })",
        [] { return std::make_unique<Fail>(); }, origin);
  r.add(R"(type: t_channel
doc: opens a channel over `group` in setup
collectives: { group: dp, doc: "nothing is exchanged" }
params: { group: { type: string, default: dp } })",
        [] { return std::make_unique<Channel>(); }, origin);
  r.add(R"(type: t_stream
doc: emits items on a stream
outputs: { items: { kind: stream, type: int } }
params:
  count: { type: int, default: 4, min: 0 }
  sleep_ms: { type: int, default: 0, min: 0 })",
        [] { return std::make_unique<Stream>(); }, origin);
  r.add(R"(type: t_dev_source
doc: device test source (a buffer written by a kernel on its stream)
outputs: { out: { kind: value, type: buf } }
params:
  k: { type: int, default: 0 }
  sleep_us: { type: int, default: 0, min: 0 })",
        [] { return std::make_unique<DevSource>(); }, origin);
  r.add(R"(type: t_dev_check
doc: checks its input buffer on its stream; on the host every host_every steps
inputs: { in: { kind: value, type: buf } }
params:
  host_every: { type: int, default: 0, min: 0 }
  sleep_us: { type: int, default: 0, min: 0 })",
        [] { return std::make_unique<DevCheck>(); }, origin);
  r.add(R"(type: t_dev_cell
doc: owns a device test cell
outputs: { cell: { kind: state, access: none, type: devcell } })",
        [] { return std::make_unique<DevCellOwner>(); }, origin);
  r.add(R"(type: t_dev_read
doc: reads a device cell on its stream
inputs: { s: { kind: state, access: read, type: devcell } }
params: { sleep_us: { type: int, default: 0, min: 0 } })",
        [] { return std::make_unique<DevAccess>(false); }, origin);
  r.add(R"(type: t_dev_write
doc: writes a device cell on its stream
inputs: { s: { kind: state, access: write, type: devcell } }
params: { sleep_us: { type: int, default: 0, min: 0 } })",
        [] { return std::make_unique<DevAccess>(true); }, origin);
  r.add(R"(type: t_dev_stream
doc: emits buffers written on its stream
outputs: { items: { kind: stream, type: buf } }
params:
  count: { type: int, default: 4, min: 0 }
  sleep_us: { type: int, default: 0, min: 0 })",
        [] { return std::make_unique<DevStream>(); }, origin);
  r.add(R"(type: t_dev_sink
doc: checks stream items on its stream
inputs: { items: { kind: stream, type: buf } })",
        [] { return std::make_unique<DevSink>(); }, origin);
  r.add(R"(type: t_sink
doc: consumes a stream
inputs: { items: { kind: stream, type: int } }
outputs: { out: { kind: value, type: int } }
params: { sleep_ms: { type: int, default: 0, min: 0 } })",
        [] { return std::make_unique<Sink>(); }, origin);
}

}  // namespace flowrun::test
