#include "manifest.hpp"

#include <catch2/catch.hpp>

#include "checksum.hpp"

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

namespace {

using ferry::DType;
using ferry::Manifest;
using ferry::ManifestChunk;
using ferry::ManifestTensor;
using ferry::StatusCode;

// Appends a chunk to the tensor's file `file`, placed right after the bytes
// already used there, with a valid checksum list for block size `block`.
void add_chunk(Manifest& m, ManifestTensor& t, uint32_t file, std::vector<int64_t> offsets,
               std::vector<int64_t> sizes, bool with_checksums = true) {
  ManifestChunk c;
  c.offsets = std::move(offsets);
  c.sizes = std::move(sizes);
  c.file = file;
  uint64_t numel = 1;
  for (int64_t s : c.sizes) numel *= static_cast<uint64_t>(s);
  c.byte_length = numel * ferry::dtype_size(t.dtype);
  c.byte_offset = m.files[file].size;
  m.files[file].size += c.byte_length;
  c.entry = t.key + "@";
  for (size_t i = 0; i < c.offsets.size(); ++i)
    c.entry += (i ? "," : "") + std::to_string(c.offsets[i]);
  if (with_checksums) {
    const uint64_t blocks = (c.byte_length + m.checksum_block_bytes - 1) / m.checksum_block_bytes;
    for (uint64_t b = 0; b < blocks; ++b) c.checksums.push_back(0x9e3779b97f4a7c15ull * (b + 1));
  }
  t.chunks.push_back(std::move(c));
}

ManifestTensor tensor(std::string key, DType dtype, std::vector<int64_t> shape) {
  ManifestTensor t;
  t.key = std::move(key);
  t.dtype = dtype;
  t.global_shape = std::move(shape);
  return t;
}

// Several tensors over two files: split along rows, a 0-d scalar, a
// zero-size tensor, one without checksums, and metadata with odd bytes.
Manifest rich_manifest() {
  Manifest m;
  m.step = 1200;
  m.commit_seq = 7;
  m.world_size = 2;
  m.job_id = "job-abc";
  m.checkpoint_id = "ckpt-\xce\xbb-1";
  m.fsynced = false;
  m.checksum_block_bytes = 16;
  m.created_unix_ms = 1'700'000'000'123;
  m.files = {{"rank-00000-0000.safetensors", 4096, 0}, {"rank-00001-0000.safetensors", 4096, 1}};

  auto a = tensor("a.weight", DType::f32, {4, 6});
  add_chunk(m, a, 0, {0, 0}, {2, 6});
  add_chunk(m, a, 1, {2, 0}, {2, 6});
  auto b = tensor("b.bias", DType::bf16, {10});
  add_chunk(m, b, 0, {0}, {10});
  auto c = tensor("c.scalar", DType::i64, {});
  add_chunk(m, c, 1, {}, {});
  auto d = tensor("d.empty", DType::f32, {0, 3});
  add_chunk(m, d, 0, {0, 0}, {0, 3});
  auto e = tensor("e.no_sums", DType::u8, {5});
  add_chunk(m, e, 1, {0}, {5}, /*with_checksums=*/false);
  m.tensors = {a, b, c, d, e};
  m.metadata = {{"lr", "0.001"}, {"empty", ""}, {"nul\0key", "v\nalue"}};
  m.metadata[2].first = std::string("nul\0key", 7);
  return m;
}

void require_same(const Manifest& x, const Manifest& y) {
  REQUIRE(x.format_version == y.format_version);
  REQUIRE(x.required_features == y.required_features);
  REQUIRE(x.step == y.step);
  REQUIRE(x.commit_seq == y.commit_seq);
  REQUIRE(x.world_size == y.world_size);
  REQUIRE(x.job_id == y.job_id);
  REQUIRE(x.checkpoint_id == y.checkpoint_id);
  REQUIRE(x.fsynced == y.fsynced);
  REQUIRE(x.checksum_block_bytes == y.checksum_block_bytes);
  REQUIRE(x.created_unix_ms == y.created_unix_ms);
  REQUIRE(x.metadata == y.metadata);
  REQUIRE(x.files.size() == y.files.size());
  for (size_t i = 0; i < x.files.size(); ++i) {
    REQUIRE(x.files[i].name == y.files[i].name);
    REQUIRE(x.files[i].size == y.files[i].size);
    REQUIRE(x.files[i].rank == y.files[i].rank);
  }
  REQUIRE(x.tensors.size() == y.tensors.size());
  for (size_t i = 0; i < x.tensors.size(); ++i) {
    const auto& a = x.tensors[i];
    const auto& b = y.tensors[i];
    REQUIRE(a.key == b.key);
    REQUIRE(a.dtype == b.dtype);
    REQUIRE(a.global_shape == b.global_shape);
    REQUIRE(a.chunks.size() == b.chunks.size());
    for (size_t j = 0; j < a.chunks.size(); ++j) {
      const auto& p = a.chunks[j];
      const auto& q = b.chunks[j];
      REQUIRE(p.offsets == q.offsets);
      REQUIRE(p.sizes == q.sizes);
      REQUIRE(p.file == q.file);
      REQUIRE(p.byte_offset == q.byte_offset);
      REQUIRE(p.byte_length == q.byte_length);
      REQUIRE(p.entry == q.entry);
      REQUIRE(p.checksums == q.checksums);
    }
  }
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("manifest: a rich manifest round-trips", "[manifest]") {
  const Manifest m = rich_manifest();
  const std::string bytes = ferry::encode_manifest(m);
  REQUIRE(bytes.compare(0, 8, "FERRYMF1") == 0);
  auto decoded = ferry::decode_manifest(bytes);
  INFO(decoded.status().to_string());
  REQUIRE(decoded.ok());
  require_same(m, decoded.value());
  // Encoding is deterministic, so a re-encode is byte-identical.
  REQUIRE(ferry::encode_manifest(decoded.value()) == bytes);
}

TEST_CASE("manifest: an empty manifest round-trips", "[manifest]") {
  Manifest m;
  auto decoded = ferry::decode_manifest(ferry::encode_manifest(m));
  INFO(decoded.status().to_string());
  REQUIRE(decoded.ok());
  require_same(m, decoded.value());
}

TEST_CASE("manifest: find and total_bytes", "[manifest]") {
  const Manifest m = rich_manifest();
  REQUIRE(m.find("a.weight") == &m.tensors[0]);
  REQUIRE(m.find("c.scalar") == &m.tensors[2]);
  REQUIRE(m.find("e.no_sums") == &m.tensors[4]);
  REQUIRE(m.find("a") == nullptr);
  REQUIRE(m.find("zzz") == nullptr);
  REQUIRE(m.find("") == nullptr);
  REQUIRE(Manifest().find("a.weight") == nullptr);
  REQUIRE(m.total_bytes() == 48 + 48 + 20 + 8 + 0 + 5);
  REQUIRE(ferry::known_manifest_features() == std::vector<std::string>{"codec-zstd"});
}

TEST_CASE("manifest: every single-byte change is detected", "[manifest]") {
  const std::string bytes = ferry::encode_manifest(rich_manifest());
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (unsigned mask : {0x01u, 0x80u, 0xffu}) {
      std::string bad = bytes;
      bad[i] = static_cast<char>(static_cast<unsigned char>(bad[i]) ^ mask);
      auto r = ferry::decode_manifest(bad);
      INFO("byte " << i << " mask " << mask);
      REQUIRE_FALSE(r.ok());
      REQUIRE((r.status().code() == StatusCode::corruption ||
               r.status().code() == StatusCode::unsupported));
      REQUIRE_FALSE(r.status().message().empty());
    }
  }
}

TEST_CASE("manifest: truncation at every length and trailing bytes are corruption", "[manifest]") {
  const std::string bytes = ferry::encode_manifest(rich_manifest());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = ferry::decode_manifest(std::string_view(bytes).substr(0, n));
    INFO("length " << n);
    REQUIRE_FALSE(r.ok());
    REQUIRE(r.status().code() == StatusCode::corruption);
  }
  auto r = ferry::decode_manifest(bytes + std::string(8, '\0'));
  REQUIRE(r.status().code() == StatusCode::corruption);
}

TEST_CASE("manifest: decoding does not depend on the input's alignment", "[manifest]") {
  const std::string bytes = ferry::encode_manifest(rich_manifest());
  std::string shifted = "x" + bytes;
  auto r = ferry::decode_manifest(std::string_view(shifted).substr(1));
  INFO(r.status().to_string());
  REQUIRE(r.ok());
}

namespace {

// Frames `payload` correctly (magic, version 1, no features, length, checksum)
// so that only the Cap'n Proto decoder sees what is wrong with it.
std::string frame(const std::string& payload, uint32_t version = 1) {
  std::string out = "FERRYMF1";
  auto put = [&out](uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
  };
  put(version, 4);
  put(0, 4);
  put(payload.size(), 8);
  put(ferry::xxh3_64(payload.data(), payload.size()), 8);
  return out + payload;
}

}  // namespace

TEST_CASE("manifest: garbage is corruption", "[manifest]") {
  REQUIRE(ferry::decode_manifest("").status().code() == StatusCode::corruption);
  auto r = ferry::decode_manifest("PK\x03\x04 definitely not a manifest");
  REQUIRE(r.status().code() == StatusCode::corruption);
  REQUIRE(contains(r.status().message(), "magic"));

  // Well framed, but not a Cap'n Proto message: a segment table claiming
  // 2^32 segments, then one claiming a segment far larger than the input.
  for (std::string payload :
       {std::string("\xff\xff\xff\xff\x00\x00\x00\x00", 8),
        std::string("\x00\x00\x00\x00\xff\xff\xff\x0f", 8) + std::string(8, '\x01')}) {
    auto g = ferry::decode_manifest(frame(payload));
    INFO(g.status().to_string());
    REQUIRE(g.status().code() == StatusCode::corruption);
    REQUIRE(contains(g.status().message(), "does not decode"));
  }
  // A root pointer into nowhere.
  std::string ptr = std::string("\x00\x00\x00\x00\x01\x00\x00\x00", 8) +
                    std::string("\xfc\xff\xff\x7f\x01\x00\x01\x00", 8);
  REQUIRE(ferry::decode_manifest(frame(ptr)).status().code() == StatusCode::corruption);
  // Not a whole number of words.
  REQUIRE(ferry::decode_manifest(frame(std::string(12, '\0'))).status().code() ==
          StatusCode::corruption);
}

TEST_CASE("manifest: a frame that disagrees with its payload is corruption", "[manifest]") {
  // The payload checksum does not cover the frame, so the payload repeats
  // the version: a payload saying 0 inside a frame saying 1 must be caught.
  Manifest m = rich_manifest();
  m.format_version = 0;
  std::string bytes = ferry::encode_manifest(m);
  REQUIRE(ferry::decode_manifest(bytes).status().code() == StatusCode::corruption);
  bytes[8] = 1;
  auto r = ferry::decode_manifest(bytes);
  INFO(r.status().to_string());
  REQUIRE(r.status().code() == StatusCode::corruption);
  REQUIRE(contains(r.status().message(), "payload says 0"));
}

TEST_CASE("manifest: a newer format version is refused naming both versions", "[manifest]") {
  Manifest m = rich_manifest();
  m.format_version = ferry::kManifestFormatVersion + 1;
  auto r = ferry::decode_manifest(ferry::encode_manifest(m));
  REQUIRE(r.status().code() == StatusCode::unsupported);
  INFO(r.status().message());
  REQUIRE(contains(r.status().message(),
                   "version " + std::to_string(ferry::kManifestFormatVersion + 1)));
  REQUIRE(contains(r.status().message(),
                   "version " + std::to_string(ferry::kManifestFormatVersion) + ")"));
}

TEST_CASE("manifest: an unknown required feature is refused naming it", "[manifest]") {
  Manifest m = rich_manifest();
  m.required_features = {"compression-zstd"};
  auto r = ferry::decode_manifest(ferry::encode_manifest(m));
  REQUIRE(r.status().code() == StatusCode::unsupported);
  INFO(r.status().message());
  REQUIRE(contains(r.status().message(), "'compression-zstd'"));
}

namespace {

// rich_manifest with tensor b.bias (20 raw bytes) stored as two zstd frames
// of 16 and 4 raw bytes in 13 stored bytes.
Manifest compressed_manifest() {
  Manifest m = rich_manifest();
  m.required_features = {"codec-zstd"};
  auto& c = m.tensors[1].chunks[0];
  c.codec = "zstd";
  c.raw_length = c.byte_length;
  c.byte_length = 13;
  c.frame_bytes = 16;
  c.frame_ends = {9, 13};
  c.checksums = {c.checksums[0]};
  return m;
}

}  // namespace

TEST_CASE("manifest: a compressed chunk round-trips with its frames", "[manifest][compress]") {
  const Manifest m = compressed_manifest();
  auto r = ferry::decode_manifest(ferry::encode_manifest(m));
  INFO(r.status().to_string());
  REQUIRE(r.ok());
  require_same(m, r.value());
  const auto& c = r->tensors[1].chunks[0];
  REQUIRE(c.codec == "zstd");
  REQUIRE(c.raw_bytes() == 20);
  REQUIRE(c.frame_bytes == 16);
  REQUIRE(c.frame_ends == std::vector<uint64_t>{9, 13});
  REQUIRE(r->tensors[0].chunks[0].raw_bytes() == r->tensors[0].chunks[0].byte_length);
}

TEST_CASE("manifest: bad compressed chunks are corruption naming the tensor",
          "[manifest][compress]") {
  const std::vector<std::pair<std::function<void(Manifest&)>, std::string>> cases = {
      {[](Manifest& m) { m.required_features.clear(); }, "required feature 'codec-zstd'"},
      {[](Manifest& m) { m.tensors[1].chunks[0].codec = "lz4"; }, "unknown codec 'lz4'"},
      {[](Manifest& m) { m.tensors[1].chunks[0].raw_length = 24; }, "raw length 24"},
      {[](Manifest& m) { m.tensors[1].chunks[0].frame_bytes = 0; }, "frame size 0"},
      // A reader decodes whole frames: an unbounded frame size is unbounded
      // memory for the smallest load (one frame of 20 raw bytes here).
      {[](Manifest& m) {
         auto& c = m.tensors[1].chunks[0];
         c.frame_bytes = 2ull << 30;
         c.frame_ends = {13};
       },
       "frame size 2147483648 exceeds"},
      {[](Manifest& m) { m.tensors[1].chunks[0].frame_ends = {13}; }, "1 frames, expected 2"},
      {[](Manifest& m) {
         m.tensors[1].chunks[0].frame_ends = {9, 9};
       },
       "frame 1 ends at 9"},
      {[](Manifest& m) {
         m.tensors[1].chunks[0].frame_ends = {9, 12};
       },
       "frames end at 12"},
  };
  for (const auto& [edit, expect] : cases) {
    Manifest m = compressed_manifest();
    edit(m);
    auto r = ferry::decode_manifest(ferry::encode_manifest(m));
    REQUIRE_FALSE(r.ok());
    INFO(r.status().message());
    REQUIRE(r.status().code() == StatusCode::corruption);
    REQUIRE(contains(r.status().message(), "b.bias"));
    REQUIRE(contains(r.status().message(), expect));
  }
}

TEST_CASE("manifest: semantic errors name the tensor", "[manifest]") {
  struct Case {
    const char* name;
    std::function<void(Manifest&)> edit;
    std::string expect;  // besides the key
  };
  const std::vector<Case> cases = {
      {"unknown dtype", [](Manifest& m) { m.tensors[1].dtype = static_cast<DType>(200); },
       "unknown dtype"},
      {"chunk rank",
       [](Manifest& m) {
         m.tensors[1].chunks[0].offsets = {0, 0};
       },
       "rank"},
      {"chunk outside shape", [](Manifest& m) { m.tensors[1].chunks[0].offsets = {1}; }, "outside"},
      {"negative offset", [](Manifest& m) { m.tensors[1].chunks[0].offsets = {-1}; }, "outside"},
      {"file index", [](Manifest& m) { m.tensors[1].chunks[0].file = 2; }, "file index 2"},
      {"past file end",
       [](Manifest& m) { m.tensors[1].chunks[0].byte_offset = m.files[0].size - 4; },
       "past the end"},
      {"byte length", [](Manifest& m) { m.tensors[1].chunks[0].byte_length = 21; },
       "byte length 21, expected 20"},
      {"checksum count", [](Manifest& m) { m.tensors[1].chunks[0].checksums.push_back(1); },
       "3 checksums, expected 2"},
      {"checksums on empty chunk",
       [](Manifest& m) { m.tensors[3].chunks[0].checksums.push_back(1); },
       "1 checksums, expected 0"},
      {"unsorted", [](Manifest& m) { std::swap(m.tensors[1], m.tensors[2]); }, "out of order"},
      {"duplicate",
       [](Manifest& m) {
         m.tensors[1] = m.tensors[0];
         for (auto& c : m.tensors[1].chunks) c.entry += "x";
         m.tensors[1].chunks[0].byte_offset = 0;  // keep byte ranges apart
         m.tensors[1].chunks[1].byte_offset = 0;
       },
       "listed twice"},
      {"overlap", [](Manifest& m) { m.tensors[1].chunks[0].byte_offset -= 4; }, "overlaps"},
      {"overlapping boxes",
       [](Manifest& m) {
         m.tensors[0].chunks[1].offsets = {1, 0};
       },
       "chunk 1 overlaps chunk 0"},
  };
  const std::vector<std::string> keys = {"b.bias",   "b.bias", "b.bias",  "b.bias",  "b.bias",
                                         "b.bias",   "b.bias", "b.bias",  "d.empty", "b.bias",
                                         "a.weight", "b.bias", "a.weight"};
  REQUIRE(keys.size() == cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    Manifest m = rich_manifest();
    cases[i].edit(m);
    auto r = ferry::decode_manifest(ferry::encode_manifest(m));
    INFO(cases[i].name << ": " << r.status().to_string());
    REQUIRE(r.status().code() == StatusCode::corruption);
    REQUIRE(contains(r.status().message(), "'" + keys[i] + "'"));
    REQUIRE(contains(r.status().message(), cases[i].expect));
  }
}

TEST_CASE("manifest: chunk boxes of a tensor must be disjoint", "[manifest]") {
  Manifest m;
  m.checksum_block_bytes = 64;
  m.files.push_back({"rank-00000-0000.safetensors", 4096, 0});
  // A 4 x 4 grid of 2 x 3 blocks, listed column by column.
  auto t = tensor("grid", DType::f32, {8, 12});
  for (int64_t c = 0; c < 4; ++c)
    for (int64_t r = 0; r < 4; ++r) add_chunk(m, t, 0, {2 * r, 3 * c}, {2, 3});
  // Empty boxes overlap nothing, wherever they sit.
  add_chunk(m, t, 0, {3, 3}, {0, 3});
  add_chunk(m, t, 0, {5, 7}, {2, 0});
  m.tensors.push_back(t);
  auto ok = ferry::decode_manifest(ferry::encode_manifest(m));
  INFO(ok.status().to_string());
  REQUIRE(ok.ok());

  // Shifting one block by a single column makes it overlap its neighbour.
  m.tensors[0].chunks[5].offsets[1] += 1;
  auto bad = ferry::decode_manifest(ferry::encode_manifest(m));
  REQUIRE(bad.status().code() == StatusCode::corruption);
  REQUIRE(contains(bad.status().message(), "'grid'"));
  REQUIRE(contains(bad.status().message(), "overlaps"));

  // Two chunks of a 0-d tensor are the same element twice.
  Manifest s;
  s.files.push_back({"rank-00000-0000.safetensors", 4096, 0});
  auto scalar = tensor("s", DType::i32, {});
  add_chunk(s, scalar, 0, {}, {});
  add_chunk(s, scalar, 0, {}, {});
  scalar.chunks[1].entry += "2";
  s.tensors.push_back(scalar);
  REQUIRE(ferry::decode_manifest(ferry::encode_manifest(s)).status().code() ==
          StatusCode::corruption);
}

TEST_CASE("manifest: manifest-wide semantic errors", "[manifest]") {
  {
    Manifest m = rich_manifest();
    m.checksum_block_bytes = 0;
    auto r = ferry::decode_manifest(ferry::encode_manifest(m));
    REQUIRE(r.status().code() == StatusCode::corruption);
    REQUIRE(contains(r.status().message(), "checksum_block_bytes"));
  }
  {
    Manifest m = rich_manifest();
    m.files[1].name = "../../etc/passwd";
    auto r = ferry::decode_manifest(ferry::encode_manifest(m));
    REQUIRE(r.status().code() == StatusCode::corruption);
    REQUIRE(contains(r.status().message(), "../../etc/passwd"));
  }
  {
    Manifest m = rich_manifest();
    m.files[1].rank = 5;
    auto r = ferry::decode_manifest(ferry::encode_manifest(m));
    REQUIRE(r.status().code() == StatusCode::corruption);
    REQUIRE(contains(r.status().message(), "rank 5"));
  }
}

TEST_CASE("manifest: a large manifest round-trips", "[manifest]") {
  Manifest m;
  m.world_size = 4;
  m.checksum_block_bytes = 1 << 20;
  for (int r = 0; r < 4; ++r)
    m.files.push_back({"rank-0000" + std::to_string(r) + "-0000.safetensors", 4096, r});
  char key[32];
  for (int i = 0; i < 2000; ++i) {
    std::snprintf(key, sizeof(key), "layers.%04d.weight", i);
    auto t = tensor(key, DType::bf16, {4096, 1024});
    for (int c = 0; c < 4; ++c)
      add_chunk(m, t, static_cast<uint32_t>(c), {1024 * c, 0}, {1024, 1024});
    m.tensors.push_back(std::move(t));
  }
  const std::string bytes = ferry::encode_manifest(m);
  auto r = ferry::decode_manifest(bytes);
  INFO(r.status().to_string());
  REQUIRE(r.ok());
  require_same(m, r.value());
  REQUIRE(r->find("layers.1234.weight") == &r->tensors[1234]);
  REQUIRE(r->total_bytes() == 2000ull * 4096 * 1024 * 2);
}

TEST_CASE("manifest: a payload past Cap'n Proto's default traversal limit decodes", "[manifest]") {
  // 9 Mi checksums = 72 MiB of payload, over the 64 MiB default limit: the
  // limit has to be sized from the input.
  Manifest m;
  m.checksum_block_bytes = 1;
  const int64_t n = 9 << 20;
  m.files.push_back({"rank-00000-0000.safetensors", 4096, 0});
  auto t = tensor("big", DType::u8, {n});
  add_chunk(m, t, 0, {0}, {n});
  m.tensors.push_back(std::move(t));
  auto r = ferry::decode_manifest(ferry::encode_manifest(m));
  INFO(r.status().to_string());
  REQUIRE(r.ok());
  REQUIRE(r->tensors[0].chunks[0].checksums.size() == static_cast<size_t>(n));
}
