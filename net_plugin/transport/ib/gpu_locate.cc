#include "transport/ib/gpu_locate.h"

#include <limits.h>
#include <stdlib.h>

#include <cctype>
#include <cstdlib>
#include <fstream>

#ifdef R2CCL_USE_CUDA
#include <cuda.h>
#include <dlfcn.h>

#include <mutex>
#endif

namespace r2ccl::net::ib {

int pci_numa_node(const std::string& pci_path) {
  std::ifstream f(pci_path + "/numa_node");
  long v = -1;
  if (!(f >> v) || v < -1 || v > (1 << 20)) return -1;
  return static_cast<int>(v);
}

#ifdef R2CCL_USE_CUDA
namespace {

struct CudaDriver {
  CUresult (*init)(unsigned int) = nullptr;
  CUresult (*pointer_get_attribute)(void*, CUpointer_attribute, CUdeviceptr) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_get_pci_bus_id)(char*, int, CUdevice) = nullptr;
  std::string error;  // why the driver is unusable, "" when it is
};

const CudaDriver& cuda_driver() {
  static CudaDriver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      d.error = std::string("dlopen libcuda.so.1: ") + dlerror();
      return;
    }
    d.init = reinterpret_cast<decltype(d.init)>(dlsym(h, "cuInit"));
    d.pointer_get_attribute =
        reinterpret_cast<decltype(d.pointer_get_attribute)>(dlsym(h, "cuPointerGetAttribute"));
    d.device_get = reinterpret_cast<decltype(d.device_get)>(dlsym(h, "cuDeviceGet"));
    d.device_get_pci_bus_id =
        reinterpret_cast<decltype(d.device_get_pci_bus_id)>(dlsym(h, "cuDeviceGetPCIBusId"));
    if (!d.init || !d.pointer_get_attribute || !d.device_get || !d.device_get_pci_bus_id)
      d.error =
          "libcuda.so.1 lacks cuInit, cuPointerGetAttribute, cuDeviceGet or "
          "cuDeviceGetPCIBusId";
    else if (const CUresult r = d.init(0); r != CUDA_SUCCESS)
      d.error = "cuInit: CUresult " + std::to_string(static_cast<int>(r));
  });
  return d;
}

}  // namespace

bool gpu_pci_of(const void* ptr, std::string* pci_path, int* numa, std::string* why) {
  const CudaDriver& d = cuda_driver();
  if (!d.error.empty()) {
    *why = d.error;
    return false;
  }
  int ordinal = -1;
  CUresult r = d.pointer_get_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                       reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) {
    *why = "cuPointerGetAttribute(DEVICE_ORDINAL): CUresult " + std::to_string(static_cast<int>(r));
    return false;
  }
  CUdevice dev = 0;
  char bus[64] = {};
  if ((r = d.device_get(&dev, ordinal)) != CUDA_SUCCESS ||
      (r = d.device_get_pci_bus_id(bus, sizeof(bus), dev)) != CUDA_SUCCESS) {
    *why = "cuDeviceGet/cuDeviceGetPCIBusId of device " + std::to_string(ordinal) + ": CUresult " +
           std::to_string(static_cast<int>(r));
    return false;
  }
  std::string id = bus;
  for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const std::string link = "/sys/bus/pci/devices/" + id;
  char real[PATH_MAX];
  if (!realpath(link.c_str(), real)) {
    *why = "GPU " + std::to_string(ordinal) + " (" + id + "): no " + link;
    return false;
  }
  *pci_path = real;
  *numa = pci_numa_node(*pci_path);
  return true;
}
#else
bool gpu_pci_of(const void* ptr, std::string* pci_path, int* numa, std::string* why) {
  (void)ptr;
  (void)pci_path;
  (void)numa;
  *why = "this build has no CUDA (USE_CUDA=OFF)";
  return false;
}
#endif

}  // namespace r2ccl::net::ib
