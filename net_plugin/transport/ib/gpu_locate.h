// Where a GPU buffer's GPU sits on the PCI bus, for the GPUDirect reach of backup HCAs
// (transport/ib/gdr.h).
//
// CUDA build (R2CCL_USE_CUDA): the CUDA driver API, loaded at run time (libcuda.so.1, so the
// plugin still loads on hosts without it): cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_
// DEVICE_ORDINAL) names the device that owns the address (CUDA >= 9.2), cuDeviceGet and
// cuDeviceGetPCIBusId its PCI bus id ("0000:3B:00.0"), whose sysfs node is
// /sys/bus/pci/devices/<id in lower case> (a link to /sys/devices/pci.../<id>). Other builds
// cannot tell (the tests give the answer through R2CCL_TEST_HOOKS=gpu_pci=PATH instead).
//
// Thread-safety: any thread (the driver's calls are thread-safe; the library is loaded once).
#pragma once

#include <string>

namespace r2ccl::net::ib {

// The realpath'd sysfs directory of the GPU that owns `ptr` and its numa_node (-1 when the
// file says so or is unreadable). Returns false with *why (the failing call and its error)
// when it cannot be told; *pci_path and *numa are set only on success.
bool gpu_pci_of(const void* ptr, std::string* pci_path, int* numa, std::string* why);

// The numa_node file of a sysfs PCI device directory: its value, or -1 when unreadable.
int pci_numa_node(const std::string& pci_path);

}  // namespace r2ccl::net::ib
