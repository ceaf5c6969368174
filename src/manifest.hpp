// The committed checkpoint's index (MANIFEST): its C++ form and the framed
// Cap'n Proto encoding described in docs/format.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry {

constexpr uint32_t kManifestFormatVersion = 1;
constexpr char kManifestFileName[] = "MANIFEST";

struct ManifestChunk {
  std::vector<int64_t> offsets;  // in the global tensor
  std::vector<int64_t> sizes;
  uint32_t file = 0;         // index into Manifest::files
  uint64_t byte_offset = 0;  // absolute offset in that file
  uint64_t byte_length = 0;
  std::string entry;  // safetensors entry name
  // xxh3-64 of each checksum_block_bytes piece of the chunk's bytes (the
  // last may be shorter); empty when the checkpoint was saved without them.
  std::vector<uint64_t> checksums;
  // Compressed (codec.hpp): byte_length is the stored size, checksums cover
  // the stored bytes, and the raw bytes are in frames of frame_bytes.
  std::string codec;  // "" = raw
  uint64_t raw_length = 0;
  uint64_t frame_bytes = 0;
  std::vector<uint64_t> frame_ends;  // stored end of each frame, from byte_offset

  // The chunk's bytes once decoded: numel x dtype size.
  uint64_t raw_bytes() const { return codec.empty() ? byte_length : raw_length; }
};

struct ManifestTensor {
  std::string key;
  DType dtype = DType::f32;
  std::vector<int64_t> global_shape;
  std::vector<ManifestChunk> chunks;
  // >= 0: rank per_rank's value of a per-rank entry, whose key is
  // per_rank_key(entry, per_rank); -1: an ordinary tensor.
  int32_t per_rank = -1;
};

struct ManifestFile {
  std::string name;
  uint64_t size = 0;
  int32_t rank = 0;
  uint64_t header_bytes = 0;     // the safetensors header, padding included
  uint64_t header_checksum = 0;  // xxh3-64 of it, so a flipped header byte is caught on load
};

struct Manifest {
  uint32_t format_version = kManifestFormatVersion;
  std::vector<std::string> required_features;  // a reader refuses unknown ones
  uint64_t step = 0;
  uint64_t commit_seq = 0;
  int32_t world_size = 1;
  std::string job_id;
  std::string checkpoint_id;
  bool fsynced = true;
  uint64_t checksum_block_bytes = 1ull << 20;
  int64_t created_unix_ms = 0;
  std::vector<ManifestFile> files;
  std::vector<ManifestTensor> tensors;                        // sorted by key
  std::vector<std::pair<std::string, std::string>> metadata;  // user key/values

  const ManifestTensor* find(const std::string& key) const;  // binary search
  uint64_t total_bytes() const;                              // sum of chunk byte lengths
};

// Features this build understands (a manifest naming another is refused).
const std::vector<std::string>& known_manifest_features();

// Framed bytes: magic, version, required features, payload length + xxh3,
// Cap'n Proto payload.
std::string encode_manifest(const Manifest& m);
// The same bytes into *out, whose memory is reused.
void encode_manifest_into(const Manifest& m, std::string* out);

// encode_manifest_into's bytes, from a Cap'n Proto message kept between
// calls: when a manifest differs from the last one encoded here only in what
// a repeated save changes (header numbers, ids, file names and metadata of
// the same lengths, file sizes and headers, chunk files, byte ranges and
// checksums of the same counts), those are rewritten in place and the rest
// of the message is not built again. Anything else builds it afresh. Keeps
// up to kKeptManifestBufferBytes of message. Not thread-safe.
class ManifestEncoder {
 public:
  ManifestEncoder();
  ~ManifestEncoder();
  ManifestEncoder(ManifestEncoder&&) noexcept;
  ManifestEncoder& operator=(ManifestEncoder&&) noexcept;

  // `body`, when not 0, names the manifest's tensors apart from their
  // chunks' files, byte ranges, checksums and codec fields: their keys,
  // dtypes, shapes, per-rank values, boxes and entries. A caller passes the
  // value of the last call again only when those are unchanged since (a
  // refilled ManifestSkeleton); then they are not written again (at 100,000
  // tensors a fifth of a rewrite's time). 0: all of it is written.
  void encode(const Manifest& m, std::string* out, uint64_t body = 0);
  // encode()'s bytes in two pieces, nothing copied out of the kept message:
  // *head (the frame and the payload's segment table), then the returned
  // bytes of the message itself, valid until the next call or
  // release_oversized().
  std::string_view encode_parts(const Manifest& m, std::string* head, uint64_t body = 0);
  // Gives back a message larger than kKeptManifestBufferBytes (encode()
  // does it itself; a caller of encode_parts once it used the bytes),
  // unless it holds the newest chunk values (chunks_put).
  void release_oversized();

  // A refill writes each chunk's new values into the kept message instead
  // of the manifest's own vectors (ManifestSkeleton): one walk over the
  // chunks, and no chunk rewritten at the encode. Only while holds(body):
  // the message is that body's, chunk `i` the i-th of the manifest's chunks,
  // tensor by tensor.
  bool holds(uint64_t body) const;
  // Chunk i's byte range and checksums; false (nothing written) when the
  // message holds another number of checksums for it. *same: the byte
  // range and the checksum count are the ones it held.
  bool put_chunk(size_t i, uint64_t byte_offset, uint64_t byte_length, const uint64_t* sums,
                 size_t n, bool* same);
  // Asks for chunk `near`'s places in the message, and for where chunk
  // `far`'s are: a walk ahead of itself (either may be past the end).
  void prefetch_chunk(size_t near, size_t far) const;
  // Declares the message's chunk values the newest of the manifests named
  // `body` (0: none): the caller put every chunk since it held that body.
  // Then an encode with `body` takes them from the message, not from the
  // manifest it is given (whose chunk values may be older), rebuilding
  // included, and the message is kept whatever its size until this is
  // cleared, by chunks_put(0) or an encode with another body.
  void chunks_put(uint64_t body) { chunks_put_ = body; }
  bool chunks_newest(uint64_t body) const {
    return body != 0 && chunks_put_ == body && holds(body);
  }
  // The message's chunk values (byte ranges, checksums) into `m`, a manifest
  // of the body it holds; false (m unchanged) when m's shape is another.
  bool take_chunks(Manifest* m) const;
  // The last encode() rewrote the kept message rather than building it.
  bool last_patched() const { return patched_; }

 private:
  struct Kept;
  std::unique_ptr<Kept> kept_;
  bool patched_ = false;
  uint64_t body_ = 0;        // the kept message's tensors are the ones this names; 0: none
  uint64_t chunks_put_ = 0;  // see chunks_put()
};

// Checks the frame (magic, version <= ours, known features, length, payload
// checksum), decodes with traversal/nesting limits sized from the input, and
// checks that the contents are consistent (chunks inside their tensors and
// files, lengths matching dtype x numel, checksum counts). Every failure is a
// Status (corruption / unsupported) naming what is wrong; never throws.
Result<Manifest> decode_manifest(std::string_view bytes);
// How many times decode_manifest ran in this process (tests count a load's decodes).
uint64_t manifest_decodes();

// decode_manifest's checks of the contents, on a manifest in memory (what
// rank 0 checks before a commit, without encoding and decoding it).
Status check_manifest(const Manifest& m);

// What ordering checkpoints needs, for a fraction of decode_manifest's
// cost: the frame and the payload checksum are checked, and of the payload
// only the root's step and commit sequence are read. A manifest it accepts
// may still fail decode_manifest's checks of the tensors.
struct ManifestSummary {
  uint64_t step = 0;
  uint64_t commit_seq = 0;
  uint64_t payload_sum = 0;
};
Result<ManifestSummary> summarize_manifest(std::string_view bytes);
// The most a thread keeps of the buffers it reads manifests through, between
// reads (decode_manifest's aligned copy, the catalog's file bytes).
constexpr size_t kKeptManifestBufferBytes = 64u << 20;

// The payload checksum from a manifest's frame, which `head` (the file's
// first bytes, 4 KiB hold any frame this build writes) need only contain:
// it names the manifest's content without reading or decoding the rest.
Result<uint64_t> manifest_payload_sum(std::string_view head);

// The whole file's length as the frame in `head` gives it (frame plus
// payload length), so a reader can refuse a MANIFEST whose frame disagrees
// with the file, or that is larger than kMaxManifestBytes, before reading it.
Result<uint64_t> manifest_file_bytes(std::string_view head);
// The largest MANIFEST a reader accepts (docs/format.md): far above what a
// checkpoint of millions of chunks needs, and a bound on what one hostile
// file costs every `ls`, save and load.
constexpr uint64_t kMaxManifestBytes = 256ull << 20;

}  // namespace ferry
