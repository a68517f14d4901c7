// Host-only entries: status names, device capability, scale-factor layout arithmetic.
// Built once (no device code) so these work on machines without a GPU.
#include "common.cuh"

namespace pds {

int check_device(ArchSet arch) {
  int major = 0, minor = 0;
  int status = pds_device_capability(&major, &minor);
  if (status != PDS_OK) return status;
  if (arch == ArchSet::Sm120Only) return (major == 12 && minor == 0) ? PDS_OK : PDS_UNSUPPORTED_ARCH;
  // Portable kernels carry SASS for sm_80 (runs on 8.x), sm_90a and sm_120a.
  bool ok = major == 8 || (major == 9 && minor == 0) || (major == 12 && minor == 0);
  return ok ? PDS_OK : PDS_UNSUPPORTED_ARCH;
}

}  // namespace pds

extern "C" {

PDS_API const char* pds_status_name(int status) {
  switch (status) {
    case PDS_OK: return "ok";
    case PDS_NO_DEVICE: return "no CUDA device";
    case PDS_UNSUPPORTED_ARCH: return "unsupported GPU architecture";
    case PDS_INVALID_ARGUMENT: return "invalid argument";
    case PDS_WORKSPACE_TOO_SMALL: return "workspace too small";
    case PDS_CANNOT_IMPLEMENT: return "CUTLASS cannot implement this problem";
    case PDS_LAUNCH_FAILED: return "CUDA launch failed";
    default: return "unknown status";
  }
}

PDS_API int pds_abi_version(void) { return 1; }

PDS_API int pds_device_capability(int* major, int* minor) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return PDS_NO_DEVICE;
  }
  if (cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return PDS_NO_DEVICE;
  }
  return PDS_OK;
}

// Layout (Sm1xxBlockScaledConfig<16>, K-major): 512-byte atoms of 128 rows x 4 scale columns.
PDS_API int64_t pds_nvfp4_sf_bytes(int64_t rows, int64_t k) {
  if (rows <= 0 || k <= 0 || k % 16 != 0) return -1;
  int64_t row_tiles = (rows + 127) / 128;
  int64_t col_tiles = (k / 16 + 3) / 4;
  return row_tiles * col_tiles * 512;
}

}  // extern "C"
