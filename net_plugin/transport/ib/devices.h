// HCAs: the verbs devices and ports r2ccl uses, one NCCL device per (HCA, port).
//
// Everything that decides is pure and unit-tested over plain structs: the R2CCL_IB_HCA spec
// (NCCL_IB_HCA's syntax), RoCE GID selection, the IB speed encodings, PCI distance and the
// backup-rail order. HcaSet::discover() is the thin part that asks libibverbs (only through
// the VerbsApi table) and sysfs, and feeds those functions.
//
// Sources of protocol facts: rdma-core's <infiniband/verbs.h> (struct and enum values), the
// InfiniBand Architecture Specification vol. 1 (PortInfo LinkSpeedActive / LinkWidthActive
// encodings, GID format), RFC 4291 (IPv4-mapped ::ffff:a.b.c.d and link-local fe80::/10
// addresses), the kernel's sysfs ABI for infiniband devices
// (ports/<p>/gid_attrs/types/<i>: "IB/RoCE v1" or "RoCE v2"; <pci device>/numa_node) and
// NCCL's documented NCCL_IB_HCA / NCCL_IB_GID_INDEX / NCCL_IB_ROCE_VERSION_NUM /
// NCCL_IB_ADDR_FAMILY / NCCL_IB_ADDR_RANGE syntax.
//
// Thread-safety: the free functions are pure (no shared state) and may be called from any
// thread. HcaSet: discover() from init; hcas()/any_active() from any thread while nobody
// runs refresh_port(); refresh_port() is serialised by the caller (the background thread).
#pragma once

#include <infiniband/verbs.h>
#include <sys/socket.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "r2ccl/params.h"
#include "transport/ib/verbs_api.h"

namespace r2ccl::net::ib {

// ---------------------------------------------------------------------------------------
// R2CCL_IB_HCA (else NCCL_IB_HCA): comma-separated entries NAME[:PORT]. A leading '^' on the
// whole string excludes the listed ones instead of selecting them; a leading '=' (after an
// optional '^') makes names match exactly, otherwise each NAME is a prefix ("mlx5" matches
// mlx5_0 and mlx5_1). PORT omitted = any port. Empty (or only "^" / "=") = everything.
struct HcaSpec {
  bool exclude = false;
  bool exact = false;
  struct Entry {
    std::string name;
    int port = -1;  // 1..255, or -1 for any port
  };
  std::vector<Entry> entries;
};

// Parses `s`. Returns false with *err (naming R2CCL_IB_HCA, the bad entry and the accepted
// form) on an empty name, a PORT that is not a decimal 1..255, or a stray '^'/'=' inside an
// entry; *out is set only on success. Empty entries (",,") are ignored.
bool parse_hca_spec(const std::string& s, HcaSpec* out, std::string* err);

// Whether port `port` (1-based) of device `dev` is selected by `spec`.
bool hca_spec_selects(const HcaSpec& spec, const std::string& dev, int port);

// ---------------------------------------------------------------------------------------
// RoCE GID selection.
constexpr int kGidTypeIb = 0;
constexpr int kGidTypeRoceV1 = 1;
constexpr int kGidTypeRoceV2 = 2;

struct GidEntry {
  int index;
  uint8_t raw[16];  // network byte order, as in union ibv_gid
  int type;         // kGidTypeIb, kGidTypeRoceV1 or kGidTypeRoceV2
  // The GID belongs to another netdev than the port's own (a VLAN device such as eth0.100, or
  // another upper device): sysfs ports/<p>/gid_attrs/ndevs/<i> names a netdev other than
  // that of GID 0 (the kernel's default GID, always on the port's own netdev). False when
  // the file is unreadable (older kernels, containers).
  bool other_netdev = false;
};

struct GidPrefs {
  int forced_index = -1;   // R2CCL_IB_GID_INDEX; -1 = select automatically
  int roce_version = 2;    // R2CCL_IB_ROCE_VERSION_NUM: 1 or 2
  int family = AF_INET;    // R2CCL_IB_ADDR_FAMILY: AF_INET or AF_INET6
  bool has_range = false;  // R2CCL_IB_ADDR_RANGE set
  // The range's address as a 16-byte GID: an IPv4 range is stored IPv4-mapped
  // (::ffff:a.b.c.d), so range_prefix then counts bits of the IPv4 address (0..32) and
  // applies to raw[12..15] of IPv4-mapped GIDs only; an IPv6 range prefix (0..128) applies to
  // all 16 bytes.
  uint8_t range_addr[16] = {};
  int range_prefix = 0;
  int range_family = AF_INET;  // family of the range: AF_INET or AF_INET6
};

// Reads the GID preferences from the config: ib_gid_index, ib_roce_version (1 or 2),
// ib_addr_family ("AF_INET" or "AF_INET6"; empty = AF_INET) and ib_addr_range ("ADDR/PREFIX",
// IPv4 with PREFIX 0..32 or IPv6 with PREFIX 0..128; empty = no range). Returns false with
// *err naming the variable, the value and the accepted form; *out is set only on success.
bool parse_gid_prefs(const Config& c, GidPrefs* out, std::string* err);

// Chooses a GID of one RoCE port's table. Returns the chosen entry's `index`, or -1 when no
// entry fits. The exact order:
//  1. p.forced_index >= 0 and an entry with that index exists with a non-zero GID: that one
//     (nothing else is checked). Otherwise automatic selection as below (the caller warns).
//  2. Candidates: entries whose GID is not all zeros (an empty table slot) and, when a range
//     is set, that lie in the range (a filter, not a preference: R2CCL_IB_ADDR_RANGE says
//     the GID must lie in that subnet; an IPv4 range holds only IPv4-mapped GIDs). No
//     candidate: -1.
//  3. Link-local GIDs (fe80::/10) are used only when no other candidate exists.
//  4. Among the rest, lexicographically: type == p.roce_version first (when no candidate
//     has that version, the other version is accepted, as NCCL does); then family ==
//     p.family (IPv4 = IPv4-mapped ::ffff:a.b.c.d, anything else is IPv6); then GIDs of the
//     port's own netdev before those of VLAN (or other upper) netdevs; then the lowest
//     index. The netdev rule is r2ccl's: NCCL 2.30.7 (ncclIbGetGidIndex) ignores netdevs
//     and takes the lowest index, so two hosts whose tables hold their entries in another
//     order (GIDs are added as addresses appear) could pick GIDs on different VLANs, which
//     cannot reach each other. To run on a VLAN, name its subnet with R2CCL_IB_ADDR_RANGE
//     (a filter, rule 2) or its index with R2CCL_IB_GID_INDEX.
int select_gid(const std::vector<GidEntry>& table, const GidPrefs& p);

// ---------------------------------------------------------------------------------------
// Partition keys. R2CCL_IB_PKEY names a P_Key *value* (0x0001..0xffff, hex "0x8001" or
// decimal); its index is looked up in each port's P_Key table (ibv_query_pkey). Its NCCL
// fallback NCCL_IB_PKEY keeps NCCL's meaning, a P_Key *index* used as is (NCCL 2.30.7,
// src/transport/net_ib/connect.cc: qp pkey_index = NCCL_IB_PKEY, default 0). Neither set:
// index 0, as NCCL.
struct PkeyPref {
  enum Kind { kDefault, kValue, kIndex } kind = kDefault;
  uint32_t value = 0;  // kValue: the P_Key (host order); kIndex: the table index
};

// Reads the preference from c.ib_pkey and c.sources ("R2CCL_IB_PKEY from NCCL_IB_PKEY" means
// the value is NCCL's index). Returns false with *err naming the variable, the value and the
// accepted form (a P_Key 0x0001..0xffff whose low 15 bits are not 0, or an index 0..65535);
// *out is set only on success.
bool parse_pkey_pref(const Config& c, PkeyPref* out, std::string* err);

// The index of `pkey` (host order) in a port's P_Key table (host order, by index): an entry
// equal to it, else the first entry of the same partition (low 15 bits; the membership bit
// 0x8000 differs), else -1. IBA vol. 1 10.9: bit 15 of a P_Key is full (1) or limited (0)
// membership, the low 15 bits name the partition.
int find_pkey_index(const std::vector<uint16_t>& table, uint16_t pkey);

// "(0xffff, 0x8001)": a P_Key table for messages.
std::string pkey_table_text(const std::vector<uint16_t>& table);

// "::ffff:10.1.0.1", "fe80::248a:703:49:d4f0" (inet_ntop's IPv6 text form).
std::string gid_to_string(const uint8_t raw[16]);

// ---------------------------------------------------------------------------------------
// Port speed in Mbps from ibv_port_attr's active_speed and active_width (IB spec PortInfo
// encodings; per-lane nominal data rate as NCCL reports it):
//   speed 1 SDR 2500, 2 DDR 5000, 4 QDR 10000, 8 FDR10 10000, 16 FDR 14000, 32 EDR 25000,
//         64 HDR 50000, 128 NDR 100000, 256 XDR 200000 (XDR does not fit the classic uint8_t
//         active_speed; it is accepted here for callers with the extended field);
//   width 1 = 1x, 2 = 4x, 4 = 8x, 8 = 12x, 16 = 2x.
// Returns lanes * lane rate (EDR 4x = 100000), or 0 for an unknown speed or width (the
// caller then reports 10000, NCCL's rule for a speed <= 0).
int port_speed_mbps(uint32_t active_speed, uint8_t active_width);

// ---------------------------------------------------------------------------------------
struct HcaInfo {
  std::string name;     // e.g. mlx5_0
  int port = 0;         // 1-based
  int link_layer = 0;   // IBV_LINK_LAYER_INFINIBAND or IBV_LINK_LAYER_ETHERNET
  bool active = false;  // port state IBV_PORT_ACTIVE at discovery (or last refresh)
  uint16_t lid = 0;
  int gid_index = -1;  // selected (RoCE) or 0 (IB); -1 if no usable GID
  int gid_type = -1;   // kGidType* of the selected GID, -1 if none
  uint8_t gid[16] = {};
  int speed_mbps = 10000;      // from port attrs (or R2CCL_SPEED_MBPS), 10000 if unknown
  std::string pci_path;        // realpath of <ibdev_path>/device, "" if none (virtual)
  int numa = -1;               // from <pci_path>/numa_node, -1 unknown
  uint64_t guid = 0;           // node GUID, host order
  int active_mtu = 0;          // enum ibv_mtu
  uint8_t port_flags = 0;      // ibv_port_attr.flags (IBV_QPF_GRH_REQUIRED)
  uint16_t pkey_index = 0;     // the QPs' P_Key index (R2CCL_IB_PKEY / NCCL_IB_PKEY)
  uint16_t pkey = 0;           // the P_Key at that index (host order), 0 if unknown
  ibv_context* ctx = nullptr;  // opened, owned by the HcaSet
  ibv_pd* pd = nullptr;        // allocated, owned by the HcaSet
  // The device's incarnation: 0 at discovery, + 1 each time it is reopened after a fatal
  // error (HcaSet::reopen). QPs, CQs and MRs made on an older incarnation's ctx/pd are dead.
  uint32_t epoch = 0;
};

// PCI distance between two realpath'd sysfs device paths such as
// /sys/devices/pci0000:00/0000:00:01.0/0000:0b:00.0 (the root complex "pciDDDD:BB", then
// bridges, then the function):
//   0  same function (identical non-empty paths);
//   1  same PCIe switch or device: below the same bridge of the root complex (they share at
//      least the first component after the root, i.e. the root port, and so the switch
//      tree hanging off it; this includes two functions of one card and siblings that share
//      everything but the last component);
//   2  same root complex only;
//   3  different root complexes, or a path that is empty or not below a PCI root.
int pci_distance(const std::string& pci_path_a, const std::string& pci_path_b);

// Every entry of `hcas` other than `primary` (pass only the usable ones), nearest first:
// same PCIe switch or card (pci_distance 0 or 1, smaller first), then same root complex or
// same known NUMA node, then the rest; within a group by pci_distance, then by index.
// Uses only the pci_path and numa fields.
std::vector<int> backup_order(const std::vector<HcaInfo>& hcas, int primary);

// One line for the init banner, e.g.
// "mlx5_0:1 RoCEv2 gid[3]=::ffff:10.1.0.1 100000 Mbps numa 0" or
// "mlx5_1:1 IB lid 7 gid[0]=fe80::... 200000 Mbps numa 1 (down)".
std::string describe(const HcaInfo& h);

// ---------------------------------------------------------------------------------------
// The HCA ports of this process. Owns one ibv_context and one PD per device (shared by that
// device's ports); the destructor deallocates the PDs and closes the devices (everything
// made on them, QPs, CQs and MRs, must be gone first).
class HcaSet {
 public:
  ~HcaSet();
  HcaSet(const HcaSet&) = delete;
  HcaSet& operator=(const HcaSet&) = delete;

  // Opens every device, queries every port, keeps the ports selected by cfg.ib_hca whose
  // link layer is InfiniBand or Ethernet (UNSPECIFIED, from drivers older than the field,
  // counts as InfiniBand); ports that are down are kept with active=false (they may come up
  // later). Devices are ordered by name (digit runs compared as numbers), ports ascending.
  // A device that fails to open or to allocate a PD is skipped with a WARN.
  // Returns false with *err on a bad spec, bad GID preferences, or a P_Key (R2CCL_IB_PKEY) or
  // index (NCCL_IB_PKEY) missing from a selected port's table. Returns true with an empty
  // list when the library lists no device. cfg.speed_mbps > 0 overrides every port's speed.
  // Thread: init only.
  static bool discover(const VerbsApi* v, const Config& cfg, std::unique_ptr<HcaSet>* out,
                       std::string* err);

  const std::vector<HcaInfo>& hcas() const { return hcas_; }
  bool any_active() const;

  // Re-reads port i's state (active, lid, MTU, speed), and re-selects the GID (after
  // IBV_EVENT_GID_CHANGE or a port coming up). *active_now (may be nullptr) gets the port
  // state; a failed port query counts as down. Returns true if gid or gid_index changed.
  // Thread: the caller serialises (background thread) against other readers of hcas().
  bool refresh_port(int i, bool* active_now);

  // After IBV_EVENT_DEVICE_FATAL on port i's device (a firmware reset): opens the device
  // again (listed under the same name with the same node GUID once its reset is done),
  // allocates a new PD and moves every port of the device onto them (ctx, pd, epoch + 1,
  // port state and GID re-read). The dead context and PD stay open, retired, until the set
  // is destroyed: QPs, CQs and MRs made on them may still exist (their owners destroy them
  // when they rebuild). Returns false with *why when the device is not back yet (not listed,
  // cannot be opened, no PD); nothing changes then. Thread: as refresh_port.
  bool reopen(int i, std::string* why);

 private:
  HcaSet() = default;
  struct Device {
    ibv_context* ctx = nullptr;
    ibv_pd* pd = nullptr;
  };
  // Reads the port's GID table (RoCE) or GID 0 (IB) and fills gid/gid_index/gid_type.
  void load_gid(size_t i);
  // Fills pkey_index/pkey of port i from prefs; false with *err when the port's table lacks
  // the P_Key (or the index).
  bool load_pkey(size_t i, std::string* err);

  const VerbsApi* v_ = nullptr;
  GidPrefs prefs_;
  PkeyPref pkey_pref_;
  int speed_override_ = 0;
  std::vector<Device> devices_;
  std::vector<Device> retired_;  // dead incarnations (reopen), closed by the destructor
  std::vector<HcaInfo> hcas_;
  std::vector<std::string> ibdev_paths_;  // per hca: the device's sysfs directory
};

}  // namespace r2ccl::net::ib
