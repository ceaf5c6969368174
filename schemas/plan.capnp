# The planning protocol of one checkpoint (local plans in, each rank's part of
# the global plan out, write results back), and of a multi-rank load (rank 0
# resolves the checkpoint and sends the manifest once). Each message travels
# in the frame of src/include/ferry/protocol.hpp with protocol byte 1.
# Byte offsets are not planned: writers report them in their WriteResult.
# Never remove or renumber a field: retire it by renaming it obsoleteX.
@0xc56fc378ab1f020a;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("ferry::proto");

using Control = import "control.capnp";

# A region of a tensor's global index space.
struct Box {
  offsets @0 :List(Int64);         # origin, one per dimension (empty: 0-d)
  sizes @1 :List(Int64);           # extent, one per dimension
}

# A user key/value given to save_async; ends up in the manifest.
struct UserMetadata {
  key @0 :Text;                    # metadata key
  value @1 :Text;                  # metadata value
}

# One state dict entry of a rank, as its local plan lists it.
struct WriteItem {
  key @0 :Text;                    # state dict key
  dtype @1 :Text;                  # safetensors dtype name ("F32", "BF16", ...)
  globalShape @2 :List(Int64);     # shape of the whole tensor
  box @3 :Box;                     # the region of it this rank holds
  nbytes @4 :UInt64;               # bytes of the box
  entry @5 :UInt32;                # index of the entry in the rank's state dict
}

# A rank's write items for one checkpoint.
struct LocalPlan {
  rank @0 :Int32;                  # the rank the plan belongs to
  items @1 :List(WriteItem);       # in state dict order
}

# One piece that a rank writes: all of an item, or a dim-0 slice of it.
struct ChunkAssignment {
  item @0 :UInt32;                 # index into the rank's LocalPlan.items
  box @1 :Box;                     # inside the item's box; unset when whole
  file @2 :UInt32;                 # index of the rank's file, < RankPlan.files
  whole @3 :Bool;                  # all of the item, whose box the rank has: no box sent
}

# One rank's part of the global plan.
struct RankPlan {
  rank @0 :Int32;                  # the rank that writes it
  files @1 :UInt32;                # how many data files the rank writes
  chunks @2 :List(ChunkAssignment); # in the order the rank writes them
  bytes @3 :UInt64;                # sum of the chunks' bytes
  replicated @4 :List(UInt32);     # its items other ranks hold too (LocalPlan.items indices): replica-check hashes them
}

# A data file a rank wrote.
struct WrittenFile {
  name @0 :Text;                   # file name inside the pending directory
  size @1 :UInt64;                 # exact size in bytes
  headerBytes @2 :UInt64;          # bytes of its header (0: none recorded)
  headerChecksum @3 :UInt64;       # xxh3-64 of the header
}

# A chunk as written: where its bytes are and their checksums.
struct WrittenChunk {
  key @0 :Text;                    # state dict key
  dtype @1 :Text;                  # safetensors dtype name
  globalShape @2 :List(Int64);     # shape of the whole tensor
  box @3 :Box;                     # the chunk's region of it
  file @4 :UInt32;                 # index into WriteResult.files
  byteOffset @5 :UInt64;           # absolute offset of the chunk in the file
  byteLength @6 :UInt64;           # bytes of the chunk in the file
  entry @7 :Text;                  # safetensors entry name
  checksums @8 :List(UInt64);      # xxh3-64 per checksum block; empty if off
  codec @9 :Text;                  # "" = raw; "zstd": byteLength is the stored size
  rawLength @10 :UInt64;           # decoded bytes, when compressed
  frameBytes @11 :UInt64;          # raw bytes per frame
  frameEnds @12 :List(UInt64);     # stored end of each frame, from the chunk's start
}

# One rank's report once its files and the pending directory are durable.
struct WriteResult {
  rank @0 :Int32;                  # the reporting rank
  files @1 :List(WrittenFile);     # its data files
  chunks @2 :List(WrittenChunk);   # every chunk it wrote
  snapshotMs @3 :Float64;          # time until its last byte was off the device
  writeMs @4 :Float64;             # time until its files were durable
  bytes @5 :UInt64;                # bytes it wrote
  readyMs @6 :Float64;             # save_async -> its files and directory durable
  replicaDigests @7 :List(ReplicaDigest); # one per item of RankPlan.replicated, unless replica-check = off
}

# A rank's hash of one replicated item's bytes; rank 0 compares the holders'.
struct ReplicaDigest {
  key @0 :Text;                    # state dict key
  offsets @1 :List(Int64);         # the item's box origin (its replica group's)
  digest @2 :UInt64;               # xxh3-64 of the bytes, or of the sample
  sampled @3 :Bool;                # the digest covers a sample of the bytes (replica-check)
}

# Rank -> rank 0: the rank's local plan for one checkpoint.
struct PlanRequest {
  jobId @0 :Text;                  # the sender's job
  checkpointId @1 :Text;           # the checkpoint being planned
  rank @2 :Int32;                  # the sender's rank
  step @3 :UInt64;                 # the step the caller saves
  root @4 :Text;                   # the checkpoint root as the caller gave it
  overwrite @5 :Bool;              # the caller allows replacing an existing step
  metadata @6 :List(UserMetadata); # user key/values (rank 0's are kept)
  plan @7 :LocalPlan;              # the rank's write items
  wantAll @8 :Bool;                # the reply should carry every rank's plan (SavePlanner)
  ownerPolicy @9 :UInt8;           # 0: rank 0's configured one, 1: balanced, 2: lowest rank
  filePrefix @10 :Text;            # the rank's data files are <filePrefix>-<rank>-<k>.<ext>
  fileMaxBytes @11 :UInt64;        # most data bytes per file of the rank; 0 = no cap
  fileCompress @12 :Text;          # "none" or "zstd:<level>" (normalized)
}

# Rank 0 -> a rank: its part of the global plan, or why there is none.
struct PlanReply {
  jobId @0 :Text;                  # the job
  checkpointId @1 :Text;           # the checkpoint planned
  status @2 :Control.Status;       # not ok: planning failed, the save is aborted
  pendingDir @3 :Text;             # the directory every rank writes its files into
  plan @4 :RankPlan;               # what the receiving rank writes
  allPlans @5 :Data;               # "FRYGPLN2" + SavePlanList (above), if asked
}

# Rank -> rank 0: the rank's write result.
struct CommitRequest {
  jobId @0 :Text;                  # the sender's job
  checkpointId @1 :Text;           # the checkpoint written
  result @2 :WriteResult;          # what the rank wrote
  trace @3 :Control.RankTrace;     # with trace-dir set: the rank's phases of the save
}

# Rank -> rank 0: which checkpoint to load.
struct LoadRequest {
  jobId @0 :Text;                  # the sender's job
  loadId @1 :Text;                 # unique id of this load, shared by all ranks
  rank @2 :Int32;                  # the sender's rank
  path @3 :Text;                   # the checkpoint path as the caller gave it
}

# Rank 0 -> a rank: the checkpoint everyone loads.
struct LoadReply {
  jobId @0 :Text;                  # the job
  loadId @1 :Text;                 # the load answered
  status @2 :Control.Status;       # not ok: the load fails on every rank
  dir @3 :Text;                    # the resolved checkpoint directory
  manifest @4 :Data;               # the MANIFEST file's bytes, frame included
}

# The byte forms of the public planner (src/include/ferry/planner.hpp). Each
# is 8 bytes of magic naming the kind, then one Cap'n Proto message:
#   "FRYLPLN2" + LocalPlan      LocalSavePlan::to_bytes
#   "FRYSPLN2" + SavePlan       SavePlan::to_bytes
#   "FRYGPLN2" + SavePlanList   every rank's SavePlan, in PlanReply.allPlans

# The ranks that write (part of) one item of a rank's SavePlan.
struct ItemOwners {
  ranks @0 :List(Int32);           # ascending, each once; empty: nobody writes it
}

# One piece a rank writes: all of one of its items, or a dim-0 slice of it.
struct PlannedWrite {
  item @0 :UInt32;                 # index into SavePlan.items
  box @1 :Box;                     # inside the item's box
  nbytes @2 :UInt64;               # bytes of the box
  file @3 :UInt32;                 # index into SavePlan.files
}

# One rank's part of the global plan, as the public planner shows it.
struct SavePlan {
  rank @0 :Int32;                  # the rank it belongs to
  items @1 :List(WriteItem);       # the rank's local plan
  owners @2 :List(ItemOwners);     # one per item: who writes it
  writes @3 :List(PlannedWrite);   # in the order the rank writes them
  files @4 :List(Text);            # its data file names (may be none)
  bytes @5 :UInt64;                # sum of writes' nbytes
}

# Every rank's SavePlan, index r being rank r's.
struct SavePlanList {
  plans @0 :List(SavePlan);        # one per rank
}

# What one plan frame holds: exactly one of these.
struct PlanMessage {
  union {
    planRequest @0 :PlanRequest;   # rank -> rank 0
    planReply @1 :PlanReply;       # rank 0 -> rank
    commitRequest @2 :CommitRequest; # rank -> rank 0
    loadRequest @3 :LoadRequest;   # rank -> rank 0
    loadReply @4 :LoadReply;       # rank 0 -> rank
  }
}
