#include "block_walk.hpp"

#include <catch2/catch.hpp>

#include <random>
#include <string>
#include <vector>

#include "layout.hpp"

namespace {

using ferry::BlockWalk;
using ferry::ChunkSlice;
using ferry::FileLayout;

// A laid-out file of tensors of 1-D f32 chunks with the given byte sizes
// (multiples of 4), through layout_file as a save lays it out.
FileLayout file_of(const std::vector<uint64_t>& sizes) {
  std::vector<ferry::ChunkRef> chunks;
  for (size_t i = 0; i < sizes.size(); ++i) {
    ferry::ChunkRef c;
    c.key = "layers." + std::to_string(i) + ".weight";
    c.dtype = ferry::DType::f32;
    const auto n = static_cast<int64_t>(sizes[i] / 4);
    c.global_shape = {n};
    c.box.offsets = {0};
    c.box.sizes = {n};
    chunks.push_back(std::move(c));
  }
  auto f = ferry::layout_file("rank-00000-0000.safetensors", std::move(chunks));
  REQUIRE(f.ok());
  return std::move(f).value();
}

// Every chunk byte of the file, block by block, as the old scan found them:
// every chunk tested against every block.
std::vector<ChunkSlice> scan_all(const FileLayout& f, uint64_t block) {
  std::vector<ChunkSlice> out;
  for (uint64_t off = 0; off < f.size; off += block) {
    const uint64_t end = std::min(f.size, off + block);
    for (size_t i = 0; i < f.chunks.size(); ++i) {
      const auto& c = f.chunks[i];
      const uint64_t lo = std::max(off, c.offset), hi = std::min(end, c.offset + c.length);
      if (lo < hi) out.push_back({i, lo - c.offset, hi - lo, lo - off});
    }
  }
  return out;
}

bool same(const std::vector<ChunkSlice>& a, const std::vector<ChunkSlice>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].chunk != b[i].chunk || a[i].chunk_off != b[i].chunk_off || a[i].len != b[i].len ||
        a[i].block_off != b[i].block_off)
      return false;
  return true;
}

}  // namespace

TEST_CASE("block walk: the slices of every block equal a full scan's", "[block_walk]") {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 50; ++round) {
    // Small and large tensors, empty ones included, blocks smaller and
    // larger than a tensor.
    std::vector<uint64_t> sizes(1 + rng() % 300);
    for (auto& s : sizes) s = rng() % 5 == 0 ? 0 : 4 * (1 + rng() % (rng() % 2 ? 64 : 40000));
    const FileLayout f = file_of(sizes);
    const uint64_t block = 4096 * (1 + rng() % 16);
    BlockWalk walk(f);
    std::vector<ChunkSlice> got;
    for (uint64_t off = 0; off < f.size; off += block)
      walk.next(off, std::min(block, f.size - off), got);
    INFO("round " << round << ", " << sizes.size() << " chunks, block " << block);
    CHECK(same(got, scan_all(f, block)));
    uint64_t bytes = 0;
    for (const auto& s : got) bytes += s.len;
    CHECK(bytes == f.size - f.header.size());
  }
}

// The snapshot issues the blocks of a file from this walk: each block must
// cost the chunks it holds, not the file's whole chunk list (10,000 small
// tensors in 40 blocks were 400,000 chunk visits, now about 10,040).
TEST_CASE("block walk: a file's chunks are visited once, plus one per block boundary",
          "[block_walk]") {
  const std::vector<uint64_t> sizes(10000, 4 * 1000 + 256);  // 10,000 small tensors
  const FileLayout f = file_of(sizes);
  const uint64_t block = 1 << 20;
  const uint64_t blocks = (f.size + block - 1) / block;
  REQUIRE(blocks >= 40);
  BlockWalk walk(f);
  std::vector<ChunkSlice> got;
  for (uint64_t off = 0; off < f.size; off += block)
    walk.next(off, std::min(block, f.size - off), got);
  CHECK(walk.visited() <= f.chunks.size() + blocks);
  CHECK(same(got, scan_all(f, block)));
}

TEST_CASE("block walk: a walk may start past the file's first blocks", "[block_walk]") {
  const FileLayout f = file_of({40000, 4, 80000, 400, 120000});
  const uint64_t block = 8192;
  const uint64_t first = 3 * block;
  BlockWalk walk(f);
  std::vector<ChunkSlice> got;
  for (uint64_t off = first; off < f.size; off += block)
    walk.next(off, std::min(block, f.size - off), got);
  std::vector<ChunkSlice> want;
  for (const auto& s : scan_all(f, block))
    if (f.chunks[s.chunk].offset + s.chunk_off >= first) want.push_back(s);
  CHECK(same(got, want));
}
