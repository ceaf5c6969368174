// The loader actor: splits a load over the readers and answers it once; reads are load_reader's.
//
// The loader splits a load plan over the readers (load_reader.cpp) and
// gathers their outcomes (a reader that dies fails its part, it never hangs
// the load); it lands the bytes other ranks send this rank
// (load_share_receive.hpp, load_fetches.hpp) as they come.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "actors/load_fetches.hpp"
#include "actors/load_reader.hpp"
#include "actors/load_share_receive.hpp"
#include "actors/load_verify.hpp"
#include "actors/loader_actor.hpp"
#include "actors/messages.hpp"
#include "cpus.hpp"
#include "populate.hpp"

namespace ferry {

namespace {

// readers = auto (0): one reader where this process may run on at most 2
// CPUs, else 2. Each reader checks and copies what it reads; two of them
// keep both CPUs of a 2-CPU VM busy, and its virtual disk, which moves the
// data with CPU time of the same VM, then reads slower: a raw reader of
// 2 GiB beside one busy thread ran at 0.9-1.1x its speed alone, beside two
// at 0.6-0.7x, even at nice 19. One reader there: load / raw 0.895-0.922
// against 0.879-0.900 for two (the mean of 6-12 interleaved runs each, three
// sets), at 0.31 against 0.36 CPU-s per 2 GiB load.
uint32_t load_readers(uint32_t setting) {
  if (setting > 0) return setting;
  return usable_cpus() <= 2 ? 1 : 2;
}

// One load in flight: its promise and how many reader tasks are still out
// (the bytes other ranks send count as one more task).
struct LoadInFlight {
  caf::response_promise rp;
  size_t left = 0;
  Status first_error;
  // Ranks this rank reads shared bytes for: told once should its reads fail.
  std::vector<int32_t> receivers;
  std::string load_id;
  std::shared_ptr<Transport> transport;
  std::shared_ptr<UnverifiedTensors> unverified = std::make_shared<UnverifiedTensors>();
  std::shared_ptr<Fetches> fetches;  // load-sharing = job: what other hosts send
};

// A read task handed to a reader (or the share wait of a load) not yet answered.
struct ReaderTask {
  size_t reader = 0;  // kNoReader for the share wait
  std::shared_ptr<LoadInFlight> load;
};
constexpr size_t kNoReader = ~size_t{0};

using ReaderTasks = std::map<uint64_t, ReaderTask>;

// Tells the sender of shared bytes what this rank took (flow control), or,
// with an error, that it takes no more bytes of the load.
void send_ack(const RankContext& ctx, Transport& t, const std::string& load_id, int32_t sender,
              uint64_t bytes, const Status& status) {
  Status s =
      t.send(t.next_hop(sender),
             encode_message(ShareAckMsg{ctx.job_id, load_id, ctx.rank, sender, bytes, status}));
  // A sender that is gone needs no ack; its failure reaches the load anyway.
  if (!s.ok())
    log_printf(ctx.log, LogLevel::warning, "ferry[rank %d]: no ShareAck to rank %d: %s", ctx.rank,
               sender, s.to_string().c_str());
}

// Every load is answered exactly once, whatever dies: a reader's reply, its
// death and the loader's own end each finish a task at most once.
//
//   idle --load--> reading --every task answered, or its reader died--> idle
//
// Shared bytes: a load's share wait ends when every piece arrived, a sender
// reported its failure, a piece failed its checks, or no bytes came for
// write-timeout. Bytes that come before their load are kept until it does.
struct loader_state {
  static inline const char* name = "ferry.loader";
  ContextPtr ctx;
  std::vector<reader_actor> readers;
  uint64_t next_task = 0;
  // Shared with the functor that answers what is left when the loader ends.
  std::shared_ptr<ReaderTasks> tasks = std::make_shared<ReaderTasks>();
  std::map<std::string, ShareWait> shares;                  // by load id
  std::map<std::string, std::vector<BlockShareMsg>> early;  // by load id
  std::deque<std::string> ended;  // the last few share waits that ended: late bytes are dropped
  // load-sharing = job: by load id, what other hosts send this rank whole,
  // and the reader that waits for it (after the storage readers in `readers`).
  std::map<std::string, std::shared_ptr<Fetches>> fetches;
  size_t storage_readers = 0;
};

using loader_ptr = loader_actor::stateful_pointer<loader_state>;

// A load whose own reads failed tells the ranks waiting for its bytes, so
// they fail at once, naming it, instead of at their deadline.
void tell_receivers(const RankContext& ctx, LoadInFlight& load, const Status& why) {
  if (!load.transport) return;
  for (int32_t to : load.receivers)
    (void)load.transport->send(
        load.transport->next_hop(to),
        encode_message(BlockShareMsg{ctx.job_id, load.load_id, ctx.rank, to, 0, 0, why, ""}));
  load.receivers.clear();
}

void finish_task(const RankContext& ctx, ReaderTasks& tasks, uint64_t id, Status s) {
  auto it = tasks.find(id);
  if (it == tasks.end()) return;
  auto load = std::move(it->second.load);
  const bool reads = it->second.reader != kNoReader;
  tasks.erase(it);
  if (!s.ok() && reads) {
    tell_receivers(ctx, *load, s);
    // The load failed here: its other readers stop sending at once.
    if (!load->load_id.empty()) ctx.shares->close(load->load_id, s);
  }
  // A failed load waits for nothing more from other hosts.
  if (!s.ok() && load->fetches) load->fetches->end(ctx, load->load_id, s);
  if (!s.ok() && load->first_error.ok()) load->first_error = std::move(s);
  if (--load->left == 0) {
    if (load->fetches) load->fetches->end(ctx, load->load_id, load->first_error);
    if (!load->load_id.empty()) ctx.shares->close(load->load_id, load->first_error);
    load->rp.deliver(load->unverified->name_in(load->first_error));
  }
}

void end_share(loader_ptr self, const std::string& id, Status s) {
  auto& st = self->state;
  auto it = st.shares.find(id);
  if (it == st.shares.end()) return;
  const uint64_t task = it->second.task;
  // Senders that still owe bytes stop now, rather than wait for acks that
  // will not come.
  if (!s.ok() && it->second.transport)
    for (const auto& [from, n] : it->second.owed)
      if (n > 0) send_ack(*st.ctx, *it->second.transport, id, from, 0, s);
  st.shares.erase(it);
  st.ended.push_back(id);
  if (st.ended.size() > 8) st.ended.pop_front();
  finish_task(*st.ctx, *st.tasks, task, std::move(s));
}

// Why a load owed bytes by `from` fails once `from` failed (`why`).
Status waiting_for(const RankContext& ctx, int32_t from, const Status& why) {
  return why.with_context("rank " + std::to_string(ctx.rank) + " was waiting for bytes rank " +
                          std::to_string(from) + " reads for it: ");
}

// A frame (or a failure) from a reader of another host that sends this rank
// a piece whole: landed, and acknowledged as a node's shared bytes are.
void on_fetched(const RankContext& ctx, Fetches& f, const std::string& load_id,
                const BlockShareMsg& msg) {
  if (!msg.status.ok())
    return f.fail(msg.from, msg.status.with_context("rank " + std::to_string(msg.from) +
                                                    " (another host) failed to read bytes rank " +
                                                    std::to_string(ctx.rank) + " needs from it: "));
  Status s = f.land(msg);
  if (f.transport()) send_ack(ctx, *f.transport(), load_id, msg.from, s.ok() ? msg.length() : 0, s);
  if (!s.ok()) f.fail(msg.from, s);
}

void on_share(loader_ptr self, const BlockShareMsg& msg) {
  auto& st = self->state;
  if (msg.load_id == kAnyLoad)
    for (auto& [id, f] : st.fetches)
      f->fail(msg.from,
              msg.status.with_context("rank " + std::to_string(st.ctx->rank) +
                                      " was waiting for bytes rank " + std::to_string(msg.from) +
                                      " (another host) reads for its node: "));
  if (auto f = st.fetches.find(msg.load_id); f != st.fetches.end() && f->second->sends(msg.from))
    return on_fetched(*st.ctx, *f->second, msg.load_id, msg);
  if (msg.load_id == kAnyLoad) {
    // A rank failed: every load still owed bytes by it fails, naming it.
    std::vector<std::string> owing;
    for (const auto& [id, w] : st.shares)
      if (auto it = w.owed.find(msg.from); it != w.owed.end() && it->second > 0)
        owing.push_back(id);
    for (const auto& id : owing) end_share(self, id, waiting_for(*st.ctx, msg.from, msg.status));
    return;
  }
  auto it = st.shares.find(msg.load_id);
  if (it == st.shares.end()) {
    if (std::find(st.ended.begin(), st.ended.end(), msg.load_id) == st.ended.end())
      st.early[msg.load_id].push_back(msg);
    return;
  }
  ShareWait& w = it->second;
  st.ctx->fs->crash_point("load.receive");
  Status s = take_share(*st.ctx, w, msg);
  if (!s.ok()) return end_share(self, msg.load_id, std::move(s));
  if (w.transport) send_ack(*st.ctx, *w.transport, msg.load_id, msg.from, msg.length(), s);
  for (const auto& [from, n] : w.owed)
    if (n > 0) return;
  end_share(self, msg.load_id, Status());
}

void on_share_due(loader_ptr self, const std::string& id) {
  auto& st = self->state;
  auto it = st.shares.find(id);
  if (it == st.shares.end()) return;
  const auto limit = std::chrono::duration<double>(st.ctx->opts.write_timeout_s);
  const auto idle = std::chrono::steady_clock::now() - it->second.last;
  if (idle < limit) {
    self->delayed_send(loader_actor{self},
                       std::chrono::duration_cast<std::chrono::milliseconds>(limit - idle) +
                           std::chrono::milliseconds(1),
                       atom::share_due_v, id);
    return;
  }
  std::string ranks;
  for (const auto& [from, n] : it->second.owed)
    if (n > 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(from);
  end_share(self, id,
            Status::timeout("rank " + std::to_string(st.ctx->rank) + ": no bytes from rank(s) " +
                            ranks + ", which read shared bytes for it, within write-timeout (" +
                            std::to_string(st.ctx->opts.write_timeout_s) + " s)"));
}

// Starts waiting for the pieces other ranks read for this one.
void expect_shares(loader_ptr self, LoadJob& job, const std::shared_ptr<LoadInFlight>& load) {
  auto& st = self->state;
  ShareWait w;
  w.manifest = job.manifest;
  w.targets = job.targets;
  w.pieces = std::move(job.receive);
  w.transport = job.transport;
  w.ring = job.ring;
  w.unverified = load->unverified;
  std::sort(w.pieces.begin(), w.pieces.end(), [](const auto& a, const auto& b) {
    return std::tie(a.second.file, a.second.file_offset) <
           std::tie(b.second.file, b.second.file_offset);
  });
  for (size_t i = 0; i < w.pieces.size(); ++i) {
    const auto& [from, op] = w.pieces[i];
    const bool again = i > 0 && w.pieces[i - 1].second.file == op.file &&
                       w.pieces[i - 1].second.file_offset == op.file_offset;
    if (!again)
      w.owed[from] += shared_bytes(op, dtype_size(job.manifest->tensors[op.tensor].dtype));
  }
  w.last = std::chrono::steady_clock::now();
  w.task = st.next_task++;
  st.tasks->emplace(w.task, ReaderTask{kNoReader, load});
  ++load->left;
  st.shares.emplace(job.load_id, std::move(w));
  self->delayed_send(
      loader_actor{self},
      std::chrono::milliseconds(static_cast<int64_t>(st.ctx->opts.write_timeout_s * 1000) + 1),
      atom::share_due_v, job.load_id);
  // A sender that failed before this load began sends nothing more: the
  // link recorded its failure (fail_rank) before telling this loader, whose
  // report (kAnyLoad) ended only the waits that existed then. Without this
  // the wait would last write-timeout.
  for (const auto& [from, n] : st.shares.at(job.load_id).owed)
    if (auto why = n > 0 ? st.ctx->shares->failure(from) : std::nullopt) {
      st.early.clear();
      return end_share(self, job.load_id, waiting_for(*st.ctx, from, *why));
    }
  // Loads run one at a time per rank: what came early for another load is stale.
  auto early = std::move(st.early[job.load_id]);
  st.early.clear();
  for (const auto& msg : early) {
    if (!st.shares.count(job.load_id)) break;  // ended on an earlier frame
    on_share(self, msg);
  }
}

reader_actor spawn_reader(loader_ptr self);

// Starts waiting for the pieces readers of other hosts send this rank whole
// (load-sharing = job), on a reader of their own.
void fetch(loader_ptr self, const LoadJob& job, const std::shared_ptr<LoadInFlight>& load,
           std::vector<ReadOp> ops) {
  auto& st = self->state;
  for (auto it = st.fetches.begin(); it != st.fetches.end();)
    it = it->second->ended() ? st.fetches.erase(it) : std::next(it);
  auto f = std::make_shared<Fetches>(st.ctx->rank, job.transport);
  std::sort(ops.begin(), ops.end(), [](const ReadOp& a, const ReadOp& b) {
    return std::tie(a.file, a.file_offset) < std::tie(b.file, b.file_offset);
  });
  for (const ReadOp& op : ops) {
    f->add(op);
    // A sender that failed before this load began sends nothing (see expect_shares).
    if (auto why = st.ctx->shares->failure(op.fetch_from))
      f->fail(op.fetch_from, waiting_for(*st.ctx, op.fetch_from, *why));
  }
  load->fetches = f;
  st.fetches[job.load_id] = f;
  if (st.readers.size() == st.storage_readers) st.readers.push_back(spawn_reader(self));
  const size_t i = st.storage_readers;
  ReadTask task;
  task.dir = job.dir;
  task.manifest = job.manifest;
  task.targets = job.targets;
  task.load_id = job.load_id;
  task.transport = job.transport;
  task.peer_rings = job.peer_rings;
  task.unverified = load->unverified;
  task.clocks = job.clocks;
  task.fetches = f;
  task.ops = std::move(ops);
  const uint64_t id = st.next_task++;
  st.tasks->emplace(id, ReaderTask{i, load});
  ++load->left;
  self->request(st.readers[i], caf::infinite, atom::read_v, std::move(task))
      .then(
          [self, id](const Status& s) { finish_task(*self->state.ctx, *self->state.tasks, id, s); },
          [self, id, i](caf::error& e) {
            finish_task(
                *self->state.ctx, *self->state.tasks, id,
                Status::internal("reader " + std::to_string(i) + ": " + self->system().render(e)));
          });
  // Frames that came before this load began here (not for a node's share
  // wait, which takes its own in expect_shares).
  if (job.receive.empty()) {
    auto early = std::move(st.early[job.load_id]);
    st.early.clear();
    for (const auto& msg : early) on_share(self, msg);
  }
}

// The host tensors this load fills that were just allocated fault in huge
// pages (advise_huge_pages), before any read or copy touches them. At most
// kAdvisedTargets a load: each flagged range inside a larger mapping (a
// heap) may split it, and the process's count of mappings is bounded.
void advise_fresh_targets(const LoadJob& job) {
  constexpr size_t kAdvisedTargets = 4096;
  std::vector<bool> filled(job.targets->size());
  for (const ReadOp& op : job.ops)
    if (op.entry != ReadOp::kForOthers && op.entry < filled.size()) filled[op.entry] = true;
  for (const auto& [from, op] : job.receive)
    if (op.entry != ReadOp::kForOthers && op.entry < filled.size()) filled[op.entry] = true;
  size_t advised = 0;
  for (size_t i = 0; i < filled.size() && advised < kAdvisedTargets; ++i) {
    const TensorView& t = (*job.targets)[i];
    if (filled[i] && t.device.is_host() && t.is_contiguous() && t.data)
      advised += advise_huge_pages(t.data, t.nbytes()) ? 1 : 0;
  }
}

reader_actor spawn_reader(loader_ptr self) {
  // Linked: readers end with the loader. Detached: preads block.
  return self->spawn<caf::detached + caf::linked>(reader_fun, self->state.ctx);
}

// A reader that died (an exception in a copy, say) no longer touches the
// caller's tensors: its tasks fail, and a new reader takes its place.
bool on_reader_exit(loader_ptr self, const caf::exit_msg& msg) {
  auto& st = self->state;
  for (size_t i = 0; i < st.readers.size(); ++i) {
    if (st.readers[i].address() != msg.source) continue;
    const Status why = Status::internal("reader " + std::to_string(i) +
                                        " died: " + self->system().render(msg.reason));
    std::vector<uint64_t> lost;
    for (const auto& [id, t] : *st.tasks)
      if (t.reader == i) lost.push_back(id);
    for (uint64_t id : lost) finish_task(*st.ctx, *st.tasks, id, why);
    st.readers[i] = spawn_reader(self);
    return true;
  }
  return false;
}

loader_actor::behavior_type loader_fun(loader_ptr self, ContextPtr ctx) {
  self->state.ctx = ctx;
  const uint32_t readers = load_readers(ctx->opts.readers);
  for (uint32_t i = 0; i < readers; ++i) self->state.readers.push_back(spawn_reader(self));
  self->state.storage_readers = readers;
  self->set_exit_handler([self](caf::exit_msg& msg) {
    if (!on_reader_exit(self, msg)) self->quit(msg.reason);  // the runtime shuts down
  });
  self->attach_functor([ctx, tasks = self->state.tasks](const caf::error& reason) {
    const Status why = Status::internal("the loader stopped (" + caf::to_string(reason) + ")");
    // Readers waiting for room in a window end now, not at their timeout.
    ctx->shares->close_all(why);
    while (!tasks->empty()) finish_task(*ctx, *tasks, tasks->begin()->first, why);
  });
  return {
      [self](atom::load, LoadJob& job) -> caf::result<Status> {
        auto& st = self->state;
        // The targets may be memory freed and mapped again since a last load.
        forget_populated();
        advise_fresh_targets(job);
        // Each reader takes a contiguous stretch of the files, equal in bytes:
        // a few long sequential streams, and runs coalesce inside each.
        // Pieces another host sends whole go to a reader of their own, which
        // waits for them while the others read from storage.
        // Ops are moved as little as may be: a load of 50,000 tensors has as
        // many, each a few hundred bytes with boxes of their own.
        std::vector<ReadOp> ops = std::move(job.ops);
        auto from_others = std::stable_partition(
            ops.begin(), ops.end(), [](const ReadOp& op) { return op.fetch_from < 0; });
        std::vector<ReadOp> fetched(std::make_move_iterator(from_others),
                                    std::make_move_iterator(ops.end()));
        ops.erase(from_others, ops.end());
        std::vector<ReadTask> tasks(std::min<size_t>(st.storage_readers, ops.size()));
        if (tasks.empty() && fetched.empty() && job.receive.empty()) return Status();
        auto by_place = [](const ReadOp& a, const ReadOp& b) {
          return std::tie(a.file, a.file_offset) < std::tie(b.file, b.file_offset);
        };
        if (!std::is_sorted(ops.begin(), ops.end(), by_place))
          std::sort(ops.begin(), ops.end(), by_place);
        auto load = std::make_shared<LoadInFlight>();
        load->rp = self->make_response_promise();
        load->load_id = job.load_id;
        load->transport = job.transport;
        uint64_t total = 0;
        for (const auto& op : ops) {
          total += op.length;
          for (const ShareTo& to : op.share_with) load->receivers.push_back(to.rank);
        }
        for (const auto& op : fetched)
          for (const ShareTo& to : op.share_with) load->receivers.push_back(to.rank);
        // As a save's (planner.cpp): a sized-by-use pool takes in what this
        // rank reads, up to its cap.
        if (Status g = total ? st.ctx->pool->grow(total) : Status(); !g.ok())
          std::fprintf(stderr, "ferry: rank %d: the staging pool stays at %llu bytes: %s\n",
                       st.ctx->rank, static_cast<unsigned long long>(st.ctx->pool->bytes()),
                       g.message().c_str());
        std::sort(load->receivers.begin(), load->receivers.end());
        load->receivers.erase(std::unique(load->receivers.begin(), load->receivers.end()),
                              load->receivers.end());
        if (!load->receivers.empty())
          st.ctx->shares->open(st.ctx->rank, job.load_id, load->receivers);
        uint64_t seen = 0;
        if (tasks.size() == 1) {
          tasks[0].ops = std::move(ops);
        } else {
          for (auto& t : tasks) t.ops.reserve(ops.size() / tasks.size() + 1);
          for (auto& op : ops) {
            const size_t k =
                total ? std::min<size_t>(tasks.size() - 1, seen * tasks.size() / total) : 0;
            seen += op.length;
            tasks[k].ops.push_back(std::move(op));
          }
        }
        for (const auto& t : tasks) load->left += t.ops.empty() ? 0 : 1;
        for (size_t i = 0; i < tasks.size(); ++i) {
          if (tasks[i].ops.empty()) continue;
          tasks[i].dir = job.dir;
          tasks[i].manifest = job.manifest;
          tasks[i].targets = job.targets;
          tasks[i].load_id = job.load_id;
          tasks[i].transport = job.transport;
          tasks[i].peer_rings = job.peer_rings;
          tasks[i].unverified = load->unverified;
          tasks[i].clocks = job.clocks;
          const uint64_t id = st.next_task++;
          st.tasks->emplace(id, ReaderTask{i, load});
          self->request(st.readers[i], caf::infinite, atom::read_v, std::move(tasks[i]))
              .then(
                  [self, id](const Status& s) {
                    finish_task(*self->state.ctx, *self->state.tasks, id, s);
                  },
                  [self, id, i](caf::error& e) {
                    finish_task(*self->state.ctx, *self->state.tasks, id,
                                Status::internal("reader " + std::to_string(i) + ": " +
                                                 self->system().render(e)));
                  });
        }
        if (!fetched.empty()) fetch(self, job, load, std::move(fetched));
        if (!job.receive.empty()) expect_shares(self, job, load);
        return load->rp;
      },
      [self](atom::share, const BlockShareMsg& msg) { on_share(self, msg); },
      [self](atom::share_due, const std::string& id) { on_share_due(self, id); },
  };
}

}  // namespace

loader_actor spawn_loader(caf::actor_system& sys, ContextPtr ctx) {
  return sys.spawn(loader_fun, std::move(ctx));
}

}  // namespace ferry
