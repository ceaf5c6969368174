# The control protocol between ranks: joining a job, liveness, and the outcome
# (abort or commit) of one checkpoint. Each message travels in the frame of
# src/include/ferry/protocol.hpp with protocol byte 0. Every message carries
# the job id (and the checkpoint id where it concerns one) so that a stray
# message from another job or an older checkpoint is recognised and dropped.
# Never remove or renumber a field: retire it by renaming it obsoleteX.
@0xc6e0b4c34e39e9da;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("ferry::proto");

# The wire form of ferry::Status, shared by both protocols (plan.capnp imports
# it). Enumerants follow ferry::StatusCode in name and order.
struct Status {
  code @0 :Code;                   # what kind of failure; ok for success
  message @1 :Text;                # names the rank, file, key... that is wrong

  enum Code {
    ok @0;                         # success
    invalidArgument @1;            # bad input from the caller
    notFound @2;                   # a file, checkpoint or key does not exist
    alreadyExists @3;              # e.g. the step directory exists
    ioError @4;                    # an OS call failed
    corruption @5;                 # bytes on disk disagree with the manifest
    unsupported @6;                # a format version or feature this build lacks
    busy @7;                       # a save is in flight and fail-fast is set
    aborted @8;                    # the checkpoint was abandoned
    timeout @9;                    # a phase ran past its deadline
    outcomeUnknown @10;            # the coordinator vanished after the commit point
    internal @11;                  # a bug
  }
}

# First message of a non-zero rank on its connection to rank 0.
struct Join {
  jobId @0 :Text;                  # the job the sender believes it belongs to
  token @1 :Text;                  # FERRY_JOB_TOKEN, else TORCHELASTIC_RUN_ID, else SLURM_JOB_ID
  rank @2 :Int32;                  # sender's rank, in [0, worldSize)
  worldSize @3 :Int32;             # world size as the sender sees it
  host @4 :Text;                   # sender's host name, for error messages
  pid @5 :Int64;                   # sender's process id, for error messages
}

# Rank 0's answer to a Join.
struct JoinAck {
  jobId @0 :Text;                  # rank 0's job id
  status @1 :Status;               # not ok: the join is refused, with the reason
  allJoined @2 :Bool;              # sent again once every rank joined: the start barrier
  # Rank 0's steady clock (ns) as it answered the hello: the rank sets its
  # timeline's clock from it and its own send and receive times.
  clockNs @3 :Int64;
}

# Liveness of a rank; hung peers are not caught by the transport alone.
struct Heartbeat {
  jobId @0 :Text;                  # the sender's job
  rank @1 :Int32;                  # the sender's rank
  seq @2 :UInt64;                  # increases by one per heartbeat of the sender
  leaving @3 :Bool;                # the sender is shutting down: its close is expected
}

# A checkpoint is abandoned on every rank.
struct Abort {
  jobId @0 :Text;                  # the job of the checkpoint
  checkpointId @1 :Text;           # the abandoned checkpoint
  failedRank @2 :Int32 = -1;       # the rank that failed; -1 when unknown
  phase @3 :Text;                  # "plan", "write" or "commit"
  reason @4 :Status;               # why it was abandoned
}

# Rank 0 -> every rank: the outcome of a checkpoint's commit.
struct Commit {
  jobId @0 :Text;                  # the job of the checkpoint
  checkpointId @1 :Text;           # the committed (or failed) checkpoint
  status @2 :Status;               # ok: committed; otherwise why not
  path @3 :Text;                   # the step directory (ROOT/step-...)
  commitSeq @4 :UInt64;            # the commit sequence number given to it
  slowestRank @5 :Int32 = -1;      # the rank whose files were durable last
  slowestMs @6 :Float64;           # its readyMs: the straggler's time
  warnings @7 :List(Text);         # committed, but these failed after the commit point
}

# A load ends the same way on every rank. After its local reads each rank
# reports its own outcome to rank 0; once every rank reported (or one failed,
# or write-timeout passed) rank 0 answers each with the load's outcome.
struct LoadOutcome {
  jobId @0 :Text;                  # the sender's job
  loadId @1 :Text;                 # the load, as in plan.capnp's LoadRequest
  rank @2 :Int32;                  # the sender's rank
  status @3 :Status;               # from a rank: its own outcome; from rank 0: the load's
  failedRank @4 :Int32 = -1;       # from rank 0: the rank the error comes from; -1 when ok
  # Before the reads the same exchange, under load id "<load>/needs", gathers
  # what each rank will read: a rank sends its own entry, rank 0 answers with
  # every rank's, and all ranks derive who reads which shared bytes.
  needs @5 :List(RankNeeds);
  trace @6 :RankTrace;             # from a rank, with trace-dir set: its phases of the load
}

# The byte ranges of data files one rank's load reads, and its node.
struct RankNeeds {
  rank @0 :Int32;                  # the rank
  host @1 :Text;                   # its node: ranks of one node read shared bytes once
  ranges @2 :List(FileRange);      # what its plan reads
  # Its share ring for this load (ringBytes 0: none): a sealed memfd that
  # ranks of its node map through /proc/<ringPid>/fd/<ringFd> and write the
  # bytes they read for it into; it starts with ringToken. See share_ring.hpp.
  ringPid @3 :UInt32;
  ringFd @4 :Int32;
  ringBytes @5 :UInt64;
  ringToken @6 :UInt64;
}

struct FileRange {
  file @0 :UInt32;                 # index into the manifest's files
  offset @1 :UInt64;               # byte offset in that file
  length @2 :UInt64;               # bytes
  # In needs: the box of the tensor the rank copies out of the range
  # (global coordinates, as plan.capnp's Box): its elements in the range are
  # all that travels to it when another rank reads the range.
  regionOffsets @3 :List(Int64);
  regionSizes @4 :List(Int64);
}

# Bytes of a data file one rank read and verified for another rank of its
# node (only those the receiver copies from) (ranks > 0 send through rank 0, which forwards by `to`). A reader
# that failed sends a status instead, so its receivers fail naming it.
struct BlockShare {
  jobId @0 :Text;                  # the sender's job
  loadId @1 :Text;                 # the load, as in LoadOutcome
  from @2 :Int32;                  # the rank that read the bytes
  to @3 :Int32;                    # the rank they are for
  file @4 :UInt32;                 # index into the manifest's files
  offset @5 :UInt64;               # the file offset of data's first element
  status @6 :Status;               # not ok: the sender's reads failed; no data
  data @7 :Data;                   # the receiver's box's elements from there on, packed (verified)
  checksum @8 :UInt64;             # xxh3-64 of data: the receiver checks it
  # ringLength > 0: data is empty, and the bytes lie in the receiver's share
  # ring (its needs' ring), ringLength of them at ringOffset, inside the
  # sender's region.
  ringOffset @9 :UInt64;
  ringLength @10 :UInt64;
}

# The receiver of BlockShare frames -> their sender (through rank 0, which
# forwards by `to`): flow control. A sender keeps at most share-window bytes
# per receiver unacknowledged, so no queue on the way (rank 0's relay
# included) holds more than the sum of the windows.
struct ShareAck {
  jobId @0 :Text;                  # the receiver's job
  loadId @1 :Text;                 # the load, as in BlockShare
  from @2 :Int32;                  # the rank that took the bytes (the BlockShare's `to`)
  to @3 :Int32;                    # the rank that sent them (the BlockShare's `from`)
  bytes @4 :UInt64;                # BlockShare data bytes taken since the previous ack
  status @5 :Status;               # not ok: the receiver takes no more bytes of this load (why)
}

# One phase of a rank in a save's or load's timeline (trace-dir).
struct TraceSpan {
  name @0 :Text;                   # the phase: "plan", "write <file>", "read", ...
  track @1 :Text;                  # the row of the rank's timeline it belongs in
  startNs @2 :Int64;               # on rank 0's steady clock
  endNs @3 :Int64;                 # on rank 0's steady clock, >= startNs
  bytes @4 :UInt64;                # bytes the phase moved; 0: not counted
  busyMs @5 :Float64 = -1;         # time spent working inside it (summed over threads); < 0: none
}

# A rank's timeline of one save or load; no spans when tracing is off.
struct RankTrace {
  host @0 :Text;                   # the rank's host name
  clockErrorNs @1 :Int64;          # how far its clock may be off rank 0's
  spans @2 :List(TraceSpan);       # its phases
}

# What one control frame holds: exactly one of these.
struct ControlMessage {
  union {
    join @0 :Join;                 # rank -> rank 0, first on a connection
    joinAck @1 :JoinAck;           # rank 0 -> rank
    heartbeat @2 :Heartbeat;       # either direction
    abort @3 :Abort;               # rank 0 -> every rank, or rank -> rank 0
    commit @4 :Commit;             # rank 0 -> every rank
    loadOutcome @5 :LoadOutcome;   # rank -> rank 0, then rank 0 -> every rank
    blockShare @6 :BlockShare;     # rank -> rank of its node (through rank 0)
    shareAck @7 :ShareAck;         # receiver -> sender of BlockShare (through rank 0)
  }
}
