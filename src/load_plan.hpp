// Load planning (resharding), pure: intersect the shards a caller asks for
// with the chunks a manifest has, and produce byte-range reads aligned to the
// chunks' checksum blocks, so every byte read can be verified.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "box.hpp"
#include "ferry/status.hpp"
#include "ferry/tensor.hpp"
#include "manifest.hpp"
#include "share_ring.hpp"

namespace ferry {

// What one state dict entry wants: its region of the global tensor.
struct LoadRequest {
  uint32_t entry = 0;  // index in the caller's StateDict
  std::string key;
  DType dtype = DType::f32;
  std::vector<int64_t> global_shape;
  Box box;
};

// Builds one request per entry (a view without a Shard asks for the whole
// tensor). Errors name the key.
Result<std::vector<LoadRequest>> make_load_requests(const StateDict& sd);

// A rank of this node that receives bytes of a shared read, and which: the
// elements of `box` (global coordinates) that lie in the read, packed in
// row-major order (its shared stream, for_each_shared_run). Only those
// travel: a rank loading a stretch of columns gets its columns of a block,
// not the block. An empty box: it copies nothing there.
// raw: a rank of another node (load-sharing = job) that takes the read
// whole, as stored, and checks its checksum blocks as if it had read them.
struct ShareTo {
  int32_t rank = 0;
  Box box;
  bool raw = false;
  friend bool operator==(const ShareTo& a, const ShareTo& b) {
    return a.rank == b.rank && a.box == b.box && a.raw == b.raw;
  }
};

// One read of a contiguous range of whole checksum blocks of one chunk, and
// what to copy out of it into one entry.
struct ReadOp {
  // entry of a read made only for other ranks (it copies nothing here)
  static constexpr uint32_t kForOthers = UINT32_MAX;
  uint32_t entry = 0;         // StateDict entry, or kForOthers
  uint32_t tensor = 0;        // index into Manifest::tensors
  uint32_t chunk = 0;         // index into that tensor's chunks
  uint32_t file = 0;          // index into Manifest::files
  uint64_t file_offset = 0;   // absolute offset of the read in the file
  uint64_t length = 0;        // bytes to read
  uint64_t chunk_offset = 0;  // where the read starts inside the chunk
  uint32_t first_block = 0;   // first checksum block covered (chunk_offset / block bytes)
  uint32_t nblocks = 0;
  Box region;      // the part of the tensor both have (global coords)
  Box chunk_box;   // the saved chunk's box
  Box target_box;  // the caller's box
  // Ranks of this node that receive bytes of this read from this rank once
  // it has verified them (assign_shared_reads), and with load-sharing = job
  // the readers of other nodes (raw); empty for most reads.
  std::vector<ShareTo> share_with;
  // A piece another rank reads for this one: the box whose elements in it
  // travel (this rank's ShareTo, inside chunk_box).
  Box shared_box;
  // load-sharing = job: the rank of another node that reads these bytes
  // from storage and sends them whole (a raw ShareTo); -1: read them here.
  int32_t fetch_from = -1;
};

struct LoadPlanOptions {
  uint64_t max_read_bytes = 64ull << 20;  // reads are split at block boundaries past this
};

// Points the requests of per-rank entries (StateEntry::per_rank) at the
// value the load gives rank `rank` of `world_size`: its own when the
// checkpoint was saved by as many ranks, else by the entry's on_resize
// (error: invalid_argument naming the key and both world sizes; first:
// rank 0's). An entry the checkpoint holds as one ordinary tensor loads it.
Status resolve_per_rank(std::vector<LoadRequest>& requests, const StateDict& sd, const Manifest& m,
                        int32_t rank, int32_t world_size);

// Errors (invalid_argument / not_found, naming the key): key absent from the
// checkpoint, dtype or global shape different from the saved one, a requested
// region the saved chunks do not fully cover. Only blocks that hold bytes of
// the requested region are read; adjacent touched blocks are merged.
Result<std::vector<ReadOp>> make_load_plan(const Manifest& m,
                                           const std::vector<LoadRequest>& requests,
                                           const LoadPlanOptions& opts = {});

// One read of an aligned range of a file that holds whole ops: what a reader
// hands to one pread into one staging block. Ops are pieces of the plan's
// ops, cut only at checksum-block boundaries, so each piece is verified from
// this read alone.
struct ReadRun {
  uint32_t file = 0;
  uint64_t offset = 0;      // a multiple of the alignment
  uint64_t length = 0;      // a multiple of the alignment; may run past the file's end
  std::vector<ReadOp> ops;  // sorted by file_offset, all inside [offset, offset + length)
};

// Sorts `ops` by file and offset and packs them into runs of at most
// `max_run_bytes` (a multiple of `align`): neighbours in a file share a run,
// an op that does not fit is cut at a checksum block boundary (at any
// `align` multiple when its chunk has no checksums). Bytes no op needs are
// read only as alignment padding at a run's two ends, so a resharded load
// reads the blocks it needs and little else. A run is longer than
// `max_run_bytes` only when one checksum block plus its padding is. The
// runs of the last `max_run_bytes` of op bytes are at most `tail_run_bytes`
// (0: `max_run_bytes`): the last run's checks and copies, which nothing
// overlaps, are then short.
std::vector<ReadRun> make_read_runs(std::vector<ReadOp> ops, const Manifest& m,
                                    uint64_t max_run_bytes, uint64_t align = 4096,
                                    uint64_t tail_run_bytes = 0);

// The keys of the checkpoint's tensors that no request asks for, in the
// manifest's (sorted) order: a load may restore fewer tensors than the
// checkpoint holds, but it says which it left out.
std::vector<std::string> tensors_not_requested(const Manifest& m,
                                               const std::vector<LoadRequest>& requests);

// For every contiguous run of op.region whose bytes lie in this read, calls
// fn(offset in the read buffer, byte offset in the target's row-major
// linearization, bytes). Together the ops of a plan cover every requested
// byte exactly once.
void for_each_copy(const ReadOp& op, size_t elem_size,
                   const std::function<void(uint64_t, uint64_t, uint64_t)>& fn);

// --- Reading replicated bytes once per node ---------------------------------------
//
// Ranks of one node that need the same bytes of a file (a replicated tensor,
// overlapping boxes) read them once: every rank reports the ranges its plan
// reads, and each range needed by several ranks of a node gets one reader
// among them, which sends the verified bytes to the others. Every rank
// computes the same assignment from the same reports.

struct FileRange {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// A range one rank's plan reads (whole checksum blocks), and the part of the
// tensor it copies out of it (global coordinates): when another rank reads
// the range, only those elements travel to this one.
struct NeededRange {
  FileRange range;
  Box region;
};

// The ranges one rank's plan reads, and the node it runs on.
struct RankNeeds {
  int32_t rank = 0;
  std::string host;  // its node: node_identity() (src/node.hpp)
  std::vector<NeededRange> ranges;
  RingInfo ring;  // where ranks of its node may put the bytes they read for it
};

// The ranges of `ops` that may be shared, in the ops' order. Ops of
// compressed chunks are left out: their stored bytes are frames that each
// rank decodes itself, so each rank reads them alone.
std::vector<NeededRange> needed_ranges(const std::vector<ReadOp>& ops, const Manifest& m);

// A range needed by `receivers` and `reader` (ranks of one node, ascending),
// cut where any of their ranges starts or ends, so it lies inside one op of
// each of them and on their chunk's checksum-block grid. A receiver's box is
// its region there (their bounding box, should two of its entries read the
// range). The reader needs the range too, except for a small range only one
// rank needs that touches a range the reader reads and none its needer
// reads: the reader takes it into its run and sends it on, sparing the needer
// a tiny read.
struct SharedRead {
  FileRange range;
  int32_t reader = 0;
  std::vector<ShareTo> receivers;  // empty: only the reader needs it
  // Across hosts: the reader of another node that reads the range from
  // storage and sends it whole to this one's reader; -1: read from storage.
  int32_t fetch_from = -1;
};

// Deterministic in its input (order of `needs` aside): per node and per set
// of ranks needing a range, the bytes they share are split into one
// contiguous stretch per rank, equal in bytes, so each reads its share in
// long sequential runs. Small ranges one rank needs alone go to the rank
// reading next to them (SharedRead). Sorted by node, file and offset.
// across_hosts (load-sharing = job): every node cuts the files where any
// rank's range starts or ends, so each range several nodes need is one
// range on each; one node's reader (nodes take turns, equal in bytes per
// set of nodes) reads it from storage and sends it whole (a raw receiver)
// to the reader of each other node, which fetches it (fetch_from) and
// shares it inside its node as if it had read it.
std::vector<SharedRead> assign_shared_reads(std::vector<RankNeeds> needs,
                                            bool across_hosts = false);

// One rank's part of an assignment.
struct RankShare {
  // The pieces of its ops it reads itself; a piece others need carries them
  // in share_with (only one piece per shared range does, should two entries
  // read the same bytes). Ranges it reads only for others are pieces of
  // their chunk with entry kForOthers: verified and sent, copied nowhere
  // here (their region is empty, but for a 0-d tensor's).
  std::vector<ReadOp> read;
  // The pieces it receives, with the rank each comes from, each with its
  // shared_box: the sender verified the piece's blocks, and a sum of each
  // frame guards their way here.
  std::vector<std::pair<int32_t, ReadOp>> receive;
};

// Cuts `ops` (this rank's plan, whose ranges it reported) at the boundaries
// of `shared` and splits the pieces into those `rank` reads and those it
// receives. Pieces start and end on their chunk's checksum-block grid; one
// whose shared box holds nothing of it is left out.
RankShare split_for_rank(const std::vector<ReadOp>& ops, const std::vector<SharedRead>& shared,
                         int32_t rank, const Manifest& m);

// The part of `op` in [file_offset, file_offset + length), which must lie
// inside it, start on its chunk's checksum-block grid and end on it or at the
// op's end; nullopt otherwise.
std::optional<ReadOp> slice_op(const ReadOp& op, uint64_t file_offset, uint64_t length,
                               const Manifest& m);

// The runs of `box`'s elements (global coordinates; the part inside
// op.chunk_box) that lie in the bytes of `op`, in file order: fn(offset in
// the read buffer, position in box's packed row-major byte stream, bytes).
// Consecutive runs are consecutive in the stream.
void for_each_shared_run(const ReadOp& op, const Box& box, size_t elem_size,
                         const std::function<void(uint64_t, uint64_t, uint64_t)>& fn);

// Where byte `offset` of `op`'s read lies in box's packed stream; nullopt
// when it is not an element of `box` (or lies outside the read).
std::optional<uint64_t> packed_position(const ReadOp& op, const Box& box, uint64_t offset,
                                        size_t elem_size);

// The inverse: the byte of `op`'s read at `position` of box's packed
// stream; nullopt when that byte lies outside the read (or the box).
std::optional<uint64_t> unpacked_offset(const ReadOp& op, const Box& box, uint64_t position,
                                        size_t elem_size);

// The bytes of a received piece that travel: its shared_box's elements in it.
uint64_t shared_bytes(const ReadOp& piece, size_t elem_size);

}  // namespace ferry
