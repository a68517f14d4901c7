// Shared by every .cu of the library: status codes, the device check, launch error mapping.
#pragma once
#include <cuda_runtime.h>
#include "pds_api.h"

namespace pds {

// Which GPUs a translation unit's kernels have code for.
enum class ArchSet { Portable, Sm120Only };

// Status of the current device for a kernel family; never crashes without a GPU.
int check_device(ArchSet arch);

// Maps the last CUDA launch error to a status (and clears it).
inline int launch_status() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? PDS_OK : PDS_LAUNCH_FAILED;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace pds
