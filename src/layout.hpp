// The layout of one data file, decided by the writer side: a safetensors
// header (padded with spaces so data starts 4096-aligned), then every chunk
// back to back in plan order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "box.hpp"
#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry {

constexpr uint64_t kDataAlignment = 4096;

// What an O_DIRECT write of `n` bytes at an aligned offset covers: the last
// block of a data file is padded to this, and its file allocated to it.
constexpr uint64_t direct_io_bytes(uint64_t n) {
  return (n + kDataAlignment - 1) / kDataAlignment * kDataAlignment;
}

struct Compressed;  // codec.hpp

struct ChunkRef {
  std::string key;
  DType dtype = DType::f32;
  std::vector<int64_t> global_shape;
  Box box;  // the chunk's region of the global tensor
  // Set when the chunk is stored compressed: its header entry is then a U8
  // blob of the stored bytes, and the manifest says how to decode it.
  std::shared_ptr<const Compressed> compressed;
  uint64_t nbytes() const { return static_cast<uint64_t>(box.numel()) * dtype_size(dtype); }
};

struct LaidOutChunk {
  ChunkRef chunk;
  std::string entry;    // safetensors entry name, see entry_name()
  uint64_t offset = 0;  // absolute byte offset in the file
  uint64_t length = 0;  // stored bytes (compressed size for a compressed chunk)
};

struct FileLayout {
  std::string name;    // file name inside the checkpoint directory
  std::string header;  // 8-byte LE length + JSON + spaces; size % 4096 == 0
  std::vector<LaidOutChunk> chunks;
  uint64_t size = 0;  // exact file size: header.size() + all chunk bytes
};

// "key@o0,o1,..." (offsets of the chunk in the global tensor): unique within a
// checkpoint as long as chunks of one tensor never share offsets.
std::string entry_name(const std::string& key, const Box& box);

// "<prefix>-00003-0001.safetensors" ("rank" is the default prefix, which
// gives the names of checkpoints written before prefixes existed). Loads take
// file names from the manifest, never from this pattern. `extension` is
// "safetensors" or, for compressed files, kCompressedExtension.
std::string data_file_name(const std::string& prefix, int32_t rank, uint32_t file,
                           const std::string& extension = "safetensors");
inline std::string data_file_name(int32_t rank, uint32_t file) {
  return data_file_name("rank", rank, file);
}

// One piece of a rank's data in a file: all of input chunk `source`, or a
// dim-0 slice of it that starts `skip` bytes into the chunk's bytes.
struct FilePiece {
  size_t source = 0;
  ChunkRef chunk;
  uint64_t skip = 0;
};

// Packs chunks, in order, into files of at most `shard_size` data bytes (the
// header, 4 KiB for a few hundred entries, comes on top). A chunk that does
// not fit in what is left of a file is split along dim 0 at row boundaries,
// so every piece is a box of its own and loads and reshards like any chunk.
// A single row larger than the cap (or a 0-d tensor) cannot be split and gets
// a file of its own. shard_size 0: everything in one file. `stored` maps a
// piece's raw size to the most it can take in the file (for compressed
// files, the codec's worst case); none: the raw size.
std::vector<std::vector<FilePiece>> pack_into_files(
    const std::vector<ChunkRef>& chunks, uint64_t shard_size,
    const std::function<uint64_t(uint64_t)>& stored = nullptr);

// Builds the header and offsets. The JSON carries "__metadata__" with
// {"format": "ferry"} and one entry per chunk with dtype, shape (box sizes)
// and data_offsets relative to the data start.
Result<FileLayout> layout_file(std::string name, std::vector<ChunkRef> chunks);

// What a safetensors header says about one entry.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // relative to the data start
};
struct SafetensorsHeader {
  uint64_t data_start = 0;  // 8 + header length
  std::vector<SafetensorsEntry> entries;
  std::vector<std::pair<std::string, std::string>> metadata;
};

// Parses and checks the header at the start of a safetensors file of
// `file_size` bytes (`prefix` holds at least its first 8 + N bytes): valid
// JSON object, known dtypes, shape/size agreement, entries contiguous and
// covering [0, file_size - data_start) exactly, unique names.
Result<SafetensorsHeader> parse_safetensors_header(const std::string& prefix, uint64_t file_size);

// A safetensors header: 8-byte LE length, then a JSON object with the
// `metadata` as "__metadata__" (when any) and `entries` in order, padded
// with spaces so the data starts on a multiple of `alignment`. Keys,
// values and names must be valid UTF-8.
Result<std::string> safetensors_header(
    const std::vector<SafetensorsEntry>& entries,
    const std::vector<std::pair<std::string, std::string>>& metadata, uint64_t alignment);

// `s` as a JSON string literal, quotes included (`s` valid UTF-8).
std::string json_string(const std::string& s);

}  // namespace ferry
