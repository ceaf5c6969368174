// MANIFEST encoding: a small hand-written frame around a Cap'n Proto payload.
// The byte layout is specified in docs/format.md; keep the two in step.

#include "manifest.hpp"
#include "capnp_text.hpp"

#include "box.hpp"

#include <capnp/any.h>
#include <capnp/message.h>
#include <capnp/schema.h>
#include <capnp/serialize.h>
#include <kj/array.h>
#include <kj/exception.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstring>
#include <exception>
#include <limits>
#include <string_view>
#include <tuple>
#include <unordered_set>

#include "checksum.hpp"
#include "codec.hpp"
#include "manifest.capnp.h"

namespace ferry {
namespace {

using capnp_util::fill;
using capnp_util::str;
using capnp_util::text;

// Never changes with the format version: it only says "this is a Ferry
// manifest", so a reader can tell a foreign file from a newer one.
constexpr char kMagic[8] = {'F', 'E', 'R', 'R', 'Y', 'M', 'F', '1'};

// The decode limits scale with the input (bounded_options): a manifest of a
// 1,000-rank job is far larger than Cap'n Proto's 64 MiB default.
constexpr uint64_t kMarginWords = 4096;

void put_u16(std::string& out, uint16_t v) {
  for (int i = 0; i < 2; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Reads the frame front to back; every take() is bounds-checked so a
// truncated or lying frame turns into a corruption status, never a read past
// the end.
class FrameReader {
 public:
  explicit FrameReader(std::string_view bytes) : bytes_(bytes) {}

  size_t position() const { return pos_; }
  size_t remaining() const { return bytes_.size() - pos_; }

  bool take(size_t n, std::string_view* out) {
    if (remaining() < n) return false;
    *out = bytes_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  template <class T>
  bool take_le(T* out) {
    std::string_view b;
    if (!take(sizeof(T), &b)) return false;
    T v = 0;
    for (size_t i = 0; i < sizeof(T); ++i)
      v |= static_cast<T>(static_cast<unsigned char>(b[i])) << (8 * i);
    *out = v;
    return true;
  }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

Status truncated(const FrameReader& r, const char* what) {
  return Status::corruption("MANIFEST is truncated: " + std::string(what) + " at byte " +
                            std::to_string(r.position()) + " runs past the end (" +
                            std::to_string(r.remaining()) + " bytes left)");
}

// Reads the payload into *out. Throws kj::Exception on a malformed message
// (the caller catches it); of the semantics it checks only what the C++ form
// cannot hold, an unknown dtype name.
Status from_proto(proto::Manifest::Reader root, Manifest* out) {
  Manifest& m = *out;
  m.format_version = root.getFormatVersion();
  for (auto f : root.getRequiredFeatures()) m.required_features.push_back(str(f));
  m.step = root.getStep();
  m.commit_seq = root.getCommitSeq();
  m.world_size = root.getWorldSize();
  m.job_id = str(root.getJobId());
  m.checkpoint_id = str(root.getCheckpointId());
  m.fsynced = root.getFsynced();
  m.checksum_block_bytes = root.getChecksumBlockBytes();
  m.created_unix_ms = root.getCreatedUnixMs();

  auto files = root.getFiles();
  m.files.reserve(files.size());
  for (auto f : files)
    m.files.push_back(
        {str(f.getName()), f.getSize(), f.getRank(), f.getHeaderBytes(), f.getHeaderChecksum()});

  auto tensors = root.getTensors();
  m.tensors.reserve(tensors.size());
  for (auto t : tensors) {
    ManifestTensor mt;
    mt.key = str(t.getKey());
    std::string dtype = str(t.getDtype());
    auto parsed = parse_dtype(dtype);
    if (!parsed.ok())
      return Status::corruption("manifest: tensor '" + mt.key + "': unknown dtype '" + dtype + "'");
    mt.dtype = parsed.value();
    for (int64_t d : t.getGlobalShape()) mt.global_shape.push_back(d);
    if (t.getPerRank()) {
      auto pr = parse_per_rank_key(mt.key);
      if (!pr || pr->second != t.getRank())
        return Status::corruption(
            "manifest: tensor '" + mt.key + "' is marked rank " + std::to_string(t.getRank()) +
            "'s per-rank value but its key does not end in @rank" + std::to_string(t.getRank()));
      mt.per_rank = t.getRank();
    }
    auto chunks = t.getChunks();
    mt.chunks.reserve(chunks.size());
    for (auto c : chunks) {
      ManifestChunk mc;
      for (int64_t o : c.getOffsets()) mc.offsets.push_back(o);
      for (int64_t s : c.getSizes()) mc.sizes.push_back(s);
      capnp_util::get_stored_bytes(c, &mc);
      mt.chunks.push_back(std::move(mc));
    }
    m.tensors.push_back(std::move(mt));
  }

  for (auto kv : root.getMetadata()) m.metadata.emplace_back(str(kv.getKey()), str(kv.getValue()));
  return Status();
}

// a * b into *out, false on overflow.
bool mul_u64(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// The loader counts covered elements to decide whether a request is fully
// covered, which is only sound if a tensor's chunks never overlap. A sweep
// along the dimension with the most distinct offsets keeps this close to
// n log n for row, column and grid shardings. REQUIRES: every chunk's box is
// inside the global shape.
template <class Who>
Status check_disjoint(const ManifestTensor& t, const Who& who) {
  std::vector<size_t> live;  // chunks with at least one element
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    bool empty = false;
    for (int64_t s : t.chunks[i].sizes) empty = empty || s == 0;
    if (!empty) live.push_back(i);
  }
  if (live.size() < 2) return Status();
  const size_t rank = t.global_shape.size();
  auto overlap = [&](size_t a, size_t b) {
    const auto& x = t.chunks[a];
    const auto& y = t.chunks[b];
    for (size_t d = 0; d < rank; ++d)
      if (x.offsets[d] >= y.offsets[d] + y.sizes[d] || y.offsets[d] >= x.offsets[d] + x.sizes[d])
        return false;
    return true;  // a 0-d tensor's chunks always overlap
  };
  size_t sweep = 0, best = 0;
  for (size_t d = 0; d < rank; ++d) {
    std::vector<int64_t> offs;
    offs.reserve(live.size());
    for (size_t i : live) offs.push_back(t.chunks[i].offsets[d]);
    std::sort(offs.begin(), offs.end());
    const size_t distinct =
        static_cast<size_t>(std::unique(offs.begin(), offs.end()) - offs.begin());
    if (distinct > best) best = distinct, sweep = d;
  }
  auto begin = [&](size_t i) { return rank ? t.chunks[i].offsets[sweep] : 0; };
  auto end = [&](size_t i) {
    return rank ? t.chunks[i].offsets[sweep] + t.chunks[i].sizes[sweep] : 1;
  };
  std::sort(live.begin(), live.end(), [&](size_t a, size_t b) { return begin(a) < begin(b); });
  std::vector<size_t> active;  // chunks whose extent along `sweep` reaches the current one
  for (size_t i : live) {
    active.erase(
        std::remove_if(active.begin(), active.end(), [&](size_t a) { return end(a) <= begin(i); }),
        active.end());
    for (size_t a : active)
      if (overlap(a, i))
        return Status::corruption(who() + ": chunk " + std::to_string(i) + " overlaps chunk " +
                                  std::to_string(a) + " (offsets " +
                                  shape_to_string(t.chunks[i].offsets) + " and " +
                                  shape_to_string(t.chunks[a].offsets) + ")");
    active.push_back(i);
  }
  return Status();
}

// A compressed chunk: a codec the manifest declares, its raw size matching
// the box, and frames that tile the raw bytes and the stored bytes exactly.
Status check_frames(const Manifest& m, const ManifestChunk& c, uint64_t raw,
                    const std::string& who) {
  if (c.codec != kCodecZstd) return Status::corruption(who + ": unknown codec '" + c.codec + "'");
  if (std::find(m.required_features.begin(), m.required_features.end(), kCodecZstdFeature) ==
      m.required_features.end())
    return Status::corruption(who + ": codec '" + c.codec + "' without the required feature '" +
                              kCodecZstdFeature + "'");
  if (c.raw_length != raw)
    return Status::corruption(who + ": raw length " + std::to_string(c.raw_length) + ", expected " +
                              std::to_string(raw));
  if (c.frame_bytes == 0) return Status::corruption(who + ": frame size 0");
  if (c.frame_bytes > kMaxFrameRawBytes)
    return Status::corruption(who + ": frame size " + std::to_string(c.frame_bytes) +
                              " exceeds the most a reader decodes (" +
                              std::to_string(kMaxFrameRawBytes) + ")");
  const uint64_t frames = raw / c.frame_bytes + (raw % c.frame_bytes != 0 ? 1 : 0);
  if (c.frame_ends.size() != frames)
    return Status::corruption(who + ": " + std::to_string(c.frame_ends.size()) +
                              " frames, expected " + std::to_string(frames));
  for (size_t i = 0; i < frames; ++i)
    if (c.frame_ends[i] == 0 || (i > 0 && c.frame_ends[i] <= c.frame_ends[i - 1]))
      return Status::corruption(who + ": frame " + std::to_string(i) + " ends at " +
                                std::to_string(c.frame_ends[i]) + ", not after the previous one");
  if ((frames ? c.frame_ends.back() : 0) != c.byte_length)
    return Status::corruption(who + ": frames end at " +
                              std::to_string(frames ? c.frame_ends.back() : 0) +
                              ", the stored length is " + std::to_string(c.byte_length));
  return Status();
}

// Everything a reader relies on before it touches a data file: a manifest
// that passes here cannot send a load outside a file or a tensor.
Status check_semantics(const Manifest& m) {
  if (m.checksum_block_bytes == 0) return Status::corruption("manifest: checksum_block_bytes is 0");
  if (m.world_size <= 0)
    return Status::corruption("manifest: world size " + std::to_string(m.world_size) +
                              " is not positive");

  std::unordered_set<std::string> file_names;
  for (size_t i = 0; i < m.files.size(); ++i) {
    const auto& f = m.files[i];
    // The name is joined to the checkpoint directory: it must not escape it.
    // A name may have a directory part (an object root's save prefix,
    // "save-<id>/rank-..."), never an empty, "." or ".." component.
    bool bad_part = f.name.empty() || f.name.find('\0') != std::string::npos;
    for (size_t at = 0; !bad_part && at <= f.name.size();) {
      size_t end = std::min(f.name.find('/', at), f.name.size());
      const std::string_view part(f.name.data() + at, end - at);
      bad_part = part.empty() || part == "." || part == "..";
      at = end + 1;
    }
    if (bad_part)
      return Status::corruption("manifest: file " + std::to_string(i) + " has an invalid name '" +
                                f.name + "'");
    if (!file_names.insert(f.name).second)
      return Status::corruption("manifest: file '" + f.name + "' is listed twice");
    if (f.rank < 0 || f.rank >= m.world_size)
      return Status::corruption("manifest: file '" + f.name + "' was written by rank " +
                                std::to_string(f.rank) + ", outside world size " +
                                std::to_string(m.world_size));
    if (f.header_bytes > f.size)
      return Status::corruption("manifest: file '" + f.name + "' has a header of " +
                                std::to_string(f.header_bytes) + " bytes but is only " +
                                std::to_string(f.size) + " bytes long");
  }

  struct Range {
    uint32_t file;
    uint64_t begin, end;
    size_t tensor, chunk;
  };
  std::vector<Range> ranges;
  // (file, entry name): views into `m`, so no string is built per chunk.
  struct EntryHash {
    size_t operator()(const std::pair<uint32_t, std::string_view>& e) const {
      return std::hash<std::string_view>()(e.second) * 31 + e.first;
    }
  };
  std::unordered_set<std::pair<uint32_t, std::string_view>, EntryHash> entries;
  size_t chunk_count = 0;
  for (const auto& t : m.tensors) chunk_count += t.chunks.size();
  entries.reserve(chunk_count);
  ranges.reserve(chunk_count);

  for (size_t ti = 0; ti < m.tensors.size(); ++ti) {
    const auto& t = m.tensors[ti];
    // Error texts are built only on failure: this runs over every chunk of every load.
    auto who = [&t] { return "manifest: tensor '" + t.key + "'"; };
    if (t.key.empty())
      return Status::corruption("manifest: tensor " + std::to_string(ti) + " has an empty key");
    if (ti > 0 && !(m.tensors[ti - 1].key < t.key)) {
      if (m.tensors[ti - 1].key == t.key) return Status::corruption(who() + " is listed twice");
      return Status::corruption(who() + " is out of order (after '" + m.tensors[ti - 1].key +
                                "'): tensors must be sorted by key");
    }
    const uint64_t elem = dtype_size(t.dtype);
    if (elem == 0) return Status::corruption(who() + ": unknown dtype");
    for (int64_t d : t.global_shape)
      if (d < 0)
        return Status::corruption(who() + ": negative dimension in global shape " +
                                  shape_to_string(t.global_shape));

    for (size_t ci = 0; ci < t.chunks.size(); ++ci) {
      const auto& c = t.chunks[ci];
      auto cwho = [&who, ci] { return who() + " chunk " + std::to_string(ci); };
      const size_t rank = t.global_shape.size();
      if (c.offsets.size() != rank || c.sizes.size() != rank)
        return Status::corruption(
            cwho() + ": box rank (offsets " + std::to_string(c.offsets.size()) + ", sizes " +
            std::to_string(c.sizes.size()) + ") differs from tensor rank " + std::to_string(rank));
      uint64_t numel = 1;
      bool overflow = false;
      for (size_t d = 0; d < rank; ++d) {
        const int64_t o = c.offsets[d], s = c.sizes[d], g = t.global_shape[d];
        if (o < 0 || s < 0 || o > g || s > g - o)
          return Status::corruption(cwho() + ": box offsets " + shape_to_string(c.offsets) +
                                    " sizes " + shape_to_string(c.sizes) +
                                    " lies outside global shape " +
                                    shape_to_string(t.global_shape));
        overflow = overflow || !mul_u64(numel, static_cast<uint64_t>(s), &numel);
      }
      uint64_t expected = 0;
      if (overflow || !mul_u64(numel, elem, &expected))
        return Status::corruption(cwho() + ": byte size of box " + shape_to_string(c.sizes) +
                                  " overflows");
      if (!c.codec.empty()) FERRY_RETURN_IF_ERROR(check_frames(m, c, expected, cwho()));
      if (c.codec.empty() && c.byte_length != expected)
        return Status::corruption(cwho() + ": byte length " + std::to_string(c.byte_length) +
                                  ", expected " + std::to_string(expected) + " (" +
                                  std::to_string(numel) + " x " + dtype_name(t.dtype) + ")");
      if (c.file >= m.files.size())
        return Status::corruption(cwho() + ": file index " + std::to_string(c.file) +
                                  " out of range (" + std::to_string(m.files.size()) + " files)");
      const auto& f = m.files[c.file];
      if (c.byte_offset > f.size || c.byte_length > f.size - c.byte_offset)
        return Status::corruption(cwho() + ": bytes [" + std::to_string(c.byte_offset) + ", +" +
                                  std::to_string(c.byte_length) + ") run past the end of file '" +
                                  f.name + "' (" + std::to_string(f.size) + " bytes)");
      if (!c.checksums.empty()) {
        const uint64_t blocks = c.byte_length / m.checksum_block_bytes +
                                (c.byte_length % m.checksum_block_bytes != 0 ? 1 : 0);
        if (c.checksums.size() != blocks)
          return Status::corruption(cwho() + ": " + std::to_string(c.checksums.size()) +
                                    " checksums, expected " + std::to_string(blocks) + " for " +
                                    std::to_string(c.byte_length) + " bytes in blocks of " +
                                    std::to_string(m.checksum_block_bytes));
      }
      if (!entries.emplace(c.file, std::string_view(c.entry)).second)
        return Status::corruption(cwho() + ": entry '" + c.entry + "' appears twice in file '" +
                                  f.name + "'");
      if (c.byte_length > 0)
        ranges.push_back({c.file, c.byte_offset, c.byte_offset + c.byte_length, ti, ci});
    }
    FERRY_RETURN_IF_ERROR(check_disjoint(t, who));
  }

  // Two chunks sharing bytes would make one of them wrong whatever is on disk.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return std::tie(a.file, a.begin) < std::tie(b.file, b.begin);
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const auto& a = ranges[i - 1];
    const auto& b = ranges[i];
    if (a.file == b.file && b.begin < a.end)
      return Status::corruption("manifest: tensor '" + m.tensors[b.tensor].key + "' chunk " +
                                std::to_string(b.chunk) + " overlaps tensor '" +
                                m.tensors[a.tensor].key + "' chunk " + std::to_string(a.chunk) +
                                " in file '" + m.files[a.file].name + "'");
  }
  return Status();
}

}  // namespace

const ManifestTensor* Manifest::find(const std::string& key) const {
  auto it =
      std::lower_bound(tensors.begin(), tensors.end(), key,
                       [](const ManifestTensor& t, const std::string& k) { return t.key < k; });
  return it != tensors.end() && it->key == key ? &*it : nullptr;
}

uint64_t Manifest::total_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors)
    for (const auto& c : t.chunks) n += c.byte_length;
  return n;
}

const std::vector<std::string>& known_manifest_features() {
  // A name added here must also be described in docs/format.md.
  static const std::vector<std::string> kKnown = {kCodecZstdFeature};
  return kKnown;
}

std::string encode_manifest(const Manifest& m) {
  std::string out;
  encode_manifest_into(m, &out);
  return out;
}

namespace {

// The Cap'n Proto form of `m` into `root`.
void build_payload(const Manifest& m, proto::Manifest::Builder root) {
  root.setFormatVersion(m.format_version);
  root.setStep(m.step);
  root.setCommitSeq(m.commit_seq);
  root.setWorldSize(m.world_size);
  root.setJobId(text(m.job_id));
  root.setCheckpointId(text(m.checkpoint_id));
  root.setFsynced(m.fsynced);
  root.setChecksumBlockBytes(m.checksum_block_bytes);
  root.setCreatedUnixMs(m.created_unix_ms);

  auto features = root.initRequiredFeatures(static_cast<unsigned>(m.required_features.size()));
  for (size_t i = 0; i < m.required_features.size(); ++i)
    features.set(static_cast<unsigned>(i), text(m.required_features[i]));

  auto files = root.initFiles(static_cast<unsigned>(m.files.size()));
  for (size_t i = 0; i < m.files.size(); ++i) {
    auto f = files[static_cast<unsigned>(i)];
    f.setName(text(m.files[i].name));
    f.setSize(m.files[i].size);
    f.setRank(m.files[i].rank);
    f.setHeaderBytes(m.files[i].header_bytes);
    f.setHeaderChecksum(m.files[i].header_checksum);
  }

  auto tensors = root.initTensors(static_cast<unsigned>(m.tensors.size()));
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const auto& mt = m.tensors[i];
    auto t = tensors[static_cast<unsigned>(i)];
    t.setKey(text(mt.key));
    t.setDtype(dtype_name(mt.dtype));
    if (mt.per_rank >= 0) {
      t.setPerRank(true);
      t.setRank(mt.per_rank);
    }
    fill(t.initGlobalShape(static_cast<unsigned>(mt.global_shape.size())), mt.global_shape);
    auto chunks = t.initChunks(static_cast<unsigned>(mt.chunks.size()));
    for (size_t j = 0; j < mt.chunks.size(); ++j) {
      const auto& mc = mt.chunks[j];
      auto c = chunks[static_cast<unsigned>(j)];
      fill(c.initOffsets(static_cast<unsigned>(mc.offsets.size())), mc.offsets);
      fill(c.initSizes(static_cast<unsigned>(mc.sizes.size())), mc.sizes);
      capnp_util::set_stored_bytes(c, mc);
    }
  }

  auto metadata = root.initMetadata(static_cast<unsigned>(m.metadata.size()));
  for (size_t i = 0; i < m.metadata.size(); ++i) {
    auto kv = metadata[static_cast<unsigned>(i)];
    kv.setKey(text(m.metadata[i].first));
    kv.setValue(text(m.metadata[i].second));
  }
}

// The frame up to the payload's length: magic, version, required features.
// `more`: the bytes that will follow, reserved.
void put_frame_start(const Manifest& m, size_t more, std::string& out) {
  out.clear();
  size_t feature_bytes = 0;
  for (const auto& f : m.required_features) feature_bytes += 2 + f.size();
  out.reserve(sizeof(kMagic) + 8 + feature_bytes + more);
  out.append(kMagic, sizeof(kMagic));
  put_u32(out, m.format_version);
  put_u32(out, static_cast<uint32_t>(m.required_features.size()));
  for (const auto& f : m.required_features) {
    // Feature names are short identifiers; a longer one is a caller bug.
    const size_t n = std::min<size_t>(f.size(), std::numeric_limits<uint16_t>::max());
    put_u16(out, static_cast<uint16_t>(n));
    out.append(f.data(), n);
  }
}

// Frame and `message` (m's payload) into *out_bytes. Returns the payload's
// size in words; *segments, how many it holds.
size_t write_framed(const Manifest& m, capnp::MessageBuilder& message, std::string* out_bytes,
                    size_t* segments) {
  const size_t payload_size = capnp::computeSerializedSizeInWords(message) * sizeof(capnp::word);
  *segments = message.getSegmentsForOutput().size();

  std::string& out = *out_bytes;
  put_frame_start(m, 16 + payload_size, out);
  put_u64(out, payload_size);
  const size_t at = out.size() + 8;  // after the checksum
  put_u64(out, 0);                   // the checksum, once the payload is there
  // capnp::writeMessage's bytes (segment table, then the segments), appended
  // rather than written over a resized string, which would zero megabytes
  // first.
  auto segs = message.getSegmentsForOutput();
  put_u32(out, static_cast<uint32_t>(segs.size() - 1));
  for (auto seg : segs) put_u32(out, static_cast<uint32_t>(seg.size()));
  if (segs.size() % 2 == 0) put_u32(out, 0);  // the table fills whole words
  for (auto seg : segs)
    out.append(reinterpret_cast<const char*>(seg.begin()), seg.size() * sizeof(capnp::word));
  const uint64_t sum = xxh3_64(out.data() + at, payload_size);
  for (int i = 0; i < 8; ++i) out[at - 8 + i] = static_cast<char>((sum >> (8 * i)) & 0xff);
  return payload_size / sizeof(capnp::word);
}

// Frame and payload into *out_bytes; the builder starts in `first` (zeroed).
// Returns the payload's size in words; *segments, how many it holds.
size_t encode_framed(const Manifest& m, kj::ArrayPtr<capnp::word> first, std::string* out_bytes,
                     size_t* segments) {
  capnp::MallocMessageBuilder message(first);
  build_payload(m, message.initRoot<proto::Manifest>());
  return write_framed(m, message, out_bytes, segments);
}

}  // namespace

namespace {

// A builder's first segment, kept between encodes and sized to the largest
// manifest so far: megabytes of fresh memory are paged in on every commit
// otherwise, most of an encode's time. 64-bit words, not capnp::word, which
// libstdc++ cannot fill or resize under clang.
class KeptSegment {
 public:
  // Zeroed, as Cap'n Proto requires of a first segment.
  kj::ArrayPtr<capnp::word> zeroed() {
    std::fill(words_.begin(), words_.end(), uint64_t{0});
    return {reinterpret_cast<capnp::word*>(words_.data()), words_.size()};
  }
  void grow(size_t words) { words_.resize(words); }
  bool oversized() const { return words_.size() * sizeof(uint64_t) > kKeptManifestBufferBytes; }
  // Gives back what one huge manifest took; no message may be built in it
  // (a builder zeroes its first segment as it goes).
  void trim() { std::vector<uint64_t>(kFirstWords).swap(words_); }

 private:
  static constexpr size_t kFirstWords = 1024;
  std::vector<uint64_t> words_ = std::vector<uint64_t>(kFirstWords);
};

}  // namespace

void encode_manifest_into(const Manifest& m, std::string* out) {
  // Always one segment, so the bytes depend on the manifest alone, not on
  // what the thread encoded before: one that does not fit is encoded again.
  static thread_local KeptSegment segment;
  for (;;) {
    size_t segments = 0;
    const size_t words = encode_framed(m, segment.zeroed(), out, &segments);
    if (segments == 1) break;
    segment.grow(words);
  }
  if (segment.oversized()) segment.trim();
}

namespace {

// Patching writes values into a message built before; it holds the bytes a
// fresh build gives only where the message's shape is the same: every
// list's length, every text's length, which optional fields are present.
bool patch_text(capnp::Text::Builder b, std::string_view s) {
  if (b.size() != s.size()) return false;
  if (!s.empty()) std::memcpy(b.begin(), s.data(), s.size());
  return true;
}

// Where build_payload put each tensor's and chunk's parts in the message's
// segment, so a repeated save's values are written there directly: going
// through Cap'n Proto's accessors for every chunk costs as much as building.
struct Span {
  kj::byte* p = nullptr;
  size_t n = 0;  // bytes
};
struct WhereTensor {
  Span key, dtype, shape, data;
  size_t chunks = 0;
};
// What a repeated save rewrites first: one cache line of the walk.
struct WhereChunk {
  Span data, checksums, offsets, sizes, entry, codec, frame_ends;
};
struct Where {
  std::vector<WhereTensor> tensors;
  std::vector<WhereChunk> chunks;  // of every tensor, in order
};

// Byte (or, for a Bool, bit) offsets of the fields in their data sections.
struct Offsets {
  size_t file, byte_offset, byte_length, raw_length, frame_bytes, per_rank_bit, rank;
};
const Offsets& offsets() {
  static const Offsets o = [] {
    auto slot = [](capnp::StructSchema s, const char* name, size_t bytes) {
      return static_cast<size_t>(s.getFieldByName(name).getProto().getSlot().getOffset()) * bytes;
    };
    const auto chunk = capnp::Schema::from<proto::Chunk>();
    const auto tensor = capnp::Schema::from<proto::Tensor>();
    return Offsets{slot(chunk, "file", 4),       slot(chunk, "byteOffset", 8),
                   slot(chunk, "byteLength", 8), slot(chunk, "rawLength", 8),
                   slot(chunk, "frameBytes", 8), slot(tensor, "perRank", 1),
                   slot(tensor, "rank", 4)};
  }();
  return o;
}

Span span(capnp::Text::Builder t) {
  return {reinterpret_cast<kj::byte*>(t.begin()), t.size()};
}
template <class List>
Span span(List l) {
  auto raw = capnp::AnyList::Reader(l.asReader()).getRawBytes();
  return {const_cast<kj::byte*>(raw.begin()), raw.size()};
}
Span span_data(capnp::AnyStruct::Builder b) {
  auto d = b.getDataSection();
  return {d.begin(), d.size()};
}

void record(proto::Manifest::Builder root, Where* where) {
  where->tensors.clear();
  where->chunks.clear();
  for (auto t : root.getTensors()) {
    auto chunks = t.getChunks();
    where->tensors.push_back({span(t.getKey()), span(t.getDtype()), span(t.getGlobalShape()),
                              span_data(capnp::AnyStruct::Builder(proto::Tensor::Builder(t))),
                              chunks.size()});
    for (auto c : chunks)
      where->chunks.push_back({span_data(capnp::AnyStruct::Builder(proto::Chunk::Builder(c))),
                               span(c.getChecksums()), span(c.getOffsets()), span(c.getSizes()),
                               span(c.getEntry()), c.hasCodec() ? span(c.getCodec()) : Span{},
                               c.hasFrameEnds() ? span(c.getFrameEnds()) : Span{}});
  }
}

// The little-endian bytes of `n` bytes of values at `v` into `at`, when the
// sizes agree.
bool put(const Span& at, const void* v, size_t n) {
  if (at.n != n) return false;
  if (n != 0) std::memcpy(at.p, v, n);
  return true;
}
template <class T>
void put_field(const Span& data, size_t offset, T v) {
  std::memcpy(data.p + offset, &v, sizeof v);
}

// `names_kept`: the message holds the tensors' keys, dtypes, shapes,
// per-rank values, boxes and entries already (ManifestEncoder's `body`).
bool patch_tensors(const Manifest& m, const Where& where, bool names_kept) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the message is written in host order");
  const Offsets& o = offsets();
  if (where.tensors.size() != m.tensors.size()) return false;
  size_t k = 0;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const ManifestTensor& mt = m.tensors[i];
    const WhereTensor& wt = where.tensors[i];
    if (wt.chunks != mt.chunks.size() || k + mt.chunks.size() > where.chunks.size()) return false;
    // A tensor's chunks, their checksums and their places in the message lie
    // all over memory: asked for ahead, the walk is not one cache miss after
    // another (at 100,000 tensors it is bound by those misses).
    if (i + 16 < m.tensors.size()) __builtin_prefetch(m.tensors[i + 16].chunks.data());
    if (i + 8 < m.tensors.size() && !m.tensors[i + 8].chunks.empty())
      __builtin_prefetch(m.tensors[i + 8].chunks.front().checksums.data());
    if (k + 8 < where.chunks.size()) {
      __builtin_prefetch(where.chunks[k + 8].checksums.p, 1);
      __builtin_prefetch(where.chunks[k + 8].data.p, 1);
    }
    if (!names_kept) {
      const char* dtype = dtype_name(mt.dtype);
      if (!put(wt.key, mt.key.data(), mt.key.size()) || !put(wt.dtype, dtype, std::strlen(dtype)) ||
          !put(wt.shape, mt.global_shape.data(), mt.global_shape.size() * sizeof(int64_t)))
        return false;
      // build_payload leaves both at zero for an ordinary tensor.
      kj::byte& flags = wt.data.p[o.per_rank_bit / 8];
      const kj::byte bit = static_cast<kj::byte>(1u << (o.per_rank_bit % 8));
      flags = static_cast<kj::byte>(mt.per_rank >= 0 ? flags | bit : flags & ~bit);
      put_field<int32_t>(wt.data, o.rank, mt.per_rank >= 0 ? mt.per_rank : 0);
    }
    for (const ManifestChunk& mc : mt.chunks) {
      const WhereChunk& wc = where.chunks[k++];
      if (!names_kept &&
          (!put(wc.offsets, mc.offsets.data(), mc.offsets.size() * sizeof(int64_t)) ||
           !put(wc.sizes, mc.sizes.data(), mc.sizes.size() * sizeof(int64_t)) ||
           !put(wc.entry, mc.entry.data(), mc.entry.size())))
        return false;
      if (!put(wc.checksums, mc.checksums.data(), mc.checksums.size() * sizeof(uint64_t)))
        return false;
      put_field<uint32_t>(wc.data, o.file, mc.file);
      put_field<uint64_t>(wc.data, o.byte_offset, mc.byte_offset);
      put_field<uint64_t>(wc.data, o.byte_length, mc.byte_length);
      // set_stored_bytes writes the codec's fields only for a compressed chunk.
      if ((wc.codec.p != nullptr) != !mc.codec.empty()) return false;
      if (mc.codec.empty()) {
        if (wc.frame_ends.p != nullptr) return false;
        continue;
      }
      if (!put(wc.codec, mc.codec.data(), mc.codec.size()) ||
          !put(wc.frame_ends, mc.frame_ends.data(), mc.frame_ends.size() * sizeof(uint64_t)))
        return false;
      put_field<uint64_t>(wc.data, o.raw_length, mc.raw_length);
      put_field<uint64_t>(wc.data, o.frame_bytes, mc.frame_bytes);
    }
  }
  return true;
}

// build_payload's result, written over a message build_payload made for a
// manifest of the same shape; false (the message then half written) if the
// shapes differ.
// `chunks_kept`: with names_kept, the message holds every chunk's values
// too (ManifestEncoder::chunks_put), so no tensor is rewritten.
bool patch_payload(const Manifest& m, proto::Manifest::Builder root, const Where& where,
                   bool names_kept, bool chunks_kept) {
  auto features = root.getRequiredFeatures();
  auto files = root.getFiles();
  auto tensors = root.getTensors();
  auto metadata = root.getMetadata();
  if (features.size() != m.required_features.size() || files.size() != m.files.size() ||
      tensors.size() != m.tensors.size() || metadata.size() != m.metadata.size() ||
      !patch_text(root.getJobId(), m.job_id) ||
      !patch_text(root.getCheckpointId(), m.checkpoint_id))
    return false;
  root.setFormatVersion(m.format_version);
  root.setStep(m.step);
  root.setCommitSeq(m.commit_seq);
  root.setWorldSize(m.world_size);
  root.setFsynced(m.fsynced);
  root.setChecksumBlockBytes(m.checksum_block_bytes);
  root.setCreatedUnixMs(m.created_unix_ms);
  for (size_t i = 0; i < m.required_features.size(); ++i)
    if (!patch_text(features[static_cast<unsigned>(i)], m.required_features[i])) return false;
  for (size_t i = 0; i < m.files.size(); ++i) {
    const ManifestFile& mf = m.files[i];
    auto f = files[static_cast<unsigned>(i)];
    if (!patch_text(f.getName(), mf.name)) return false;
    f.setSize(mf.size);
    f.setRank(mf.rank);
    f.setHeaderBytes(mf.header_bytes);
    f.setHeaderChecksum(mf.header_checksum);
  }
  if (names_kept && chunks_kept) {
    if (where.tensors.size() != m.tensors.size()) return false;
  } else if (!patch_tensors(m, where, names_kept)) {
    return false;
  }
  for (size_t i = 0; i < m.metadata.size(); ++i) {
    auto kv = metadata[static_cast<unsigned>(i)];
    if (!patch_text(kv.getKey(), m.metadata[i].first) ||
        !patch_text(kv.getValue(), m.metadata[i].second))
      return false;
  }
  return true;
}

}  // namespace

struct ManifestEncoder::Kept {
  KeptSegment segment;
  // Built in `segment` alone (one segment, as encode_manifest_into's); null
  // when nothing is kept.
  std::unique_ptr<capnp::MallocMessageBuilder> message;
  Where where;
};

ManifestEncoder::ManifestEncoder() : kept_(std::make_unique<Kept>()) {}
ManifestEncoder::~ManifestEncoder() = default;
ManifestEncoder::ManifestEncoder(ManifestEncoder&&) noexcept = default;
ManifestEncoder& ManifestEncoder::operator=(ManifestEncoder&&) noexcept = default;

void ManifestEncoder::encode(const Manifest& m, std::string* out, uint64_t body) {
  const std::string_view rest = encode_parts(m, out, body);
  out->reserve(out->size() + rest.size());
  out->append(rest);
  release_oversized();
}

std::string_view ManifestEncoder::encode_parts(const Manifest& m, std::string* head,
                                               uint64_t body) {
  if (!kept_) kept_ = std::make_unique<Kept>();
  Kept& k = *kept_;
  const bool names_kept = body != 0 && body == body_;
  const bool chunks_kept = names_kept && chunks_put_ == body;
  // Until it is whole again the message holds no body a later call may name.
  body_ = 0;
  chunks_put_ = 0;
  patched_ = k.message != nullptr && patch_payload(m, k.message->getRoot<proto::Manifest>(),
                                                   k.where, names_kept, chunks_kept);
  if (!patched_) {
    // Built afresh (a header of another shape): the newest chunk values are
    // the message's, taken before it goes.
    Manifest whole;
    if (chunks_kept) {
      whole = m;
      const bool taken = take_chunks(&whole);
      assert(taken);  // the message holds `body`, whose shape m has
      (void)taken;
    }
    const Manifest& from = chunks_kept ? whole : m;
    for (;;) {
      k.message.reset();
      k.message = std::make_unique<capnp::MallocMessageBuilder>(k.segment.zeroed());
      build_payload(from, k.message->initRoot<proto::Manifest>());
      if (k.message->getSegmentsForOutput().size() == 1) break;
      const size_t words = capnp::computeSerializedSizeInWords(*k.message);
      k.message.reset();
      k.segment.grow(words);
    }
    record(k.message->getRoot<proto::Manifest>(), &k.where);
  }
  body_ = body;
  if (chunks_kept) chunks_put_ = body;
  // writeMessage's bytes of one segment: its table (count - 1, size), then
  // the segment, which stays where the message keeps it.
  const kj::ArrayPtr<const capnp::word> seg = k.message->getSegmentsForOutput()[0];
  const std::string_view rest(reinterpret_cast<const char*>(seg.begin()),
                              seg.size() * sizeof(capnp::word));
  std::string table;
  put_u32(table, 0);
  put_u32(table, static_cast<uint32_t>(seg.size()));
  StreamingChecksum sum;
  sum.update(table.data(), table.size());
  sum.update(rest.data(), rest.size());
  std::string& out = *head;
  put_frame_start(m, 24, out);
  put_u64(out, table.size() + rest.size());
  put_u64(out, sum.digest());
  out.append(table);
  return rest;
}

bool ManifestEncoder::holds(uint64_t body) const {
  return body != 0 && body == body_ && kept_ && kept_->message != nullptr;
}

template <class T>
T get_field(const Span& data, size_t offset) {
  T v;
  std::memcpy(&v, data.p + offset, sizeof v);
  return v;
}

bool ManifestEncoder::put_chunk(size_t i, uint64_t byte_offset, uint64_t byte_length,
                                const uint64_t* sums, size_t n, bool* same) {
  if (i >= kept_->where.chunks.size()) return false;
  const WhereChunk& wc = kept_->where.chunks[i];
  if (!put(wc.checksums, sums, n * sizeof(uint64_t))) return false;
  const Offsets& o = offsets();
  *same = *same && get_field<uint64_t>(wc.data, o.byte_offset) == byte_offset &&
          get_field<uint64_t>(wc.data, o.byte_length) == byte_length;
  put_field<uint64_t>(wc.data, o.byte_offset, byte_offset);
  put_field<uint64_t>(wc.data, o.byte_length, byte_length);
  return true;
}

bool ManifestEncoder::take_chunks(Manifest* m) const {
  if (!kept_ || kept_->message == nullptr) return false;
  const std::vector<WhereChunk>& chunks = kept_->where.chunks;
  size_t n = 0;
  for (const ManifestTensor& t : m->tensors) n += t.chunks.size();
  if (n != chunks.size()) return false;
  if (m->tensors.size() != kept_->where.tensors.size()) return false;
  for (size_t i = 0; i < m->tensors.size(); ++i)
    if (m->tensors[i].chunks.size() != kept_->where.tensors[i].chunks) return false;
  const Offsets& o = offsets();
  size_t k = 0;
  for (ManifestTensor& t : m->tensors)
    for (ManifestChunk& mc : t.chunks) {
      const WhereChunk& wc = chunks[k++];
      mc.byte_offset = get_field<uint64_t>(wc.data, o.byte_offset);
      mc.byte_length = get_field<uint64_t>(wc.data, o.byte_length);
      const size_t sums = wc.checksums.n / sizeof(uint64_t);
      mc.checksums.resize(sums);
      if (sums != 0) std::memcpy(mc.checksums.data(), wc.checksums.p, wc.checksums.n);
    }
  return true;
}

void ManifestEncoder::prefetch_chunk(size_t near, size_t far) const {
  const std::vector<WhereChunk>& chunks = kept_->where.chunks;
  if (far < chunks.size()) __builtin_prefetch(&chunks[far]);
  if (near < chunks.size()) {
    __builtin_prefetch(chunks[near].data.p, 1);
    __builtin_prefetch(chunks[near].checksums.p, 1);
  }
}

void ManifestEncoder::release_oversized() {
  // Held chunk values are the only copy of them: kept, whatever the size.
  if (!kept_ || !kept_->segment.oversized() || chunks_put_ != 0) return;
  body_ = 0;
  kept_->message.reset();
  kept_->where = Where{};
  kept_->segment.trim();
}

namespace {

// The frame before the payload: magic, version, required features, payload
// length and checksum. `bytes` may end anywhere after that (a file's head).
struct Frame {
  uint32_t version = 0;
  std::vector<std::string> features;
  uint64_t payload_len = 0;
  uint64_t payload_sum = 0;
};

Result<Frame> read_frame(FrameReader& r, size_t total_bytes) {
  Frame fr;
  std::string_view magic;
  if (!r.take(sizeof(kMagic), &magic) || std::memcmp(magic.data(), kMagic, sizeof(kMagic)) != 0)
    return Status::corruption("MANIFEST has a bad magic (not a Ferry manifest, " +
                              std::to_string(total_bytes) + " bytes)");

  if (!r.take_le(&fr.version)) return truncated(r, "format version");
  if (fr.version == 0) return Status::corruption("MANIFEST format version is 0");
  if (fr.version > kManifestFormatVersion)
    return Status::unsupported("MANIFEST format version " + std::to_string(fr.version) +
                               " is newer than this build supports (version " +
                               std::to_string(kManifestFormatVersion) + ")");

  uint32_t feature_count = 0;
  if (!r.take_le(&feature_count)) return truncated(r, "required feature count");
  const auto& known = known_manifest_features();
  for (uint32_t i = 0; i < feature_count; ++i) {
    uint16_t len = 0;
    std::string_view name;
    if (!r.take_le(&len) || !r.take(len, &name)) return truncated(r, "required feature");
    if (name.empty()) return Status::corruption("MANIFEST names an empty required feature");
    if (std::find(known.begin(), known.end(), name) == known.end())
      return Status::unsupported("MANIFEST requires feature '" + std::string(name) +
                                 "', which this build does not know");
    fr.features.emplace_back(name);
  }

  if (!r.take_le(&fr.payload_len) || !r.take_le(&fr.payload_sum))
    return truncated(r, "payload header");
  return fr;
}

}  // namespace

Result<uint64_t> manifest_payload_sum(std::string_view head) {
  FrameReader r(head);
  FERRY_ASSIGN_OR_RETURN(Frame fr, read_frame(r, head.size()));
  return fr.payload_sum;
}

Result<uint64_t> manifest_file_bytes(std::string_view head) {
  FrameReader r(head);
  FERRY_ASSIGN_OR_RETURN(Frame fr, read_frame(r, head.size()));
  const uint64_t frame = r.position();
  if (fr.payload_len > std::numeric_limits<uint64_t>::max() - frame)
    return Status::corruption("MANIFEST payload length " + std::to_string(fr.payload_len) +
                              " overflows");
  return frame + fr.payload_len;
}

namespace {

// Payloads are read in place when aligned, else copied into a buffer this
// thread keeps (up to kKeptManifestBufferBytes): ordering many checkpoints reads many
// manifests, and a fresh buffer for each cost more in page faults than
// everything else.
// 64-bit words, not capnp::word, which libstdc++ cannot move under clang.
std::vector<uint64_t>& payload_scratch() {
  static thread_local std::vector<uint64_t> scratch;
  return scratch;
}

kj::ArrayPtr<const capnp::word> payload_words(std::string_view payload) {
  static_assert(sizeof(capnp::word) == sizeof(uint64_t));
  const size_t nwords = payload.size() / sizeof(capnp::word);
  if (reinterpret_cast<uintptr_t>(payload.data()) % alignof(capnp::word) == 0)
    return {reinterpret_cast<const capnp::word*>(payload.data()), nwords};
  std::vector<uint64_t>& scratch = payload_scratch();
  scratch.resize(nwords);
  std::memcpy(scratch.data(), payload.data(), nwords * sizeof(capnp::word));
  return {reinterpret_cast<const capnp::word*>(scratch.data()), nwords};
}

void trim_payload_scratch() {
  std::vector<uint64_t>& scratch = payload_scratch();
  if (scratch.capacity() * sizeof(uint64_t) > kKeptManifestBufferBytes)
    std::vector<uint64_t>().swap(scratch);
}

// Checks the frame, the payload's length and checksum, then hands the
// payload's root to `read` (which may throw what Cap'n Proto throws).
template <class Read>
Status read_checked_payload(std::string_view bytes, Frame* fr, Read&& read) {
  FrameReader r(bytes);
  FERRY_ASSIGN_OR_RETURN(*fr, read_frame(r, bytes.size()));
  const uint64_t payload_len = fr->payload_len;
  if (payload_len != r.remaining())
    return Status::corruption("MANIFEST payload length is " + std::to_string(payload_len) +
                              " but " + std::to_string(r.remaining()) + " bytes follow");
  if (payload_len == 0 || payload_len % sizeof(capnp::word) != 0)
    return Status::corruption("MANIFEST payload length " + std::to_string(payload_len) +
                              " is not a positive multiple of 8");
  std::string_view payload;
  r.take(payload_len, &payload);
  const uint64_t actual_sum = xxh3_64(payload.data(), payload.size());
  if (actual_sum != fr->payload_sum)
    return Status::corruption("MANIFEST payload checksum mismatch (stored " +
                              std::to_string(fr->payload_sum) + ", computed " +
                              std::to_string(actual_sum) + ")");

  // Cap'n Proto reads words in place, so it needs 8-byte alignment the input
  // string does not promise.
  const size_t nwords = payload_len / sizeof(capnp::word);
  struct Trim {
    ~Trim() { trim_payload_scratch(); }
  } trim;
  try {
    const kj::ArrayPtr<const capnp::word> words = payload_words(payload);
    capnp::FlatArrayMessageReader reader(words, capnp_util::bounded_options(nwords, kMarginWords));
    if (reader.getEnd() != words.end())
      return Status::corruption("MANIFEST payload has " +
                                std::to_string((words.end() - reader.getEnd()) * 8) +
                                " bytes after the message");
    return read(reader.getRoot<proto::Manifest>());
  } catch (const kj::Exception& e) {
    return Status::corruption("MANIFEST payload does not decode: " +
                              std::string(e.getDescription().cStr()));
  } catch (const std::exception& e) {
    return Status::corruption(std::string("MANIFEST payload does not decode: ") + e.what());
  }
}

}  // namespace

Result<ManifestSummary> summarize_manifest(std::string_view bytes) {
  Frame fr;
  ManifestSummary out;
  FERRY_RETURN_IF_ERROR(read_checked_payload(bytes, &fr, [&out](proto::Manifest::Reader root) {
    out.step = root.getStep();
    out.commit_seq = root.getCommitSeq();
    return Status();
  }));
  out.payload_sum = fr.payload_sum;
  return out;
}

namespace {
std::atomic<uint64_t> g_manifest_decodes{0};
}  // namespace

uint64_t manifest_decodes() {
  return g_manifest_decodes.load(std::memory_order_relaxed);
}

Result<Manifest> decode_manifest(std::string_view bytes) {
  g_manifest_decodes.fetch_add(1, std::memory_order_relaxed);
  Frame fr;
  Manifest m;
  FERRY_RETURN_IF_ERROR(read_checked_payload(
      bytes, &fr, [&m](proto::Manifest::Reader root) { return from_proto(root, &m); }));

  // The payload repeats the frame's version and features so that a frame
  // edited without the payload (which the checksum cannot see) is caught.
  if (m.format_version != fr.version)
    return Status::corruption("MANIFEST frame says version " + std::to_string(fr.version) +
                              " but its payload says " + std::to_string(m.format_version));
  if (m.required_features != fr.features)
    return Status::corruption("MANIFEST frame and payload list different required features");

  FERRY_RETURN_IF_ERROR(check_semantics(m));
  return m;
}

Status check_manifest(const Manifest& m) {
  return check_semantics(m);
}

}  // namespace ferry
