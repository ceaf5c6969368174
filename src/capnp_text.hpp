// Conversions between Ferry's C++ values and Cap'n Proto readers and
// builders, shared by the protocol, the manifest and the plan bytes.
#pragma once

#include <capnp/list.h>
#include <capnp/message.h>
#include <kj/array.h>
#include <kj/string.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace ferry::capnp_util {

inline kj::StringPtr text(const std::string& s) {
  return kj::StringPtr(s.c_str(), s.size());
}

inline std::string str(capnp::Text::Reader t) {
  return std::string(t.cStr(), t.size());
}

inline std::vector<int64_t> i64s(capnp::List<int64_t>::Reader l) {
  std::vector<int64_t> v;
  v.reserve(l.size());
  for (int64_t x : l) v.push_back(x);
  return v;
}

// Sets list[i] = values[i]; the list was initialized with values.size().
template <class ListBuilder, class Vector>
void fill(ListBuilder list, const Vector& values) {
  for (size_t i = 0; i < values.size(); ++i) list.set(static_cast<unsigned>(i), values[i]);
}

// Where a chunk's bytes lie and how they are stored (file, byte range, entry,
// checksums, codec and frames): the same fields in the manifest's Chunk and
// in a rank's WrittenChunk (plan.capnp), and in their C++ forms, so one pair
// of functions moves them for both. The frame fields are written only for a
// compressed chunk (codec not empty).
template <class ChunkBuilder, class Chunk>
void set_stored_bytes(ChunkBuilder b, const Chunk& c) {
  b.setFile(c.file);
  b.setByteOffset(c.byte_offset);
  b.setByteLength(c.byte_length);
  b.setEntry(text(c.entry));
  fill(b.initChecksums(static_cast<unsigned>(c.checksums.size())), c.checksums);
  if (!c.codec.empty()) {
    b.setCodec(text(c.codec));
    b.setRawLength(c.raw_length);
    b.setFrameBytes(c.frame_bytes);
    fill(b.initFrameEnds(static_cast<unsigned>(c.frame_ends.size())), c.frame_ends);
  }
}

template <class ChunkReader, class Chunk>
void get_stored_bytes(ChunkReader r, Chunk* c) {
  c->file = r.getFile();
  c->byte_offset = r.getByteOffset();
  c->byte_length = r.getByteLength();
  c->entry = str(r.getEntry());
  auto sums = r.getChecksums();
  c->checksums.reserve(sums.size());
  for (uint64_t s : sums) c->checksums.push_back(s);
  c->codec = str(r.getCodec());
  c->raw_length = r.getRawLength();
  c->frame_bytes = r.getFrameBytes();
  for (uint64_t e : r.getFrameEnds()) c->frame_ends.push_back(e);
}

// Cap'n Proto reads words in place, and bytes from a file or a frame may
// sit at any address: an aligned copy of the whole words of `n` bytes.
inline kj::Array<capnp::word> aligned_words(const void* data, size_t n) {
  kj::Array<capnp::word> words = kj::heapArray<capnp::word>(n / sizeof(capnp::word));
  std::memcpy(words.begin(), data, words.size() * sizeof(capnp::word));
  return words;
}

// Decode limits for untrusted bytes: the traversal limit scales with the
// input (each word is read about once; the factor covers list headers and
// zero-sized elements, charged a word each; the margin tiny messages), so a
// crafted message cannot make the reader loop, and our schemas nest at most
// about seven levels, so anything deeper than 16 is not ours.
inline capnp::ReaderOptions bounded_options(size_t words, uint64_t margin_words) {
  capnp::ReaderOptions o;
  o.traversalLimitInWords = words * 4 + margin_words;
  o.nestingLimit = 16;
  return o;
}

}  // namespace ferry::capnp_util
