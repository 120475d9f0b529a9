// GPUDirect RDMA reach: which HCAs may read and write a GPU buffer (NCCL_PTR_CUDA / DMABUF).
//
// NCCL checks the GPU-to-NIC distance against NCCL_NET_GDR_LEVEL only for the NIC it picked
// (the connection's primary); r2ccl's backups are other HCAs, possibly across the CPU
// interconnect, where GPUDirect is slow or broken. So a backup carries a GPU buffer only when
// its PCI path type to the GPU is within the level, computed the way NCCL computes it.
//
// Source of the facts (NCCL 2.30.7, github.com/NVIDIA/nccl commit 5067397):
//  - path types, src/include/graph.h PATH_*: LOC 0, NVL 1, NVB 2, C2C 3, PIX 4, PXB 5, P2C 6,
//    PXN 7, PHB 8, SYS 9; names as src/graph/topo.cc topoPathTypeStr spells them;
//  - NCCL_NET_GDR_LEVEL, src/graph/paths.cc ncclGetLevel: one of the names LOC..SYS
//    (case-sensitive), else a decimal integer of the old numbering (0 LOC, 1 PIX, 2 PXB,
//    3 PHB, 4 SYS, 5 and above SYS); anything else NCCL ignores silently (r2ccl refuses it);
//    ncclTopoCheckGdr: GDR only when distance <= level; default PXB (P2C with
//    NCCL_NET_GDR_C2C=1, which differs only on C2C-attached GPUs, which r2ccl does not detect);
//  - the PCI tree, src/graph/xml.cc ncclTopoGetXmlFromSys: a device's parent is the function
//    two levels up its sysfs path (a switch: upstream port above downstream port), named by
//    its bus id, or the CPU (its NUMA node) when the root complex comes first; paths.cc: a
//    path through one PCI switch is PIX, through several PXB, through a CPU PHB, between CPUs
//    SYS.
//
// Pure functions. Thread-safety: stateless.
#pragma once

#include <string>

#include "r2ccl/params.h"

namespace r2ccl::net::ib {

enum GdrPathType : int {
  kPathLoc = 0,
  kPathNvl = 1,
  kPathNvb = 2,
  kPathC2c = 3,
  kPathPix = 4,
  kPathPxb = 5,
  kPathP2c = 6,
  kPathPxn = 7,
  kPathPhb = 8,
  kPathSys = 9,
};

// "PXB" for kPathPxb; "?" out of range.
const char* gdr_path_name(int type);

// Parses an NCCL_NET_GDR_LEVEL value. `var` names the variable the value came from (for the
// error). Returns false with *err naming it, the value and the accepted form; *out (a
// GdrPathType) is set only on success.
bool parse_gdr_level(const std::string& value, const std::string& var, int* out, std::string* err);

// The process's level from cfg.net_gdr_level, errors naming the variable it came from
// (R2CCL_NET_GDR_LEVEL or its fallback NCCL_NET_GDR_LEVEL); *text (may be nullptr) gets e.g.
// "R2CCL_NET_GDR_LEVEL=PXB (default)" for logs. Checked at init whatever the transport (a
// typo must not pass unnoticed on a host that falls back to TCP). Thread: any.
bool gdr_level_of(const Config& cfg, int* out, std::string* text, std::string* err);

// NCCL's path type between a GPU and a NIC from their realpath'd sysfs PCI paths
// (/sys/devices/pci0000:00/0000:00:01.0/...) and NUMA nodes (-1 unknown): PIX when one PCI
// switch node is the parent of both, PXB when they share a switch node higher up, PHB when
// they meet only at the CPU (same PCI root, or the same NUMA node), SYS otherwise, and also
// when either path is empty or not below a PCI root (a virtual device: no GPUDirect).
int gpu_nic_path_type(const std::string& gpu_pci, int gpu_numa, const std::string& nic_pci,
                      int nic_numa);

}  // namespace r2ccl::net::ib
