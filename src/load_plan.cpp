#include "load_plan.hpp"

#include <algorithm>
#include <memory>
#include <tuple>
#include <unordered_map>

namespace ferry {

namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

Box chunk_box(const ManifestChunk& c) {
  return Box{c.offsets, c.sizes};
}

// A tensor's chunks sorted by their start in dim 0. With the largest dim-0
// extent of any chunk, the chunks that can meet a request are a contiguous
// slice of this order, so a 1,000-rank row-sharded tensor is not scanned in
// full for each of its 1,000 requests.
struct ChunkIndex {
  std::vector<uint32_t> by_start;
  int64_t max_extent = 0;
};

// Below this many chunks a linear scan is as fast as the index and simpler.
constexpr size_t kIndexMinChunks = 16;

Status check_chunks(const ManifestTensor& t, size_t elem_size) {
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    const auto& c = t.chunks[i];
    auto bad = [&](const std::string& why) {
      return Status::corruption("tensor '" + t.key + "' chunk " + std::to_string(i) + ": " + why);
    };
    if (c.offsets.size() != t.global_shape.size() || c.sizes.size() != t.global_shape.size())
      return bad("rank differs from the tensor's");
    if (c.raw_bytes() != static_cast<uint64_t>(chunk_box(c).numel()) * elem_size)
      return bad("holds " + std::to_string(c.raw_bytes()) + " bytes, its box " +
                 chunk_box(c).to_string() + " needs " +
                 std::to_string(static_cast<uint64_t>(chunk_box(c).numel()) * elem_size));
  }
  return Status();
}

ChunkIndex build_index(const ManifestTensor& t) {
  ChunkIndex ix;
  ix.by_start.resize(t.chunks.size());
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    ix.by_start[i] = static_cast<uint32_t>(i);
    ix.max_extent = std::max(ix.max_extent, t.chunks[i].sizes[0]);
  }
  std::sort(ix.by_start.begin(), ix.by_start.end(), [&](uint32_t a, uint32_t b) {
    return t.chunks[a].offsets[0] < t.chunks[b].offsets[0];
  });
  return ix;
}

// Chunk indices (ascending) that may intersect `box`.
std::vector<uint32_t> candidate_chunks(const ManifestTensor& t, const ChunkIndex* ix,
                                       const Box& box) {
  std::vector<uint32_t> out;
  if (!ix) {
    out.reserve(t.chunks.size());
    for (size_t i = 0; i < t.chunks.size(); ++i) out.push_back(static_cast<uint32_t>(i));
    return out;
  }
  // A chunk starting at or before box.start - max_extent ends at or before
  // box.start; one starting at or after box.end starts past it.
  const int64_t lo = box.offsets[0] - ix->max_extent;
  const int64_t hi = box.offsets[0] + box.sizes[0];
  auto start_of = [&](uint32_t c) { return t.chunks[c].offsets[0]; };
  auto first = std::upper_bound(ix->by_start.begin(), ix->by_start.end(), lo,
                                [&](int64_t v, uint32_t c) { return v < start_of(c); });
  auto last = std::lower_bound(first, ix->by_start.end(), hi,
                               [&](uint32_t c, int64_t v) { return start_of(c) < v; });
  out.assign(first, last);
  std::sort(out.begin(), out.end());
  return out;
}

// Appends the reads of the blocks of one chunk that hold bytes of `region`.
void plan_chunk_reads(const LoadRequest& req, uint32_t tensor_idx, uint32_t chunk_idx,
                      const ManifestChunk& c, const Box& region, const Box& cbox, size_t elem_size,
                      uint64_t block_bytes, const LoadPlanOptions& opts, std::vector<ReadOp>* out) {
  // A checkpoint without a block size is read as one block per chunk.
  // A compressed chunk is read in whole frames (codec.hpp), decoded by the reader.
  const uint64_t bb = !c.codec.empty() ? c.frame_bytes
                      : block_bytes    ? block_bytes
                                       : std::max<uint64_t>(c.byte_length, 1);

  // Inclusive ranges of touched blocks. Runs of a region arrive in increasing
  // chunk order (the region is a sub-box of the chunk, both row-major), so a
  // new range only ever extends or follows the last one.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for_each_run(region, cbox, req.box, [&](int64_t s, int64_t, int64_t n) {
    const uint64_t first = static_cast<uint64_t>(s) * elem_size / bb;
    const uint64_t last = (static_cast<uint64_t>(s + n) * elem_size - 1) / bb;
    if (!ranges.empty() && first <= ranges.back().second + 1) {
      ranges.back().second = std::max(ranges.back().second, last);
    } else {
      ranges.emplace_back(first, last);
    }
  });

  const uint64_t max_blocks = std::max<uint64_t>(1, opts.max_read_bytes / bb);
  for (const auto& [first, last] : ranges) {
    for (uint64_t b = first; b <= last; b += max_blocks) {
      const uint64_t nb = std::min(max_blocks, last - b + 1);
      ReadOp op;
      op.entry = req.entry;
      op.tensor = tensor_idx;
      op.chunk = chunk_idx;
      op.file = c.file;
      op.chunk_offset = b * bb;
      // The chunk's last block may be short.
      op.length = std::min((b + nb) * bb, c.raw_bytes()) - op.chunk_offset;
      op.file_offset = c.byte_offset + op.chunk_offset;
      op.first_block = static_cast<uint32_t>(b);
      op.nblocks = static_cast<uint32_t>(nb);
      op.region = region;
      op.chunk_box = cbox;
      op.target_box = req.box;
      out->push_back(std::move(op));
    }
  }
}

}  // namespace

Result<std::vector<LoadRequest>> make_load_requests(const StateDict& sd) {
  std::vector<LoadRequest> out;
  out.reserve(sd.size());
  const auto& entries = sd.entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    FERRY_RETURN_IF_ERROR(validate_entry(e));
    LoadRequest r;
    r.entry = static_cast<uint32_t>(i);
    r.key = e.key;
    r.dtype = e.view.dtype;
    if (e.shard) {
      r.global_shape = e.shard->global_shape;
      r.box = Box{e.shard->offsets, e.view.shape};
    } else {
      r.global_shape = e.view.shape;
      r.box = Box::whole(e.view.shape);
    }
    out.push_back(std::move(r));
  }
  return out;
}

Result<std::vector<ReadOp>> make_load_plan(const Manifest& m,
                                           const std::vector<LoadRequest>& requests,
                                           const LoadPlanOptions& opts) {
  std::vector<ReadOp> ops;
  // Per tensor, built on first use: its chunks are checked once, and indexed
  // when there are many, however many requests name it.
  std::unordered_map<uint32_t, std::unique_ptr<ChunkIndex>> seen;

  for (const auto& req : requests) {
    const ManifestTensor* t = m.find(req.key);
    if (!t) return Status::not_found("tensor '" + req.key + "' is not in the checkpoint");
    if (t->dtype != req.dtype)
      return Status::invalid_argument("tensor '" + req.key + "': dtype " + dtype_name(req.dtype) +
                                      " requested, checkpoint has " + dtype_name(t->dtype));
    if (t->global_shape != req.global_shape)
      return Status::invalid_argument(
          "tensor '" + req.key + "': global shape " + shape_string(req.global_shape) +
          " requested, checkpoint has " + shape_string(t->global_shape));
    if (req.box.offsets.size() != req.global_shape.size() ||
        std::any_of(req.box.sizes.begin(), req.box.sizes.end(), [](int64_t s) { return s < 0; }) ||
        !Box::whole(req.global_shape).contains(req.box))
      return Status::invalid_argument("tensor '" + req.key + "': requested box " +
                                      req.box.to_string() + " is not inside global shape " +
                                      shape_string(req.global_shape));
    const size_t elem_size = dtype_size(t->dtype);
    if (elem_size == 0) return Status::invalid_argument("tensor '" + req.key + "': unknown dtype");
    if (req.box.empty()) continue;

    const auto tensor_idx = static_cast<uint32_t>(t - m.tensors.data());
    auto it = seen.find(tensor_idx);
    if (it == seen.end()) {
      FERRY_RETURN_IF_ERROR(check_chunks(*t, elem_size));
      std::unique_ptr<ChunkIndex> ix;
      if (t->chunks.size() >= kIndexMinChunks && !t->global_shape.empty())
        ix = std::make_unique<ChunkIndex>(build_index(*t));
      it = seen.emplace(tensor_idx, std::move(ix)).first;
    }

    int64_t covered = 0;
    for (uint32_t ci : candidate_chunks(*t, it->second.get(), req.box)) {
      const auto& c = t->chunks[ci];
      const Box cbox = chunk_box(c);
      auto region = intersect(cbox, req.box);
      if (!region) continue;
      covered += region->numel();
      plan_chunk_reads(req, tensor_idx, ci, c, *region, cbox, elem_size, m.checksum_block_bytes,
                       opts, &ops);
    }
    // Saved chunks are disjoint, so full coverage is exactly a full count.
    if (covered != req.box.numel())
      return Status::invalid_argument("tensor '" + req.key + "': region " + req.box.to_string() +
                                      " is not fully covered by the checkpoint's chunks (" +
                                      std::to_string(covered) + " of " +
                                      std::to_string(req.box.numel()) + " elements)");
  }
  return ops;
}

void for_each_copy(const ReadOp& op, size_t elem_size,
                   const std::function<void(uint64_t, uint64_t, uint64_t)>& fn) {
  RunCursor cur(op.region, op.chunk_box, op.target_box);
  if (cur.count() == 0 || op.length == 0) return;
  const uint64_t es = elem_size;
  const uint64_t lo = op.chunk_offset;
  const uint64_t hi = op.chunk_offset + op.length;
  const uint64_t run_bytes = static_cast<uint64_t>(cur.run()) * es;

  // First run that ends past the read's start (source offsets grow with the
  // run index).
  int64_t a = 0, b = cur.count();
  while (a < b) {
    const int64_t mid = a + (b - a) / 2;
    if (static_cast<uint64_t>(cur.src_of(mid)) * es + run_bytes <= lo) {
      a = mid + 1;
    } else {
      b = mid;
    }
  }
  for (cur.seek(a); !cur.done(); cur.next()) {
    const uint64_t s = static_cast<uint64_t>(cur.src()) * es;
    if (s >= hi) break;
    const uint64_t from = std::max(s, lo);
    const uint64_t to = std::min(s + run_bytes, hi);
    fn(from - lo, static_cast<uint64_t>(cur.dst()) * es + (from - s), to - from);
  }
}

std::vector<ReadRun> make_read_runs(std::vector<ReadOp> ops, const Manifest& m,
                                    uint64_t max_run_bytes, uint64_t align) {
  std::sort(ops.begin(), ops.end(), [](const ReadOp& a, const ReadOp& b) {
    return std::tie(a.file, a.file_offset, a.entry) < std::tie(b.file, b.file_offset, b.entry);
  });
  auto down = [align](uint64_t v) { return v / align * align; };
  auto up = [align](uint64_t v) { return (v + align - 1) / align * align; };
  max_run_bytes = std::max(align, down(max_run_bytes));

  std::vector<ReadRun> runs;
  for (ReadOp& op : ops) {
    const ManifestChunk& c = m.tensors[op.tensor].chunks[op.chunk];
    const bool blocks = !c.checksums.empty() && m.checksum_block_bytes > 0;
    const uint64_t grain = blocks ? m.checksum_block_bytes : align;
    bool fresh = false;  // the op's rest must start a run of its own
    while (op.length > 0) {
      const bool joins = !fresh && !runs.empty() && runs.back().file == op.file &&
                         down(op.file_offset) <= runs.back().offset + runs.back().length;
      if (!joins) runs.push_back(ReadRun{op.file, down(op.file_offset), 0, {}});
      ReadRun& run = runs.back();
      const uint64_t room_end = run.offset + max_run_bytes;
      const uint64_t end = op.file_offset + op.length;
      if (up(end) <= room_end) {
        run.length = std::max(run.length, up(end) - run.offset);
        run.ops.push_back(op);
        break;
      }
      uint64_t take = room_end > op.file_offset ? (room_end - op.file_offset) / grain * grain : 0;
      if (take == 0) {
        if (joins) {
          fresh = true;  // this run is full: the op starts the next
          continue;
        }
        take = std::min(grain, op.length);  // one block bigger than a run: an oversized run
      }
      ReadOp piece = op;
      piece.length = take;
      const auto piece_blocks = static_cast<uint32_t>(blocks ? (take + grain - 1) / grain : 0);
      if (blocks) piece.nblocks = piece_blocks;
      run.length = std::max(run.length, up(piece.file_offset + take) - run.offset);
      run.ops.push_back(piece);
      op.file_offset += take;
      op.chunk_offset += take;
      op.length -= take;
      if (blocks) {
        op.first_block += piece_blocks;
        op.nblocks -= piece_blocks;
      }
      fresh = true;
    }
  }
  return runs;
}

std::vector<std::string> tensors_not_requested(const Manifest& m,
                                               const std::vector<LoadRequest>& requests) {
  std::vector<const std::string*> asked;
  asked.reserve(requests.size());
  for (const auto& r : requests) asked.push_back(&r.key);
  std::sort(asked.begin(), asked.end(),
            [](const std::string* a, const std::string* b) { return *a < *b; });
  std::vector<std::string> left;
  for (const auto& t : m.tensors) {
    auto it = std::lower_bound(asked.begin(), asked.end(), &t.key,
                               [](const std::string* a, const std::string* b) { return *a < *b; });
    if (it == asked.end() || **it != t.key) left.push_back(t.key);
  }
  return left;
}

}  // namespace ferry
