// The coordinator's kept manifest (ManifestSkeleton, issue 45): a repeated
// save's reports refill it in place, rank 0's own as a "repeat" report that
// carries only sizes and checksums. Whatever the reports, the manifest is
// the one assemble_manifest builds from whole reports.

#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "commit.hpp"
#include "manifest.hpp"

namespace {

constexpr uint64_t kBytes = 16;  // per chunk: 4 floats

// Rank `rank`'s whole report of `n` tensors in one file, checksums from `seed`.
ferry::WriteResult report(int32_t rank, size_t n, uint64_t seed, uint64_t layout) {
  ferry::WriteResult wr;
  wr.rank = rank;
  wr.layout = layout;
  wr.files.push_back({"rank-" + std::to_string(rank), 64 + n * kBytes, 64, seed});
  for (size_t i = 0; i < n; ++i) {
    ferry::WrittenChunk c;
    c.key = "r" + std::to_string(rank) + ".t" + std::to_string(i);
    c.dtype = ferry::DType::f32;
    c.global_shape = {4};
    c.box.offsets = {0};
    c.box.sizes = {4};
    c.byte_offset = 64 + i * kBytes;
    c.byte_length = kBytes;
    c.entry = c.key;
    c.checksums = {seed * 1000 + i};
    wr.chunks.push_back(c);
  }
  return wr;
}

// The same report as rank 0 sends it when rank 0 holds its layout: no
// chunk of its own, the byte ranges in its (shared) layouts, the checksums
// by [file][chunk].
ferry::WriteResult as_repeat(const ferry::WriteResult& whole) {
  ferry::WriteResult wr = whole;
  wr.repeat = true;
  auto files = std::make_shared<std::vector<ferry::FileLayout>>(whole.files.size());
  wr.sums.assign(whole.files.size(), {});
  for (const ferry::WrittenChunk& c : whole.chunks) {
    ferry::LaidOutChunk lc;
    lc.offset = c.byte_offset;
    lc.length = c.byte_length;
    (*files)[c.file].chunks.push_back(lc);
    wr.sums[c.file].push_back(c.checksums);
  }
  wr.laid_out = std::move(files);
  wr.chunks.clear();
  return wr;
}

ferry::Manifest header() {
  ferry::Manifest h;
  h.world_size = 2;
  h.step = 3;
  h.checksum_block_bytes = 1 << 20;
  return h;
}

// Encoded without the creation time, which differs between two assemblies.
std::string encoded(ferry::Manifest m) {
  m.created_unix_ms = 0;
  return ferry::encode_manifest(m);
}

std::string expected(const std::vector<ferry::WriteResult>& whole) {
  auto m = ferry::assemble_manifest(header(), whole);
  REQUIRE(m.ok());
  return encoded(*m);
}

std::string assembled(ferry::ManifestSkeleton& sk, std::vector<ferry::WriteResult> results) {
  auto m = ferry::assemble_manifest_into(sk, header(), results);
  INFO(m.status().to_string());
  REQUIRE(m.ok());
  // The commit encodes through the skeleton's encoder, naming its tensors
  // (ManifestSkeleton::body), before anything brings the chunk values the
  // refill put into the encoder back into the manifest: the same bytes.
  ferry::Manifest timeless = **m;
  timeless.created_unix_ms = 0;
  std::string fast;
  sk.encoder.encode(timeless, &fast, sk.body);
  ferry::sync_chunks(sk);
  // What the commit tells the catalog of the manifest's size, counted as it was filled.
  CHECK(sk.total_bytes == (*m)->total_bytes());
  CHECK(fast == encoded(**m));
  return encoded(**m);
}

}  // namespace

TEST_CASE("a repeat report refills the kept manifest with its new sizes and checksums",
          "[commit][scale]") {
  ferry::ManifestSkeleton sk;
  const std::vector<ferry::WriteResult> first{report(0, 5, 1, 7), report(1, 3, 1, 9)};
  CHECK(assembled(sk, first) == expected(first));
  sk.checked = true;  // as the coordinator does once the check passed

  // New checksums at the same places: refilled, and the check still holds.
  const std::vector<ferry::WriteResult> second{report(0, 5, 2, 7), report(1, 3, 2, 9)};
  CHECK(assembled(sk, {as_repeat(second[0]), second[1]}) == expected(second));
  CHECK(sk.checked);

  // A chunk that moved in its file: the check must run again.
  std::vector<ferry::WriteResult> third{report(0, 5, 3, 7), report(1, 3, 3, 9)};
  third[0].files[0].size += kBytes;
  third[0].chunks[4].byte_offset += kBytes;
  CHECK(assembled(sk, {as_repeat(third[0]), third[1]}) == expected(third));
  CHECK_FALSE(sk.checked);
}

TEST_CASE("a repeat report is made whole again when another rank's state changed shape",
          "[commit][scale]") {
  ferry::ManifestSkeleton sk;
  const std::vector<ferry::WriteResult> first{report(0, 5, 1, 7), report(1, 3, 1, 9)};
  CHECK(assembled(sk, first) == expected(first));
  // Rank 1 has a tensor more: its layout is new, rank 0's is the kept one.
  const std::vector<ferry::WriteResult> second{report(0, 5, 2, 7), report(1, 4, 2, 10)};
  CHECK(assembled(sk, {as_repeat(second[0]), second[1]}) == expected(second));
  // And the rebuilt skeleton takes rank 0's repeat reports from then on.
  const std::vector<ferry::WriteResult> third{report(0, 5, 3, 7), report(1, 4, 3, 10)};
  CHECK(assembled(sk, {as_repeat(third[0]), as_repeat(third[1])}) == expected(third));
}

TEST_CASE("a repeat report of a layout rank 0 does not hold fails, naming the rank",
          "[commit][scale]") {
  ferry::ManifestSkeleton sk;
  std::vector<ferry::WriteResult> fresh{as_repeat(report(0, 5, 1, 7)), report(1, 3, 1, 9)};
  auto m = ferry::assemble_manifest_into(sk, header(), fresh);
  REQUIRE_FALSE(m.ok());
  CHECK(m.status().message().find("rank 0 reported its files as laid out in its last save") !=
        std::string::npos);

  const std::vector<ferry::WriteResult> first{report(0, 5, 1, 7), report(1, 3, 1, 9)};
  CHECK(assembled(sk, first) == expected(first));
  std::vector<ferry::WriteResult> other{as_repeat(report(0, 5, 2, 8)), report(1, 3, 2, 9)};
  m = ferry::assemble_manifest_into(sk, header(), other);
  REQUIRE_FALSE(m.ok());
  CHECK(m.status().message().find("layout 8") != std::string::npos);
  // A failed repeat leaves the kept manifest as it was.
  const std::vector<ferry::WriteResult> second{report(0, 5, 2, 7), report(1, 3, 2, 9)};
  CHECK(assembled(sk, {as_repeat(second[0]), second[1]}) == expected(second));
}

TEST_CASE("a repeat report refills the kept manifest without a chunk of its own",
          "[commit][scale]") {
  ferry::ManifestSkeleton sk;
  const std::vector<ferry::WriteResult> first{report(0, 5, 1, 7), report(1, 3, 1, 9)};
  CHECK(assembled(sk, first) == expected(first));
  const std::vector<ferry::WriteResult> second{report(0, 5, 2, 7), report(1, 3, 2, 9)};
  ferry::WriteResult repeat = as_repeat(second[0]);
  REQUIRE(repeat.chunks.empty());
  CHECK(repeat.chunk_count() == 5);
  // The kept manifest's checksum vectors are refilled where they are.
  const uint64_t* kept = sk.manifest.tensors[0].chunks[0].checksums.data();
  CHECK(assembled(sk, {repeat, second[1]}) == expected(second));
  CHECK(sk.manifest.tensors[0].chunks[0].checksums.data() == kept);

  // Without checksums (checksum = false): none in the report, none kept.
  std::vector<ferry::WriteResult> bare{report(0, 5, 3, 7), report(1, 3, 3, 9)};
  for (auto& wr : bare)
    for (auto& c : wr.chunks) c.checksums.clear();
  ferry::WriteResult bare_repeat = as_repeat(bare[0]);
  bare_repeat.sums.clear();
  CHECK(assembled(sk, {bare_repeat, bare[1]}) == expected(bare));
}

TEST_CASE("a repeat report whose checksums do not fit its layout fails, naming the rank",
          "[commit][scale]") {
  ferry::ManifestSkeleton sk;
  const std::vector<ferry::WriteResult> first{report(0, 5, 1, 7), report(1, 3, 1, 9)};
  CHECK(assembled(sk, first) == expected(first));
  ferry::WriteResult short_sums = as_repeat(report(0, 5, 2, 7));
  short_sums.sums[0].pop_back();
  std::vector<ferry::WriteResult> results{short_sums, report(1, 3, 2, 9)};
  auto m = ferry::assemble_manifest_into(sk, header(), results);
  REQUIRE_FALSE(m.ok());
  CHECK(m.status().message().find("rank 0's repeated report does not match its layout 7") !=
        std::string::npos);
  // Nothing of it was taken: the next good report refills as before.
  const std::vector<ferry::WriteResult> second{report(0, 5, 3, 7), report(1, 3, 3, 9)};
  CHECK(assembled(sk, {as_repeat(second[0]), second[1]}) == expected(second));
}

// The encoder leaves a refilled manifest's keys, boxes and entries as they
// are in its kept message: a skeleton assembled afresh must name its tensors
// anew, or a rank's renamed tensors (same lengths, so the same message
// shape) would keep their old names in the bytes.
TEST_CASE("a manifest assembled afresh names its tensors anew for the encoder", "[commit][scale]") {
  ferry::ManifestSkeleton sk;
  const std::vector<ferry::WriteResult> first{report(0, 5, 1, 7), report(1, 3, 1, 9)};
  CHECK(assembled(sk, first) == expected(first));
  const uint64_t body = sk.body;
  CHECK(body != 0);
  const std::vector<ferry::WriteResult> second{report(0, 5, 2, 7), report(1, 3, 2, 9)};
  CHECK(assembled(sk, {as_repeat(second[0]), second[1]}) == expected(second));
  CHECK(sk.encoder.last_patched());
  CHECK(sk.body == body);  // refilled: the same tensors

  std::vector<ferry::WriteResult> renamed{report(0, 5, 3, 7), report(1, 3, 3, 10)};
  for (ferry::WrittenChunk& c : renamed[1].chunks) {
    c.key[3] = 'u';  // "r1.t0" -> "r1.u0"
    c.entry = c.key;
  }
  const std::string bytes = assembled(sk, {as_repeat(renamed[0]), renamed[1]});
  CHECK(bytes == expected(renamed));
  CHECK(bytes.find("r1.u0") != std::string::npos);
  CHECK(bytes.find("r1.t0") == std::string::npos);
  CHECK(sk.body != 0);
  CHECK(sk.body != body);
  // And its repeats are rewritten from there.
  std::vector<ferry::WriteResult> again{report(0, 5, 4, 7), report(1, 3, 4, 10)};
  for (ferry::WrittenChunk& c : again[1].chunks) {
    c.key[3] = 'u';
    c.entry = c.key;
  }
  CHECK(assembled(sk, {as_repeat(again[0]), as_repeat(again[1])}) == expected(again));
  CHECK(sk.encoder.last_patched());
}

// The commit tells the catalog the manifest's size from the skeleton's own
// count (ManifestSkeleton::total_bytes) rather than walking every chunk
// again: a refill whose chunks grew must count their new lengths.
TEST_CASE("a refilled manifest's total counts its chunks' new lengths", "[commit][scale]") {
  ferry::ManifestSkeleton sk;
  const std::vector<ferry::WriteResult> first{report(0, 5, 1, 7), report(1, 3, 1, 9)};
  CHECK(assembled(sk, first) == expected(first));
  CHECK(sk.total_bytes == 8 * kBytes);

  std::vector<ferry::WriteResult> grown{report(0, 5, 2, 7), report(1, 3, 2, 9)};
  grown[0].files[0].size += kBytes;
  grown[0].chunks[4].byte_length += kBytes;  // rank 0's last chunk, as a repeat report
  grown[1].files[0].size += 2 * kBytes;
  grown[1].chunks[2].byte_length += 2 * kBytes;  // rank 1's last, as a whole one
  CHECK(assembled(sk, {as_repeat(grown[0]), grown[1]}) == expected(grown));
  CHECK(sk.total_bytes == 11 * kBytes);
}

// A repeat report's values go into the encoder's kept message only; the
// manifest's own vectors catch up when asked (sync_chunks), and the encoder
// keeps them through whatever comes before the next encode.
TEST_CASE("a refill's values kept by the encoder survive a rebuild, a skipped encode and a sync",
          "[commit][scale]") {
  ferry::ManifestSkeleton sk;
  const std::vector<ferry::WriteResult> first{report(0, 5, 1, 7), report(1, 3, 1, 9)};
  CHECK(assembled(sk, first) == expected(first));

  // Refilled twice with no encode in between (a commit that failed before
  // it encoded): the second refill's values are the ones encoded.
  const std::vector<ferry::WriteResult> second{report(0, 5, 2, 7), report(1, 3, 2, 9)};
  std::vector<ferry::WriteResult> results{as_repeat(second[0]), second[1]};
  REQUIRE(ferry::assemble_manifest_into(sk, header(), results).ok());
  const std::vector<ferry::WriteResult> third{report(0, 5, 3, 7), report(1, 3, 3, 9)};
  CHECK(assembled(sk, {as_repeat(third[0]), third[1]}) == expected(third));

  // A header of another length (a longer checkpoint id) cannot be patched:
  // the message is built afresh, with the refill's values, not the stale
  // ones of the manifest's own vectors.
  const std::vector<ferry::WriteResult> fourth{report(0, 5, 4, 7), report(1, 3, 4, 9)};
  results = {as_repeat(fourth[0]), fourth[1]};
  auto m = ferry::assemble_manifest_into(sk, header(), results);
  REQUIRE(m.ok());
  ferry::Manifest longer = **m;
  longer.created_unix_ms = 0;
  longer.checkpoint_id = "a-longer-checkpoint-id";
  std::string fast;
  sk.encoder.encode(longer, &fast, sk.body);
  CHECK_FALSE(sk.encoder.last_patched());
  auto want = ferry::assemble_manifest(header(), fourth);
  REQUIRE(want.ok());
  want->checkpoint_id = longer.checkpoint_id;
  CHECK(fast == encoded(*want));
  ferry::sync_chunks(sk);
  CHECK(sk.manifest.tensors[0].chunks[0].checksums == want->tensors[0].chunks[0].checksums);
  // Back to the first id's length (built afresh again), then patched in place.
  const std::vector<ferry::WriteResult> fifth{report(0, 5, 5, 7), report(1, 3, 5, 9)};
  CHECK(assembled(sk, {as_repeat(fifth[0]), fifth[1]}) == expected(fifth));
  const std::vector<ferry::WriteResult> sixth{report(0, 5, 6, 7), report(1, 3, 6, 9)};
  CHECK(assembled(sk, {as_repeat(sixth[0]), sixth[1]}) == expected(sixth));
  CHECK(sk.encoder.last_patched());
}

// A chunk whose checksum count changed does not fit the kept message: from
// there the manifest's own vectors take the values, after the ones the
// message took before it, and the encode builds afresh.
TEST_CASE("a refill that meets a chunk with another checksum count midway loses no value",
          "[commit][scale]") {
  ferry::ManifestSkeleton sk;
  const std::vector<ferry::WriteResult> first{report(0, 5, 1, 7), report(1, 3, 1, 9)};
  CHECK(assembled(sk, first) == expected(first));
  const std::vector<ferry::WriteResult> second{report(0, 5, 2, 7), report(1, 3, 2, 9)};
  CHECK(assembled(sk, {as_repeat(second[0]), second[1]}) == expected(second));

  std::vector<ferry::WriteResult> third{report(0, 5, 3, 7), report(1, 3, 3, 9)};
  third[0].chunks[3].checksums.push_back(42);  // rank 0's fourth chunk: one block more
  sk.checked = true;
  CHECK(assembled(sk, {as_repeat(third[0]), third[1]}) == expected(third));
  CHECK_FALSE(sk.checked);
  CHECK_FALSE(sk.encoder.last_patched());
  // Rank 1's whole report met a count change too.
  std::vector<ferry::WriteResult> fourth{report(0, 5, 4, 7), report(1, 3, 4, 9)};
  fourth[0].chunks[3].checksums.push_back(43);
  fourth[1].chunks[1].checksums.push_back(44);
  CHECK(assembled(sk, {as_repeat(fourth[0]), fourth[1]}) == expected(fourth));
  // The new shape is kept: patched from there.
  std::vector<ferry::WriteResult> fifth{report(0, 5, 5, 7), report(1, 3, 5, 9)};
  fifth[0].chunks[3].checksums.push_back(45);
  fifth[1].chunks[1].checksums.push_back(46);
  CHECK(assembled(sk, {as_repeat(fifth[0]), fifth[1]}) == expected(fifth));
  CHECK(sk.encoder.last_patched());
}
