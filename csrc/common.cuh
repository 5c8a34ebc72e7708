// Shared macros for code compiled both by nvcc (device) and g++ (the overlap._C CPU extension).
#pragma once

#if defined(__CUDACC__)
#define OVERLAP_HD __host__ __device__ __forceinline__
#else
#define OVERLAP_HD inline
#endif
