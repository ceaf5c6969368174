// ManifestEncoder (issue 45): a repeated save's manifest is rewritten in the
// message kept from the last commit. Whatever it is given, its bytes are the
// ones encode_manifest gives for the same manifest, byte for byte.

#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "codec.hpp"
#include "manifest.hpp"

namespace {

// A manifest of `n` tensors over two files: multi-chunk tensors, a per-rank
// value, metadata; checksums and byte ranges from `seed`.
ferry::Manifest sample(size_t n, uint64_t seed) {
  ferry::Manifest m;
  m.step = 100 + seed;
  m.commit_seq = 7 + seed;
  m.world_size = 2;
  m.checksum_block_bytes = 16;
  m.job_id = "job-" + std::to_string(seed % 10);
  m.checkpoint_id = "ckpt-" + std::to_string(1000 + seed % 9000);
  m.created_unix_ms = 1700000000000 + static_cast<int64_t>(seed);
  uint64_t at[2] = {4096, 4096};
  for (size_t i = 0; i < n; ++i) {
    ferry::ManifestTensor t;
    t.key = "layer." + std::to_string(i) + ".w";
    t.dtype = i % 3 == 0 ? ferry::DType::bf16 : ferry::DType::f32;
    t.global_shape = {8, 4};
    for (int64_t half = 0; half < (i % 2 == 0 ? 2 : 1); ++half) {
      ferry::ManifestChunk c;
      c.offsets = {half * 4, 0};
      c.sizes = {i % 2 == 0 ? 4 : 8, 4};
      c.file = static_cast<uint32_t>(half);
      c.byte_length = static_cast<uint64_t>(c.sizes[0] * 4) * ferry::dtype_size(t.dtype);
      c.byte_offset = at[half] + seed % 2 * 64;
      at[half] += c.byte_length;
      c.entry = t.key + "/" + std::to_string(half);
      for (uint64_t b = 0; b < c.byte_length; b += m.checksum_block_bytes)
        c.checksums.push_back(seed * 31 + i + b);
      t.chunks.push_back(c);
    }
    m.tensors.push_back(t);
  }
  ferry::ManifestTensor pr;
  pr.key = ferry::per_rank_key("zz.step", 1);
  pr.dtype = ferry::DType::i64;
  pr.global_shape = {1};
  pr.per_rank = 1;
  pr.chunks.push_back({{0}, {1}, 1, at[1] + seed % 2 * 64, 8, pr.key, {seed}, "", 0, 0, {}});
  m.tensors.push_back(pr);
  m.files = {{"rank-00000-0000.safetensors", at[0] + 64 + seed, 0, 4096, seed * 3},
             {"rank-00001-0000.safetensors", at[1] + 72 + seed, 1, 4096, seed * 5}};
  std::sort(m.tensors.begin(), m.tensors.end(),
            [](const auto& a, const auto& b) { return a.key < b.key; });
  m.metadata = {{"loss", "0.12" + std::to_string(seed % 10)}, {"run", "a"}};
  return m;
}

// Encodes with `enc`, checks the bytes against a full encode, and says
// whether the kept message was rewritten.
bool patched(ferry::ManifestEncoder& enc, const ferry::Manifest& m) {
  std::string out;
  enc.encode(m, &out);
  REQUIRE(out == ferry::encode_manifest(m));
  return enc.last_patched();
}

}  // namespace

TEST_CASE("a repeated save's manifest rewritten in the kept message is a full encode's bytes",
          "[manifest][scale]") {
  ferry::ManifestEncoder enc;
  CHECK_FALSE(patched(enc, sample(20, 1)));
  // New step, ids of the same lengths, times, file sizes, checksums and
  // byte offsets: rewritten in place.
  for (uint64_t seed = 2; seed < 6; ++seed) CHECK(patched(enc, sample(20, seed)));
  std::string out;
  enc.encode(sample(20, 9), &out);
  auto back = ferry::decode_manifest(out);
  INFO(back.status().to_string());
  REQUIRE(back.ok());
  CHECK(back->step == 109);
  CHECK(back->tensors[4].chunks[1].checksums == sample(20, 9).tensors[4].chunks[1].checksums);

  // A compressed chunk: its codec's fields are rewritten too.
  ferry::Manifest z = sample(20, 6);
  z.required_features = {ferry::kCodecZstdFeature};
  ferry::ManifestChunk& c = z.tensors[3].chunks[0];
  c.codec = ferry::kCodecZstd;
  c.raw_length = c.byte_length;
  c.frame_bytes = 64;
  c.frame_ends = {40, 70};
  CHECK_FALSE(patched(enc, z));
  c.raw_length += 1;
  c.frame_ends = {41, 73};
  for (uint64_t& sum : c.checksums) sum += 99;
  CHECK(patched(enc, z));
  // Back to raw: the codec's fields must be gone, as in a full encode.
  CHECK_FALSE(patched(enc, sample(20, 7)));
}

TEST_CASE("a manifest of another shape is built afresh, then rewritten from there",
          "[manifest][scale]") {
  ferry::ManifestEncoder enc;
  CHECK_FALSE(patched(enc, sample(20, 1)));
  using Change = void (*)(ferry::Manifest&);
  const std::vector<std::pair<const char*, Change>> changes = {
      {"a tensor more", [](ferry::Manifest& m) { m.tensors.push_back(m.tensors.back()); }},
      {"a checksum more",
       [](ferry::Manifest& m) { m.tensors[2].chunks[0].checksums.push_back(1); }},
      {"a longer key", [](ferry::Manifest& m) { m.tensors[2].key += "x"; }},
      {"a longer checkpoint id", [](ferry::Manifest& m) { m.checkpoint_id += "1"; }},
      {"a chunk fewer", [](ferry::Manifest& m) { m.tensors[0].chunks.pop_back(); }},
      {"a file more", [](ferry::Manifest& m) { m.files.push_back(m.files[0]); }},
      {"another metadata value length", [](ferry::Manifest& m) { m.metadata[1].second = "ab"; }},
      {"a per-rank value fewer", [](ferry::Manifest& m) { m.tensors.pop_back(); }},
  };
  uint64_t seed = 2;
  for (const auto& [what, change] : changes) {
    INFO(what);
    ferry::Manifest m = sample(20, seed++);
    change(m);
    CHECK_FALSE(patched(enc, m));
    ferry::Manifest again = sample(20, seed++);
    change(again);
    CHECK(patched(enc, again));
  }
  // A per-rank value that becomes an ordinary tensor: its flags rewritten.
  CHECK_FALSE(patched(enc, sample(20, seed++)));
  ferry::Manifest m = sample(20, seed++);
  m.tensors.back().per_rank = -1;
  CHECK(patched(enc, m));
  CHECK(patched(enc, sample(20, seed++)));
}

TEST_CASE("random manifests: the encoder's bytes always equal a full encode's",
          "[manifest][scale]") {
  std::mt19937_64 rng(45);
  ferry::ManifestEncoder enc;
  ferry::Manifest m = sample(8, 1);
  int rewritten = 0;
  for (int round = 0; round < 300; ++round) {
    ferry::ManifestTensor& t = m.tensors[rng() % m.tensors.size()];
    ferry::ManifestChunk& c = t.chunks[rng() % t.chunks.size()];
    switch (rng() % 8) {
      case 0:
        c.checksums[rng() % c.checksums.size()] = rng();
        break;
      case 1:
        c.byte_offset = rng() % 100000;
        break;
      case 2:
        m.step = rng();
        break;
      case 3:
        m.files[rng() % m.files.size()].size = rng();
        break;
      case 4:
        c.checksums.resize(1 + rng() % 3, rng());
        break;
      case 5:
        t.key[0] = static_cast<char>('a' + rng() % 26);
        break;
      case 6:
        m.job_id.resize(1 + rng() % 6, 'j');
        break;
      case 7:
        t.per_rank = t.per_rank >= 0 ? -1 : 0;
        break;
    }
    std::sort(m.tensors.begin(), m.tensors.end(),
              [](const auto& a, const auto& b) { return a.key < b.key; });
    std::string out;
    enc.encode(m, &out);
    REQUIRE(out == ferry::encode_manifest(m));
    rewritten += enc.last_patched() ? 1 : 0;
  }
  // Most changes keep the shape: the fast path ran, and was checked.
  CHECK(rewritten > 150);
}

// The commit writes the frame and then the kept message itself: the two
// pieces are a full encode's bytes, and a rewritten manifest's message is
// the one kept, where it was (nothing copied out, nothing reallocated).
TEST_CASE("the encoder's two pieces are a full encode's bytes, the message where it is kept",
          "[manifest][scale]") {
  ferry::ManifestEncoder enc;
  std::string head;
  const std::string_view first = enc.encode_parts(sample(20, 1), &head);
  CHECK(head + std::string(first) == ferry::encode_manifest(sample(20, 1)));
  CHECK_FALSE(enc.last_patched());
  for (uint64_t seed = 2; seed < 5; ++seed) {
    const std::string_view rest = enc.encode_parts(sample(20, seed), &head);
    CHECK(enc.last_patched());
    CHECK(rest.data() == first.data());
    CHECK(rest.size() == first.size());
    const std::string whole = head + std::string(rest);
    CHECK(whole == ferry::encode_manifest(sample(20, seed)));
    auto back = ferry::decode_manifest(whole);
    INFO(back.status().to_string());
    REQUIRE(back.ok());
    CHECK(back->step == 100 + seed);
  }
  // Another shape: built afresh, the pieces still a full encode's.
  const std::string_view other = enc.encode_parts(sample(33, 6), &head);
  CHECK_FALSE(enc.last_patched());
  CHECK(head + std::string(other) == ferry::encode_manifest(sample(33, 6)));
}

// A caller that names the manifest's tensors (`body`, a refilled skeleton's)
// has only the values a repeated save changes rewritten: the bytes are
// still a full encode's.
TEST_CASE("a manifest whose tensors are named again has only its values rewritten",
          "[manifest][scale]") {
  ferry::ManifestEncoder enc;
  const auto encode = [&](const ferry::Manifest& m, uint64_t body) {
    std::string out;
    enc.encode(m, &out, body);
    return out;
  };
  CHECK(encode(sample(20, 1), 5) == ferry::encode_manifest(sample(20, 1)));
  CHECK_FALSE(enc.last_patched());
  // sample() keeps keys, boxes and entries across seeds: byte ranges,
  // checksums, file sizes, ids and header numbers change.
  for (uint64_t seed = 2; seed < 6; ++seed) {
    CHECK(encode(sample(20, seed), 5) == ferry::encode_manifest(sample(20, seed)));
    CHECK(enc.last_patched());
  }

  // The names are taken as the caller says: a key changed under the same
  // body is not written (what makes the rewrite cheap), ...
  ferry::Manifest renamed = sample(20, 6);
  const std::string old_key = renamed.tensors[2].key;
  renamed.tensors[2].key.back() = 'x';
  std::string out = encode(renamed, 5);
  CHECK(out.find(old_key) != std::string::npos);
  CHECK(out != ferry::encode_manifest(renamed));
  // ... another body (or none) has it written: a full encode's bytes again.
  CHECK(encode(renamed, 6) == ferry::encode_manifest(renamed));
  CHECK(enc.last_patched());
  CHECK(encode(renamed, 6) == ferry::encode_manifest(renamed));
  renamed.tensors[2].key = old_key;
  CHECK(encode(renamed, 0) == ferry::encode_manifest(renamed));
  CHECK(encode(renamed, 0) == ferry::encode_manifest(renamed));

  // A checksum more under the same body: the message is built afresh.
  ferry::Manifest longer = sample(20, 7);
  CHECK(encode(longer, 8) == ferry::encode_manifest(longer));
  longer.tensors[3].chunks[0].checksums.push_back(42);
  CHECK(encode(longer, 8) == ferry::encode_manifest(longer));
  CHECK_FALSE(enc.last_patched());
  longer.tensors[3].chunks[0].checksums.back() = 43;
  CHECK(encode(longer, 8) == ferry::encode_manifest(longer));
  CHECK(enc.last_patched());

  // A compressed chunk's codec fields are values too.
  ferry::Manifest z = sample(20, 8);
  z.required_features = {ferry::kCodecZstdFeature};
  ferry::ManifestChunk& c = z.tensors[3].chunks[0];
  c.codec = ferry::kCodecZstd;
  c.raw_length = c.byte_length;
  c.frame_bytes = 64;
  c.frame_ends = {40, 70};
  CHECK(encode(z, 9) == ferry::encode_manifest(z));
  c.raw_length += 1;
  c.frame_bytes = 65;
  c.frame_ends = {41, 73};
  CHECK(encode(z, 9) == ferry::encode_manifest(z));
  CHECK(enc.last_patched());
}
