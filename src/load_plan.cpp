#include "load_plan.hpp"

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

namespace ferry {

namespace {

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
    int64_t numel = 1;
    for (int64_t s : c.sizes) numel *= s;
    if (c.raw_bytes() != static_cast<uint64_t>(numel) * elem_size)
      return bad("holds " + std::to_string(c.raw_bytes()) + " bytes, its box " +
                 chunk_box(c).to_string() + " needs " +
                 std::to_string(static_cast<uint64_t>(numel) * elem_size));
  }
  return Status();
}

// Box::whole(shape).contains(box), without building the whole box (a plan
// asks it once per request).
bool inside_shape(const Box& box, const std::vector<int64_t>& shape) {
  if (box.offsets.size() != shape.size() || box.sizes.size() != shape.size()) return false;
  for (size_t i = 0; i < shape.size(); ++i)
    if (box.offsets[i] < 0 || box.offsets[i] + box.sizes[i] > shape[i]) return false;
  return true;
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

// Chunk indices (ascending) that may intersect `box`, into `out`. Without an
// index, every chunk (most tensors have one): `out` is left empty and the
// caller walks them all, so a plan of many small tensors allocates nothing here.
void candidate_chunks(const ManifestTensor& t, const ChunkIndex* ix, const Box& box,
                      std::vector<uint32_t>* out) {
  out->clear();
  if (!ix) return;
  // A chunk starting at or before box.start - max_extent ends at or before
  // box.start; one starting at or after box.end starts past it.
  const int64_t lo = box.offsets[0] - ix->max_extent;
  const int64_t hi = box.offsets[0] + box.sizes[0];
  auto start_of = [&](uint32_t c) { return t.chunks[c].offsets[0]; };
  auto first = std::upper_bound(ix->by_start.begin(), ix->by_start.end(), lo,
                                [&](int64_t v, uint32_t c) { return v < start_of(c); });
  auto last = std::lower_bound(first, ix->by_start.end(), hi,
                               [&](uint32_t c, int64_t v) { return start_of(c) < v; });
  out->assign(first, last);
  std::sort(out->begin(), out->end());
}

// Appends the reads of the blocks of one chunk that hold bytes of `region`.
// `region` and `cbox` are moved into the last read (most chunks have one).
void plan_chunk_reads(const LoadRequest& req, uint32_t tensor_idx, uint32_t chunk_idx,
                      const ManifestChunk& c, Box region, Box cbox, size_t elem_size,
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
  if (region == cbox) {
    // The whole chunk (a load of the sharding it was saved with): every
    // block, without walking the region's runs.
    ranges.emplace_back(0, (c.raw_bytes() - 1) / bb);
  } else {
    for_each_run(region, cbox, req.box, [&](int64_t s, int64_t, int64_t n) {
      const uint64_t first = static_cast<uint64_t>(s) * elem_size / bb;
      const uint64_t last = (static_cast<uint64_t>(s + n) * elem_size - 1) / bb;
      if (!ranges.empty() && first <= ranges.back().second + 1) {
        ranges.back().second = std::max(ranges.back().second, last);
      } else {
        ranges.emplace_back(first, last);
      }
    });
  }

  const uint64_t max_blocks = std::max<uint64_t>(1, opts.max_read_bytes / bb);
  for (size_t r = 0; r < ranges.size(); ++r) {
    const auto [first, last] = ranges[r];
    for (uint64_t b = first; b <= last; b += max_blocks) {
      const uint64_t nb = std::min(max_blocks, last - b + 1);
      const bool final_read = r + 1 == ranges.size() && last - b < max_blocks;
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
      if (final_read) {
        op.region = std::move(region);
        op.chunk_box = std::move(cbox);
      } else {
        op.region = region;
        op.chunk_box = cbox;
      }
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
  ops.reserve(requests.size());  // one read per request, the most common case
  // Per tensor, built on first use: its chunks are checked once, and indexed
  // when there are many, however many requests name it. By tensor index: a
  // map node per tensor cost more than the rest of a small tensor's plan.
  std::vector<char> checked(m.tensors.size(), 0);
  std::vector<std::unique_ptr<ChunkIndex>> indexes(m.tensors.size());
  std::vector<uint32_t> candidates;  // reused: one allocation for the whole plan

  for (const auto& req : requests) {
    const ManifestTensor* t = m.find(req.key);
    if (!t) return Status::not_found("tensor '" + req.key + "' is not in the checkpoint");
    if (t->dtype != req.dtype)
      return Status::invalid_argument("tensor '" + req.key + "': dtype " + dtype_name(req.dtype) +
                                      " requested, checkpoint has " + dtype_name(t->dtype));
    if (t->global_shape != req.global_shape)
      return Status::invalid_argument(
          "tensor '" + req.key + "': global shape " + shape_to_string(req.global_shape) +
          " requested, checkpoint has " + shape_to_string(t->global_shape));
    if (req.box.offsets.size() != req.global_shape.size() ||
        std::any_of(req.box.sizes.begin(), req.box.sizes.end(), [](int64_t s) { return s < 0; }) ||
        !inside_shape(req.box, req.global_shape))
      return Status::invalid_argument("tensor '" + req.key + "': requested box " +
                                      req.box.to_string() + " is not inside global shape " +
                                      shape_to_string(req.global_shape));
    const size_t elem_size = dtype_size(t->dtype);
    if (elem_size == 0) return Status::invalid_argument("tensor '" + req.key + "': unknown dtype");
    if (req.box.empty()) continue;

    const auto tensor_idx = static_cast<uint32_t>(t - m.tensors.data());
    if (!checked[tensor_idx]) {
      FERRY_RETURN_IF_ERROR(check_chunks(*t, elem_size));
      if (t->chunks.size() >= kIndexMinChunks && !t->global_shape.empty())
        indexes[tensor_idx] = std::make_unique<ChunkIndex>(build_index(*t));
      checked[tensor_idx] = 1;
    }
    const ChunkIndex* ix = indexes[tensor_idx].get();

    int64_t covered = 0;
    candidate_chunks(*t, ix, req.box, &candidates);
    const size_t n = ix ? candidates.size() : t->chunks.size();
    for (size_t k = 0; k < n; ++k) {
      const uint32_t ci = ix ? candidates[k] : static_cast<uint32_t>(k);
      const auto& c = t->chunks[ci];
      Box cbox = chunk_box(c);
      auto region = intersect(cbox, req.box);
      if (!region) continue;
      covered += region->numel();
      plan_chunk_reads(req, tensor_idx, ci, c, std::move(*region), std::move(cbox), elem_size,
                       m.checksum_block_bytes, opts, &ops);
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
                                    uint64_t max_run_bytes, uint64_t align,
                                    uint64_t tail_run_bytes) {
  auto by_place = [](const ReadOp& a, const ReadOp& b) {
    return std::tie(a.file, a.file_offset, a.entry) < std::tie(b.file, b.file_offset, b.entry);
  };
  // Usually sorted already (the loader's split keeps file order).
  if (!std::is_sorted(ops.begin(), ops.end(), by_place))
    std::sort(ops.begin(), ops.end(), by_place);
  auto down = [align](uint64_t v) { return v / align * align; };
  auto up = [align](uint64_t v) { return (v + align - 1) / align * align; };
  max_run_bytes = std::max(align, down(max_run_bytes));
  tail_run_bytes =
      tail_run_bytes == 0 ? max_run_bytes : std::clamp(down(tail_run_bytes), align, max_run_bytes);
  uint64_t left = 0;  // op bytes not yet in a run
  for (const ReadOp& op : ops) left += op.length;
  // Each run's ops reserved for as many of the average op as it holds: a
  // run of hundreds of small ops otherwise grows (and moves them) ten times.
  const uint64_t mean_op = ops.empty() ? 1 : std::max<uint64_t>(1, left / ops.size());
  size_t ops_left = ops.size();
  // A run started with `left` bytes to go: the last max_run_bytes go in
  // runs of tail_run_bytes, and the run before them ends where they begin.
  auto cap_for = [&]() {
    if (left > 2 * max_run_bytes) return max_run_bytes;
    if (left > max_run_bytes) return std::max(tail_run_bytes, up(left - max_run_bytes));
    return tail_run_bytes;
  };

  std::vector<ReadRun> runs;
  uint64_t cap = max_run_bytes;  // of runs.back()
  for (ReadOp& op : ops) {
    const ManifestChunk& c = m.tensors[op.tensor].chunks[op.chunk];
    const bool blocks = !c.checksums.empty() && m.checksum_block_bytes > 0;
    const uint64_t grain = blocks ? m.checksum_block_bytes : align;
    bool fresh = false;  // the op's rest must start a run of its own
    while (op.length > 0) {
      const bool joins = !fresh && !runs.empty() && runs.back().file == op.file &&
                         down(op.file_offset) <= runs.back().offset + runs.back().length;
      if (!joins) {
        runs.push_back(ReadRun{op.file, down(op.file_offset), 0, {}});
        cap = cap_for();
        runs.back().ops.reserve(std::min<uint64_t>(ops_left, cap / mean_op + 1));
      }
      ReadRun& run = runs.back();
      const uint64_t room_end = run.offset + cap;
      const uint64_t end = op.file_offset + op.length;
      if (up(end) <= room_end) {
        run.length = std::max(run.length, up(end) - run.offset);
        left -= op.length;
        --ops_left;
        run.ops.push_back(std::move(op));
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
      left -= take;
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

Status resolve_per_rank(std::vector<LoadRequest>& requests, const StateDict& sd, const Manifest& m,
                        int32_t rank, int32_t world_size) {
  const auto& entries = sd.entries();
  for (LoadRequest& r : requests) {
    const StateEntry& e = entries[r.entry];
    if (!e.per_rank || m.find(e.key) != nullptr) continue;  // saved as one value: load that
    int32_t from = rank;
    if (m.world_size != world_size) {
      if (e.on_resize == OnResize::error)
        return Status::invalid_argument(
            "tensor '" + e.key + "' is per-rank: saved by " + std::to_string(m.world_size) +
            " ranks, loaded by " + std::to_string(world_size) +
            ", and its on_resize policy is error (choose first, or in Python a function of the "
            "saved values, to say what each rank gets)");
      from = 0;
    }
    r.key = per_rank_key(e.key, from);
    if (m.find(r.key) == nullptr)
      return Status::not_found("tensor '" + e.key +
                               "': the checkpoint has no per-rank value of "
                               "rank " +
                               std::to_string(from) + " (saved by " + std::to_string(m.world_size) +
                               " ranks)");
  }
  return Status();
}

std::vector<std::string> tensors_not_requested(const Manifest& m,
                                               const std::vector<LoadRequest>& requests) {
  // Marked by index through the manifest's own (sorted) order: sorting the
  // requests' keys instead was most of this at 10,000 tensors.
  std::vector<char> asked(m.tensors.size(), 0);
  // Per-rank entries asked for: the other ranks' values of them are not left out.
  std::vector<std::string> per_rank_asked;
  for (const auto& r : requests) {
    if (const ManifestTensor* t = m.find(r.key))
      asked[static_cast<size_t>(t - m.tensors.data())] = 1;
    if (auto pr = parse_per_rank_key(r.key)) per_rank_asked.push_back(pr->first);
  }
  std::sort(per_rank_asked.begin(), per_rank_asked.end());
  std::vector<std::string> left;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const ManifestTensor& t = m.tensors[i];
    if (asked[i]) continue;
    if (t.per_rank >= 0 && !per_rank_asked.empty()) {
      auto pr = parse_per_rank_key(t.key);
      if (pr && std::binary_search(per_rank_asked.begin(), per_rank_asked.end(), pr->first))
        continue;
    }
    left.push_back(t.key);
  }
  return left;
}

std::vector<NeededRange> needed_ranges(const std::vector<ReadOp>& ops, const Manifest& m) {
  std::vector<NeededRange> out;
  out.reserve(ops.size());
  for (const auto& op : ops)
    if (m.tensors[op.tensor].chunks[op.chunk].codec.empty())
      out.push_back(NeededRange{FileRange{op.file, op.file_offset, op.length}, op.region});
  return out;
}

namespace {

// A read this short costs a disk request of its own for few bytes; the rank
// reading the bytes around it gets them in its run for free.
constexpr uint64_t kSmallReadBytes = 256 << 10;

// Ranks splitting tensors by rows need the blocks at the seams together and
// the blocks between alone. When a tensor's own part is only a small tail
// block (a tensor a little larger than a block), its needer would make one
// tiny read per tensor between the long runs another rank reads around it:
// thousands of requests queued behind the big reads. Such a read goes to the
// rank reading its neighbour instead, which sends the bytes on with the
// rest. `reads` are one node's, in file order; `alone[i]` is the only needer
// of reads[i], or null where several need it.
void give_small_reads_to_neighbours(std::vector<SharedRead>::iterator reads,
                                    std::vector<SharedRead>::iterator end,
                                    const std::vector<const ShareTo*>& alone) {
  const size_t n = static_cast<size_t>(end - reads);
  std::vector<int32_t> reader(n);
  for (size_t i = 0; i < n; ++i) reader[i] = reads[i].reader;
  auto touching = [&](size_t a, size_t b) {
    return reads[a].range.file == reads[b].range.file &&
           reads[a].range.offset + reads[a].range.length == reads[b].range.offset;
  };
  for (size_t i = 0; i < n; ++i) {
    SharedRead& r = reads[i];
    if (!alone[i] || r.range.length > kSmallReadBytes) continue;
    const bool after = i > 0 && touching(i - 1, i);
    const bool before = i + 1 < n && touching(i, i + 1);
    // Next to bytes its needer reads anyway: they share a run already.
    if ((after && reader[i - 1] == r.reader) || (before && reader[i + 1] == r.reader)) continue;
    if (!after && !before) continue;
    r.reader = after ? reader[i - 1] : reader[i + 1];
    r.receivers = {*alone[i]};
  }
}

// Splits a set's bytes into one contiguous stretch per member, equal in
// bytes: the member that takes the next `length` bytes when `at` bytes of
// the set's `total` went before (and counts them).
size_t take_turn(uint64_t& at, uint64_t total, size_t members, uint64_t length) {
  const size_t pick = static_cast<size_t>(std::min<uint64_t>(members - 1, at * members / total));
  at += length;
  return pick;
}

// Across hosts: the job's cuts of each file (sorted) and, per segment
// between two of them, the node that reads it from storage (an index into
// the nodes in host order; SIZE_MAX where no node needs it). Per set of
// nodes needing segments, their bytes split into one stretch per node.
struct JobCuts {
  std::map<uint32_t, std::vector<uint64_t>> cuts;
  std::map<uint32_t, std::vector<size_t>> source;
};

template <typename AddCuts>
JobCuts cut_job(const std::vector<RankNeeds>& needs, AddCuts add_cuts) {
  JobCuts j;
  for (const RankNeeds& n : needs) add_cuts(n, j.cuts);
  std::map<uint32_t, std::vector<std::vector<size_t>>> nodes;  // [file][segment]
  for (auto& [file, c] : j.cuts) {
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
    nodes[file].resize(c.size() - 1);
  }
  size_t node = 0;
  for (size_t first = 0; first < needs.size(); ++node) {
    size_t last = first;
    while (last < needs.size() && needs[last].host == needs[first].host) ++last;
    for (size_t r = first; r < last; ++r)
      for (const auto& [fr, region] : needs[r].ranges) {
        if (fr.length == 0) continue;
        const auto& c = j.cuts[fr.file];
        auto& w = nodes[fr.file];
        const size_t a = std::lower_bound(c.begin(), c.end(), fr.offset) - c.begin();
        const size_t b = std::lower_bound(c.begin(), c.end(), fr.offset + fr.length) - c.begin();
        for (size_t k = a; k < b; ++k)
          if (w[k].empty() || w[k].back() != node) w[k].push_back(node);
      }
    first = last;
  }
  std::map<std::vector<size_t>, uint64_t> total, seen;
  for (const auto& [file, w] : nodes)
    for (size_t k = 0; k < w.size(); ++k)
      if (!w[k].empty()) total[w[k]] += j.cuts[file][k + 1] - j.cuts[file][k];
  for (const auto& [file, w] : nodes) {
    auto& src = j.source[file];
    src.assign(w.size(), SIZE_MAX);
    for (size_t k = 0; k < w.size(); ++k)
      if (!w[k].empty())
        src[k] = w[k][take_turn(seen[w[k]], total[w[k]], w[k].size(),
                                j.cuts[file][k + 1] - j.cuts[file][k])];
  }
  return j;
}

// Each range that several nodes read (the same range on each: the cuts are
// the job's) is read from storage by the node `job` picked, whose reader
// sends it whole to the reader of every other such node.
void share_across_nodes(std::vector<SharedRead>& out, const std::vector<size_t>& node_of,
                        const JobCuts& job) {
  std::map<std::tuple<uint32_t, uint64_t, uint64_t>, std::vector<size_t>> by_range;
  for (size_t i = 0; i < out.size(); ++i)
    by_range[{out[i].range.file, out[i].range.offset, out[i].range.length}].push_back(i);
  for (const auto& [range, reads] : by_range) {
    if (reads.size() < 2) continue;
    const auto& c = job.cuts.at(std::get<0>(range));
    const size_t k = std::lower_bound(c.begin(), c.end(), std::get<1>(range)) - c.begin();
    const size_t from = job.source.at(std::get<0>(range))[k];
    const auto src =
        std::find_if(reads.begin(), reads.end(), [&](size_t i) { return node_of[i] == from; });
    if (src == reads.end()) continue;  // not reached: the source node needs it
    for (size_t i : reads) {
      if (i == *src) continue;
      out[i].fetch_from = out[*src].reader;
      out[*src].receivers.push_back(ShareTo{out[i].reader, Box{}, true});
    }
  }
}

}  // namespace

std::vector<SharedRead> assign_shared_reads(std::vector<RankNeeds> needs, bool across_hosts) {
  std::sort(needs.begin(), needs.end(), [](const RankNeeds& a, const RankNeeds& b) {
    return std::tie(a.host, a.rank) < std::tie(b.host, b.rank);
  });
  auto add_cuts = [](const RankNeeds& n, std::map<uint32_t, std::vector<uint64_t>>& cuts) {
    for (const auto& [fr, region] : n.ranges) {
      if (fr.length == 0) continue;
      cuts[fr.file].push_back(fr.offset);
      cuts[fr.file].push_back(fr.offset + fr.length);
    }
  };
  // Across hosts every node cuts where any rank does: a range several nodes
  // need is then the same range on each.
  JobCuts job;
  if (across_hosts) job = cut_job(needs, add_cuts);
  std::vector<SharedRead> out;
  std::vector<size_t> node_of;  // per read in `out`: its node's index
  size_t node = 0;
  for (size_t first = 0; first < needs.size();) {
    size_t last = first;
    while (last < needs.size() && needs[last].host == needs[first].host) ++last;
    // Every start and end of a range of this node cuts the file: between two
    // neighbouring cuts the set of ranks needing the bytes is constant.
    std::map<uint32_t, std::vector<uint64_t>> cuts;
    if (across_hosts)
      cuts = job.cuts;
    else
      for (size_t r = first; r < last; ++r) add_cuts(needs[r], cuts);
    // [file][segment]: the ranks needing it, ascending, and the box of what
    // each copies out of it (the bounding box, should two of its ranges hold
    // the segment).
    std::map<uint32_t, std::vector<std::vector<ShareTo>>> who;
    for (auto& [file, c] : cuts) {
      std::sort(c.begin(), c.end());
      c.erase(std::unique(c.begin(), c.end()), c.end());
      who[file].resize(c.size() - 1);
    }
    for (size_t r = first; r < last; ++r)
      for (const auto& [fr, region] : needs[r].ranges) {
        if (fr.length == 0) continue;
        const auto& c = cuts[fr.file];
        auto& w = who[fr.file];
        const size_t i = std::lower_bound(c.begin(), c.end(), fr.offset) - c.begin();
        const size_t j = std::lower_bound(c.begin(), c.end(), fr.offset + fr.length) - c.begin();
        for (size_t k = i; k < j; ++k) {
          if (w[k].empty() || w[k].back().rank != needs[r].rank)
            w[k].push_back(ShareTo{needs[r].rank, region});
          else
            w[k].back().box = bounding_box(w[k].back().box, region);
        }
      }
    // Bytes each set of ranks shares, so each set's bytes split into equal
    // contiguous stretches, one per rank of the set. Across hosts, the bytes
    // the node reads from storage and those it fetches split apart: each
    // rank then reads its share of both.
    auto ranks_of = [&](const std::vector<ShareTo>& w, uint32_t file, size_t k) {
      std::vector<int32_t> ranks;
      for (const ShareTo& t : w) ranks.push_back(t.rank);
      if (across_hosts) ranks.push_back(job.source.at(file)[k] == node ? -1 : -2);
      return ranks;
    };
    std::map<std::vector<int32_t>, uint64_t> total, seen;
    for (const auto& [file, w] : who)
      for (size_t k = 0; k < w.size(); ++k)
        if (w[k].size() > 1) total[ranks_of(w[k], file, k)] += cuts[file][k + 1] - cuts[file][k];
    const size_t node_first = out.size();
    std::vector<const ShareTo*> alone;  // per read of this node: its only needer, if one
    for (const auto& [file, w] : who) {
      const auto& c = cuts[file];
      for (size_t k = 0; k < w.size(); ++k) {
        if (w[k].empty()) continue;
        SharedRead sr;
        sr.range = FileRange{file, c[k], c[k + 1] - c[k]};
        alone.push_back(w[k].size() == 1 ? &w[k][0] : nullptr);
        if (w[k].size() == 1) {
          sr.reader = w[k][0].rank;
        } else {
          const std::vector<int32_t> ranks = ranks_of(w[k], file, k);
          sr.reader = ranks[take_turn(seen[ranks], total[ranks], w[k].size(), sr.range.length)];
          for (const ShareTo& t : w[k])
            if (t.rank != sr.reader) sr.receivers.push_back(t);
        }
        out.push_back(std::move(sr));
      }
    }
    give_small_reads_to_neighbours(out.begin() + node_first, out.end(), alone);
    node_of.resize(out.size(), node++);
    first = last;
  }
  if (across_hosts) share_across_nodes(out, node_of, job);
  return out;
}

std::optional<ReadOp> slice_op(const ReadOp& op, uint64_t file_offset, uint64_t length,
                               const Manifest& m) {
  if (length == 0 || file_offset < op.file_offset ||
      file_offset + length > op.file_offset + op.length)
    return std::nullopt;
  const ManifestChunk& c = m.tensors[op.tensor].chunks[op.chunk];
  const uint64_t bb = c.checksums.empty() ? 0 : m.checksum_block_bytes;
  ReadOp piece = op;
  piece.file_offset = file_offset;
  piece.chunk_offset = op.chunk_offset + (file_offset - op.file_offset);
  piece.length = length;
  if (bb > 0) {
    const uint64_t end = piece.chunk_offset + length;
    if (piece.chunk_offset % bb != 0 || (end % bb != 0 && end != op.chunk_offset + op.length))
      return std::nullopt;
    piece.first_block = static_cast<uint32_t>(piece.chunk_offset / bb);
    piece.nblocks = static_cast<uint32_t>((length + bb - 1) / bb);
  }
  return piece;
}

void for_each_shared_run(const ReadOp& op, const Box& box, size_t elem_size,
                         const std::function<void(uint64_t, uint64_t, uint64_t)>& fn) {
  auto b = intersect(box, op.chunk_box);
  if (!b) return;
  // The box's elements are copied "into" the box itself: the destination
  // offsets are the packed stream's.
  ReadOp q = op;
  q.region = *b;
  q.target_box = *b;
  for_each_copy(q, elem_size, fn);
}

namespace {

// Dimension d of box ∩ chunk_box: its first index and extent (at most 0:
// empty). packed_position and unpacked_offset run once per copied run, so
// they clip in place instead of building the intersection (two vectors).
std::pair<int64_t, int64_t> clipped(const Box& box, const Box& chunk_box, size_t d) {
  const int64_t lo = std::max(box.offsets[d], chunk_box.offsets[d]);
  const int64_t hi =
      std::min(box.offsets[d] + box.sizes[d], chunk_box.offsets[d] + chunk_box.sizes[d]);
  return {lo, hi - lo};
}

}  // namespace

std::optional<uint64_t> packed_position(const ReadOp& op, const Box& box, uint64_t offset,
                                        size_t elem_size) {
  if (box.rank() != op.chunk_box.rank() || offset >= op.length || elem_size == 0)
    return std::nullopt;
  const uint64_t at = op.chunk_offset + offset;
  uint64_t elem = at / elem_size;
  uint64_t packed = 0, stride = 1;
  for (size_t d = op.chunk_box.rank(); d-- > 0;) {
    const auto [lo, extent] = clipped(box, op.chunk_box, d);
    const uint64_t n = static_cast<uint64_t>(op.chunk_box.sizes[d]);
    const int64_t g = op.chunk_box.offsets[d] + static_cast<int64_t>(elem % n);
    elem /= n;
    if (g < lo || g >= lo + extent) return std::nullopt;
    packed += static_cast<uint64_t>(g - lo) * stride;
    stride *= static_cast<uint64_t>(extent);
  }
  if (elem != 0) return std::nullopt;  // past the chunk's last element
  return packed * elem_size + at % elem_size;
}

std::optional<uint64_t> unpacked_offset(const ReadOp& op, const Box& box, uint64_t position,
                                        size_t elem_size) {
  if (box.rank() != op.chunk_box.rank() || elem_size == 0) return std::nullopt;
  uint64_t elem = position / elem_size;
  uint64_t at = 0, stride = 1;  // the element's index in the chunk
  for (size_t d = box.rank(); d-- > 0;) {
    const auto [lo, extent] = clipped(box, op.chunk_box, d);
    if (extent <= 0) return std::nullopt;
    const uint64_t n = static_cast<uint64_t>(extent);
    const int64_t g = lo + static_cast<int64_t>(elem % n);
    elem /= n;
    at += static_cast<uint64_t>(g - op.chunk_box.offsets[d]) * stride;
    stride *= static_cast<uint64_t>(op.chunk_box.sizes[d]);
  }
  if (elem != 0) return std::nullopt;  // past the box's last element
  const uint64_t byte = at * elem_size + position % elem_size;
  if (byte < op.chunk_offset || byte >= op.chunk_offset + op.length) return std::nullopt;
  return byte - op.chunk_offset;
}

uint64_t shared_bytes(const ReadOp& piece, size_t elem_size) {
  uint64_t n = 0;
  for_each_shared_run(piece, piece.shared_box, elem_size,
                      [&n](uint64_t, uint64_t, uint64_t k) { n += k; });
  return n;
}

namespace {

// Pieces of the chunks that hold `reads` (sorted by file and offset), made
// to be verified and sent on: entry kForOthers, nothing to copy here. A
// range that is no piece of a raw chunk on its block grid is left out (every
// rank plans from the same manifest, so none is); its receiver then times
// out waiting for it, naming this rank.
void add_reads_for_others(const std::vector<const SharedRead*>& reads, const Manifest& m,
                          std::vector<ReadOp>* out) {
  struct Where {
    uint32_t file;
    uint64_t offset;
    uint32_t tensor, chunk;
  };
  std::vector<Where> chunks;
  for (uint32_t t = 0; t < m.tensors.size(); ++t)
    for (uint32_t c = 0; c < m.tensors[t].chunks.size(); ++c)
      chunks.push_back({m.tensors[t].chunks[c].file, m.tensors[t].chunks[c].byte_offset, t, c});
  std::sort(chunks.begin(), chunks.end(), [](const Where& a, const Where& b) {
    return std::tie(a.file, a.offset) < std::tie(b.file, b.offset);
  });
  for (const SharedRead* r : reads) {
    auto it = std::upper_bound(chunks.begin(), chunks.end(), r->range,
                               [](const FileRange& v, const Where& w) {
                                 return std::tie(v.file, v.offset) < std::tie(w.file, w.offset);
                               });
    if (it == chunks.begin()) continue;
    --it;
    const ManifestTensor& t = m.tensors[it->tensor];
    const ManifestChunk& c = t.chunks[it->chunk];
    if (!c.codec.empty() || c.file != r->range.file) continue;
    ReadOp whole;
    whole.entry = ReadOp::kForOthers;
    whole.tensor = it->tensor;
    whole.chunk = it->chunk;
    whole.file = c.file;
    whole.file_offset = c.byte_offset;
    whole.length = c.byte_length;
    whole.chunk_box = Box{c.offsets, c.sizes};
    whole.region = Box{c.offsets, std::vector<int64_t>(c.sizes.size(), 0)};
    whole.target_box = whole.region;
    whole.share_with = r->receivers;
    whole.fetch_from = r->fetch_from;
    if (auto piece = slice_op(whole, r->range.offset, r->range.length, m))
      out->push_back(std::move(*piece));
  }
}

}  // namespace

RankShare split_for_rank(const std::vector<ReadOp>& ops, const std::vector<SharedRead>& shared,
                         int32_t rank, const Manifest& m) {
  auto elem_size = [&m](const ReadOp& op) { return dtype_size(m.tensors[op.tensor].dtype); };
  auto receiving = [rank](const SharedRead& s) -> const ShareTo* {
    for (const ShareTo& t : s.receivers)
      if (t.rank == rank && !t.raw) return &t;
    return nullptr;
  };
  std::vector<const SharedRead*> mine;
  for (const auto& s : shared)
    if (s.reader == rank || receiving(s)) mine.push_back(&s);
  std::sort(mine.begin(), mine.end(), [](const SharedRead* a, const SharedRead* b) {
    return std::tie(a->range.file, a->range.offset) < std::tie(b->range.file, b->range.offset);
  });
  std::vector<bool> sent(mine.size(), false), matched(mine.size(), false);
  RankShare out;
  for (const ReadOp& op : ops) {
    const uint64_t end = op.file_offset + op.length;
    auto it =
        std::lower_bound(mine.begin(), mine.end(), op, [](const SharedRead* s, const ReadOp& o) {
          return std::tie(s->range.file, s->range.offset) < std::tie(o.file, o.file_offset);
        });
    // The segments of a reported op tile it; anything else (an op this rank
    // did not report) is read whole, by this rank alone.
    std::vector<std::pair<size_t, ReadOp>> pieces;
    uint64_t at = op.file_offset;
    for (; it != mine.end() && (*it)->range.file == op.file && at < end; ++it) {
      const FileRange& r = (*it)->range;
      if (r.offset != at || r.offset + r.length > end) break;
      auto piece = slice_op(op, r.offset, r.length, m);
      if (!piece) break;
      pieces.emplace_back(static_cast<size_t>(it - mine.begin()), std::move(*piece));
      at += r.length;
    }
    if (at != end) {
      ReadOp whole = op;
      whole.share_with.clear();
      out.read.push_back(std::move(whole));
      continue;
    }
    for (auto& [k, piece] : pieces) {
      const SharedRead& s = *mine[k];
      matched[k] = true;
      if (s.reader != rank) {
        piece.shared_box = receiving(s)->box;
        if (shared_bytes(piece, elem_size(piece)) > 0)
          out.receive.emplace_back(s.reader, std::move(piece));
        continue;
      }
      // A second entry reading the same bytes reads them from storage.
      if (!sent[k]) {
        piece.share_with = s.receivers;
        piece.fetch_from = s.fetch_from;
      }
      sent[k] = true;
      out.read.push_back(std::move(piece));
    }
  }
  std::vector<const SharedRead*> for_others;
  for (size_t k = 0; k < mine.size(); ++k)
    if (!matched[k] && mine[k]->reader == rank && !mine[k]->receivers.empty())
      for_others.push_back(mine[k]);
  if (!for_others.empty()) add_reads_for_others(for_others, m, &out.read);
  return out;
}

}  // namespace ferry
