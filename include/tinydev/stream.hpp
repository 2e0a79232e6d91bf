// tinydev/stream.hpp: streams and events, for many concurrent requests on one device
// (docs/serving.md).
//
// A Stream is an independent in-order queue of work on a device, with its own worker queues and
// timeline: work on different streams runs concurrently and is ordered only through Events, as
// CUDA streams and events, c10 streams or IREE queues with semaphores. Every operation returns at
// once (or, on an idle stream, after running the work on the caller: StreamOptions) with the
// Event its work completes. Compiled::create_stream makes one; the device's default queue (the
// plain Buffer and Program calls) is not a Stream and is ordered with streams only through
// synchronize (the device's waits for every stream) or events.
//
// Ownership and lifetime: a Stream keeps every Buffer, Program and kernel argument its queued
// work uses alive until that work finished, and lets them go on a later call on the stream (or
// its synchronize) from the calling thread. copyin captures the host bytes before it returns;
// copyout writes into host memory the caller keeps alive until its Event completed. Dropping a
// Stream waits for its work (at most StreamOptions::drop_timeout, TINYDEV_WAIT_TIMEOUT_MS by default). An Event
// stays valid after its stream is gone.
// Thread safety: a Stream may be used from several threads (its operations are serialized); an
// Event is a value, usable from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tinydev/buffer.hpp"
#include "tinydev/compile.hpp"
#include "tinydev/graph.hpp"
#include "tinydev/signal.hpp"
#include "tinydev/export.hpp"

TINYDEV_API_BEGIN

namespace tinydev {

class Compiled;

struct StreamOptions {
  // CPU devices: work given to an idle stream (nothing of it queued or running) runs on the
  // calling thread, as a direct Program call on an idle device does, and its Event is complete
  // when the call returns: a worker hand-off costs microseconds that a small request feels. Set
  // false to have every operation return at once and run on the stream's worker, overlapping the
  // caller's own work. CUDA: kernels always run on the GPU; an idle stream's copies run on the
  // caller (through the staging ring), a busy one's are queued, and with false every copy is
  // queued (a copyin's bytes are still read before it returns; docs/serving.md).
  bool run_inline_when_idle = true;
  // How long dropping the Stream waits for its queued work. Past it, a warning is logged, what the
  // work uses is kept for the life of the process (never freed under it), and the stream's lane
  // is taken back only once that work finished without a fault; until then it counts toward the
  // device's limit. By default TINYDEV_WAIT_TIMEOUT_MS (30 s), as it is when the options are made.
  std::chrono::milliseconds drop_timeout = default_wait_timeout();
};

// A point in a stream's work: complete once the stream's timeline signal reached `value`.
class Event {
 public:
  Event() = default;  // an event that is complete from the start
  // Complete once `signal` reaches `value`. `source` names it in messages (nullptr: the signal);
  // it must outlive the event (streams pass their lane's name: lanes live as long as the process).
  Event(Signal signal, std::uint64_t value, const std::string* source = nullptr)
      : signal_(signal), value_(value), source_(source) {}

  // Whether the work before the event finished. DeviceFault (naming the failure) if it failed.
  bool query() const;
  // Blocks until the work finished. Timeout naming the stream and the value after `timeout`;
  // DeviceFault if the work failed.
  void wait(std::chrono::milliseconds timeout = default_wait_timeout()) const;

  const Signal& signal() const noexcept { return signal_; }  // empty for a complete-from-the-start event
  std::uint64_t value() const noexcept { return value_; }
  // "LLVM stream 2 at 17".
  std::string describe() const;

 private:
  Signal signal_;
  std::uint64_t value_ = 0;
  const std::string* source_ = nullptr;
};

class Stream {
 public:
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // "LLVM stream 2".
  virtual const std::string& name() const noexcept = 0;
  // The device whose memory and kernels this stream uses.
  virtual Compiled& device() const noexcept = 0;

  // Copies src into `dest` (exactly dest.nbytes()); the bytes are read before this returns.
  virtual Event copyin(const Buffer& dest, std::span<const std::byte> src) = 0;
  // Copies `src` (exactly src.nbytes()) into `dest`, which must stay alive until the Event completed.
  virtual Event copyout(std::span<std::byte> dest, const Buffer& src) = 0;
  // Runs `program` (loaded on device()) on buffers of device() and int32 values.
  virtual Event launch(const std::shared_ptr<Program>& program, std::span<const Buffer> buffers,
                       std::span<const std::int32_t> values = {}, const LaunchParams& params = {}) = 0;
  // A graph that replays on this stream (replay it with replay below).
  virtual std::unique_ptr<Graph> create_graph(std::vector<GraphNode> nodes) = 0;
  // Replays a graph made by this stream's create_graph with these inputs (kept alive until done).
  virtual Event replay(Graph& graph, std::span<const Buffer> inputs, std::span<const std::int32_t> variables = {}) = 0;
  // Copies src into dest (same size; dest may live on another device of the same backend), after
  // this stream's work and dest's device's default queue.
  virtual Event transfer(const Buffer& dest, const Buffer& src) = 0;

  // Later work on this stream waits for `event` (from any stream or device whose signals this
  // device reaches; other events are waited for here, on the host).
  virtual void wait(const Event& event) = 0;
  // An event completed once everything given to this stream so far finished.
  virtual Event record() = 0;
  // Waits for everything given to this stream so far (and lets go of what its work kept alive).
  virtual void synchronize(std::chrono::milliseconds timeout = default_wait_timeout()) = 0;

  // Sticky faults, as Compiled::fault and Compiled::recover, for this stream alone.
  virtual std::string fault() const = 0;
  virtual std::string recover(std::chrono::milliseconds timeout = default_wait_timeout()) = 0;

 protected:
  Stream() = default;
};

}  // namespace tinydev

TINYDEV_API_END
