// Device work captured once as a CUDA graph and replayed with one launch (run.cuda_graph).
// Header without torch's; CUDA builds only (elsewhere available() is false, the rest throws).
//
//   CapturedWork g(device);                    // owns a stream of its own
//   { CapturedWork::OnStream s(g); f(in); }    // eager steps: on that stream, joined both ways
//   { CapturedWork::OnStream s(g);
//     g.capture([&] { out = f(static_in); }); }  // f's kernels recorded, not run; then replayed once
//   static_in.copy_(next_in);                  // each later step: the new inputs where the capture
//   { CapturedWork::OnStream s(g); g.replay(); }  // read them; every kernel again, one launch
//
// What a capture records is fixed: the kernels, their launch parameters (every scalar the host
// computed) and the addresses of every tensor they read and write. So inputs are copied into
// the tensors the capture read, outputs are read where it wrote them (the tensors it made live
// in the graph's own memory pool until the graph is destroyed), and work whose host-side
// arguments change from step to step (a learning rate from a schedule, a freshly seeded
// generator) cannot be replayed as it is.
//
// Everything that may be captured runs on the graph's own stream, its eager steps too: CUDA
// does not capture the default stream, and autograd queues each parameter's gradient
// accumulation on the stream that was current when the parameter's accumulator was made (its
// first backward, or hooks on it), so a capture on any other stream would find backward
// reaching back to that one. The capture runs in thread-local mode: other threads keep using
// the GPU meanwhile (data readers copying the next batches), and only this thread's unsafe
// calls (a host sync) fail it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>

namespace at {
class Tensor;
}

namespace flowrun {

class CapturedWork {
 public:
  // On CUDA device `device` (its index).
  explicit CapturedWork(int device);
  ~CapturedWork();
  CapturedWork(const CapturedWork&) = delete;
  CapturedWork& operator=(const CapturedWork&) = delete;

  // Built with CUDA (FLOWRUN_CUDA).
  static bool available();

  // While alive, the calling thread's current stream is the graph's own: it starts after the
  // work queued on the previous current stream, which waits for it again at the end.
  class OnStream {
   public:
    explicit OnStream(CapturedWork& w);
    ~OnStream();
    OnStream(const OnStream&) = delete;
    OnStream& operator=(const OnStream&) = delete;

   private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
  };

  // Inside OnStream: captures the device work `work` queues (in place of an earlier capture),
  // then replays it once, so afterwards the work has been done as if `work` had run. Throws with CUDA's reason when it
  // cannot be captured (a host sync inside, a kernel on the legacy default stream, ...).
  void capture(const std::function<void()>& work);
  // Inside OnStream: queues the captured work again.
  void replay();
  bool captured() const;
  // After OnStream: `t`, made on the graph's stream, is used on the current one; its memory is
  // not handed out again before the work queued there so far is done (Tensor::record_stream).
  static void used_here(const at::Tensor& t);
  // Replays in this process so far, the one in capture() included (tests: a graph really ran).
  static int64_t replays();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flowrun
