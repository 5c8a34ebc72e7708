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
// peer sets this rank's abort word, the kernel records {code, slot, last value, aborting rank + 1,
// peer} in `error` (code 1 = timeout, 2 = aborted; see ErrorWord) and returns. `error` is mapped
// pinned host memory, so the host sees it without a device sync: the op's output is poisoned by
// overlap_poison_if_error further down the stream, and the next op on the workspace raises
// SignalTimeout or PeerDied naming the op, the slot and the peer (CudaWorkspace.raise_pending()).
extern "C" __global__ void overlap_signal_wait(const int64_t* flag, int64_t phase,
                                               uint64_t timeout_ns, int64_t slot,
                                               const int64_t* abort_word, int64_t* error,
                                               int64_t peer) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  // An earlier wait of this workspace already gave up: the op's results are void anyway, so
  // do not spend another timeout here.
  if (overlap::signal_load(error + overlap::kErrCode) != 0) return;
  const uint64_t start = globaltimer_ns();
  int64_t v = overlap::signal_load(flag);
  while (!overlap::signal_reached(v, phase)) {
    const int64_t aborted = overlap::signal_load(abort_word);
    const bool late = globaltimer_ns() - start > timeout_ns;
    if (aborted != 0 || late) {
      if (overlap::signal_load(error + overlap::kErrCode) == 0) {  // keep the first error
        error[overlap::kErrSlot] = slot;
        error[overlap::kErrSeen] = v;
        error[overlap::kErrAborted] = aborted;
        error[overlap::kErrPeer] = peer;
        overlap::signal_store(error + overlap::kErrCode, aborted != 0 ? 2 : 1);
      }
      return;
    }
    __nanosleep(128);
    v = overlap::signal_load(flag);
  }
}

// Poison an op's output if any wait of the workspace gave up: launched on the op's stream after
// its last write, it fills all `nbytes` of `out` with kPoisonByte when the error record is set,
// so a chunk that never arrived yields NaNs, never stale numbers. A no-op (one load per block)
// when nothing failed.
extern "C" __global__ void overlap_poison_if_error(const int64_t* error, uint8_t* out,
                                                   uint64_t nbytes) {
  __shared__ int64_t code;
  if (threadIdx.x == 0) code = overlap::signal_load(error + overlap::kErrCode);
  __syncthreads();
  if (code == 0) return;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nbytes;
       i += stride) {
    out[i] = overlap::kPoisonByte;
  }
}
