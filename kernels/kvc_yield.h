// kvcascade extension ops: CPU copies that let a woken latency-sensitive thread run.
//
// A store or load through the page cache (tmpfs, buffered I/O), a checksum, and the host copy
// that stands in for a GPU copy engine keep a CPU busy for milliseconds per job. When the event
// loop or the scheduler thread wakes up and every core runs such a copy, the kernel's scheduler
// often leaves it waiting until the copying thread's slice ends (up to a 4 ms tick on a HZ=250
// kernel without preemption): measured with scheduler tracepoints on 2 cores, the loop's lag
// spikes of 2-5 ms were almost all time spent runnable, waiting for a CPU. A copying thread
// therefore calls sched_yield() after every kYieldBytes it moved: a no-op when nothing else
// waits for its CPU, otherwise the waiting thread runs first (about 150 us of copying later).

#ifndef KVCASCADE_KVC_YIELD_H_
#define KVCASCADE_KVC_YIELD_H_

#include <sched.h>

#include <cstddef>

namespace kvc {

constexpr size_t kYieldBytes = size_t{1} << 20;

// Counts the bytes one thread moved and yields the CPU after every kYieldBytes.
class Yielder {
 public:
  void moved(size_t bytes) {
    since_ += bytes;
    if (since_ >= kYieldBytes) {
      since_ = 0;
      sched_yield();
    }
  }

 private:
  size_t since_ = 0;
};

}  // namespace kvc

#endif  // KVCASCADE_KVC_YIELD_H_
