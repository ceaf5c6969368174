// make_read_runs: the plan's ops packed into aligned runs that fit a staging
// block, cut only at checksum blocks, and copying exactly what the ops copy.
#include <catch2/catch.hpp>

#include <cstring>
#include <map>

#include "load_plan.hpp"

namespace {

constexpr uint64_t kBlock = 64 << 10;

// Chunks back to back from offset 4096 (one file), whole tensors, so chunk
// starts are unaligned after the first.
ferry::Manifest make_manifest(const std::vector<std::pair<std::string, std::vector<int64_t>>>& ts,
                              bool checksums) {
  ferry::Manifest m;
  m.checksum_block_bytes = kBlock;
  uint64_t off = 4096;
  for (const auto& [key, shape] : ts) {
    ferry::ManifestTensor t;
    t.key = key;
    t.dtype = ferry::DType::f32;
    t.global_shape = shape;
    ferry::ManifestChunk c;
    c.offsets.assign(shape.size(), 0);
    c.sizes = shape;
    c.byte_offset = off;
    c.byte_length = 4;
    for (auto s : shape) c.byte_length *= s;
    if (checksums) c.checksums.assign((c.byte_length + kBlock - 1) / kBlock, 1);
    c.entry = key;
    off += c.byte_length;
    t.chunks.push_back(c);
    m.tensors.push_back(t);
  }
  ferry::ManifestFile f;
  f.name = "rank-00000-0000.safetensors";
  f.size = off;
  m.files.push_back(f);
  return m;
}

ferry::LoadRequest request(const std::string& key, std::vector<int64_t> shape, ferry::Box box,
                           uint32_t entry) {
  ferry::LoadRequest r;
  r.entry = entry;
  r.key = key;
  r.global_shape = std::move(shape);
  r.box = std::move(box);
  return r;
}

// Applies `ops` reading from `file`, each op from its own offset.
std::map<uint32_t, std::vector<uint8_t>> apply_ops(const std::vector<ferry::ReadOp>& ops,
                                                   const std::vector<uint8_t>& file,
                                                   const std::vector<uint64_t>& target_bytes) {
  std::map<uint32_t, std::vector<uint8_t>> out;
  for (uint32_t e = 0; e < target_bytes.size(); ++e) out[e].assign(target_bytes[e], 0);
  for (const auto& op : ops)
    ferry::for_each_copy(op, 4, [&](uint64_t src, uint64_t dst, uint64_t n) {
      std::memcpy(out[op.entry].data() + dst, file.data() + op.file_offset + src, n);
    });
  return out;
}

}  // namespace

TEST_CASE("read runs are aligned, fit a block, and copy what the plan copies", "[load_plan]") {
  const bool checksums = GENERATE(true, false);
  const uint64_t max_run = GENERATE(uint64_t{256} << 10, uint64_t{1} << 20);
  INFO("checksums " << checksums << ", runs of at most " << max_run);
  const ferry::Manifest m = make_manifest(
      {{"a", {300, 257}}, {"b", {1000, 33}}, {"c", {7}}, {"d", {513, 129}}}, checksums);
  std::vector<ferry::LoadRequest> reqs = {
      request("a", {300, 257}, ferry::Box::whole({300, 257}), 0),
      request("b", {1000, 33}, ferry::Box{{100, 0}, {600, 33}}, 1),
      request("c", {7}, ferry::Box::whole({7}), 2),
      request("d", {513, 129}, ferry::Box{{0, 64}, {513, 65}}, 3),
  };
  auto ops = ferry::make_load_plan(m, reqs);
  REQUIRE(ops.ok());
  const std::vector<uint64_t> target_bytes = {300 * 257 * 4, 600 * 33 * 4, 7 * 4, 513 * 65 * 4};

  std::vector<uint8_t> file(m.files[0].size + 8192);
  for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<uint8_t>(i * 2654435761u >> 13);

  const auto runs = ferry::make_read_runs(ops.value(), m, max_run);
  std::vector<ferry::ReadOp> pieces;
  uint64_t op_bytes = 0, piece_bytes = 0;
  for (const auto& op : ops.value()) op_bytes += op.length;
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& r = runs[i];
    CHECK(r.offset % 4096 == 0);
    CHECK(r.length % 4096 == 0);
    CHECK(r.length <= max_run);
    REQUIRE_FALSE(r.ops.empty());
    if (i > 0) CHECK(r.offset >= runs[i - 1].offset);
    for (const auto& p : r.ops) {
      CHECK(p.file_offset >= r.offset);
      CHECK(p.file_offset + p.length <= r.offset + r.length);
      const auto& c = m.tensors[p.tensor].chunks[p.chunk];
      CHECK(p.file_offset == c.byte_offset + p.chunk_offset);
      if (checksums) {
        // Cut only at checksum blocks, so each piece verifies alone.
        CHECK(p.chunk_offset % kBlock == 0);
        CHECK(p.first_block == p.chunk_offset / kBlock);
        CHECK(p.nblocks == (p.length + kBlock - 1) / kBlock);
        CHECK((p.length % kBlock == 0 || p.chunk_offset + p.length == c.byte_length));
      }
      piece_bytes += p.length;
      pieces.push_back(p);
    }
  }
  CHECK(piece_bytes == op_bytes);
  // Neighbours share runs: no more runs than full ones plus one per gap.
  uint64_t run_bytes = 0;
  for (const auto& r : runs) run_bytes += r.length;
  CHECK(runs.size() <= op_bytes / (max_run - 2 * 4096) + 4);
  CHECK(run_bytes <= op_bytes + runs.size() * 2 * 4096);

  CHECK(apply_ops(pieces, file, target_bytes) == apply_ops(ops.value(), file, target_bytes));
}

TEST_CASE("a checksum block larger than a run makes one oversized run", "[load_plan]") {
  const ferry::Manifest m = make_manifest({{"a", {300, 257}}}, true);
  auto ops = ferry::make_load_plan(m, {request("a", {300, 257}, ferry::Box::whole({300, 257}), 0)});
  REQUIRE(ops.ok());
  const auto runs = ferry::make_read_runs(ops.value(), m, 16 << 10);
  uint64_t bytes = 0;
  for (const auto& r : runs) {
    REQUIRE(r.ops.size() == 1);
    CHECK(r.ops[0].nblocks == 1);
    CHECK(r.length <= kBlock + 2 * 4096);
    bytes += r.ops[0].length;
  }
  CHECK(bytes == 300 * 257 * 4);
}
