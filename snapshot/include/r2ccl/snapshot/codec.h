// The delta codec of the snapshot client (issue 6): one registered state buffer (parameters,
// optimizer state) turned into a chain of self-describing frames, and back.
//
//  - A chain starts with a BASE (the whole buffer) and continues with DELTAs against the
//    previous snapshot; a new base every `base_every` (K) snapshots bounds the chain, so a
//    restore needs the latest base and at most K-1 deltas.
//  - Lossless (the default): the XOR of each element's bit pattern with the previous snapshot,
//    byte-shuffled by element size within chunks of kChunkElems elements (all byte 0s, then all
//    byte 1s, ...: unchanged high bytes become long zero runs), then zstd. Exact, NaN payloads
//    included.
//  - Lossy dynamic range (opt-in, FP16/BF16 only): the delta in float32, per block of
//    kLossyBlockElems elements a float32 scale (max|delta| / 127) and one int8 code per
//    element, then zstd. The encoder computes deltas against the buffer AS THE DECODER WILL
//    HAVE RECONSTRUCTED IT (closed loop) and updates that reconstruction exactly as the
//    decoder does, so quantization errors never accumulate across snapshots; it reports the
//    largest |current - reconstructed| of each snapshot. Bases are always lossless.
//
// Frame layout (all integers little-endian), kFrameHeaderBytes = 64, then the payload:
//    0 u32 magic kFrameMagic ("R2SF")    4 u16 version (1)      6 u16 header bytes (64)
//    8 u8  dtype    9 u8 codec   10 u8 flags (bit 0: base; bit 1: no payload CRC; bit 2:
//                                  tagged chunks, lossless deltas only; others 0)
//   11 u8 reserved (0)
//   12 u32 chunk_elems (shuffle / lossy chunk, elements; a multiple of 256 in [256, 2^24])
//   16 u64 seq (this snapshot)  24 u64 base_seq (the base its chain starts from; == seq for a base)
//   32 u64 elem_count  40 u64 raw_size (bytes = elem_count * element size)
//   48 u64 payload_size (bytes after the header)   56 u32 CRC-32 of the payload (zlib), or 0
//   with flag bit 1: the frame travels in a container whose checksum covers all of it (the
//   snapshot's shard checksum, XXH3-64), so the producer hashes it once, not twice
//   60 u32 CRC-32 of header bytes 0..59
// The payload is exactly one zstd frame whose declared content size is
//   lossless: raw_size (per chunk of m elements: byte k of element i at offset k*m + i);
//   lossy:    per chunk of m elements: ceil(m/256) float32 scales, then m int8 codes;
//   lossless with flag bit 2 (tagged chunks; the encoder's deltas): from 4 to raw_size + 4
//   bytes per chunk, or unknown (the encoder does not know it before the last chunk; a
//   decoder accepts no zstd window larger than the buffer + 4 bytes per 256 elements). Per chunk of
//   m elements a u32 tag, then
//     tag 0xFFFFFFFF (dense): the chunk as above, m * ES shuffled bytes;
//     tag n (sparse, n * (4 + ES) <= m * ES): the n elements that changed, in increasing
//       order, as 4 byte planes of n u32 gaps (gap j = index j - index j-1 - 1, with
//       index -1 = -1; byte b of gap j at b*n + j), then ES byte planes of their XOR
//       values (byte k of value j at k*n + j). Indices are within the chunk (< m).
//   A sparse chunk decodes in time proportional to n: a delta of a step that moved 1 % of
//   the elements decodes about 10x faster than as zero runs (docs/BENCHMARKS.md).
// The header's codec names the payload's encoding: a lossy encoder's bases (and a lossy
// delta that met a non-finite value, sent as a base instead) carry kLossless.
//
// Thread-safety: none inside. One DeltaEncoder / DeltaDecoder per buffer, used by one thread
// at a time (different instances on different threads are independent). The free functions
// are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "r2ccl/snapshot/big_buffer.h"

struct ZSTD_CCtx_s;
struct ZSTD_DCtx_s;

namespace r2ccl::snap {

enum class DType : uint8_t { kBytes = 0, kF32 = 1, kF16 = 2, kBF16 = 3 };
enum class Codec : uint8_t { kLossless = 0, kLossyDynRange = 1 };

// Bytes per element: 1, 4, 2, 2 (0 for a value outside the enum).
size_t dtype_size(DType t);
// "kBytes", "kF32", "kF16", "kBF16", "kLossless", "kLossyDynRange" ("?" outside the enums).
const char* dtype_name(DType t);
const char* codec_name(Codec c);

// IEEE binary16 and bfloat16 <-> binary32. Narrowing rounds to nearest, ties to even;
// overflow gives +-Inf, underflow gives (signed) subnormals or zero; Inf stays Inf and NaN
// stays NaN (sign kept, made quiet; the top payload bits kept). Widening is exact.
uint16_t float_to_fp16(float f);
float fp16_to_float(uint16_t h);
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t b);

constexpr uint32_t kFrameMagic = 0x46533252u;  // bytes 'R' '2' 'S' 'F'
constexpr uint16_t kFrameVersion = 1;
constexpr size_t kFrameHeaderBytes = 64;
constexpr uint32_t kLossyBlockElems = 256;  // elements per lossy scale
constexpr uint32_t kChunkElems = 1u << 18;  // elements per shuffle chunk (what the encoder writes)
constexpr uint32_t kMaxChunkElems = 1u << 24;  // largest chunk a decoder accepts

enum FrameFlags : uint8_t { kFrameBase = 1, kFrameNoPayloadCrc = 2, kFrameTagged = 4 };
constexpr uint32_t kChunkDense = 0xFFFFFFFFu;  // tagged chunks: the tag of a dense chunk

// A frame header as parsed (or to be written).
struct FrameHeader {
  uint16_t version = kFrameVersion;
  DType dtype = DType::kBytes;
  Codec codec = Codec::kLossless;
  bool base = false;
  uint32_t chunk_elems = kChunkElems;
  uint64_t seq = 0;
  uint64_t base_seq = 0;
  uint64_t elem_count = 0;
  uint64_t raw_size = 0;        // bytes
  uint64_t payload_size = 0;    // bytes after the header
  uint32_t payload_crc = 0;     // zlib crc32 of the payload (0 when no_payload_crc)
  bool no_payload_crc = false;  // flag bit 1: not computed, not checked (see the layout)
  bool tagged = false;          // flag bit 2: tagged chunks (lossless deltas only)
};

// Parses and checks the header of the frame [frame, frame + n) on its own (no buffer, no
// payload check): n >= 64, magic, version, header bytes, header CRC, dtype/codec/flag values,
// chunk_elems, elem_count * element size == raw_size (no overflow), a lossy codec only for
// kF16/kBF16, a base only kLossless, tagged chunks only on a lossless delta, base_seq == seq
// for a base and < seq for a delta, and
// n == 64 + payload_size
// (a shorter frame is "truncated", a longer one has trailing bytes). Returns false with *err
// naming the field, its value and the accepted form; *out is set only on success. Reads
// nothing outside [frame, frame + n) and allocates nothing but the error string. For the shard
// store and the daemon, which file frames by (seq, base_seq) without decoding them.
bool parse_frame_header(const uint8_t* frame, size_t n, FrameHeader* out, std::string* err);

// Writes `h` as the 64 bytes at `out` (magic, header bytes and header CRC filled in; the
// payload CRC is taken from h). For tools and tests that build frames.
void write_frame_header(const FrameHeader& h, uint8_t* out);

struct EncoderConfig {
  DType dtype = DType::kBytes;
  size_t size_bytes = 0;           // the buffer's size, bytes: > 0, a multiple of dtype_size
  Codec codec = Codec::kLossless;  // kLossyDynRange: kF16 / kBF16 only
  uint32_t base_every = 8;         // K >= 1: a base at the first snapshot and every K-th
  int zstd_level = 1;              // zstd's range (negative = faster); 1: speed matters
  int zstd_workers = 0;            // 0..64 zstd threads; 0 = compress on the calling thread
  uint64_t first_seq = 0;          // sequence number of the first snapshot
  // false: no payload CRC (flag bit 1), for a caller that checksums the whole frame itself
  // (the snapshot client: ShardMeta::checksum), saving a pass over the payload.
  bool payload_crc = true;
  // Lossless deltas as tagged chunks (flag bit 2): a chunk in which at most 1/8 of the
  // elements changed is written as their indices and values (sparse), others as before.
  // false: the untagged layout of every version-1 decoder.
  bool sparse_chunks = true;
};

struct EncodeStats {
  uint64_t seq = 0;       // this snapshot's sequence number
  uint64_t base_seq = 0;  // the base its chain starts from
  bool is_base = false;
  Codec codec = Codec::kLossless;  // the payload's encoding (bases are always lossless)
  size_t raw_bytes = 0;            // the buffer, bytes
  size_t frame_bytes = 0;          // header + payload, bytes
  double max_abs_error = 0;        // max |current - reconstructed| over the buffer, in the
                                   // element's units (0 for a lossless frame)
  double seconds = 0;              // wall time of encode()
  double ratio() const { return frame_bytes ? double(raw_bytes) / double(frame_bytes) : 0; }
};

class DeltaEncoder {
 public:
  // Returns nullptr with *err naming the field and the accepted range for an invalid config
  // (size 0 or not a multiple of the element size, lossy for a dtype other than kF16/kBF16,
  // base_every 0, a zstd level or worker count this libzstd refuses) or a failed allocation.
  // Memory: the buffer's reconstruction (size_bytes), two chunks of scratch (kChunkElems
  // elements), the indices of a sparse chunk (kChunkElems / 8 u32) and zstd's context (sized
  // from size_bytes); the frame is the caller's.
  static std::unique_ptr<DeltaEncoder> create(const EncoderConfig& cfg, std::string* err);
  ~DeltaEncoder();
  DeltaEncoder(const DeltaEncoder&) = delete;
  DeltaEncoder& operator=(const DeltaEncoder&) = delete;

  // Encodes the snapshot of `cur` (config().size_bytes bytes, host memory, not modified; it
  // must not change during the call) into *frame (replaced; its capacity is reused, so pass
  // the same vector again to avoid reallocation) and fills *st (may be null). The frame is a
  // base for the first snapshot, every base_every-th one (seq - base_seq >= base_every), after
  // request_base() or a failed encode, and when a lossy delta meets a changed element whose
  // delta is not finite (a value changed to or from NaN/Inf, or a difference that overflows
  // float32); NaN/Inf that stay put are kept exactly by lossy deltas. Lossy reconstructions
  // saturate at the largest finite value instead of rounding to Inf. Returns false with *err
  // on a zstd failure (memory), a null argument or an exhausted sequence; the sequence number
  // is then not consumed and the next frame is a base.
  [[nodiscard]] bool encode(const void* cur, std::vector<uint8_t>* frame, EncodeStats* st,
                            std::string* err);

  // The next encode() produces a base (e.g. a replica lost the chain).
  void request_base() { need_base_ = true; }
  // Starts a new chain at sequence number next_seq: the next encode() is a base with that seq
  // (after a restore, the restored chain's last seq + 1). Keeps the reconstruction's memory,
  // so nothing is allocated or faulted in again.
  void restart(uint64_t next_seq) {
    next_seq_ = next_seq;
    need_base_ = true;
  }
  uint64_t next_seq() const { return next_seq_; }
  const EncoderConfig& config() const { return cfg_; }
  // The buffer as a decoder holds it after the last frame (size_bytes bytes; meaningless
  // before the first successful encode()).
  const uint8_t* reconstruction() const { return prev_.get(); }

 private:
  explicit DeltaEncoder(const EncoderConfig& cfg);
  bool encode_lossless(const uint8_t* cur, bool base, std::vector<uint8_t>* frame,
                       std::string* err);
  // Returns 1 on success, 0 on a zstd failure, -1 when a non-finite delta was met (the
  // caller then sends a base; the reconstruction is partly updated).
  int encode_lossy(const uint8_t* cur, std::vector<uint8_t>* frame, double* max_err,
                   std::string* err);
  bool begin_stream(uint64_t content_bytes, std::string* err);
  bool push(const uint8_t* data, size_t n, bool last, std::vector<uint8_t>* frame,
            std::string* err);

  EncoderConfig cfg_;
  size_t esize_ = 1;
  uint64_t elems_ = 0;
  uint64_t next_seq_ = 0;
  uint64_t base_seq_ = 0;
  bool need_base_ = true;
  uint32_t crc_ = 0;                    // running CRC of the payload being written
  BigBytes prev_;                       // the decoder's view (size_bytes)
  std::unique_ptr<uint8_t[]> scratch_;  // one chunk, shuffled or scales + codes
  std::unique_ptr<uint8_t[]> sparse_;   // one chunk: a sparse chunk's gap and value planes
  std::vector<uint32_t> changed_;       // a sparse chunk's indices (at most m / 8)
  std::vector<uint8_t> out_stage_;      // zstd output staging
  ZSTD_CCtx_s* cctx_ = nullptr;
};

class DeltaDecoder {
 public:
  // Returns nullptr with *err for size_bytes 0 or not a multiple of the element size.
  // Allocates the state (size_bytes, zeroed) unless `state` is given: then the state is the
  // caller's memory (size_bytes, not owned, must outlive the decoder; its bytes are kept until
  // the first base). The payload scratch is allocated at the first frame: apply(), at most
  // size_bytes + 4 * ceil(elements / 256) bytes (from the registered size), or one chunk for
  // tagged chunks (decoded twice: checked, then written); apply_streaming() one chunk and
  // apply_chain() two, of the frames' chunk_elems (at most kMaxChunkElems elements each,
  // whatever the buffer's size).
  static std::unique_ptr<DeltaDecoder> create(DType dtype, size_t size_bytes, std::string* err,
                                              uint8_t* state = nullptr);
  ~DeltaDecoder();
  DeltaDecoder(const DeltaDecoder&) = delete;
  DeltaDecoder& operator=(const DeltaDecoder&) = delete;

  // Applies the frame [frame, frame + n). Everything is checked before anything is allocated
  // from the frame's fields or written to the state: the header (parse_frame_header), dtype,
  // elem_count and raw_size against the registered buffer, the chain (a base is accepted by
  // an empty decoder or with a seq above the last one; a delta needs seq == last seq + 1 and
  // base_seq == the chain's base), the payload CRC, one zstd frame of exactly the expected
  // content size (tagged chunks: at most it), for lossy payloads finite non-negative scales
  // and codes in [-127, 127], and for tagged chunks every tag, count and index.
  // Returns false with *err naming the field, its value and the accepted form; the decoder is
  // then unchanged (state, last_seq, base_seq).
  [[nodiscard]] bool apply(const uint8_t* frame, size_t n, std::string* err);

  // The same checks before anything is written, then decodes chunk by chunk straight into the
  // state (one chunk of scratch, cache-resident: no payload-sized buffer, one pass over the
  // state). What can only be found while decoding (a zstd error, a lossy scale or code out of
  // range, a frame of a producer whose checksum held but whose content is bad) is found after
  // part of the state was written: the decoder is then reset() (has_state() false) and the
  // state must be discarded. For callers that discard the state on any error anyway (restore).
  [[nodiscard]] bool apply_streaming(const uint8_t* frame, size_t n, std::string* err);

  // Applies the frames [frames[k], frames[k] + sizes[k]), k < count, in order: the same result
  // and the same errors as apply_streaming() on each in turn, faster. Every frame's header,
  // chain position and zstd frame are checked before anything is written (an error there
  // names the frame and leaves the decoder unchanged). When the frames are lossless with one
  // chunk size, a base (or a delta) followed by deltas, and at most kMaxFusedFrames, the chain
  // is decoded in one pass over the state: per chunk, every frame's content is decoded into
  // cache-resident scratch (two chunks) and XOR'd together, then unshuffled into the state once
  // (one zstd context per frame, kept for the next call). Other chains (lossy deltas, a base
  // mid-chain) go one frame at a time. Errors found while decoding reset() the decoder, as
  // apply_streaming() does: the state must then be discarded.
  // *writing (may be null) is set once every frame passed its checks and the state is about to
  // be written: false after a refusal, true after an error found while decoding.
  static constexpr size_t kMaxFusedFrames = 64;
  [[nodiscard]] bool apply_chain(const uint8_t* const* frames, const size_t* sizes, size_t count,
                                 std::string* err, bool* writing = nullptr);

  // Forgets the chain (the next frame must be a base); the state bytes are kept.
  void reset() { has_state_ = false; }

  bool has_state() const { return has_state_; }
  // The reconstructed buffer (size_bytes() bytes; zeros before the first base).
  const uint8_t* state() const { return state_; }
  size_t size_bytes() const { return size_; }
  DType dtype() const { return dtype_; }
  uint64_t last_seq() const { return last_seq_; }  // valid when has_state()
  uint64_t base_seq() const { return base_seq_; }  // valid when has_state()

 private:
  DeltaDecoder(DType dtype, size_t size_bytes);

  DType dtype_;
  size_t size_;
  size_t esize_;
  uint64_t elems_;
  int window_log_max_;  // zstd's window limit for this buffer's frames (codec.cc)
  bool has_state_ = false;
  uint64_t last_seq_ = 0;
  uint64_t base_seq_ = 0;
  // Checks the frame (header, buffer, chain, payload CRC, zstd frame and content size) for
  // apply() and apply_streaming(); sets *h and *content (the zstd content bytes; for tagged
  // chunks, the most there may be).
  bool check(const uint8_t* frame, size_t n, FrameHeader* h, uint64_t* content, std::string* err);
  // Decodes a checked frame chunk by chunk through one chunk of scratch: into the state when
  // `write`, else only checking what decoding finds (zstd, lossy scales and codes, sparse
  // indices). False with *why (no prefix).
  bool stream(const uint8_t* frame, const FrameHeader& h, uint64_t expected, bool write,
              std::string* why);

  BigBytes own_state_;
  uint8_t* state_ = nullptr;  // own_state_ or the caller's
  std::unique_ptr<uint8_t[]> scratch_;
  size_t scratch_size_ = 0;
  ZSTD_DCtx_s* dctx_ = nullptr;
  std::vector<ZSTD_DCtx_s*> extra_dctx_;  // apply_chain(): one per frame after the first
};

}  // namespace r2ccl::snap
