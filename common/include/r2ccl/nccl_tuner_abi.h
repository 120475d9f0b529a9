// NCCL tuner-plugin ABI types, v2..v5, written from ../shared/reference/nccl-plugin-abi.md §5
// (our own summary of NVIDIA/nccl src/include/plugin/tuner/tuner_v2.h .. tuner_v5.h
// @v2.28.9-1). No NCCL header is copied: names follow NCCL's so readers can cross-check;
// layouts are pinned by static_asserts against the sizes and offsets the reference gives (LP64).
//
// The cost table handed to getCollInfo (v3+) is ONE contiguous float[numAlgo][numProto] array
// cast to float**, not an array of row pointers (reference §5.3).
// Thread-safety: plain data types, no state.
#pragma once

#include <cstddef>
#include <cstdint>

#include "r2ccl/nccl_abi.h"

extern "C" {

// ncclFunc_t (reference §5.1). Only 0..4 reach getCollInfo.
typedef enum {
  ncclFuncBroadcast = 0,
  ncclFuncReduce = 1,
  ncclFuncAllGather = 2,
  ncclFuncReduceScatter = 3,
  ncclFuncAllReduce = 4,
  ncclFuncSendRecv = 5,
  ncclFuncSend = 6,
  ncclFuncRecv = 7,
} ncclFunc_t;

// Algorithm rows and protocol columns of the cost table (reference §5.1).
#define NCCL_ALGO_UNDEF (-1)
#define NCCL_ALGO_TREE 0
#define NCCL_ALGO_RING 1
#define NCCL_ALGO_COLLNET_DIRECT 2
#define NCCL_ALGO_COLLNET_CHAIN 3
#define NCCL_ALGO_NVLS 4
#define NCCL_ALGO_NVLS_TREE 5
#define NCCL_ALGO_PAT 6
#define NCCL_NUM_ALGORITHMS 7  // 6 in NCCL <= 2.22 (no PAT): always use numAlgo from the call

#define NCCL_PROTO_UNDEF (-1)
#define NCCL_PROTO_LL 0
#define NCCL_PROTO_LL128 1
#define NCCL_PROTO_SIMPLE 2
#define NCCL_NUM_PROTOCOLS 3

#define NCCL_ALGO_PROTO_IGNORE (-1.0f)

// v5 helper structs (reference §5.2).
typedef struct {
  int nNvlDomains;
  int minRanksPerNvlDomain;
  int maxRanksPerNvlDomain;
} ncclNvlDomainInfo_v5_t;

#define NCCL_TUNER_HW_COUNT 3  // NVLINK 0, PCI 1, NET 2
#define NCCL_TUNER_CC_COUNT 4  // Volta, Ampere, Hopper, Blackwell
#define NCCL_TUNER_SCALE_COUNT 3

typedef struct {
  double baseLatencies[NCCL_NUM_ALGORITHMS][NCCL_NUM_PROTOCOLS];                     // us
  double hwLatencies[NCCL_TUNER_HW_COUNT][NCCL_NUM_ALGORITHMS][NCCL_NUM_PROTOCOLS];  // us
  double llMaxBws[NCCL_TUNER_CC_COUNT][NCCL_TUNER_SCALE_COUNT];                      // GB/s
  double perChMaxRingLL128Bws[NCCL_TUNER_CC_COUNT][NCCL_TUNER_SCALE_COUNT];          // GB/s
  double perChMaxTreeLL128Bws[NCCL_TUNER_CC_COUNT][NCCL_TUNER_SCALE_COUNT];          // GB/s
  double perChMaxTreeBws[NCCL_TUNER_CC_COUNT][NCCL_TUNER_SCALE_COUNT];               // GB/s
  double perChMaxNVLSTreeBws[NCCL_TUNER_CC_COUNT][NCCL_TUNER_SCALE_COUNT];           // GB/s
} ncclTunerConstants_v5_t;

// v5: NCCL 2.28+.
typedef struct {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes,
                       ncclDebugLogger_t logFunction, ncclNvlDomainInfo_v5_t* nvlDomainInfo,
                       ncclTunerConstants_v5_t* constants);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int regBuff,
                              int* nChannels);
  ncclResult_t (*finalize)(void* context);
} ncclTuner_v5_t;

// v4: NCCL 2.24-2.27 (accepted by 2.28). ctx is init's LAST argument.
typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void** context);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int regBuff,
                              int* nChannels);
  ncclResult_t (*destroy)(void* context);
} ncclTuner_v4_t;

// v3: NCCL 2.22-2.23 (accepted by 2.24-2.28). No regBuff.
typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void** context);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int* nChannels);
  ncclResult_t (*destroy)(void* context);
} ncclTuner_v3_t;

// v2: NCCL 2.21 (accepted by 2.22-2.28). No cost table: algorithm and protocol are set
// together or not at all.
typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void** context);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int collNetSupport,
                              int nvlsSupport, int numPipeOps, int* algorithm, int* protocol,
                              int* nChannels);
  ncclResult_t (*destroy)(void* context);
} ncclTuner_v2_t;

}  // extern "C"

// Layout pins (reference §5.1-5.2, LP64).
static_assert(sizeof(ncclFunc_t) == 4, "ncclFunc_t is int-sized");
static_assert(sizeof(ncclNvlDomainInfo_v5_t) == 12, "NvlDomainInfo v5");
static_assert(sizeof(ncclTunerConstants_v5_t) == 1152, "TunerConstants v5");
static_assert(offsetof(ncclTunerConstants_v5_t, baseLatencies) == 0, "baseLatencies");
static_assert(offsetof(ncclTunerConstants_v5_t, hwLatencies) == 168, "hwLatencies");
static_assert(offsetof(ncclTunerConstants_v5_t, llMaxBws) == 672, "llMaxBws");
static_assert(offsetof(ncclTunerConstants_v5_t, perChMaxRingLL128Bws) == 768, "ring LL128");
static_assert(offsetof(ncclTunerConstants_v5_t, perChMaxTreeLL128Bws) == 864, "tree LL128");
static_assert(offsetof(ncclTunerConstants_v5_t, perChMaxTreeBws) == 960, "tree");
static_assert(offsetof(ncclTunerConstants_v5_t, perChMaxNVLSTreeBws) == 1056, "NVLS tree");
static_assert(sizeof(ncclTuner_v5_t) == 32, "tuner v5: four slots");
static_assert(sizeof(ncclTuner_v4_t) == 32, "tuner v4: four slots");
static_assert(sizeof(ncclTuner_v3_t) == 32, "tuner v3: four slots");
static_assert(sizeof(ncclTuner_v2_t) == 32, "tuner v2: four slots");
static_assert(offsetof(ncclTuner_v5_t, getCollInfo) == 16, "slot 3");
static_assert(offsetof(ncclTuner_v5_t, finalize) == 24, "slot 4");
