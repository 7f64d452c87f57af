#include "support/thread_streams.hpp"

#include <stdexcept>

namespace flowrun::test {

namespace {
thread_local ThreadStreams* tl_streams = nullptr;
thread_local int tl_stream = -1;
}  // namespace

// Happens when the worker of its stream reaches it. The flag is shared with the work queued
// to wait for it: as with a CUDA event, the event object itself may go away before then.
struct Flag {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  void set() {
    std::lock_guard<std::mutex> l(mu);
    done = true;
    cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
  }
};

class ThreadStreams::Event : public DeviceEvent {
 public:
  explicit Event(std::atomic<int>* syncs) : flag(std::make_shared<Flag>()), syncs_(syncs) {}
  void synchronize() const override {
    syncs_->fetch_add(1);
    flag->wait();
  }
  std::shared_ptr<Flag> flag;

 private:
  std::atomic<int>* syncs_;
};

ThreadStreams::ThreadStreams() = default;

ThreadStreams::~ThreadStreams() {
  for (auto& s : streams_) {
    {
      std::lock_guard<std::mutex> l(s->mu);
      s->stop = true;
      s->cv.notify_all();
    }
    s->worker.join();
  }
}

int ThreadStreams::stream(const std::string& name) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = ids_.find(name);
  if (it != ids_.end()) return it->second;
  auto s = std::make_unique<Stream>();
  Stream* raw = s.get();
  s->worker = std::thread([raw] {
    for (;;) {
      std::function<void()> work;
      {
        std::unique_lock<std::mutex> l(raw->mu);
        raw->cv.wait(l, [&] { return raw->stop || !raw->q.empty(); });
        if (raw->q.empty()) return;  // stopping and drained
        work = std::move(raw->q.front());
      }
      work();  // still at the front: synchronize_all's marker waits behind it
      std::lock_guard<std::mutex> l(raw->mu);
      raw->q.pop_front();
    }
  });
  streams_.push_back(std::move(s));
  return ids_[name] = static_cast<int>(streams_.size()) - 1;
}

ThreadStreams::Stream& ThreadStreams::at(int stream) const {
  std::lock_guard<std::mutex> l(mu_);
  return *streams_.at(static_cast<size_t>(stream));
}

void ThreadStreams::enqueue(int stream, std::function<void()> work) {
  Stream& s = at(stream);
  std::lock_guard<std::mutex> l(s.mu);
  s.q.push_back(std::move(work));
  s.cv.notify_all();
}

void ThreadStreams::begin(int stream, const std::string&) {
  if (tl_stream >= 0) throw std::logic_error("ThreadStreams: begin() inside begin() on one thread");
  tl_streams = this;
  tl_stream = stream;
}

void ThreadStreams::end(int) {
  tl_streams = nullptr;
  tl_stream = -1;
}

std::shared_ptr<DeviceEvent> ThreadStreams::record(int stream) {
  auto e = std::make_shared<Event>(&host_syncs_);
  enqueue(stream, [f = e->flag] { f->set(); });
  return e;
}

void ThreadStreams::wait(int stream, const DeviceEvent& event) {
  waits_.fetch_add(1);
  const Event* e = dynamic_cast<const Event*>(&event);
  if (!e) throw std::logic_error("ThreadStreams::wait: an event of another implementation");
  enqueue(stream, [f = e->flag] { f->wait(); });
}

void ThreadStreams::used_on(const Value&, int) { used_on_.fetch_add(1); }

void ThreadStreams::synchronize_all() {
  size_t n;
  {
    std::lock_guard<std::mutex> l(mu_);
    n = streams_.size();
  }
  std::vector<std::shared_ptr<Flag>> marks;
  for (size_t k = 0; k < n; ++k) {
    marks.push_back(std::make_shared<Flag>());
    enqueue(static_cast<int>(k), [f = marks.back()] { f->set(); });
  }
  for (auto& f : marks) f->wait();
}

void ThreadStreams::enqueue_current(std::function<void()> work) {
  if (!tl_streams || tl_stream < 0) throw std::logic_error("ThreadStreams::enqueue_current: no current stream");
  tl_streams->enqueue(tl_stream, std::move(work));
}

ThreadStreams* ThreadStreams::current() { return tl_streams; }

}  // namespace flowrun::test
