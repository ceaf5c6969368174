#include "manifest_check.hpp"

#include <string>

#include "box.hpp"
#include "codec.hpp"

namespace ferry {

namespace {

std::string n(uint64_t v) {
  return std::to_string(v);
}

Status check_chunk(const Manifest& m, const ManifestTensor& t, const ManifestChunk& c,
                   const std::string& who) {
  uint64_t raw = dtype_size(t.dtype);
  for (int64_t s : c.sizes)
    if (s < 0 || __builtin_mul_overflow(raw, static_cast<uint64_t>(s), &raw))
      return Status::internal(who + ": box sizes " + shape_to_string(c.sizes) + " are invalid");
  const ManifestFile& f = m.files[c.file];
  if (c.byte_offset < f.header_bytes || c.byte_offset > f.size ||
      c.byte_length > f.size - c.byte_offset)
    return Status::internal(who + ": bytes [" + n(c.byte_offset) + ", +" + n(c.byte_length) +
                            ") are not inside the data of the file (header " + n(f.header_bytes) +
                            " bytes, size " + n(f.size) + ")");
  if (c.codec.empty()) {
    if (c.byte_length != raw)
      return Status::internal(who + ": stored length " + n(c.byte_length) + ", the box holds " +
                              n(raw) + " bytes of " + dtype_name(t.dtype));
  } else {
    if (c.raw_length != raw)
      return Status::internal(who + ": raw length " + n(c.raw_length) + ", the box holds " +
                              n(raw) + " bytes");
    if (c.frame_bytes == 0) return Status::internal(who + ": frame size 0");
    const uint64_t frames = raw / c.frame_bytes + (raw % c.frame_bytes != 0 ? 1 : 0);
    if (c.frame_ends.size() != frames)
      return Status::internal(who + ": " + n(c.frame_ends.size()) + " frames, " + n(raw) +
                              " raw bytes take " + n(frames));
    for (size_t i = 1; i < c.frame_ends.size(); ++i)
      if (c.frame_ends[i] <= c.frame_ends[i - 1])
        return Status::internal(who + ": frame " + n(i) + " does not end after frame " + n(i - 1));
    const uint64_t end = c.frame_ends.empty() ? 0 : c.frame_ends.back();
    if (end != c.byte_length)
      return Status::internal(who + ": frames end at " + n(end) + ", the stored length is " +
                              n(c.byte_length));
  }
  if (!c.checksums.empty() && m.checksum_block_bytes > 0) {
    const uint64_t blocks = (c.byte_length + m.checksum_block_bytes - 1) / m.checksum_block_bytes;
    if (c.checksums.size() != blocks)
      return Status::internal(who + ": " + n(c.checksums.size()) + " checksums for " +
                              n(c.byte_length) + " stored bytes (" + n(blocks) + " blocks)");
  }
  return Status();
}

}  // namespace

Status check_manifest_before_commit(const Manifest& m) {
  const std::string refused = "the manifest to commit would not load: ";
  for (const ManifestTensor& t : m.tensors)
    for (size_t ci = 0; ci < t.chunks.size(); ++ci) {
      const ManifestChunk& c = t.chunks[ci];
      // Named only on failure: one string per chunk is most of this check's cost.
      auto who = [&] { return "tensor '" + t.key + "' chunk " + n(ci); };
      if (c.file >= m.files.size())
        return Status::internal(refused + who() + ": file index " + n(c.file) + " of " +
                                n(m.files.size()) + " files");
      const ManifestFile& f = m.files[c.file];
      if (Status s = check_chunk(m, t, c, ""); !s.ok())
        return Status::internal(refused + who() + " in file '" + f.name + "' (rank " +
                                std::to_string(f.rank) + ")" + s.message());
    }
  // Everything else a load checks, by the load's own check.
  if (Status s = check_manifest(m); !s.ok()) return Status::internal(refused + s.message());
  return Status();
}

}  // namespace ferry
