#include "support/test_nodes.hpp"

#include <chrono>
#include <memory>
#include <random>
#include <stdexcept>
#include <thread>

#include "registry.hpp"

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
  int64_t sleep_us_ = 0, jitter_us_ = 0;

 public:
  void setup(SetupContext& c) override {
    sleep_us_ = c.params().get<int64_t>("sleep_us");
    jitter_us_ = c.params().get<int64_t>("jitter_us");
  }
  void run(StepContext& c) override {
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
  r.add(R"(type: t_stream
doc: emits items on a stream
outputs: { items: { kind: stream, type: int } }
params:
  count: { type: int, default: 4, min: 0 }
  sleep_ms: { type: int, default: 0, min: 0 })",
        [] { return std::make_unique<Stream>(); }, origin);
  r.add(R"(type: t_sink
doc: consumes a stream
inputs: { items: { kind: stream, type: int } }
outputs: { out: { kind: value, type: int } }
params: { sleep_ms: { type: int, default: 0, min: 0 } })",
        [] { return std::make_unique<Sink>(); }, origin);
}

}  // namespace flowrun::test
