// Planner: one per rank; drives each save from the state dict to the commit.
//
//   idle -> planning -> opening -> streaming -> finishing -> committing -> idle
//             |            |          |            |             |
//             +------------+----------+------------+-------------+--> draining -> idle
//
// planning:   local plan, sent to the coordinator; its reply is this rank's
//             part of the global plan and the pending directory.
// opening:    a writer creates the data files; the snapshot already copies.
// streaming:  snapshot -> serializer -> writers; block reports come back here.
// finishing:  each file is truncated, fsynced and closed; checksums arrive
//             from the serializer. (The pending directory is fsynced once,
//             by rank 0 after MANIFEST, for every rank's files.)
// committing: the write result goes to the coordinator, which commits.
// planned, written: a save driven in steps (SavePlanner) waits here for its
//             caller's next step (`proceed`); both count as the write phase,
//             so a caller that never goes on times out like a slow write.
// draining:   the save failed. The handle hears it only once nothing touches
//             the caller's tensors or the save's descriptors any more:
//             1. the snapshot has no copy running and the serializer hands
//                no more blocks to the writers (both answer `abandon`);
//             2. every writer has drained what was queued before (`drain`);
//             3. one writer closes the files (`close`).
//             A writer that has not answered 2. or 3. within kDrainGrace is
//             stuck in a call (a stalled disk, a checkpoint_fn that never
//             returns): it is retired and replaced (writer.cpp), the files
//             are left to close with their last reference, and the save
//             ends. Only compression, which reads the caller's tensors, is
//             waited for to its end.
// Each phase has a deadline on every rank: plan-timeout, write-timeout, and
// commit-timeout (plus, with other ranks, the write time left: committing
// waits for the slowest rank's write too). A commit that times out ends
// "outcome unknown": rank 0 may still commit.
// Saves queue here: one runs at a time.
//
// Replica check: the items this rank holds that other ranks hold too are
// hashed on the hasher's thread while the snapshot copies (replica-check);
// the snapshot counts as done, and the write result goes to rank 0, only
// once the digests are in, and a failed save's drain waits for the hashing
// (it reads the caller's tensors).

#include <cstdio>
#include <deque>
#include <functional>
#include <optional>
#include <utility>

#include "actors/messages.hpp"
#include "actors/planner_actor.hpp"
#include "actors/snapshot_actor.hpp"
#include "checkpoint_fn.hpp"
#include "checksum.hpp"
#include "codec.hpp"
#include "data_files.hpp"
#include "replica_check.hpp"
#include "storage_writer.hpp"

namespace ferry {

namespace {

enum class Phase {
  idle,
  planning,
  compressing,
  planned,
  opening,
  streaming,
  finishing,
  written,
  committing,
  draining
};

struct Current {
  uint64_t id = 0;
  SaveJob job;
  Phase phase = Phase::idle;
  std::string checkpoint_id;
  std::string pending_dir;
  // Shared with rank 0's coordinator in process, which drops it once planned.
  std::shared_ptr<LocalPlan> local = std::make_shared<LocalPlan>();
  std::optional<uint64_t> local_digest;  // local->digest(), once known
  // This rank's part of the global plan (in process: rank 0's cached one, shared).
  std::shared_ptr<const RankPlan> plan = std::make_shared<const RankPlan>();
  // Shared with the stream job (and, uncompressed, with the layout cache).
  std::shared_ptr<const std::vector<FileLayout>> layouts =
      std::make_shared<const std::vector<FileLayout>>();
  std::shared_ptr<const std::vector<std::vector<ChunkSource>>> sources;  // [file][chunk]
  std::string all_plans;  // every rank's plans, for a staged save
  std::vector<std::shared_ptr<File>> files;
  std::vector<uint64_t> file_bytes_left;  // data not yet reported written
  size_t files_left = 0;                  // not yet finished (fsynced)
  bool have_sums = false;
  bool snapshot_done = false;
  ChecksumSet sums;
  double write_started_ms = -1;
  std::chrono::steady_clock::time_point write_deadline;
  // draining: the status the save ends with, and answers still awaited.
  Status failure;
  int drain_stage = 0;
  size_t drain_left = 0;
  std::vector<bool> writer_drained;  // stage 2: which writers answered
  // A local write failure may be a consequence of another rank's (rank 0
  // removes the pending directory as it aborts): the save ends with the
  // checkpoint's one cause, rank 0's verdict, awaited for a bounded time.
  bool verdict_due = false;
  bool drained = false;
  // A staged save: the caller's go-aheads, which may come before the step.
  bool write_go = false;
  bool commit_go = false;
  // Replica check: hashing runs (`hashing`), digests are in (`hashed`;
  // true when there is nothing to hash), and what waits for them.
  bool hashing = false;
  bool hashed = true;
  bool durable_early = false;
  std::vector<ReplicaDigest> digests;
  // trace-dir set: this save's phases on this rank's clock (trace_now_ns),
  // sent to rank 0 with the write result. Untouched when tracing is off.
  bool tracing = false;
  int64_t t_start = 0;
  int64_t t_stream = 0;
  std::vector<TraceSpan> spans;
};

using hasher_actor = caf::typed_actor<caf::replies_to<atom::hash, HashJob>::with<HashDone>>;

// Hashes replicated items on its own thread: CPU work (and, for GPU tensors,
// blocking copies) that must not hold a scheduler thread.
hasher_actor::behavior_type hasher_fun(hasher_actor::pointer self, ContextPtr ctx) {
  (void)self;
  return {
      [ctx](atom::hash, HashJob& job) -> HashDone {
        HashDone out;
        const auto t0 = std::chrono::steady_clock::now();
        for (size_t i = 0; i < job.items.size(); ++i) {
          const TensorView& v = job.views[i];
          const ReplicaCheck mode = replica_mode(job.mode, v.nbytes());
          auto d = replica_digest(*ctx->device, v, mode);
          if (!d.ok()) {
            out.status =
                d.status().with_context("replica check of tensor '" + job.items[i].key + "': ");
            return out;
          }
          job.items[i].digest = *d;
          job.items[i].sampled = mode == ReplicaCheck::sampled;
        }
        out.digests = std::move(job.items);
        out.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                     .count();
        return out;
      },
  };
}

// The last uncompressed save's file layouts. A save whose local plan, part
// of the global plan and file options are the same lays its files out the
// same way: it reuses them, and only looks up its tensors again.
struct LayoutCache {
  bool valid = false;
  uint64_t local_digest = 0;
  std::vector<uint32_t> entries;  // [item]: its state dict entry
  std::shared_ptr<const RankPlan> plan;
  DataFileOptions files;
  std::shared_ptr<const std::vector<FileLayout>> layouts;
  // The last save's sources: the next one whose tensors are the same views
  // shares them instead of copying every view again.
  std::shared_ptr<const std::vector<std::vector<ChunkSource>>> sources;
  std::vector<uint64_t> header_sums;  // [file]: xxh3 of its header, reported with each save
  std::vector<std::vector<std::pair<uint32_t, uint64_t>>> picks;  // [file][chunk]: entry, skip
  uint64_t layout = 0;    // WriteResult::layout: a new one each time the cache is filled
  bool reported = false;  // rank 0 committed a save with this layout's whole report
};

bool same_rank_plan(const RankPlan& a, const RankPlan& b) {
  if (&a == &b) return true;  // rank 0's cached global plan, shared again
  if (a.rank != b.rank || a.files != b.files || a.bytes != b.bytes ||
      a.replicated != b.replicated || a.chunks.size() != b.chunks.size())
    return false;
  for (size_t i = 0; i < a.chunks.size(); ++i) {
    const ChunkAssignment& x = a.chunks[i];
    const ChunkAssignment& y = b.chunks[i];
    if (x.item != y.item || x.whole != y.whole || x.file != y.file || !(x.box == y.box))
      return false;
  }
  return true;
}

std::vector<uint32_t> item_entries(const LocalPlan& local) {
  std::vector<uint32_t> out;
  out.reserve(local.items.size());
  for (const WriteItem& it : local.items) out.push_back(it.entry);
  return out;
}

bool same_entries(const std::vector<uint32_t>& entries, const LocalPlan& local) {
  if (entries.size() != local.items.size()) return false;
  for (size_t i = 0; i < entries.size(); ++i)
    if (entries[i] != local.items[i].entry) return false;
  return true;
}

// Dims are a few values: compared inline, not through a memcmp call each.
bool same_dims(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

bool same_view(const TensorView& a, const TensorView& b) {
  return a.data == b.data && a.dtype == b.dtype && a.device == b.device &&
         same_dims(a.shape, b.shape) && same_dims(a.strides, b.strides);
}

struct planner_state {
  static inline const char* name = "ferry.planner";
  ContextPtr ctx;
  coordinator_api coordinator;  // rank 0's coordinator, or the link standing in for it
  snapshot_actor snapshot;
  serializer_actor serializer;
  std::vector<writer_actor> writers;
  std::vector<std::shared_ptr<WriterWatch>> watches;  // by writer
  // The save that failed last: its blocks still queued at writers go back
  // unwritten, so a drain waits for no more than the calls running.
  std::shared_ptr<std::atomic<uint64_t>> dropped = std::make_shared<std::atomic<uint64_t>>(0);
  std::deque<SaveJob> queue;
  uint64_t next_id = 1;
  Current cur;
  LayoutCache layout_cache;
  uint64_t layouts_made = 0;
  std::shared_ptr<LocalPlan> kept_local;  // the last save's, refilled in place by the next
  std::optional<uint64_t> kept_digest;    // kept_local->digest(), when known
  hasher_actor hasher;                    // spawned at the first save with replicated items
};

using planner_ptr = planner_actor::stateful_pointer<planner_state>;

void start_next(planner_ptr self);

// How long a failed save's drain waits for a writer's running call before
// it abandons that writer.
constexpr std::chrono::seconds kDrainGrace{2};

// Every rank calls save_async the same number of times (saves are
// collective), so (salt, sequence) names one checkpoint on all ranks. The
// step is not part of it: ranks that pass different steps then meet in one
// checkpoint, where the coordinator sees that they disagree.
std::string checkpoint_id(uint64_t salt, uint64_t seq) {
  const uint64_t parts[] = {salt, seq};
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx",
                static_cast<unsigned long long>(xxh3_64(parts, sizeof(parts))));
  return buf;
}

void end_save(planner_ptr self, const Status& status, const std::string& path,
              std::vector<std::string> warnings = {}) {
  auto& st = self->state;
  st.cur.job.state->finish(status, path, std::move(warnings));
  st.kept_local = std::move(st.cur.local);
  st.kept_digest = st.cur.local_digest;
  st.cur = Current{};
  start_next(self);
}

// True while `id` is the save being driven (not failed, not over).
bool live(const planner_state& st, uint64_t id) {
  return st.cur.id == id && st.cur.phase != Phase::idle && st.cur.phase != Phase::draining;
}

std::chrono::milliseconds seconds(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g s", s);
  return buf;
}

void arm_deadline(planner_ptr self, const char* phase, std::chrono::milliseconds after) {
  self->delayed_send(planner_actor{self}, std::max(after, std::chrono::milliseconds(0)),
                     atom::phase_due_v, self->state.cur.id, std::string(phase));
}

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::idle:
      return "idle";
    case Phase::planning:
      return "plan";
    case Phase::compressing:
    case Phase::planned:
    case Phase::opening:
    case Phase::streaming:
    case Phase::finishing:
    case Phase::written:
      return "write";
    case Phase::committing:
      return "commit";
    case Phase::draining:
      return "abort";
  }
  return "?";
}

writer_actor spawn_one_writer(planner_ptr self) {
  auto& st = self->state;
  auto watch = std::make_shared<WriterWatch>();
  watch->dropped_save = st.dropped;
  st.watches.push_back(watch);
  return spawn_writer(self, st.ctx, planner_actor{self}, std::move(watch));
}

// What the writers are stuck in, for a timeout's message: "" when none is busy.
std::string busy_writers(const planner_state& st) {
  std::string out;
  for (size_t i = 0; i < st.watches.size(); ++i) {
    const std::string d = st.watches[i]->describe();
    if (!d.empty()) out += "; writer " + std::to_string(i) + " is in " + d;
  }
  return out;
}

// Writer i is stuck in a call: a fresh one takes its place, and it ends once
// the call returns (writer.cpp). The save's failure names what it was in.
void retire_writer(planner_ptr self, size_t i) {
  auto& st = self->state;
  const std::string doing = st.watches[i]->describe();
  st.watches[i]->retired = true;
  st.ctx->stragglers->add();
  writer_actor old = st.writers[i];
  self->unlink_from(old);
  self->send(old, atom::retire_v);
  auto watch = std::make_shared<WriterWatch>();
  watch->dropped_save = st.dropped;
  st.watches[i] = watch;
  st.writers[i] = spawn_writer(self, st.ctx, planner_actor{self}, std::move(watch));
  // Before the next save's `stream`, which it sends later.
  self->send(st.serializer, atom::writers_v, st.writers);
  auto& cur = st.cur;
  cur.failure =
      Status(cur.failure.code(), cur.failure.message() + "; rank " + std::to_string(st.ctx->rank) +
                                     " abandoned writer " + std::to_string(i) + ", stuck in " +
                                     (doing.empty() ? std::string("a call") : doing));
}

// One more drain answer is in; the next stage starts when a stage is done.
void drain_step(planner_ptr self, uint64_t id) {
  auto& st = self->state;
  auto& cur = st.cur;
  if (cur.id != id || cur.phase != Phase::draining || --cur.drain_left > 0) return;
  auto next = [self, id](bool) { drain_step(self, id); };
  auto next_err = [self, id](caf::error&) { drain_step(self, id); };
  switch (cur.drain_stage++) {
    case 0:  // every block of the save is queued at a writer: let them run dry
      cur.drain_left = st.writers.size();
      cur.writer_drained.assign(st.writers.size(), false);
      for (size_t i = 0; i < st.writers.size(); ++i) {
        auto answered = [self, id, i] {
          auto& cur = self->state.cur;
          if (cur.id == id && cur.drain_stage == 1 && i < cur.writer_drained.size())
            cur.writer_drained[i] = true;
          drain_step(self, id);
        };
        self->request(st.writers[i], caf::infinite, atom::drain_v)
            .then([answered](bool) { answered(); }, [answered](caf::error&) { answered(); });
      }
      self->delayed_send(planner_actor{self}, kDrainGrace, atom::phase_due_v, id,
                         std::string("drain"));
      return;
    case 1:  // no writer will touch the files again
      cur.drain_left = 1;
      self->request(st.writers[0], caf::infinite, atom::close_v, cur.files).then(next, next_err);
      self->delayed_send(planner_actor{self}, kDrainGrace, atom::phase_due_v, id,
                         std::string("close"));
      return;
    default:
      if (!cur.verdict_due) return end_save(self, cur.failure, "");
      cur.drained = true;
      self->delayed_send(planner_actor{self}, std::chrono::seconds(2), atom::phase_due_v, id,
                         std::string("verdict"));
  }
}

// Rank 0's verdict on a checkpoint this rank failed in: its cause first.
void adopt_verdict(planner_ptr self, const Status& why) {
  auto& cur = self->state.cur;
  cur.verdict_due = false;
  if (why.message() != cur.failure.message())
    cur.failure =
        Status(why.code(), why.message() + "; then on this rank: " + cur.failure.message());
  if (cur.drained) end_save(self, cur.failure, "");
}

// Abandons the current save. `local` failures are named after this rank and
// reported to the coordinator; aborts that came from the coordinator are not
// sent back.
void fail(planner_ptr self, Status status, bool local = true) {
  auto& st = self->state;
  auto& cur = st.cur;
  if (cur.phase == Phase::idle || cur.phase == Phase::draining) return;
  const uint64_t id = cur.id;
  if (local)
    status = status.with_context("rank " + std::to_string(st.ctx->rank) + " (" +
                                 phase_name(cur.phase) + " phase): ");
  // The other ranks hear it now; this rank's handle once it has drained.
  if (local && !cur.checkpoint_id.empty())
    self->send(st.coordinator, atom::abort_ckpt_v, cur.checkpoint_id, status);
  cur.verdict_due =
      local && !cur.checkpoint_id.empty() && std::string(phase_name(cur.phase)) == "write";
  st.dropped->store(id);
  cur.phase = Phase::draining;
  cur.failure = std::move(status);
  cur.drain_stage = 0;
  // The snapshot, the serializer, this call's own step, and a running hash.
  cur.drain_left = cur.hashing ? 4 : 3;
  auto next = [self, id](bool) { drain_step(self, id); };
  auto next_err = [self, id](caf::error&) { drain_step(self, id); };
  self->request(st.snapshot, caf::infinite, atom::abandon_v, id).then(next, next_err);
  self->request(st.serializer, caf::infinite, atom::abandon_v, id).then(next, next_err);
  drain_step(self, id);
}

// The snapshot is done for the caller once its copies landed and the
// replicated items are hashed: both read the caller's tensors.
void snapshot_landed(planner_ptr self) {
  auto& cur = self->state.cur;
  if (cur.snapshot_done && cur.hashed) cur.job.state->finish_snapshot(Status());
}

void files_durable(planner_ptr self);

// A phase of this save ended now (trace-dir set).
void traced(Current& cur, std::string name, std::string track, int64_t start, uint64_t bytes = 0) {
  if (cur.tracing)
    cur.spans.push_back({std::move(name), std::move(track), start, trace_now_ns(), bytes, -1});
}

// The spans on rank 0's clock, for the write result.
RankTrace rank_trace(const planner_state& st, std::vector<TraceSpan> spans) {
  RankTrace t;
  if (spans.empty()) return t;
  t.rank = st.ctx->rank;
  t.host = st.ctx->host;
  const int64_t offset = st.ctx->trace_clock->offset_ns.load();
  t.clock_error_ns = st.ctx->trace_clock->error_ns.load();
  for (TraceSpan& s : spans) {
    s.start_ns += offset;
    s.end_ns += offset;
  }
  t.spans = std::move(spans);
  return t;
}

void on_hashed(planner_ptr self, uint64_t id, HashDone& d) {
  auto& cur = self->state.cur;
  if (cur.id != id || !cur.hashing) return;
  cur.hashing = false;
  cur.job.state->set_hashing(false);
  if (cur.phase == Phase::draining) return drain_step(self, id);
  if (!live(self->state, id)) return;
  if (!d.status.ok()) return fail(self, d.status);
  cur.digests = std::move(d.digests);
  cur.hashed = true;
  cur.job.state->update_metrics([&](SaveMetrics& m) { m.replica_check_ms = d.ms; });
  snapshot_landed(self);
  if (cur.durable_early) {
    cur.durable_early = false;
    files_durable(self);
  }
}

// Hashes the items of this rank that rank 0's plan says other ranks hold too.
Status start_hashing(planner_ptr self) {
  auto& st = self->state;
  auto& cur = st.cur;
  if (st.ctx->opts.replica_check == ReplicaCheck::off || cur.plan->replicated.empty())
    return Status();
  HashJob job;
  job.mode = st.ctx->opts.replica_check;
  const auto& entries = cur.job.sd.entries();
  for (uint32_t i : cur.plan->replicated) {
    if (i >= cur.local->items.size() || cur.local->items[i].entry >= entries.size())
      return Status::invalid_argument("rank 0's plan names replicated item " + std::to_string(i) +
                                      " of " + std::to_string(cur.local->items.size()));
    const WriteItem& it = cur.local->items[i];
    job.items.push_back({it.key, it.box.offsets, 0, false});
    job.views.push_back(entries[it.entry].view);
  }
  if (!st.hasher) st.hasher = self->spawn<caf::detached + caf::linked>(hasher_fun, st.ctx);
  cur.hashing = true;
  cur.hashed = false;
  cur.job.state->set_hashing(true);
  const uint64_t id = cur.id;
  self->request(st.hasher, caf::infinite, atom::hash_v, std::move(job))
      .then([self, id](HashDone& d) { on_hashed(self, id, d); },
            [self, id](caf::error& e) {
              HashDone d;
              d.status = Status::internal("replica check: the hasher: " + self->system().render(e));
              on_hashed(self, id, d);
            });
  return Status();
}

void send_result(planner_ptr self) {
  auto& st = self->state;
  auto& cur = st.cur;
  cur.phase = Phase::committing;
  // With other ranks, committing includes waiting for the slowest one's
  // write, which the write deadline bounds; alone, the commit starts now.
  auto commit_after = seconds(st.ctx->opts.commit_timeout_s);
  if (st.ctx->world_size > 1)
    commit_after += std::chrono::duration_cast<std::chrono::milliseconds>(
        cur.write_deadline - std::chrono::steady_clock::now());
  arm_deadline(self, "commit", commit_after);
  const double now = cur.job.state->ms_since_start();
  WriteResult wr;
  wr.rank = st.ctx->rank;
  wr.replica_digests = std::move(cur.digests);
  const LayoutCache& cache = st.layout_cache;
  if (cache.valid && cur.layouts == cache.layouts) wr.layout = cache.layout;
  // Rank 0's coordinator keeps the last report: a save laid out as the one
  // it committed sends only sizes and checksums (not over the wire).
  wr.repeat = wr.layout != 0 && cache.reported && st.ctx->rank == 0;
  for (size_t f = 0; f < cur.layouts->size(); ++f) {
    const FileLayout& l = (*cur.layouts)[f];
    wr.files.push_back(
        {l.name, l.size, l.header.size(),
         wr.layout != 0 ? cache.header_sums[f] : xxh3_64(l.header.data(), l.header.size())});
  }
  if (wr.repeat) {
    // The byte ranges are the shared layouts' and the checksums the
    // serializer's vectors: nothing is built per chunk.
    wr.laid_out = cur.layouts;
    wr.sums = std::move(cur.sums.sums);
    for (const FileLayout& l : *cur.layouts) wr.bytes += l.size - l.header.size();
  } else {
    size_t chunk_count = 0;
    for (const auto& l : *cur.layouts) chunk_count += l.chunks.size();
    wr.chunks.reserve(chunk_count);
  }
  for (size_t f = 0; f < cur.layouts->size() && !wr.repeat; ++f) {
    const FileLayout& l = (*cur.layouts)[f];
    for (size_t c = 0; c < l.chunks.size(); ++c) {
      const LaidOutChunk& lc = l.chunks[c];
      std::vector<uint64_t> sums;
      if (!cur.sums.sums.empty()) sums = std::move(cur.sums.sums[f][c]);
      wr.chunks.push_back({lc.chunk.key,
                           lc.chunk.dtype,
                           lc.chunk.global_shape,
                           lc.chunk.box,
                           static_cast<uint32_t>(f),
                           lc.offset,
                           lc.length,
                           lc.entry,
                           std::move(sums),
                           "",
                           0,
                           0,
                           {}});
      if (const auto& z = lc.chunk.compressed) {
        WrittenChunk& wc = wr.chunks.back();
        wc.codec = kCodecZstd;
        wc.raw_length = z->raw_bytes;
        wc.frame_bytes = z->frame_bytes;
        wc.frame_ends = z->frame_ends;
      }
      wr.bytes += lc.length;
    }
  }
  cur.job.state->update_metrics([&](SaveMetrics& m) {
    m.write_ms = cur.write_started_ms >= 0 ? now - cur.write_started_ms : 0;
    wr.snapshot_ms = m.snapshot_ms;
    wr.write_ms = m.write_ms;
    wr.ready_ms = now;
  });
  const uint64_t id = cur.id;
  const uint64_t layout = wr.layout;
  st.ctx->fs->crash_point("writer.report");
  self->request(st.coordinator, caf::infinite, atom::commit_v,
                CommitRequest{st.ctx->job_id, cur.checkpoint_id, std::move(wr),
                              rank_trace(st, std::move(cur.spans))})
      .then(
          [self, id, now, layout](const CommitMsg& r) {
            auto& st = self->state;
            // Rank 0 holds the cached layout's report once it committed it
            // (a late answer too); after a failure, or a commit of another
            // layout (compressed, a checkpoint_fn's), the next report is whole.
            LayoutCache& cache = st.layout_cache;
            cache.reported = r.status.ok() && layout != 0 && cache.layout == layout;
            if (!live(st, id)) return;
            st.cur.job.state->update_metrics([&](SaveMetrics& m) {
              m.commit_ms = st.cur.job.state->ms_since_start() - now;
              m.slowest_rank = r.slowest_rank;
              m.slowest_rank_ms = r.slowest_ms;
            });
            if (!r.status.ok()) {
              st.cur.checkpoint_id.clear();  // the coordinator already cleaned up
              fail(self, r.status, false);
              return;
            }
            end_save(self, Status(), r.path, r.warnings);
          },
          [self, id](caf::error& e) {
            self->state.layout_cache.reported = false;
            if (live(self->state, id))
              fail(self, Status::aborted("commit: " + self->system().render(e)));
          });
}

// This rank's files are durable: commit, or a staged save waits for barrier().
void files_durable(planner_ptr self) {
  auto& cur = self->state.cur;
  if (!cur.hashed) {
    cur.durable_early = true;  // the digests go with the write result
    return;
  }
  if (cur.job.staged) {
    cur.job.state->mark_written();
    if (!cur.commit_go) {
      cur.phase = Phase::written;
      return;
    }
  }
  send_result(self);
}

// Called whenever a piece of the finishing phase lands.
void maybe_finish(planner_ptr self) {
  auto& cur = self->state.cur;
  if (cur.phase != Phase::finishing || cur.files_left > 0 || !cur.have_sums) return;
  // The files' directory entries need no fsync here: rank 0 fsyncs the
  // pending directory after writing MANIFEST into it, before the commit
  // rename, and that one fsync covers every rank's entries.
  files_durable(self);
}

void finish_file(planner_ptr self, uint32_t f) {
  auto& st = self->state;
  const uint64_t id = st.cur.id;
  const auto& w = st.writers[f % st.writers.size()];
  const int64_t sealing = st.cur.tracing ? trace_now_ns() : 0;
  self->request(w, caf::infinite, atom::seal_v, st.cur.files[f], (*st.cur.layouts)[f].size)
      .then(
          [self, id, f, sealing](const Status& s) {
            auto& cur = self->state.cur;
            if (!live(self->state, id)) return;
            if (!s.ok()) return fail(self, s);
            if (cur.tracing) {
              const std::string& name = (*cur.layouts)[f].name;
              traced(cur, "fsync " + name, name, sealing);
            }
            --cur.files_left;
            maybe_finish(self);
          },
          [self, id, name = (*st.cur.layouts)[f].name](caf::error& e) {
            if (live(self->state, id))
              fail(self, Status::internal("closing " + name +
                                          ": the writer: " + self->system().render(e)));
          });
}

// The copies start while a writer creates the files: the serializer holds
// the filled blocks until it has them (`open`).
void start_streaming(planner_ptr self) {
  auto& st = self->state;
  auto& cur = st.cur;
  StreamJob job;
  job.save = cur.id;
  job.files = cur.layouts;
  job.block_bytes = st.ctx->pool->block_bytes();
  job.checksum_block_bytes = st.ctx->opts.checksum ? st.ctx->opts.checksum_block_bytes : 0;
  job.sources = cur.sources;
  job.state = cur.job.state;
  if (cur.tracing) cur.t_stream = trace_now_ns();
  cur.file_bytes_left.clear();
  uint64_t blocks = 0;
  for (const auto& l : *cur.layouts) {
    cur.file_bytes_left.push_back(l.size);
    blocks += (l.size + job.block_bytes - 1) / job.block_bytes;
  }
  // A pool sized by the states it sees (pool-bytes = auto) takes in the whole
  // state where its cap allows; where pinning more fails the save streams
  // through the blocks it has.
  if (Status g = st.ctx->pool->grow(blocks * job.block_bytes); !g.ok())
    std::fprintf(stderr, "ferry: rank %d: the staging pool stays at %llu bytes: %s\n", st.ctx->rank,
                 static_cast<unsigned long long>(st.ctx->pool->bytes()), g.message().c_str());
  cur.files_left = cur.layouts->size();
  // The serializer must know the job before the first block reaches it; a
  // send enqueues at once, so sending to it first is enough.
  self->send(st.serializer, atom::stream_v, job);
  self->send(st.snapshot, atom::stream_v, std::move(job));
}

// The chunks of this rank's files and where each one's bytes come from:
// the files data_files() gives this rank's plan, the same ones rank 0 put
// in every rank's SavePlan.
// `picks`, when given: each chunk's entry and skip, for the layout cache.
Status plan_chunks(planner_state& st, FileChunks& out,
                   std::vector<std::vector<std::pair<uint32_t, uint64_t>>>* picks) {
  auto& cur = st.cur;
  const auto& entries = std::as_const(cur.job.sd).entries();
  FERRY_ASSIGN_OR_RETURN(auto files, data_files(*cur.local, *cur.plan, cur.job.files));
  out = FileChunks{};
  if (picks) picks->clear();
  for (PlannedFile& f : files) {
    out.names.push_back(std::move(f.name));
    out.refs.emplace_back();
    out.srcs.emplace_back();
    if (picks) picks->emplace_back();
    for (FileSlice& s : f.slices) {
      const WriteItem& it = cur.local->items[s.item];
      out.refs.back().push_back({it.key, it.dtype, it.global_shape, std::move(s.box), nullptr});
      out.srcs.back().push_back({entries[it.entry].view, s.skip});
      if (picks) picks->back().emplace_back(it.entry, s.skip);
    }
  }
  return Status();
}

// The files' layouts, from their chunks (compressed already where asked).
Status make_layouts(planner_state& st, FileChunks& chunks) {
  auto& cur = st.cur;
  auto layouts = std::make_shared<std::vector<FileLayout>>();
  auto sources = std::make_shared<std::vector<std::vector<ChunkSource>>>();
  for (size_t f = 0; f < chunks.refs.size(); ++f) {
    FERRY_ASSIGN_OR_RETURN(FileLayout l, layout_file(chunks.names[f], std::move(chunks.refs[f])));
    layouts->push_back(std::move(l));
    sources->push_back(std::move(chunks.srcs[f]));
  }
  cur.layouts = std::move(layouts);
  cur.sources = std::move(sources);
  return Status();
}

// The cached layouts, when this save lays its files out as the last one
// did: its tensors' views are looked up again (their addresses may differ),
// and the last save's sources shared when every view is the same.
bool reuse_layouts(planner_state& st, uint64_t local_digest) {
  auto& cur = st.cur;
  LayoutCache& c = st.layout_cache;
  if (!c.valid || c.local_digest != local_digest || c.files != cur.job.files ||
      !same_rank_plan(*c.plan, *cur.plan) || !same_entries(c.entries, *cur.local))
    return false;
  const auto& entries = std::as_const(cur.job.sd).entries();
  bool same_views = c.sources != nullptr;
  for (size_t f = 0; f < c.picks.size() && same_views; ++f)
    for (size_t i = 0; i < c.picks[f].size() && same_views; ++i) {
      const uint32_t entry = c.picks[f][i].first;
      same_views =
          entry < entries.size() && same_view(entries[entry].view, (*c.sources)[f][i].view);
    }
  if (!same_views) {
    auto sources = std::make_shared<std::vector<std::vector<ChunkSource>>>(c.picks.size());
    for (size_t f = 0; f < c.picks.size(); ++f) {
      auto& out = (*sources)[f];
      out.reserve(c.picks[f].size());
      for (const auto& [entry, skip] : c.picks[f]) {
        if (entry >= entries.size()) return false;
        out.push_back({entries[entry].view, skip});
      }
    }
    c.sources = std::move(sources);
  }
  cur.layouts = c.layouts;
  cur.sources = c.sources;
  return true;
}

void start_write(planner_ptr self);

// The caller's checkpoint_fn writes the rank's files through its
// StorageWriter, on one writer's thread; what it wrote comes back laid out
// and checksummed, durable with its directory, as if Ferry had written it.
void start_custom_write(planner_ptr self) {
  auto& st = self->state;
  auto& cur = st.cur;
  std::vector<CheckpointFnWriter::PlannedFile> planned;
  std::vector<std::string> paths;
  for (size_t f = 0; f < cur.layouts->size(); ++f) {
    std::vector<PlannedSource> srcs;
    for (const auto& s : (*cur.sources)[f]) srcs.push_back({s.view, s.offset});
    planned.push_back({(*cur.layouts)[f], std::move(srcs)});
    paths.push_back(join_path(cur.pending_dir, (*cur.layouts)[f].name));
  }
  auto storage = std::make_shared<CheckpointFnWriter>(
      st.ctx->fs, cur.job.checkpoint_fn, std::move(planned), st.ctx->device,
      st.ctx->opts.checksum ? st.ctx->opts.checksum_block_bytes : 0, st.ctx->opts.fsync);
  cur.phase = Phase::opening;
  const uint64_t id = cur.id;
  self->request(st.writers[0], caf::infinite, atom::custom_v,
                CustomWrite{std::move(storage), std::move(paths)})
      .then(
          [self, id](CustomWritten& r) {
            auto& cur = self->state.cur;
            if (!live(self->state, id)) return;
            if (!r.status.ok()) return fail(self, r.status);
            cur.layouts = std::make_shared<const std::vector<FileLayout>>(std::move(r.layouts));
            cur.sums.sums = std::move(r.sums);
            cur.have_sums = true;
            cur.snapshot_done = true;
            snapshot_landed(self);
            uint64_t total = 0;
            for (const auto& l : *cur.layouts) total += l.size;
            cur.job.state->bytes_persisted += total;
            cur.job.state->bytes_total = total;
            cur.files_left = 0;
            cur.phase = Phase::finishing;
            files_durable(self);
          },
          [self, id](caf::error& e) {
            if (live(self->state, id))
              fail(self,
                   Status::internal("checkpoint_fn: the writer: " + self->system().render(e)));
          });
}

void on_chunks(planner_ptr self, FileChunks& chunks);
void laid_out(planner_ptr self);

void on_plan(planner_ptr self, PlanReply& r) {
  auto& st = self->state;
  auto& cur = st.cur;
  st.ctx->fs->crash_point("plan.received");
  if (!r.status.ok()) {
    cur.checkpoint_id.clear();  // the coordinator created nothing
    return fail(self, r.status, false);
  }
  traced(cur, "plan", "save", cur.t_start);
  // Shared in process; moved otherwise: a copy allocates per box, every save.
  cur.plan = r.shared ? std::move(r.shared) : std::make_shared<const RankPlan>(std::move(r.plan));
  cur.pending_dir = r.pending_dir;
  cur.write_deadline = std::chrono::steady_clock::now() + seconds(st.ctx->opts.write_timeout_s);
  arm_deadline(self, "write", seconds(st.ctx->opts.write_timeout_s));
  cur.all_plans = std::move(r.all_plans);
  if (Status s = start_hashing(self); !s.ok()) return fail(self, s);
  const int level = cur.job.files.level();
  if (level == 0) {
    if (!cur.local_digest) cur.local_digest = cur.local->digest();
    const uint64_t digest = *cur.local_digest;
    if (reuse_layouts(st, digest)) return laid_out(self);
    LayoutCache& cache = st.layout_cache;
    cache.valid = false;
    FileChunks chunks;
    if (Status s = plan_chunks(st, chunks, &cache.picks); !s.ok()) return fail(self, s);
    if (Status s = make_layouts(st, chunks); !s.ok()) return fail(self, s);
    cache.local_digest = digest;
    cache.entries = item_entries(*cur.local);
    cache.plan = cur.plan;
    cache.files = cur.job.files;
    cache.layouts = cur.layouts;
    cache.sources = cur.sources;
    cache.header_sums.clear();
    for (const FileLayout& l : *cur.layouts)
      cache.header_sums.push_back(xxh3_64(l.header.data(), l.header.size()));
    cache.layout = ++st.layouts_made;
    cache.reported = false;
    cache.valid = true;
    return laid_out(self);
  }
  FileChunks chunks;
  if (Status s = plan_chunks(st, chunks, nullptr); !s.ok()) return fail(self, s);
  // Compressed on a writer's thread (and its helpers), so this actor stays
  // responsive to aborts and deadlines meanwhile. A failed save's drain
  // queues behind it at that writer, so it ends only once the caller's
  // tensors are no longer read.
  cur.phase = Phase::compressing;
  const uint64_t id = cur.id;
  self->request(st.writers[0], caf::infinite, atom::compress_v,
                CompressJob{std::move(chunks), level})
      .then(
          [self, id](CompressDone& d) {
            if (!live(self->state, id)) return;
            if (!d.status.ok()) return fail(self, d.status);
            on_chunks(self, d.chunks);
          },
          [self, id](caf::error& e) {
            if (live(self->state, id))
              fail(self, Status::internal("compressing: the writer: " + self->system().render(e)));
          });
}

// The chunks are final: lay the files out and, unless a staged save waits
// for its go-ahead, start writing.
void on_chunks(planner_ptr self, FileChunks& chunks) {
  if (Status s = make_layouts(self->state, chunks); !s.ok()) return fail(self, s);
  laid_out(self);
}

void laid_out(planner_ptr self) {
  auto& cur = self->state.cur;
  uint64_t total = 0;
  for (const auto& l : *cur.layouts) total += l.size;
  cur.job.state->bytes_total = total;
  cur.job.state->update_metrics([&](SaveMetrics& m) {
    m.plan_ms = cur.job.state->ms_since_start();
    m.bytes = total;
    m.files = cur.layouts->size();
  });
  if (cur.job.staged) {
    if (cur.all_plans.empty())
      return fail(self, Status::internal("rank 0 sent no global plan to a staged save"));
    cur.job.state->mark_planned(cur.all_plans);
    if (!cur.write_go) {
      cur.phase = Phase::planned;
      return;
    }
  }
  start_write(self);
}

// The files open, then the stream starts.
void start_write(planner_ptr self) {
  auto& st = self->state;
  auto& cur = st.cur;
  if (cur.job.checkpoint_fn && !cur.layouts->empty()) return start_custom_write(self);
  if (cur.layouts->empty()) {
    cur.snapshot_done = true;
    snapshot_landed(self);
    cur.have_sums = true;
    cur.phase = Phase::finishing;
    return maybe_finish(self);
  }
  cur.phase = Phase::opening;
  OpenFiles files;
  for (const auto& l : *cur.layouts) {
    files.paths.push_back(join_path(cur.pending_dir, l.name));
    files.sizes.push_back(l.size);
  }
  const uint64_t id = cur.id;
  self->request(st.writers[0], caf::infinite, atom::open_v, std::move(files))
      .then(
          [self, id](const FileSet& fs) {
            auto& cur = self->state.cur;
            if (cur.id != id) return;
            if (cur.phase == Phase::draining) {
              // Failed while they were opened: they are closed with the others.
              cur.files.insert(cur.files.end(), fs.files.begin(), fs.files.end());
              return;
            }
            if (!fs.status.ok()) return fail(self, fs.status);
            cur.files = fs.files;
            cur.phase = Phase::streaming;
            self->send(self->state.serializer, atom::open_v, id, fs);
          },
          [self, id](caf::error& e) {
            if (live(self->state, id))
              fail(self, Status::internal("opening the data files: the writer: " +
                                          self->system().render(e)));
          });
  start_streaming(self);
}

void start_next(planner_ptr self) {
  auto& st = self->state;
  if (st.cur.phase != Phase::idle || st.queue.empty()) return;
  st.cur = Current{};
  st.cur.id = st.next_id++;
  st.cur.job = std::move(st.queue.front());
  st.queue.pop_front();
  auto& cur = st.cur;
  cur.phase = Phase::planning;
  // Taken even by a save that fails here, so the ranks stay in step; the
  // others hear why at once instead of at plan-timeout.
  cur.checkpoint_id = checkpoint_id(st.ctx->run_salt, cur.id);
  cur.tracing = !st.ctx->opts.trace_dir.empty();
  if (cur.tracing) cur.t_start = trace_now_ns();
  auto doom = [&](const Status& s) {
    Status why = s.with_context("rank " + std::to_string(st.ctx->rank) + " (plan phase): ");
    self->send(st.coordinator, atom::abort_ckpt_v, cur.checkpoint_id, why);
    end_save(self, why, "");
  };
  if (!cur.job.doomed.ok()) return doom(cur.job.doomed);
  if (cur.job.local) {
    cur.local = std::make_shared<LocalPlan>(std::move(*cur.job.local));
  } else {
    // In place unless the coordinator still holds the last one.
    const bool kept = st.kept_local && st.kept_local.use_count() == 1;
    if (kept) cur.local = std::move(st.kept_local);
    bool unchanged = false;
    if (Status s = make_local_plan_into(cur.job.sd, st.ctx->rank, cur.local.get(), &unchanged);
        !s.ok())
      return doom(s);
    // The same plan as the last save's: its digest too, not hashed again.
    if (kept && unchanged) cur.local_digest = st.kept_digest;
  }
  if (!cur.local_digest) cur.local_digest = cur.local->digest();
  // With other ranks, rank 0's coordinator ends a plan phase they never
  // join, naming them: this rank's own deadline is the backstop behind it.
  double plan_wait_s = st.ctx->opts.plan_timeout_s;
  if (st.ctx->world_size > 1) plan_wait_s += st.ctx->opts.heartbeat_timeout_s;
  arm_deadline(self, "plan", seconds(plan_wait_s));
  PlanRequest req{st.ctx->job_id,   cur.checkpoint_id,      st.ctx->rank,          cur.job.step,
                  cur.job.root,     cur.job.opts.overwrite, cur.job.opts.metadata, {},
                  cur.local,        cur.job.staged,         cur.job.owner_policy,  cur.job.files,
                  *cur.local_digest};
  const uint64_t id = cur.id;
  self->request(st.coordinator, caf::infinite, atom::plan_v, std::move(req))
      .then(
          [self, id](PlanReply& r) {
            if (live(self->state, id)) on_plan(self, r);
          },
          [self, id](caf::error& e) {
            if (live(self->state, id))
              fail(self, Status::aborted("plan: " + self->system().render(e)));
          });
  st.ctx->fs->crash_point("plan.sent");
}

planner_actor::behavior_type planner_fun(planner_ptr self, ContextPtr ctx,
                                         coordinator_api coordinator) {
  auto& st = self->state;
  st.ctx = ctx;
  st.coordinator = std::move(coordinator);
  planner_actor me = self;
  for (uint32_t i = 0; i < ctx->opts.writers; ++i) st.writers.push_back(spawn_one_writer(self));
  st.serializer = spawn_serializer(self, ctx, st.writers, me);
  st.snapshot = spawn_snapshot(self, ctx, st.serializer, me);
  snapshot_actor snap = st.snapshot;
  ctx->pool->set_release_hook([snap] { caf::anon_send(snap, atom::freed_v); });
  return {
      [self](atom::save, SaveJob& job) {
        self->state.queue.push_back(std::move(job));
        start_next(self);
      },
      [self](atom::snapped, uint64_t id, const Status& s) {
        auto& cur = self->state.cur;
        if (!live(self->state, id)) return;
        if (!s.ok()) return fail(self, s);
        if (cur.job.opts.snapshot_check) {
          if (Status c = cur.job.opts.snapshot_check(); !c.ok()) return fail(self, c);
        }
        cur.snapshot_done = true;
        traced(cur, "snapshot", "snapshot", cur.t_stream, cur.job.state->bytes_total);
        snapshot_landed(self);
      },
      [self](atom::written, uint64_t id, uint32_t f, uint64_t bytes, const Status& s) {
        auto& cur = self->state.cur;
        if (cur.id != id || cur.phase != Phase::streaming) return;
        if (!s.ok()) return fail(self, s);
        if (cur.write_started_ms < 0) cur.write_started_ms = cur.job.state->ms_since_start();
        cur.job.state->bytes_persisted += bytes;
        cur.file_bytes_left[f] -= bytes;
        if (cur.file_bytes_left[f] == 0) {
          if (cur.tracing) {
            const FileLayout& l = (*cur.layouts)[f];
            traced(cur, "write " + l.name, l.name, cur.t_stream, l.size);
          }
          finish_file(self, f);
          bool all = true;
          for (uint64_t left : cur.file_bytes_left) all = all && left == 0;
          if (all) cur.phase = Phase::finishing;
        }
      },
      // The coordinator abandoned a checkpoint ("*": every one, rank 0 is gone).
      [self](atom::aborted, const std::string& checkpoint_id, const Status& why) {
        auto& cur = self->state.cur;
        if (cur.phase == Phase::idle) return;
        if (checkpoint_id != "*" && checkpoint_id != cur.checkpoint_id) return;
        if (cur.phase == Phase::draining && cur.verdict_due) return adopt_verdict(self, why);
        fail(self, why, false);
      },
      [self](atom::phase_due, uint64_t id, const std::string& phase) {
        auto& st = self->state;
        if (phase == "drain" || phase == "close") {
          // The writers' drain (drain_stage 1 while it is out) or the close
          // (2) has not come back: the writers that did not answer are
          // stuck in a call.
          auto& cur = st.cur;
          const int stage = phase == "drain" ? 1 : 2;
          if (cur.id != id || cur.phase != Phase::draining || cur.drain_stage != stage) return;
          std::vector<size_t> stuck;
          for (size_t i = 0; i < st.writers.size(); ++i)
            if (stage == 2 ? i == 0 : !cur.writer_drained[i]) stuck.push_back(i);
          for (size_t i : stuck)
            if (st.watches[i]->reads_caller()) {
              // Compression reads the caller's tensors: the save ends after it.
              self->delayed_send(planner_actor{self}, kDrainGrace, atom::phase_due_v, id, phase);
              return;
            }
          for (size_t i : stuck) retire_writer(self, i);
          // The files close with their last reference: a retired writer
          // may still be inside a call on one.
          cur.files.clear();
          cur.drain_stage = 2;  // past the close: the next step ends the save
          cur.drain_left = 1;
          drain_step(self, id);
          return;
        }
        if (phase == "verdict") {
          // Rank 0 never answered: this rank's own failure is all it knows.
          if (st.cur.id == id && st.cur.phase == Phase::draining && st.cur.drained)
            end_save(self, st.cur.failure, "");
          return;
        }
        if (!live(st, id) || phase != phase_name(st.cur.phase)) return;
        const Options& o = st.ctx->opts;
        if (phase == "commit") {
          // Rank 0 had everything it needed and may still commit.
          fail(self, Status::outcome_unknown(
                         "the commit phase timed out (commit-timeout " +
                         seconds_text(o.commit_timeout_s) +
                         "); the checkpoint may or may not be committed: check the root"));
          return;
        }
        double limit = phase == "plan" ? o.plan_timeout_s : o.write_timeout_s;
        if (phase == "plan" && st.ctx->world_size > 1) limit += o.heartbeat_timeout_s;
        fail(self, Status::timeout("the " + phase + " phase timed out after " +
                                   seconds_text(limit) + busy_writers(st)));
      },
      [self](atom::proceed, const Proceed& p) {
        auto& st = self->state;
        auto& cur = st.cur;
        if (cur.job.state != p.save) {
          // Abandoned before it started: it never will.
          if (p.step != Proceed::abandon) return;
          for (auto it = st.queue.begin(); it != st.queue.end(); ++it)
            if (it->state == p.save) {
              it->state->finish(p.why, "");
              st.queue.erase(it);
              return;
            }
          return;
        }
        if (!live(st, cur.id)) return;  // over already: its waits say how
        switch (p.step) {
          case Proceed::write:
            cur.write_go = true;
            if (cur.phase == Phase::planned) start_write(self);
            return;
          case Proceed::commit:
            cur.commit_go = true;
            if (cur.phase == Phase::written) send_result(self);
            return;
          case Proceed::abandon:
            fail(self, p.why);
            return;
        }
      },
      [self](atom::sums, ChecksumSet& sums) {
        auto& cur = self->state.cur;
        if (!live(self->state, sums.save)) return;
        cur.sums = std::move(sums);
        cur.have_sums = true;
        traced(cur, "serialize", "serialize", cur.t_stream);
        maybe_finish(self);
      },
  };
}

}  // namespace

planner_actor spawn_planner(caf::actor_system& sys, ContextPtr ctx, coordinator_api coordinator) {
  return sys.spawn(planner_fun, std::move(ctx), std::move(coordinator));
}

}  // namespace ferry
