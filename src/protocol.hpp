// The messages ranks exchange (schemas/control.capnp, schemas/plan.capnp) in
// their C++ form, and their wire encoding: a 16-byte frame header followed by
// a Cap'n Proto flat array. Every message carries the job id and the
// checkpoint id (or load id) it belongs to, so a stray message from another
// job or an older checkpoint is recognised and dropped.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "commit.hpp"
#include "data_files.hpp"
#include "ferry/status.hpp"
#include "load_plan.hpp"
#include "plan.hpp"
#include "trace.hpp"

namespace ferry {

class FrameBuffers;

// control.capnp --------------------------------------------------------------------

// First message of a non-zero rank on its connection to rank 0.
struct JoinMsg {
  std::string job_id;
  std::string token;  // FERRY_JOB_TOKEN, else TORCHELASTIC_RUN_ID, else SLURM_JOB_ID
  int32_t rank = 0;
  int32_t world_size = 1;
  std::string host;
  int64_t pid = 0;
};

struct JoinAckMsg {
  std::string job_id;
  Status status;            // not ok: refused, with the reason
  bool all_joined = false;  // the second ack: every rank joined, the job may start
  int64_t clock_ns = 0;     // rank 0's trace clock as it answered the hello
};

struct HeartbeatMsg {
  std::string job_id;
  int32_t rank = 0;
  uint64_t seq = 0;
  bool leaving = false;  // the last one: the sender's Runtime is shutting down
};

// A checkpoint is abandoned on every rank: names the rank and phase that failed.
struct AbortMsg {
  std::string job_id;
  std::string checkpoint_id;
  int32_t failed_rank = -1;
  std::string phase;  // "plan", "write", "commit"
  Status reason;
};

// Rank 0 -> every rank: the outcome of a checkpoint's commit.
struct CommitMsg {
  std::string job_id;
  std::string checkpoint_id;
  Status status;
  std::string path;
  uint64_t commit_seq = 0;
  int32_t slowest_rank = -1;               // whose files were durable last (the straggler)
  double slowest_ms = 0;                   // its time from save_async to durable
  std::vector<std::string> warnings = {};  // committed, but these failed after the commit point
};

// plan.capnp -----------------------------------------------------------------------

// A rank's local plan for one checkpoint (rank -> rank 0).
struct PlanRequest {
  std::string job_id;
  std::string checkpoint_id;
  int32_t rank = 0;
  uint64_t step = 0;
  std::string root;
  bool overwrite = false;
  std::vector<std::pair<std::string, std::string>> metadata;  // rank 0's is kept
  LocalPlan plan;
  // In process (rank 0's own planner): its plan, shared rather than copied
  // (`plan` then empty); plan_of() reads whichever is set.
  std::shared_ptr<const LocalPlan> shared = nullptr;
  bool want_all = false;     // the reply should carry every rank's plan (SavePlanner)
  uint8_t owner_policy = 0;  // 0: rank 0's configured one, 1: balanced, 2: lowest rank
  DataFileOptions files;     // how the rank names and fills its data files (data_files())
  // In process, with `shared`: its LocalPlan::digest(), which the planner
  // knows already (0: rank 0 computes it). Not on the wire.
  uint64_t shared_digest = 0;
};

inline const LocalPlan& plan_of(const PlanRequest& r) {
  return r.shared ? *r.shared : r.plan;
}

// Rank 0 -> a rank: its part of the global plan, or why there is none.
struct PlanReply {
  std::string job_id;
  std::string checkpoint_id;
  Status status;
  std::string pending_dir;
  RankPlan plan;
  std::string all_plans = {};  // every rank's SavePlan, when a rank asked (encode_save_plans)
  // In process (to a rank whose request was `shared`): its part of the
  // cached global plan, shared rather than copied (`plan` then empty).
  std::shared_ptr<const RankPlan> shared = nullptr;
};

// A rank's write result once its files and the pending directory are durable.
struct CommitRequest {
  std::string job_id;
  std::string checkpoint_id;
  WriteResult result;
  RankTrace trace = {};  // with trace-dir set: the rank's phases (rank from result)
};

// Load: a rank asks rank 0 which checkpoint to load (path as given by the
// caller); rank 0 answers with the directory and the manifest bytes, read once.
struct LoadRequestMsg {
  std::string job_id;
  std::string load_id;
  int32_t rank = 0;
  std::string path;
};

struct LoadReplyMsg {
  std::string job_id;
  std::string load_id;
  Status status;
  std::string dir;
  std::string manifest;  // the MANIFEST file's bytes (framed; decode_manifest)
};

// Load (control.capnp): a rank's own outcome of its reads (rank -> rank 0),
// and the load's outcome (rank 0 -> every rank), so every rank ends a load
// the same way.
struct LoadOutcomeMsg {
  std::string job_id;
  std::string load_id;
  int32_t rank = 0;          // the sender
  Status status;             // from a rank: its own outcome; from rank 0: the load's
  int32_t failed_rank = -1;  // from rank 0: whose error `status` is; -1 when ok
  // Under load id "<load>/needs", before the reads: from a rank its own
  // entry, from rank 0 every rank's.
  std::vector<RankNeeds> needs = {};
  RankTrace trace = {};  // from a rank, with trace-dir set: its phases of the load
};

// Bytes that may lie inside a buffer they share with others: a BlockShare's
// data inside the frame it arrived in, so a load's shared bytes are not
// copied out of every frame (at a gigabyte a rank, each copy showed). A null
// owner is a view of memory its user keeps alive while the value is used
// (the sender's staging block, until encode_message returned).
class SharedBytes {
 public:
  SharedBytes() = default;
  SharedBytes(std::string bytes)  // NOLINT: owns its bytes, as a string would
      : owner_(std::make_shared<const std::string>(std::move(bytes))), view_(*owner_) {}
  SharedBytes(const char* bytes) : SharedBytes(std::string(bytes)) {}  // NOLINT
  SharedBytes(std::shared_ptr<const std::string> owner, std::string_view view)
      : owner_(std::move(owner)), view_(view) {}
  const char* data() const { return view_.data(); }
  size_t size() const { return view_.size(); }
  bool empty() const { return view_.empty(); }
  std::string_view view() const { return view_; }
  friend bool operator==(const SharedBytes& a, const SharedBytes& b) { return a.view_ == b.view_; }

 private:
  std::shared_ptr<const std::string> owner_;
  std::string_view view_;
};

// Bytes one rank read and verified for another of its node; a failed reader
// sends its status and no data.
struct BlockShareMsg {
  std::string job_id;
  std::string load_id;
  int32_t from = 0;
  int32_t to = 0;
  uint32_t file = 0;
  uint64_t offset = 0;
  Status status;
  SharedBytes data;
  uint64_t checksum = 0;  // xxh3-64 of data
  // ring_length > 0: no data; the bytes lie in the receiver's share ring.
  uint64_t ring_offset = 0;
  uint64_t ring_length = 0;
  uint64_t length() const { return ring_length > 0 ? ring_length : data.size(); }
};

// The receiver of BlockShare bytes tells their sender what it took (flow
// control: a sender keeps at most share-window bytes unacknowledged per
// receiver); a non-ok status says it takes no more bytes of the load.
struct ShareAckMsg {
  std::string job_id;
  std::string load_id;
  int32_t from = 0;  // the receiver
  int32_t to = 0;    // the sender
  uint64_t bytes = 0;
  Status status;
};

using WireMessage = std::variant<JoinMsg, JoinAckMsg, HeartbeatMsg, AbortMsg, CommitMsg,
                                 PlanRequest, PlanReply, CommitRequest, LoadRequestMsg,
                                 LoadReplyMsg, LoadOutcomeMsg, BlockShareMsg, ShareAckMsg>;

// Job id and checkpoint/load id of any message ("" where it has none).
std::string_view message_job_id(const WireMessage& m);
std::string_view message_checkpoint_id(const WireMessage& m);
const char* message_name(const WireMessage& m);  // "Join", "PlanRequest", ...

// Frame: magic "FRY1" (4 bytes), u8 protocol (0 control, 1 plan), 3 bytes
// reserved (0), u64 LE payload length, then the Cap'n Proto flat array.
// A large frame takes its memory from `buffers` when given (see
// frame_buffers.hpp).
std::string encode_message(const WireMessage& m, FrameBuffers* buffers = nullptr);
// A BlockShare whose data (m.data is ignored) is `parts`, in order, lying in
// increasing order in one buffer: copied into the frame once, as a sender
// gathering a stretch of columns would otherwise copy it twice.
std::string encode_gathered(const BlockShareMsg& m, const std::vector<std::string_view>& parts,
                            FrameBuffers* buffers = nullptr);

// Never throws: bad magic, length, alignment-agnostic (copies into aligned
// words), traversal/nesting limits sized from the input, unknown union
// member, invalid enum/dtype/status code -> invalid_argument naming what.
Result<WireMessage> decode_message(std::string_view bytes);
// The same, for a frame the result may keep: a BlockShare's data is then a
// view into `frame` (word-aligned, as a heap string is), not a copy.
Result<WireMessage> decode_message(std::shared_ptr<const std::string> frame);

}  // namespace ferry
