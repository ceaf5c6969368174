// Planner: one per rank; drives each save from the state dict to the commit.
//
//   idle -> planning -> opening -> streaming -> finishing -> committing -> idle
//             |            |          |            |             |
//             +------------+----------+------------+-------------+--> failed -> idle
//
// planning:   local plan, sent to the coordinator; its reply is this rank's
//             part of the global plan and the pending directory.
// opening:    a writer creates the data files.
// streaming:  snapshot -> serializer -> writers; block reports come back here.
// finishing:  each file is truncated, fsynced and closed, then the pending
//             directory is fsynced; checksums arrive from the serializer.
// committing: the write result goes to the coordinator, which commits.
// Saves queue here: one runs at a time.

#include <deque>

#include "actors/actors.hpp"
#include "actors/messages.hpp"
#include "ferry/checksum.hpp"
#include "ferry/kill_point.hpp"

namespace ferry {

namespace {

enum class Phase { idle, planning, opening, streaming, finishing, committing };

struct Current {
  uint64_t id = 0;
  SaveJob job;
  Phase phase = Phase::idle;
  std::string checkpoint_id;
  std::string pending_dir;
  LocalPlan local;
  RankPlan plan;
  std::vector<FileLayout> layouts;
  std::vector<std::vector<ChunkSource>> sources;  // [file][chunk], as laid out
  std::vector<std::shared_ptr<File>> files;
  std::vector<uint64_t> file_bytes_left;  // data not yet reported written
  size_t files_left = 0;                  // not yet finished (fsynced)
  bool have_sums = false;
  bool snapshot_done = false;
  ChecksumSet sums;
  double write_started_ms = -1;
};

struct planner_state {
  static inline const char* name = "ferry.planner";
  ContextPtr ctx;
  caf::actor coordinator;
  caf::actor snapshot;
  caf::actor serializer;
  std::vector<caf::actor> writers;
  std::deque<SaveJob> queue;
  uint64_t next_id = 1;
  Current cur;
};

using planner_ptr = caf::stateful_actor<planner_state>*;

void start_next(planner_ptr self);

// Every rank calls save_async the same number of times (saves are
// collective), so (salt, step, sequence) names one checkpoint on all ranks.
std::string checkpoint_id(uint64_t salt, uint64_t step, uint64_t seq) {
  const uint64_t parts[] = {salt, step, seq};
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx",
                static_cast<unsigned long long>(xxh3_64(parts, sizeof(parts))));
  return buf;
}

void end_save(planner_ptr self, const Status& status, const std::string& path) {
  auto& st = self->state;
  st.cur.job.state->finish(status, path);
  st.cur = Current{};
  start_next(self);
}

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::idle:
      return "idle";
    case Phase::planning:
      return "plan";
    case Phase::opening:
    case Phase::streaming:
    case Phase::finishing:
      return "write";
    case Phase::committing:
      return "commit";
  }
  return "?";
}

// Abandons the current save. `local` failures are named after this rank and
// reported to the coordinator; aborts that came from the coordinator are not
// sent back.
void fail(planner_ptr self, Status status, bool local = true) {
  auto& st = self->state;
  if (st.cur.phase == Phase::idle) return;
  const uint64_t id = st.cur.id;
  self->send(st.snapshot, atom::abort_v, id);
  self->send(st.serializer, atom::abort_v, id);
  if (local)
    status = status.with_context("rank " + std::to_string(st.ctx->rank) + " (" +
                                 phase_name(st.cur.phase) + " phase): ");
  if (local && !st.cur.checkpoint_id.empty())
    self->send(st.coordinator, atom::abort_v, st.cur.checkpoint_id, status);
  for (auto& f : st.cur.files) f->close();
  end_save(self, status, "");
}

void send_result(planner_ptr self) {
  auto& st = self->state;
  auto& cur = st.cur;
  cur.phase = Phase::committing;
  const double now = cur.job.state->ms_since_start();
  WriteResult wr;
  wr.rank = st.ctx->rank;
  for (size_t f = 0; f < cur.layouts.size(); ++f) {
    const FileLayout& l = cur.layouts[f];
    wr.files.push_back(
        {l.name, l.size, l.header.size(), xxh3_64(l.header.data(), l.header.size())});
    for (size_t c = 0; c < l.chunks.size(); ++c) {
      const LaidOutChunk& lc = l.chunks[c];
      wr.chunks.push_back({lc.chunk.key, lc.chunk.dtype, lc.chunk.global_shape, lc.chunk.box,
                           static_cast<uint32_t>(f), lc.offset, lc.length, lc.entry,
                           cur.sums.sums.empty() ? std::vector<uint64_t>{} : cur.sums.sums[f][c]});
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
  kill_point("writer.report");
  self->request(st.coordinator, caf::infinite, atom::commit_v,
                CommitRequest{st.ctx->job_id, cur.checkpoint_id, std::move(wr)})
      .then(
          [self, id, now](const CommitMsg& r) {
            auto& st = self->state;
            if (st.cur.id != id) return;
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
            end_save(self, Status(), r.path);
          },
          [self, id](caf::error& e) {
            if (self->state.cur.id == id)
              fail(self, Status::aborted("commit: " + self->system().render(e)));
          });
}

// Called whenever a piece of the finishing phase lands.
void maybe_finish(planner_ptr self) {
  auto& cur = self->state.cur;
  if (cur.phase != Phase::finishing || cur.files_left > 0 || !cur.have_sums) return;
  if (!self->state.ctx->opts.fsync || cur.layouts.empty()) {
    send_result(self);
    return;
  }
  // The files' directory entries must be durable before the coordinator
  // commits: a rename of an unsynced directory may lose them.
  const uint64_t id = cur.id;
  self->request(self->state.writers[0], caf::infinite, atom::syncdir_v, cur.pending_dir)
      .then([self, id](const Status& s) {
        if (self->state.cur.id != id) return;
        if (!s.ok()) return fail(self, s);
        send_result(self);
      });
}

void finish_file(planner_ptr self, uint32_t f) {
  auto& st = self->state;
  const uint64_t id = st.cur.id;
  const auto& w = st.writers[f % st.writers.size()];
  self->request(w, caf::infinite, atom::finish_v, st.cur.files[f], st.cur.layouts[f].size)
      .then([self, id](const Status& s) {
        auto& cur = self->state.cur;
        if (cur.id != id) return;
        if (!s.ok()) return fail(self, s);
        --cur.files_left;
        maybe_finish(self);
      });
}

void start_streaming(planner_ptr self) {
  auto& st = self->state;
  auto& cur = st.cur;
  cur.phase = Phase::streaming;
  StreamJob job;
  job.save = cur.id;
  job.files = cur.layouts;
  job.handles = cur.files;
  job.block_bytes = st.ctx->pool->block_bytes();
  job.checksum_block_bytes = st.ctx->opts.checksum ? st.ctx->opts.checksum_block_bytes : 0;
  job.sources = cur.sources;
  cur.file_bytes_left.clear();
  for (const auto& l : cur.layouts) cur.file_bytes_left.push_back(l.size);
  cur.files_left = cur.layouts.size();
  // The serializer must know the job before the first block reaches it; a
  // send enqueues at once, so sending to it first is enough.
  self->send(st.serializer, atom::snap_v, job);
  self->send(st.snapshot, atom::snap_v, std::move(job));
}

Status make_layouts(planner_state& st) {
  auto& cur = st.cur;
  const auto& entries = cur.job.sd.entries();
  std::vector<std::vector<ChunkRef>> refs(cur.plan.files);
  std::vector<std::vector<ChunkSource>> srcs(cur.plan.files);
  for (const ChunkAssignment& a : cur.plan.chunks) {
    if (a.item >= cur.local.items.size() || a.file >= cur.plan.files)
      return Status::internal("global plan refers to item " + std::to_string(a.item) + " / file " +
                              std::to_string(a.file) + " this rank does not have");
    const WriteItem& it = cur.local.items[a.item];
    const Box& box = chunk_box(a, it);
    refs[a.file].push_back({it.key, it.dtype, it.global_shape, box});
    // Splits are along dim 0, so a chunk is one contiguous byte range of the
    // item's row-major bytes.
    uint64_t offset = 0;
    if (!box.offsets.empty() && it.box.sizes[0] > 0)
      offset = static_cast<uint64_t>(box.offsets[0] - it.box.offsets[0]) *
               (it.nbytes / static_cast<uint64_t>(it.box.sizes[0]));
    srcs[a.file].push_back({entries[it.entry].view, offset});
  }
  cur.layouts.clear();
  cur.sources.clear();
  for (uint32_t f = 0; f < cur.plan.files; ++f) {
    if (refs[f].empty()) continue;  // a rank with nothing to write writes no file
    FERRY_ASSIGN_OR_RETURN(FileLayout l,
                           layout_file(data_file_name(st.ctx->rank, f), std::move(refs[f])));
    cur.layouts.push_back(std::move(l));
    cur.sources.push_back(std::move(srcs[f]));
  }
  return Status();
}

void on_plan(planner_ptr self, const PlanReply& r) {
  auto& st = self->state;
  auto& cur = st.cur;
  kill_point("plan.received");
  if (!r.status.ok()) {
    cur.checkpoint_id.clear();  // the coordinator created nothing
    return fail(self, r.status, false);
  }
  cur.plan = r.plan;
  cur.pending_dir = r.pending_dir;
  if (Status s = make_layouts(st); !s.ok()) return fail(self, s);
  uint64_t total = 0;
  for (const auto& l : cur.layouts) total += l.size;
  cur.job.state->bytes_total = total;
  cur.job.state->update_metrics([&](SaveMetrics& m) {
    m.plan_ms = cur.job.state->ms_since_start();
    m.bytes = total;
    m.files = cur.layouts.size();
  });
  if (cur.layouts.empty()) {
    cur.job.state->finish_snapshot(Status());
    cur.snapshot_done = true;
    cur.have_sums = true;
    cur.phase = Phase::finishing;
    return maybe_finish(self);
  }
  cur.phase = Phase::opening;
  std::vector<std::string> paths;
  for (const auto& l : cur.layouts) paths.push_back(join_path(cur.pending_dir, l.name));
  const uint64_t id = cur.id;
  self->request(st.writers[0], caf::infinite, atom::open_v, paths, st.ctx->opts.direct_io)
      .then([self, id](const FileSet& fs) {
        auto& cur = self->state.cur;
        if (cur.id != id) return;
        if (!fs.status.ok()) return fail(self, fs.status);
        cur.files = fs.files;
        start_streaming(self);
      });
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
  auto local = make_local_plan(cur.job.sd, st.ctx->rank);
  if (!local.ok()) return end_save(self, local.status(), "");
  cur.local = std::move(local).value();
  cur.checkpoint_id = checkpoint_id(st.ctx->run_salt, cur.job.step, cur.id);
  PlanRequest req{st.ctx->job_id, cur.checkpoint_id,      st.ctx->rank,          cur.job.step,
                  cur.job.root,   cur.job.opts.overwrite, cur.job.opts.metadata, cur.local};
  const uint64_t id = cur.id;
  self->request(st.coordinator, caf::infinite, atom::plan_v, std::move(req))
      .then(
          [self, id](const PlanReply& r) {
            if (self->state.cur.id == id) on_plan(self, r);
          },
          [self, id](caf::error& e) {
            if (self->state.cur.id == id)
              fail(self, Status::aborted("plan: " + self->system().render(e)));
          });
  kill_point("plan.sent");
}

caf::behavior planner_actor(planner_ptr self, ContextPtr ctx, caf::actor coordinator) {
  auto& st = self->state;
  st.ctx = ctx;
  st.coordinator = std::move(coordinator);
  caf::actor me = caf::actor_cast<caf::actor>(self);
  for (uint32_t i = 0; i < ctx->opts.writers; ++i)
    st.writers.push_back(spawn_writer(self, ctx, me));
  st.serializer = spawn_serializer(self, ctx, st.writers, me);
  st.snapshot = spawn_snapshot(self, ctx, st.serializer, me);
  caf::actor snap = st.snapshot;
  ctx->pool->set_release_hook([snap] { caf::anon_send(snap, atom::freed_v); });
  return {
      [self](atom::save, SaveJob& job) {
        self->state.queue.push_back(std::move(job));
        start_next(self);
      },
      [self](atom::snap, uint64_t id, const Status& s) {
        auto& cur = self->state.cur;
        if (cur.id != id) return;
        if (!s.ok()) return fail(self, s);
        cur.snapshot_done = true;
        cur.job.state->finish_snapshot(Status());
      },
      [self](atom::written, uint64_t id, uint32_t f, uint64_t bytes, const Status& s) {
        auto& cur = self->state.cur;
        if (cur.id != id || cur.phase != Phase::streaming) return;
        if (!s.ok()) return fail(self, s);
        if (cur.write_started_ms < 0) cur.write_started_ms = cur.job.state->ms_since_start();
        cur.job.state->bytes_persisted += bytes;
        cur.file_bytes_left[f] -= bytes;
        if (cur.file_bytes_left[f] == 0) {
          finish_file(self, f);
          bool all = true;
          for (uint64_t left : cur.file_bytes_left) all = all && left == 0;
          if (all) cur.phase = Phase::finishing;
        }
      },
      // The coordinator abandoned a checkpoint ("*": every one, rank 0 is gone).
      [self](atom::abort, const std::string& checkpoint_id, const Status& why) {
        auto& cur = self->state.cur;
        if (cur.phase == Phase::idle) return;
        if (checkpoint_id == "*" || checkpoint_id == cur.checkpoint_id) fail(self, why, false);
      },
      [self](atom::sums, ChecksumSet& sums) {
        auto& cur = self->state.cur;
        if (cur.id != sums.save) return;
        cur.sums = std::move(sums);
        cur.have_sums = true;
        maybe_finish(self);
      },
  };
}

}  // namespace

caf::actor spawn_planner(caf::actor_system& sys, ContextPtr ctx, caf::actor coordinator) {
  return sys.spawn(planner_actor, std::move(ctx), std::move(coordinator));
}

}  // namespace ferry
