// Messages between the actors of one process. They are copyable (CAF 0.17
// requires it): pool blocks travel as leases, files as shared_ptrs, and the
// tensors as non-owning views.
#pragma once

#include <caf/all.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/save_state.hpp"
#include "actors/transport.hpp"
#include "commit.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/planner.hpp"
#include "ferry/runtime.hpp"
#include "layout.hpp"
#include "load_plan.hpp"
#include "manifest.hpp"
#include "plan.hpp"
#include "pool.hpp"
#include "protocol.hpp"
#include "storage_writer.hpp"

// One atom per message: the atom names what the message asks, so no two
// messages differ by their arguments alone. Texts are at most 10 characters.
// Saves.
CAF_ADD_ATOM(ferry, ferry::atom, save, "save")
CAF_ADD_ATOM(ferry, ferry::atom, stream, "stream")
CAF_ADD_ATOM(ferry, ferry::atom, snapped, "snapped")
CAF_ADD_ATOM(ferry, ferry::atom, fill, "fill")
CAF_ADD_ATOM(ferry, ferry::atom, copied, "copied")
CAF_ADD_ATOM(ferry, ferry::atom, freed, "freed")
CAF_ADD_ATOM(ferry, ferry::atom, block, "block")
CAF_ADD_ATOM(ferry, ferry::atom, write, "write")
CAF_ADD_ATOM(ferry, ferry::atom, back, "back")
CAF_ADD_ATOM(ferry, ferry::atom, written, "written")
CAF_ADD_ATOM(ferry, ferry::atom, sums, "sums")
CAF_ADD_ATOM(ferry, ferry::atom, open, "open")
CAF_ADD_ATOM(ferry, ferry::atom, seal, "seal")
CAF_ADD_ATOM(ferry, ferry::atom, drain, "drain")
CAF_ADD_ATOM(ferry, ferry::atom, retire, "retire")
CAF_ADD_ATOM(ferry, ferry::atom, writers, "writers")
CAF_ADD_ATOM(ferry, ferry::atom, close, "close")
CAF_ADD_ATOM(ferry, ferry::atom, abandon, "abandon")
CAF_ADD_ATOM(ferry, ferry::atom, phase_due, "phasedue")
CAF_ADD_ATOM(ferry, ferry::atom, aborted, "aborted")
CAF_ADD_ATOM(ferry, ferry::atom, proceed, "proceed")
CAF_ADD_ATOM(ferry, ferry::atom, custom, "custom")
CAF_ADD_ATOM(ferry, ferry::atom, compress, "compress")
CAF_ADD_ATOM(ferry, ferry::atom, hash, "hash")
// The coordinator's interface (coordinator_api), served by the coordinator
// on rank 0 and by the link elsewhere.
CAF_ADD_ATOM(ferry, ferry::atom, plan, "plan")
CAF_ADD_ATOM(ferry, ferry::atom, commit, "commit")
CAF_ADD_ATOM(ferry, ferry::atom, abort_ckpt, "abortckpt")
CAF_ADD_ATOM(ferry, ferry::atom, resolve, "resolve")
CAF_ADD_ATOM(ferry, ferry::atom, outcome, "outcome")
// The coordinator's own.
CAF_ADD_ATOM(ferry, ferry::atom, attach_link, "attachlink")
CAF_ADD_ATOM(ferry, ferry::atom, rank_failed, "rankfailed")
CAF_ADD_ATOM(ferry, ferry::atom, ckpt_due, "ckptdue")
CAF_ADD_ATOM(ferry, ferry::atom, load_due, "loaddue")
CAF_ADD_ATOM(ferry, ferry::atom, lease, "lease")
CAF_ADD_ATOM(ferry, ferry::atom, sweep, "sweep")
CAF_ADD_ATOM(ferry, ferry::atom, tidy, "tidy")
CAF_ADD_ATOM(ferry, ferry::atom, rank_rejoined, "rankrejoin")
// The link's own.
CAF_ADD_ATOM(ferry, ferry::atom, broadcast, "broadcast")
CAF_ADD_ATOM(ferry, ferry::atom, attach_net, "attachnet")
CAF_ADD_ATOM(ferry, ferry::atom, frame, "frame")
CAF_ADD_ATOM(ferry, ferry::atom, peer_failed, "peerfailed")
CAF_ADD_ATOM(ferry, ferry::atom, reply_due, "replydue")
CAF_ADD_ATOM(ferry, ferry::atom, leave, "leave")
CAF_ADD_ATOM(ferry, ferry::atom, peer_rejoined, "peerrejoin")
// Loads.
CAF_ADD_ATOM(ferry, ferry::atom, load, "load")
CAF_ADD_ATOM(ferry, ferry::atom, read, "read")
CAF_ADD_ATOM(ferry, ferry::atom, share, "share")
CAF_ADD_ATOM(ferry, ferry::atom, share_due, "sharedue")
CAF_ADD_ATOM(ferry, ferry::atom, attach_loader, "attachload")

namespace ferry {

// save_async -> planner.
struct SaveJob {
  StateDict sd;
  uint64_t step = 0;
  SaveOptions opts;
  std::string root;
  std::shared_ptr<detail::SaveState> state;
  // SavePlanner: the local plan it built (maybe transformed), and that the
  // save stops after the plan and after the write until told to go on.
  std::optional<LocalPlan> local;
  bool staged = false;
  CheckpointFn checkpoint_fn;  // set: the caller's function writes the rank's file
  uint8_t owner_policy = 0;    // as PlanRequest: 0 is the configured one
  DataFileOptions files;       // resolved by save_async / SavePlanner, sent with the plan
  // Not ok: this rank cannot take part (a bad SavePlanner argument). The
  // planner tells rank 0 at once, so no rank waits for plan-timeout.
  Status doomed;
};

// planner -> writer: the caller's checkpoint_fn writes the rank's files
// (through its StorageWriter), which are then read back.
struct CustomWrite {
  std::shared_ptr<CheckpointFnWriter> storage;
  std::vector<std::string> paths;
};

struct CustomWritten {
  Status status;
  std::vector<FileLayout> layouts;                       // as written
  std::vector<std::vector<std::vector<uint64_t>>> sums;  // [file][chunk][block]
};

// SavePlanner -> planner: the next step of a staged save.
struct Proceed {
  enum Step : uint8_t { write, commit, abandon };
  std::shared_ptr<detail::SaveState> save;
  Step step = write;
  Status why;  // abandon: the reason every rank hears
};

// Where one chunk's bytes come from: a contiguous range of the view's
// row-major byte stream (splits are along dim 0, so always contiguous).
struct ChunkSource {
  TensorView view;
  uint64_t offset = 0;
};

// The chunks of a rank's files and where each one's bytes come from, by
// [file][chunk].
struct FileChunks {
  std::vector<std::string> names;  // [file], from data_files()
  std::vector<std::vector<ChunkRef>> refs;
  std::vector<std::vector<ChunkSource>> srcs;
};

// planner -> writer: compress every chunk (level > 0) from its source.
struct CompressJob {
  FileChunks chunks;
  int level = 0;
};

// The chunks now point at their compressed bytes.
struct CompressDone {
  Status status;
  FileChunks chunks;
};

// planner -> hasher: the replicated items of a save whose bytes every holder
// hashes (replica-check), from the caller's tensors.
struct HashJob {
  std::vector<ReplicaDigest> items;  // key and offsets set; digest filled in by the hasher
  std::vector<TensorView> views;     // by item
  ReplicaCheck mode = ReplicaCheck::automatic;
};

struct HashDone {
  Status status;
  std::vector<ReplicaDigest> digests;
  double ms = 0;  // time the hashing took
};

// planner -> snapshot and serializer: everything about the files of a save.
struct StreamJob {
  uint64_t save = 0;
  // Shared by the planner, the snapshot and the serializer, never copied:
  // at 100,000 chunks a copy per actor would cost more than the plan.
  std::shared_ptr<const std::vector<FileLayout>> files;
  std::vector<std::shared_ptr<File>> handles;  // [file]: the serializer's, from `open`
  std::shared_ptr<const std::vector<std::vector<ChunkSource>>> sources;  // [file][chunk]
  uint64_t block_bytes = 0;
  uint64_t checksum_block_bytes = 0;         // 0: no checksums
  std::shared_ptr<detail::SaveState> state;  // told when every copy is queued
};

// A filled pool block: bytes [offset, offset + len) of a file.
struct BlockMsg {
  uint64_t save = 0;
  uint32_t file = 0;
  uint64_t index = 0;
  Lease lease;
  uint64_t offset = 0;
  uint64_t len = 0;
};

// Where a writer hands a written block back instead of to the pool (the
// serializer, when it hashes after the writes): only this one message.
using block_return_actor = caf::typed_actor<caf::reacts_to<atom::back, BlockMsg>>;

struct WriteBlock {
  BlockMsg block;
  std::shared_ptr<File> file;
  uint64_t write_len = 0;        // len rounded up for O_DIRECT
  block_return_actor return_to;  // when set, the written block goes back there, not to the pool
};

// The data files of a save, and the bytes each will hold (reserved at once).
struct OpenFiles {
  std::vector<std::string> paths;
  std::vector<uint64_t> sizes;
};

struct FileSet {
  Status status;
  std::vector<std::shared_ptr<File>> files;
};

struct ChecksumSet {
  uint64_t save = 0;
  std::vector<std::vector<std::vector<uint64_t>>> sums;  // [file][chunk][block]
};

// Runtime::load -> loader.
// A load's tensors, by StateDict entry index: one copy of their views per
// load, shared by every reader task (a load of 50,000 tensors copied them
// once per reader, two allocations a view). Never null in a LoadJob.
using LoadTargets = std::shared_ptr<const std::vector<TensorView>>;

struct LoadJob {
  std::string dir;
  std::shared_ptr<const Manifest> manifest;
  std::vector<ReadOp> ops;  // what this rank reads (ops with share_with are sent on)
  LoadTargets targets;
  // Reading replicated bytes once per node: the collective load's id, the
  // pieces other ranks read for this one (with the rank each comes from),
  // and the transport the shared bytes leave on. Empty/null on one rank.
  std::string load_id;
  std::vector<std::pair<int32_t, ReadOp>> receive;
  std::shared_ptr<Transport> transport;
  // The ring this rank offered for the bytes it receives, and the rings its
  // receivers offered (share_ring.hpp). Null: frames carry the bytes.
  std::shared_ptr<const ShareRing> ring;
  std::shared_ptr<PeerRings> peer_rings;
  std::shared_ptr<LoadClocks> clocks;  // trace-dir set: the readers time their work here
};

// The load id of a BlockShare that says its sender failed (sent by the link
// that saw it fail, not by the sender): every load it owes bytes fails.
inline const std::string kAnyLoad = "*";

class UnverifiedTensors;  // load_verify.hpp
class Fetches;            // load_fetches.hpp

struct ReadTask {
  std::string dir;
  std::shared_ptr<const Manifest> manifest;
  std::vector<ReadOp> ops;
  LoadTargets targets;
  std::string load_id;
  std::shared_ptr<Transport> transport;
  std::shared_ptr<PeerRings> peer_rings;
  // The load's tensors that hold bytes which did not pass their checksum.
  std::shared_ptr<UnverifiedTensors> unverified;
  std::shared_ptr<LoadClocks> clocks;  // trace-dir set: the job's
  // Where the bytes of ops with fetch_from land (load-sharing = job).
  std::shared_ptr<Fetches> fetches;
};

}  // namespace ferry

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::Status)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::SaveJob)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::Proceed)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::CustomWrite)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::CustomWritten)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::CompressJob)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::CompressDone)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::HashJob)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::HashDone)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::PlanRequest)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::PlanReply)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::StreamJob)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::BlockMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::WriteBlock)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::OpenFiles)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::FileSet)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::ChecksumSet)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::CommitRequest)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::CommitMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::AbortMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::LoadRequestMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::LoadReplyMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<ferry::Transport>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::LoadJob)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::ReadTask)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<ferry::File>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::LoadOutcomeMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::BlockShareMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::vector<std::shared_ptr<ferry::File>>)
