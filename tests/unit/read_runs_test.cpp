// make_read_runs: the plan's ops packed into aligned runs that fit a staging
// block, cut only at checksum blocks, and copying exactly what the ops copy.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <string>

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

// A piece lies at its place in its chunk and, with checksums, starts at a
// checksum block and names the blocks it covers, so that it verifies alone.
void check_piece(const ferry::Manifest& m, const ferry::ReadOp& p, bool checksums) {
  const auto& c = m.tensors[p.tensor].chunks[p.chunk];
  CHECK(p.file_offset == c.byte_offset + p.chunk_offset);
  if (checksums) {
    CHECK(p.chunk_offset % kBlock == 0);
    CHECK(p.first_block == p.chunk_offset / kBlock);
    CHECK(p.nblocks == (p.length + kBlock - 1) / kBlock);
  }
}

// Applies `ops` reading from `file`, each op from its own offset.
std::map<uint32_t, std::vector<uint8_t>> apply_ops(const std::vector<ferry::ReadOp>& ops,
                                                   const std::vector<uint8_t>& file,
                                                   const std::vector<uint64_t>& target_bytes) {
  std::map<uint32_t, std::vector<uint8_t>> out;
  for (uint32_t e = 0; e < target_bytes.size(); ++e) out[e].assign(target_bytes[e], 0);
  for (const auto& op : ops)
    ferry::for_each_copy(op, 4, [&](uint64_t src, uint64_t dst, uint64_t n) {
      // A read made only for other ranks copies nothing here.
      REQUIRE(op.entry != ferry::ReadOp::kForOthers);
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
      check_piece(m, p, checksums);
      if (checksums) {
        const auto& c = m.tensors[p.tensor].chunks[p.chunk];
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

TEST_CASE("the last runs are short, and still copy what the plan copies", "[load_plan]") {
  const bool checksums = GENERATE(true, false);
  INFO("checksums " << checksums);
  constexpr uint64_t kMaxRun = 1 << 20, kTail = 256 << 10;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"a", {1000, 257}}, {"b", {3000, 129}}, {"c", {777, 513}}};
  const ferry::Manifest m = make_manifest(shapes, checksums);
  std::vector<ferry::LoadRequest> reqs;
  std::vector<uint64_t> target_bytes;
  for (const auto& [key, shape] : shapes) {
    reqs.push_back(
        request(key, shape, ferry::Box::whole(shape), static_cast<uint32_t>(target_bytes.size())));
    target_bytes.push_back(static_cast<uint64_t>(shape[0] * shape[1] * 4));
  }
  auto ops = ferry::make_load_plan(m, reqs);
  REQUIRE(ops.ok());
  std::vector<uint8_t> file(m.files[0].size + 8192);
  for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<uint8_t>(i * 2654435761u >> 13);

  const auto runs = ferry::make_read_runs(ops.value(), m, kMaxRun, 4096, kTail);
  std::vector<ferry::ReadOp> pieces;
  uint64_t total = 0;
  for (const auto& op : ops.value()) total += op.length;
  // Op bytes from the end, run by run: every run that holds any of the last
  // kMaxRun bytes is a tail run.
  uint64_t after = 0;
  for (size_t i = runs.size(); i-- > 0;) {
    const auto& r = runs[i];
    CHECK(r.length <= kMaxRun);
    if (after < kMaxRun) CHECK(r.length <= kTail + 2 * 4096);
    for (const auto& p : r.ops) {
      check_piece(m, p, checksums);
      after += p.length;
      pieces.push_back(p);
    }
  }
  CHECK(after == total);
  // The runs before the tail are not cut short too: full ones but for the
  // one that hands over to the tail.
  size_t short_runs = 0;
  for (const auto& r : runs) short_runs += r.length <= kTail + 2 * 4096;
  CHECK(short_runs <= kMaxRun / (kTail - 2 * 4096) + 3);
  CHECK(apply_ops(pieces, file, target_bytes) == apply_ops(ops.value(), file, target_bytes));
}

// --- reading replicated bytes once per node ---------------------------------------

namespace {

// Rank r (mod 4) asks for every tensor whole (replicated) plus its own
// rows of "b" and an overlapping window of "d".
std::vector<ferry::LoadRequest> rank_requests(int rank) {
  const int r = rank % 4;
  return {
      request("a", {300, 257}, ferry::Box::whole({300, 257}), 0),
      request("b", {1000, 33}, ferry::Box{{r * 200, 0}, {300, 33}}, 1),
      request("c", {7}, ferry::Box::whole({7}), 2),
      request("d", {513, 129}, ferry::Box{{0, r * 16}, {513, 65}}, 3),
  };
}

const std::vector<uint64_t> kRankTargetBytes = {300 * 257 * 4, 300 * 33 * 4, 7 * 4, 513 * 65 * 4};

}  // namespace

// What rank r ends up with: its own reads applied, and each piece it
// receives rebuilt from the stream its sender sends (the sender's piece of
// the same bytes, cut to the receiver's box), checking both sides agree.
struct Loaded {
  std::map<uint32_t, std::vector<uint8_t>> bytes;
  uint64_t blocks = 0;    // bytes of the pieces it received
  uint64_t received = 0;  // bytes that travelled to it
};

Loaded load_rank(const ferry::Manifest& m, const std::vector<ferry::RankShare>& parts, int r,
                 const std::vector<uint8_t>& file, const std::vector<uint64_t>& target_bytes,
                 bool checksums) {
  const auto& part = parts[r];
  Loaded out;
  auto& got = out.bytes;
  got = apply_ops(part.read, file, target_bytes);
  for (const auto& [from, p] : part.receive) {
    CHECK(from != r);
    CHECK(p.share_with.empty());
    check_piece(m, p, checksums);
    // The sender's piece of the same bytes, and the stream it sends.
    const ferry::ReadOp* sent = nullptr;
    const ferry::ShareTo* to = nullptr;
    for (const auto& q : parts[from].read)
      for (const ferry::ShareTo& t : q.share_with)
        if (t.rank == r && q.file_offset == p.file_offset) {
          sent = &q;
          to = &t;
        }
    REQUIRE(sent != nullptr);
    CHECK(sent->length == p.length);
    CHECK(to->box == p.shared_box);
    // Positions are the box's stream's (the whole box, not this piece):
    // the piece's part of it starts at `base`.
    std::vector<uint8_t> stream;
    uint64_t base = 0;
    ferry::for_each_shared_run(*sent, to->box, 4, [&](uint64_t src, uint64_t at, uint64_t n) {
      if (stream.empty()) base = at;
      CHECK(at == base + stream.size());  // runs are consecutive in the stream
      stream.insert(stream.end(), file.begin() + sent->file_offset + src,
                    file.begin() + sent->file_offset + src + n);
    });
    CHECK(stream.size() == ferry::shared_bytes(p, 4));
    CHECK(stream.size() <= p.length);
    ferry::for_each_copy(p, 4, [&](uint64_t src, uint64_t dst, uint64_t n) {
      auto at = ferry::packed_position(p, p.shared_box, src, 4);
      REQUIRE(at.has_value());
      REQUIRE(*at >= base);
      REQUIRE(*at - base + n <= stream.size());
      std::memcpy(got[p.entry].data() + dst, stream.data() + (*at - base), n);
    });
    out.blocks += p.length;
    out.received += stream.size();
  }
  return out;
}

// Ranks 0..n-1 of one node, rank r loading reqs[r]: their plans, who reads
// what, and each rank's part of it.
struct NodeLoad {
  std::vector<std::vector<ferry::ReadOp>> plans;
  std::vector<ferry::SharedRead> shared;
  std::vector<ferry::RankShare> parts;
};

NodeLoad plan_node(const ferry::Manifest& m,
                   const std::vector<std::vector<ferry::LoadRequest>>& reqs) {
  NodeLoad out;
  std::vector<ferry::RankNeeds> needs;
  for (size_t r = 0; r < reqs.size(); ++r) {
    auto ops = ferry::make_load_plan(m, reqs[r]);
    REQUIRE(ops.ok());
    out.plans.push_back(ops.value());
    needs.push_back({static_cast<int32_t>(r), "n0", ferry::needed_ranges(ops.value(), m), {}});
  }
  out.shared = ferry::assign_shared_reads(needs);
  for (size_t r = 0; r < reqs.size(); ++r)
    out.parts.push_back(
        ferry::split_for_rank(out.plans[r], out.shared, static_cast<int32_t>(r), m));
  return out;
}

TEST_CASE("shared reads: each byte a node needs has one reader, and every rank gets its bytes",
          "[load_plan]") {
  const bool checksums = GENERATE(true, false);
  INFO("checksums " << checksums);
  const ferry::Manifest m = make_manifest(
      {{"a", {300, 257}}, {"b", {1000, 33}}, {"c", {7}}, {"d", {513, 129}}}, checksums);
  std::vector<uint8_t> file(m.files[0].size + 8192);
  for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<uint8_t>(i * 2654435761u >> 13);

  // Ranks 0-3 on node "n0", 4-5 on node "n1".
  constexpr int kRanks = 6;
  std::vector<std::vector<ferry::ReadOp>> plans;
  std::vector<ferry::RankNeeds> needs;
  for (int r = 0; r < kRanks; ++r) {
    auto ops = ferry::make_load_plan(m, rank_requests(r));
    REQUIRE(ops.ok());
    plans.push_back(ops.value());
    needs.push_back({r, r < 4 ? "n0" : "n1", ferry::needed_ranges(ops.value(), m), {}});
  }
  const auto shared = ferry::assign_shared_reads(needs);

  // The same assignment whatever order the reports come in.
  auto shuffled = needs;
  std::reverse(shuffled.begin(), shuffled.end());
  const auto again = ferry::assign_shared_reads(shuffled);
  REQUIRE(again.size() == shared.size());
  for (size_t i = 0; i < shared.size(); ++i) {
    CHECK(again[i].range.offset == shared[i].range.offset);
    CHECK(again[i].reader == shared[i].reader);
    CHECK(again[i].receivers == shared[i].receivers);
  }

  // Per node: the ranges are disjoint, the reader and the receivers are
  // exactly the ranks of that node whose plan reads the range.
  std::map<std::string, uint64_t> node_bytes, union_bytes;
  for (const auto& s : shared) {
    const std::string node = s.reader < 4 ? "n0" : "n1";
    node_bytes[node] += s.range.length;
    std::vector<int32_t> needers;
    for (int r = 0; r < kRanks; ++r) {
      if ((r < 4 ? "n0" : "n1") != node) continue;
      for (const auto& op : plans[r])
        if (op.file_offset < s.range.offset + s.range.length &&
            s.range.offset < op.file_offset + op.length) {
          // A range is never cut across by a rank's read: inside or outside.
          CHECK(op.file_offset <= s.range.offset);
          CHECK(s.range.offset + s.range.length <= op.file_offset + op.length);
          needers.push_back(r);
          break;
        }
    }
    std::vector<int32_t> got;
    for (const ferry::ShareTo& t : s.receivers) got.push_back(t.rank);
    if (std::find(needers.begin(), needers.end(), s.reader) == needers.end()) {
      // A small range one rank needs alone, read by the rank reading the
      // bytes next to it.
      CHECK(got == needers);
      CHECK(needers.size() == 1);
      CHECK(s.range.length <= (256u << 10));
      bool beside = false;
      for (const auto& o : shared)
        beside |= o.reader == s.reader && o.range.file == s.range.file &&
                  (o.range.offset + o.range.length == s.range.offset ||
                   s.range.offset + s.range.length == o.range.offset);
      CHECK(beside);
      continue;
    }
    got.push_back(s.reader);
    std::sort(got.begin(), got.end());
    CHECK(got == needers);
  }
  for (const auto& node : {std::string("n0"), std::string("n1")}) {
    std::vector<std::pair<uint64_t, uint64_t>> spans;
    for (int r = 0; r < kRanks; ++r)
      if ((r < 4 ? "n0" : "n1") == node)
        for (const auto& op : plans[r])
          spans.emplace_back(op.file_offset, op.file_offset + op.length);
    std::sort(spans.begin(), spans.end());
    uint64_t end = 0;
    for (const auto& [a, b] : spans) {
      if (b > std::max(a, end)) union_bytes[node] += b - std::max(a, end);
      end = std::max(end, b);
    }
    INFO("node " << node);
    CHECK(node_bytes[node] == union_bytes[node]);
  }

  // Each rank's read pieces, and the streams its readers send it scattered
  // as it scatters them, copy exactly what its plan copies; the ranks of a
  // node read the node's bytes once, spread over them; and a rank loading a
  // window of columns ("d") gets fewer bytes than the blocks it needs.
  std::vector<ferry::RankShare> parts;
  for (int r = 0; r < kRanks; ++r) parts.push_back(ferry::split_for_rank(plans[r], shared, r, m));
  std::map<std::string, uint64_t> read_bytes;
  std::vector<uint64_t> rank_read(kRanks, 0);
  for (int r = 0; r < kRanks; ++r) {
    INFO("rank " << r);
    const auto& part = parts[r];
    for (const auto& p : part.read) rank_read[r] += p.length;
    for (const auto& p : part.read) {
      check_piece(m, p, checksums);
      for (const ferry::ShareTo& to : p.share_with) CHECK(((to.rank < 4) == (r < 4)));
    }
    for (const auto& [from, p] : part.receive) CHECK(((from < 4) == (r < 4)));  // its own node
    const Loaded l = load_rank(m, parts, r, file, kRankTargetBytes, checksums);
    const auto& got = l.bytes;
    const uint64_t blocks = l.blocks, received = l.received;
    read_bytes[r < 4 ? "n0" : "n1"] += rank_read[r];
    CHECK(got == apply_ops(plans[r], file, kRankTargetBytes));
    if (blocks > 0) CHECK(received < blocks);
  }
  CHECK(read_bytes["n0"] == union_bytes["n0"]);
  CHECK(read_bytes["n1"] == union_bytes["n1"]);
}

TEST_CASE("shared reads: a replicated state splits evenly across the ranks of a node",
          "[load_plan]") {
  std::vector<std::pair<std::string, std::vector<int64_t>>> ts;
  for (int i = 0; i < 40; ++i) ts.push_back({"t" + std::to_string(100 + i), {64, 256}});
  const ferry::Manifest m = make_manifest(ts, true);
  std::vector<ferry::LoadRequest> reqs;
  for (uint32_t i = 0; i < ts.size(); ++i)
    reqs.push_back(request(ts[i].first, ts[i].second, ferry::Box::whole(ts[i].second), i));
  auto ops = ferry::make_load_plan(m, reqs);
  REQUIRE(ops.ok());
  std::vector<ferry::RankNeeds> needs;
  for (int r = 0; r < 4; ++r) needs.push_back({r, "n0", ferry::needed_ranges(ops.value(), m), {}});
  const auto shared = ferry::assign_shared_reads(needs);
  std::vector<uint64_t> read(4, 0);
  for (const auto& s : shared) {
    CHECK(s.receivers.size() == 3);
    read[s.reader] += s.range.length;
  }
  const uint64_t one = 64 * 256 * 4;
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(read[r] >= 9 * one);
    CHECK(read[r] <= 11 * one);
  }
}

TEST_CASE("shared reads: ranks splitting a block between them receive only the bytes they copy",
          "[load_plan]") {
  // 200 rows of 4 KiB (a chunk of 12.5 checksum blocks) split between two
  // ranks by rows, or by columns: a block both need is read by one, and the
  // other gets only its rows (one stretch) or its columns (one per row).
  constexpr int64_t kRows = 200, kHalf = kRows / 2;
  const bool by_cols = GENERATE(false, true);
  INFO((by_cols ? "columns" : "rows"));
  const ferry::Manifest m = make_manifest({{"a", {kRows, 1024}}}, true);
  const uint64_t start = m.tensors[0].chunks[0].byte_offset;
  auto box_of = [&](int r) {
    return by_cols ? ferry::Box{{0, r * 512}, {kRows, 512}}
                   : ferry::Box{{r * kHalf, 0}, {kHalf, 1024}};
  };
  std::vector<std::vector<ferry::ReadOp>> plans;
  std::vector<ferry::RankNeeds> needs;
  for (int r = 0; r < 2; ++r) {
    auto ops = ferry::make_load_plan(m, {request("a", {kRows, 1024}, box_of(r), 0)});
    REQUIRE(ops.ok());
    plans.push_back(ops.value());
    needs.push_back({r, "n0", ferry::needed_ranges(ops.value(), m), {}});
    REQUIRE(needs[r].ranges.size() == 1);
    CHECK(needs[r].ranges[0].region == box_of(r));
  }
  const auto shared = ferry::assign_shared_reads(needs);
  std::vector<uint8_t> file(m.files[0].size + 8192);
  for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<uint8_t>(i * 40503u >> 7);
  uint64_t received = 0, shared_blocks = 0;
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    const auto part = ferry::split_for_rank(plans[r], shared, r, m);
    auto got = apply_ops(part.read, file, {kHalf * 4096});
    for (const auto& [from, p] : part.receive) {
      CHECK(from == 1 - r);
      CHECK(p.shared_box == box_of(r));
      shared_blocks += p.length;
      received += ferry::shared_bytes(p, 4);
      // The packed stream of this rank's box in the piece, as the reader
      // builds it from its own copy of the bytes.
      std::vector<uint8_t> stream;
      uint64_t base = 0;
      ferry::for_each_shared_run(p, box_of(r), 4, [&](uint64_t src, uint64_t at, uint64_t n) {
        if (stream.empty()) base = at;
        stream.insert(stream.end(), file.begin() + p.file_offset + src,
                      file.begin() + p.file_offset + src + n);
      });
      ferry::for_each_copy(p, 4, [&](uint64_t src, uint64_t dst, uint64_t n) {
        auto at = ferry::packed_position(p, p.shared_box, src, 4);
        REQUIRE(at.has_value());
        REQUIRE(*at - base + n <= stream.size());
        std::memcpy(got[0].data() + dst, stream.data() + (*at - base), n);
      });
    }
    CHECK(got == apply_ops(plans[r], file, {kHalf * 4096}));
  }
  if (by_cols) {
    // Every block is needed by both: each rank reads half the chunk and
    // gets its half of every row of the other half.
    CHECK(shared_blocks == kRows * 4096);
    CHECK(received == kHalf * 4096);
  } else {
    // The block holding row kHalf is the only one both need; it travels
    // once, and what travels is the receiver's rows of it.
    CHECK(shared_blocks == kBlock);
    const uint64_t split = start + kHalf * 4096;
    const uint64_t seam = start + (kHalf * 4096 / kBlock) * kBlock;
    CHECK((received == split - seam || received == seam + kBlock - split));
  }
  // Rank 1's first element is the first of its box's stream; it has no
  // place in rank 0's.
  const ferry::ReadOp& op = plans[1][0];
  const uint64_t first = by_cols ? 512 * 4 : kHalf * 4096 - op.chunk_offset;
  CHECK(ferry::packed_position(op, box_of(1), first, 4) == uint64_t{0});
  CHECK(ferry::packed_position(op, box_of(1), first + 4, 4) == uint64_t{4});
  CHECK_FALSE(ferry::packed_position(op, box_of(0), first, 4).has_value());
  // Every byte of the box in the read, and back.
  uint64_t seen = 0;
  ferry::for_each_shared_run(op, box_of(1), 4, [&](uint64_t src, uint64_t at, uint64_t n) {
    for (uint64_t k = 0; k < n; k += 1021) {
      CHECK(ferry::packed_position(op, box_of(1), src + k, 4) == at + k);
      CHECK(ferry::unpacked_offset(op, box_of(1), at + k, 4) == src + k);
    }
    seen += n;
  });
  CHECK(seen == kHalf * 4096);
  CHECK_FALSE(ferry::unpacked_offset(op, box_of(1), seen, 4).has_value());  // past the box
}

TEST_CASE("shared reads: a small tail one rank needs is read by the rank reading around it",
          "[load_plan]") {
  // Tensors one block and a 1 KiB row long, split by rows between two ranks:
  // both need block 0 of each, only rank 1 its tail. The ranks split the
  // block 0s between them; rank 0 also reads the tails lying between its
  // block 0s and sends them on, so neither rank makes a read per tensor.
  constexpr int kTensors = 50;
  constexpr int64_t kRowFloats = 256, kRows = kBlock / (kRowFloats * 4) + 1;
  std::vector<std::pair<std::string, std::vector<int64_t>>> ts;
  for (int i = 0; i < kTensors; ++i)
    ts.push_back({"t" + std::to_string(100 + i), {kRows, kRowFloats}});
  const ferry::Manifest m = make_manifest(ts, true);
  std::vector<uint8_t> file(m.files[0].size + 8192);
  for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<uint8_t>(i * 2246822519u >> 11);
  const int64_t half = kRows / 2;
  std::vector<std::vector<ferry::LoadRequest>> reqs(2);
  std::vector<uint64_t> target_bytes(kTensors);
  for (int r = 0; r < 2; ++r) {
    const ferry::Box box = r == 0 ? ferry::Box{{0, 0}, {half, kRowFloats}}
                                  : ferry::Box{{half, 0}, {kRows - half, kRowFloats}};
    for (uint32_t i = 0; i < kTensors; ++i) {
      reqs[r].push_back(request(ts[i].first, ts[i].second, box, i));
      if (r == 1) target_bytes[i] = static_cast<uint64_t>(box.numel()) * 4;
    }
  }
  const NodeLoad node = plan_node(m, reqs);
  const auto& plans = node.plans;
  const auto& parts = node.parts;

  uint64_t union_bytes = 0, read_bytes = 0;
  for (const auto& t : m.tensors) union_bytes += t.chunks[0].byte_length;
  size_t for_others = 0;
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    for (const auto& p : parts[r].read) {
      read_bytes += p.length;
      check_piece(m, p, true);
      if (p.entry != ferry::ReadOp::kForOthers) continue;
      ++for_others;
      CHECK(r == 0);
      CHECK(p.region.empty());
      CHECK(p.length == 1024);  // a tail
      REQUIRE(p.share_with.size() == 1);
      CHECK(p.share_with[0].rank == 1);
    }
    // Each rank's reads make one long run, or two (rank 1's own tensors,
    // and the tail of the last tensor whose block 0 rank 0 reads).
    const auto runs = ferry::make_read_runs(parts[r].read, m, 64 << 20);
    CHECK(runs.size() <= 2);
    const auto mine =
        r == 0 ? std::vector<uint64_t>(kTensors, half * kRowFloats * 4) : target_bytes;
    const Loaded l = load_rank(m, parts, r, file, mine, true);
    CHECK(l.bytes == apply_ops(plans[r], file, mine));
  }
  // Rank 0 reads the tails between its block 0s: all but its last.
  CHECK(for_others == kTensors / 2 - 1);
  CHECK(read_bytes == union_bytes);  // every byte once
}

TEST_CASE("shared reads, random shapes and splits: every rank gets its bytes, each read once",
          "[load_plan]") {
  // Tensors of random shapes (tails of any size, single rows, 1-D), each
  // loaded by 2-4 ranks of one node split by rows, by columns, replicated
  // or as overlapping windows: whatever the assignment does with small
  // ranges, every rank ends up with exactly the bytes its plan copies, the
  // node reads each byte it needs once, and reads for others copy nothing.
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    INFO("seed " << seed);
    std::mt19937 rng(seed);
    auto pick = [&rng](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    const int ranks = static_cast<int>(pick(2, 4));
    std::vector<std::pair<std::string, std::vector<int64_t>>> ts;
    const int64_t n = pick(1, 10);
    for (int64_t i = 0; i < n; ++i) {
      std::vector<int64_t> shape = {pick(ranks, 160), pick(1, 300)};
      if (pick(0, 5) == 0) shape = {pick(ranks, 60000)};
      ts.push_back({"t" + std::to_string(100 + i), shape});
    }
    const bool checksums = pick(0, 4) != 0;
    const ferry::Manifest m = make_manifest(ts, checksums);
    std::vector<uint8_t> file(m.files[0].size + 8192);
    for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<uint8_t>(i * 2654435761u >> 9);

    std::vector<std::vector<ferry::LoadRequest>> reqs(ranks);
    std::vector<std::vector<uint64_t>> targets(ranks);
    std::vector<int> how(ts.size());
    for (auto& h : how) h = static_cast<int>(pick(0, 3));
    for (int r = 0; r < ranks; ++r) {
      for (uint32_t i = 0; i < ts.size(); ++i) {
        const auto& shape = ts[i].second;
        ferry::Box box = ferry::Box::whole(shape);
        const int64_t rows = shape[0];
        if (how[i] == 0 || (how[i] == 1 && shape.size() == 1)) {
          box.offsets[0] = rows * r / ranks;
          box.sizes[0] = rows * (r + 1) / ranks - box.offsets[0];
        } else if (how[i] == 1) {
          const int64_t cols = shape[1];
          if (cols >= ranks) {
            box.offsets[1] = cols * r / ranks;
            box.sizes[1] = cols * (r + 1) / ranks - box.offsets[1];
          }
        } else if (how[i] == 3) {
          box.offsets[0] = rows * r / (ranks + 1);  // windows that overlap
          box.sizes[0] = rows * (r + 2) / (ranks + 1) - box.offsets[0];
        }
        targets[r].push_back(static_cast<uint64_t>(box.numel()) * 4);
        reqs[r].push_back(request(ts[i].first, shape, box, i));
      }
    }
    const NodeLoad node = plan_node(m, reqs);
    const auto& plans = node.plans;
    const auto& parts = node.parts;

    std::vector<std::pair<uint64_t, uint64_t>> spans;
    for (const auto& plan : plans)
      for (const auto& op : plan) spans.emplace_back(op.file_offset, op.file_offset + op.length);
    std::sort(spans.begin(), spans.end());
    uint64_t union_bytes = 0, end = 0, read_bytes = 0;
    for (const auto& [a, b] : spans) {
      if (b > std::max(a, end)) union_bytes += b - std::max(a, end);
      end = std::max(end, b);
    }
    for (int r = 0; r < ranks; ++r) {
      INFO("rank " << r);
      for (const auto& p : parts[r].read) {
        read_bytes += p.length;
        check_piece(m, p, checksums);
        if (p.entry == ferry::ReadOp::kForOthers) {
          CHECK(p.length <= (256u << 10));
          REQUIRE(p.share_with.size() == 1);
          CHECK(p.share_with[0].rank != r);
        }
      }
      const Loaded l = load_rank(m, parts, r, file, targets[r], checksums);
      CHECK(l.bytes == apply_ops(plans[r], file, targets[r]));
    }
    CHECK(read_bytes == union_bytes);
  }
}

TEST_CASE("slice_op takes pieces on the checksum-block grid only", "[load_plan]") {
  const ferry::Manifest m = make_manifest({{"a", {300, 257}}}, true);
  auto ops = ferry::make_load_plan(m, {request("a", {300, 257}, ferry::Box::whole({300, 257}), 0)});
  REQUIRE(ops.ok());
  const ferry::ReadOp& op = ops.value()[0];
  auto mid = ferry::slice_op(op, op.file_offset + kBlock, kBlock, m);
  REQUIRE(mid);
  CHECK(mid->first_block == 1);
  CHECK(mid->nblocks == 1);
  auto tail = ferry::slice_op(op, op.file_offset + kBlock, op.length - kBlock, m);
  REQUIRE(tail);
  CHECK(tail->nblocks == (op.length - kBlock + kBlock - 1) / kBlock);
  CHECK_FALSE(ferry::slice_op(op, op.file_offset + 4096, kBlock, m));       // off the grid
  CHECK_FALSE(ferry::slice_op(op, op.file_offset, kBlock + 4096, m));       // ends off it
  CHECK_FALSE(ferry::slice_op(op, op.file_offset, op.length + kBlock, m));  // past the op
}

TEST_CASE("shared reads across hosts: every byte is read from storage once per job",
          "[load_plan]") {
  const bool checksums = GENERATE(true, false);
  INFO("checksums " << checksums);
  const ferry::Manifest m = make_manifest(
      {{"a", {300, 257}}, {"b", {1000, 33}}, {"c", {7}}, {"d", {513, 129}}}, checksums);
  std::vector<uint8_t> file(m.files[0].size + 8192);
  for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  // Ranks 0-3 on node "n0", 4-5 on "n1", 6 on "n2".
  constexpr int kRanks = 7;
  auto node = [](int r) { return r < 4 ? 0 : r < 6 ? 1 : 2; };
  std::vector<std::vector<ferry::ReadOp>> plans;
  std::vector<ferry::RankNeeds> needs;
  for (int r = 0; r < kRanks; ++r) {
    auto ops = ferry::make_load_plan(m, rank_requests(r));
    REQUIRE(ops.ok());
    plans.push_back(ops.value());
    needs.push_back({r, "n" + std::to_string(node(r)), ferry::needed_ranges(ops.value(), m), {}});
  }
  const auto shared = ferry::assign_shared_reads(needs, /*across_hosts=*/true);
  std::vector<ferry::RankShare> parts;
  for (int r = 0; r < kRanks; ++r) parts.push_back(ferry::split_for_rank(plans[r], shared, r, m));

  // The bytes any rank of the job needs, once.
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const auto& plan : plans)
    for (const auto& op : plan) spans.emplace_back(op.file_offset, op.file_offset + op.length);
  std::sort(spans.begin(), spans.end());
  uint64_t job_bytes = 0, end = 0;
  for (const auto& [a, b] : spans) {
    if (b > std::max(a, end)) job_bytes += b - std::max(a, end);
    end = std::max(end, b);
  }
  uint64_t from_storage = 0;
  std::vector<uint64_t> node_read(3, 0), node_fetched(3, 0);
  for (int r = 0; r < kRanks; ++r) {
    INFO("rank " << r);
    for (const auto& p : parts[r].read) {
      check_piece(m, p, checksums);
      for (const ferry::ShareTo& to : p.share_with)
        CHECK((node(to.rank) == node(r)) == !to.raw);  // raw: whole, to another node only
      if (p.fetch_from < 0) {
        from_storage += p.length;
        node_read[node(r)] += p.length;
        continue;
      }
      // Fetched: its sender, on another node, reads the same bytes and sends them whole here.
      node_fetched[node(r)] += p.length;
      CHECK(node(p.fetch_from) != node(r));
      int senders = 0;
      for (const auto& q : parts[p.fetch_from].read)
        if (q.file_offset == p.file_offset && q.length == p.length && q.fetch_from < 0)
          for (const ferry::ShareTo& to : q.share_with) senders += to.raw && to.rank == r;
      CHECK(senders == 1);
    }
    for (const auto& [from, p] : parts[r].receive) CHECK(node(from) == node(r));
    // What it ends up with is what its plan reads (fetched bytes are the file's bytes).
    CHECK(load_rank(m, parts, r, file, kRankTargetBytes, checksums).bytes ==
          apply_ops(plans[r], file, kRankTargetBytes));
  }
  CHECK(from_storage == job_bytes);
  // Each node reads part of what it needs and fetches the rest, once.
  int reading = 0;
  for (int n = 0; n < 3; ++n) {
    std::vector<std::pair<uint64_t, uint64_t>> mine;
    for (int r = 0; r < kRanks; ++r)
      if (node(r) == n)
        for (const auto& op : plans[r])
          mine.emplace_back(op.file_offset, op.file_offset + op.length);
    std::sort(mine.begin(), mine.end());
    uint64_t need = 0, upto = 0;
    for (const auto& [a, b] : mine) {
      if (b > std::max(a, upto)) need += b - std::max(a, upto);
      upto = std::max(upto, b);
    }
    INFO("node " << n << " read " << node_read[n] << ", fetched " << node_fetched[n]);
    CHECK(node_read[n] + node_fetched[n] == need);
    CHECK(node_fetched[n] > 0);
    reading += node_read[n] > 0;
  }
  CHECK(reading >= 2);

  // Per node (the default), each node reads what it needs itself.
  uint64_t per_node = 0;
  for (int r = 0; r < kRanks; ++r)
    for (const auto& p :
         ferry::split_for_rank(plans[r], ferry::assign_shared_reads(needs), r, m).read) {
      CHECK(p.fetch_from == -1);
      per_node += p.length;
    }
  CHECK(per_node > from_storage);
}

TEST_CASE("shared reads across hosts: a replicated state splits evenly across the nodes",
          "[load_plan]") {
  std::vector<std::pair<std::string, std::vector<int64_t>>> ts;
  for (int i = 0; i < 60; ++i) ts.push_back({"t" + std::to_string(100 + i), {64, 256}});
  const ferry::Manifest m = make_manifest(ts, true);
  std::vector<ferry::LoadRequest> reqs;
  for (uint32_t i = 0; i < ts.size(); ++i)
    reqs.push_back(request(ts[i].first, ts[i].second, ferry::Box::whole(ts[i].second), i));
  auto ops = ferry::make_load_plan(m, reqs);
  REQUIRE(ops.ok());
  // 3 nodes x 2 ranks, every rank loads everything.
  std::vector<ferry::RankNeeds> needs;
  for (int r = 0; r < 6; ++r)
    needs.push_back({r, "n" + std::to_string(r / 2), ferry::needed_ranges(ops.value(), m), {}});
  const auto shared = ferry::assign_shared_reads(needs, true);
  std::vector<uint64_t> read(6, 0);
  for (const auto& s : shared) {
    if (s.fetch_from >= 0) {
      CHECK(s.fetch_from / 2 != s.reader / 2);
      continue;
    }
    // Read from storage: its node-mate takes its stream, the two other nodes' readers the bytes.
    int raw = 0, mates = 0;
    for (const auto& t : s.receivers) (t.raw ? raw : mates) += 1;
    CHECK(raw == 2);
    CHECK(mates == 1);
    read[s.reader] += s.range.length;
  }
  const uint64_t one = 64 * 256 * 4;
  for (int r = 0; r < 6; ++r) {
    INFO("rank " << r);
    CHECK(read[r] >= 9 * one);  // 60 tensors over 6 ranks of 3 nodes
    CHECK(read[r] <= 11 * one);
  }
}
