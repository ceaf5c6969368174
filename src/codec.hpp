// Compression of chunk bytes (the `compress` save option). A compressed chunk
// is stored as independent zstd frames of kFrameRawBytes raw bytes each (the
// last one shorter), back to back; the manifest keeps each frame's stored
// end, so a resharded read that needs part of a chunk reads and decodes only
// the frames holding that part. Checksum blocks cover the stored bytes, as
// for raw chunks, so corruption is caught before anything is decoded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/filesystem.hpp"
#include "ferry/status.hpp"
#include "load_plan.hpp"
#include "manifest.hpp"

namespace ferry {

// 1 MiB of raw bytes per frame: large enough that zstd reaches nearly its
// whole-buffer ratio, small enough that a partial read decodes little extra.
constexpr uint64_t kFrameRawBytes = 1ull << 20;
// The largest frame a reader decodes: a load decodes whole frames, so a
// manifest's frame size bounds the memory and work of every read of it.
constexpr uint64_t kMaxFrameRawBytes = 64ull << 20;
// Compressed data files are not safetensors files: their own extension.
constexpr char kCompressedExtension[] = "ferryz";
// The codec name in the manifest and the required feature it implies.
constexpr char kCodecZstd[] = "zstd";
constexpr char kCodecZstdFeature[] = "codec-zstd";

struct Compressed {
  uint64_t raw_bytes = 0;
  uint64_t frame_bytes = kFrameRawBytes;
  std::vector<uint64_t> frame_ends;  // stored end of frame i, from the chunk's start
  std::vector<uint8_t> data;         // the frames back to back
};

// The most stored bytes `raw` bytes can take in frames of `frame_bytes`
// (incompressible data grows a little): what shard-size packing counts.
uint64_t max_stored_bytes(uint64_t raw, uint64_t frame_bytes = kFrameRawBytes);

// The zstd level of a normalized compress option ("zstd:3"), or 0 for "none".
int compress_level(const std::string& compress);

// Raw bytes to compress; `who` names them in errors.
struct RawSpan {
  const uint8_t* data = nullptr;
  uint64_t bytes = 0;
  std::string who;
};

// Compresses each span in frames of `frame_bytes`, all the spans' frames
// spread over `threads` threads. Errors are internal, naming the span.
Result<std::vector<Compressed>> compress_spans(const std::vector<RawSpan>& spans, int level,
                                               uint32_t threads,
                                               uint64_t frame_bytes = kFrameRawBytes);

// The same for one span of `n` raw bytes.
Result<Compressed> compress_frames(const uint8_t* raw, uint64_t n, int level, uint32_t threads,
                                   const std::string& who, uint64_t frame_bytes = kFrameRawBytes);

// Decodes frames [first, first + count) of a chunk into `out` (their raw
// bytes, back to back). `stored` holds the chunk's stored bytes from the
// start of frame `first` on. A frame that does not decode to exactly its raw
// size is corruption naming `who`.
Status decompress_frames(const uint8_t* stored, uint64_t stored_len,
                         const std::vector<uint64_t>& frame_ends, uint64_t frame_bytes,
                         uint64_t raw_bytes, uint64_t first, uint64_t count, uint8_t* out,
                         const std::string& who);

// The load side: reads from `f` (file `path`) the stored bytes of the frames
// of `op`'s chunk that hold its raw range [op.chunk_offset, + op.length),
// verifies the checksum blocks over them, and decodes that range into
// `raw` (op.length bytes). Errors name the tensor and the file.
Status read_compressed(File& f, const std::string& path, const Manifest& m, const ReadOp& op,
                       std::vector<uint8_t>* raw);

}  // namespace ferry
