// Stream-ordered signal kernels for the CUDA SymmetricWorkspace backend.
//
// Launched with <<<1, 1>>> on the stream that produced (set) or will consume (wait) a chunk, so
// the ordering is expressed on the GPU without a host sync. Compiled at first use by NVRTC
// (overlap/kernels/cuda.py) and compile-checked in CI with nvcc -arch=sm_90a and sm_80.
#include "signal.cuh"

namespace {

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

}  // namespace

// Release-store `value` into a (possibly peer's) flag once all prior work on the stream is done.
extern "C" __global__ void overlap_signal_set(int64_t* flag, int64_t value) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    __threadfence_system();
    overlap::signal_store(flag, value);
  }
}

// Atomically add `value` to a flag (used when several producers count into one slot).
extern "C" __global__ void overlap_signal_add(int64_t* flag, int64_t value) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    __threadfence_system();
    overlap::signal_add(flag, value);
  }
}

// Block the stream until *flag >= phase. Never spins forever: after timeout_ns, or as soon as a
// peer sets this rank's abort word, the kernel records {code, slot, last value, aborting rank + 1}
// in `error` (code 1 = timeout, 2 = aborted) and returns; the host raises SignalTimeout or
// PeerDied naming them at its next check (CudaWorkspace.check_errors()).
extern "C" __global__ void overlap_signal_wait(const int64_t* flag, int64_t phase,
                                               uint64_t timeout_ns, int64_t slot,
                                               const int64_t* abort_word, int64_t* error) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const uint64_t start = globaltimer_ns();
  int64_t v = overlap::signal_load(flag);
  while (!overlap::signal_reached(v, phase)) {
    const int64_t aborted = overlap::signal_load(abort_word);
    const bool late = globaltimer_ns() - start > timeout_ns;
    if (aborted != 0 || late) {
      error[1] = slot;
      error[2] = v;
      error[3] = aborted;
      overlap::signal_store(error, aborted != 0 ? 2 : 1);
      return;
    }
    __nanosleep(128);
    v = overlap::signal_load(flag);
  }
}
