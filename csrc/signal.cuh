// Signal flags of a symmetric workspace: one int64 counter per slot, monotonically increasing.
//
// Protocol (the same on CPU shared memory and on GPU userbuffers):
//   producer: write the payload, then signal_store(flag, phase) with *release* order, so the
//             payload is visible before the flag;
//   consumer: spin until signal_load(flag) >= phase with *acquire* order, then read the payload.
// Counters only grow, so a waiter never misses a signal that was overwritten by a later phase and
// nobody has to reset flags between ops (resetting races with a late reader).
#pragma once
#include "common.cuh"

namespace overlap {

#if defined(__CUDA_ARCH__)
// System scope: the peer that writes the flag may be another GPU (NVLink / PCIe P2P) or the host.
__device__ __forceinline__ int64_t signal_load(const int64_t* flag) {
  int64_t v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
  return v;
}
__device__ __forceinline__ void signal_store(int64_t* flag, int64_t v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(flag), "l"(v) : "memory");
}
__device__ __forceinline__ int64_t signal_add(int64_t* flag, int64_t v) {
  int64_t old;
  asm volatile("atom.add.acq_rel.sys.global.u64 %0, [%1], %2;" : "=l"(old) : "l"(flag), "l"(v) : "memory");
  return old;
}
#else
inline int64_t signal_load(const int64_t* flag) { return __atomic_load_n(flag, __ATOMIC_ACQUIRE); }
inline void signal_store(int64_t* flag, int64_t v) { __atomic_store_n(flag, v, __ATOMIC_RELEASE); }
inline int64_t signal_add(int64_t* flag, int64_t v) {
  return __atomic_fetch_add(flag, v, __ATOMIC_ACQ_REL);
}
#endif

// True once the flag has reached `phase`; the comparison every waiter uses.
OVERLAP_HD bool signal_reached(int64_t flag_value, int64_t phase) { return flag_value >= phase; }

// Every byte of a poisoned output: 0xFF makes each fp32, bf16 and fp16 element a NaN, so numbers
// computed from a chunk that never arrived can never pass for a result.
constexpr uint8_t kPoisonByte = 0xFF;

// Layout of a workspace's error record, written by a wait kernel that gives up.
enum ErrorWord : int { kErrCode = 0, kErrSlot = 1, kErrSeen = 2, kErrAborted = 3, kErrPeer = 4,
                       kErrWords = 5 };

}  // namespace overlap
