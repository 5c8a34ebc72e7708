// Shared macros and types for code compiled by nvcc (device), by NVRTC at run time (device;
// no C++ standard headers there) and by g++ (the overlap._C CPU extension).
#pragma once

#if defined(__CUDACC_RTC__)
// Every fixed-width type of <cstdint>, not just the ones in use today: nvcc (CI's warnings
// check) includes the real header, so a missing one shows only under NVRTC (issue 47: uint8_t,
// uint16_t). `python -m overlap.kernels.compile_check --nvrtc` compiles as the loader does.
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef long long intptr_t;
typedef unsigned long long uintptr_t;
#else
#include <cstdint>
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define OVERLAP_HD __host__ __device__ __forceinline__
#else
#define OVERLAP_HD inline
#endif
