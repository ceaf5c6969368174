// Loader and readers. The loader splits a load plan over the readers and
// gathers their outcomes (a reader that dies fails its part, it never hangs
// the load); readers do the blocking preads on their own
// threads, verify each checksum block they read and copy the requested bytes
// into the caller's tensors through the device.

#include <future>
#include <map>

#include "actors/loader_actor.hpp"
#include "actors/messages.hpp"
#include "ferry/checksum.hpp"

namespace ferry {

namespace {

struct reader_state {
  static inline const char* name = "ferry.reader";
  ContextPtr ctx;
};

// Verifies the checksum blocks of one read; the error names tensor and file.
Status verify(const Manifest& m, const ReadOp& op, const std::string& path, const uint8_t* buf) {
  const ManifestChunk& c = m.tensors[op.tensor].chunks[op.chunk];
  if (c.checksums.empty()) return Status();
  const uint64_t cb = m.checksum_block_bytes;
  for (uint32_t i = 0; i < op.nblocks; ++i) {
    const uint64_t begin = static_cast<uint64_t>(i) * cb;
    const uint64_t n = std::min<uint64_t>(cb, op.length - begin);
    const uint32_t block = op.first_block + i;
    if (block >= c.checksums.size() || xxh3_64(buf + begin, n) != c.checksums[block])
      return Status::corruption("checksum mismatch in tensor '" + m.tensors[op.tensor].key +
                                "' (chunk " + c.entry + ", block " + std::to_string(block) +
                                ") of file " + path);
  }
  return Status();
}

// The header is not covered by the chunk checksums; its own checksum makes
// the data file as trustworthy as the chunks read from it.
Status verify_header(File& f, const ManifestFile& mf, const std::string& path,
                     std::vector<uint8_t>& buf) {
  if (mf.header_bytes == 0) return Status();
  buf.resize(mf.header_bytes);
  FERRY_ASSIGN_OR_RETURN(size_t got, f.pread(buf.data(), buf.size(), 0));
  if (got != buf.size() || xxh3_64(buf.data(), buf.size()) != mf.header_checksum)
    return Status::corruption("safetensors header of file " + path +
                              " does not match its checksum in the manifest");
  return Status();
}

Status run_reads(reader_state& st, const ReadTask& task) {
  const Manifest& m = *task.manifest;
  std::map<uint32_t, std::unique_ptr<File>> open_files;
  std::vector<uint8_t> buf;
  for (const ReadOp& op : task.ops) {
    const std::string path = join_path(task.dir, m.files[op.file].name);
    auto& f = open_files[op.file];
    if (!f) {
      auto r = st.ctx->fs->open(path, OpenOptions{});
      if (!r.ok()) return r.status();
      f = std::move(r).value();
      FERRY_RETURN_IF_ERROR(verify_header(*f, m.files[op.file], path, buf));
    }
    buf.resize(op.length);
    FERRY_ASSIGN_OR_RETURN(size_t got, f->pread(buf.data(), op.length, op.file_offset));
    if (got != op.length)
      return Status::corruption("file " + path + " is truncated: tensor '" +
                                m.tensors[op.tensor].key + "' needs bytes up to " +
                                std::to_string(op.file_offset + op.length));
    FERRY_RETURN_IF_ERROR(verify(m, op, path, buf.data()));
    const TensorView& target = task.targets[op.entry];
    const size_t elem = dtype_size(target.dtype);
    Status copy_status;
    for_each_copy(op, elem, [&](uint64_t src, uint64_t dst, uint64_t n) {
      if (!copy_status.ok()) return;
      // The buffer is reused by the next read: wait for the copy to land.
      std::promise<Status> done;
      auto fut = done.get_future();
      st.ctx->device->copy_in(buf.data() + src, target, dst, n,
                              [&done](Status s) { done.set_value(std::move(s)); });
      copy_status = fut.get();
    });
    FERRY_RETURN_IF_ERROR(copy_status);
  }
  return Status();
}

reader_actor::behavior_type reader_fun(reader_actor::stateful_pointer<reader_state> self,
                                       ContextPtr ctx) {
  self->state.ctx = std::move(ctx);
  return {
      [self](atom::read, const ReadTask& task) -> Status { return run_reads(self->state, task); },
  };
}

// One load in flight: its promise and how many reader tasks are still out.
struct LoadInFlight {
  caf::response_promise rp;
  size_t left = 0;
  Status first_error;
};

// A read task handed to a reader and not yet answered.
struct ReaderTask {
  size_t reader = 0;
  std::shared_ptr<LoadInFlight> load;
};

using ReaderTasks = std::map<uint64_t, ReaderTask>;

// Every load is answered exactly once, whatever dies: a reader's reply, its
// death and the loader's own end each finish a task at most once.
//
//   idle --load--> reading --every task answered, or its reader died--> idle
struct loader_state {
  static inline const char* name = "ferry.loader";
  ContextPtr ctx;
  std::vector<reader_actor> readers;
  uint64_t next_task = 0;
  // Shared with the functor that answers what is left when the loader ends.
  std::shared_ptr<ReaderTasks> tasks = std::make_shared<ReaderTasks>();
};

using loader_ptr = loader_actor::stateful_pointer<loader_state>;

void finish_task(ReaderTasks& tasks, uint64_t id, Status s) {
  auto it = tasks.find(id);
  if (it == tasks.end()) return;
  auto load = std::move(it->second.load);
  tasks.erase(it);
  if (!s.ok() && load->first_error.ok()) load->first_error = std::move(s);
  if (--load->left == 0) load->rp.deliver(load->first_error);
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
    for (uint64_t id : lost) finish_task(*st.tasks, id, why);
    st.readers[i] = spawn_reader(self);
    return true;
  }
  return false;
}

loader_actor::behavior_type loader_fun(loader_ptr self, ContextPtr ctx) {
  self->state.ctx = ctx;
  for (uint32_t i = 0; i < ctx->opts.readers; ++i)
    self->state.readers.push_back(spawn_reader(self));
  self->set_exit_handler([self](caf::exit_msg& msg) {
    if (!on_reader_exit(self, msg)) self->quit(msg.reason);  // the runtime shuts down
  });
  self->attach_functor([tasks = self->state.tasks](const caf::error& reason) {
    const Status why = Status::internal("the loader stopped (" + caf::to_string(reason) + ")");
    while (!tasks->empty()) finish_task(*tasks, tasks->begin()->first, why);
  });
  return {
      [self](atom::load, const LoadJob& job) -> caf::result<Status> {
        auto& st = self->state;
        // Contiguous runs of the plan per reader keep each reader on few files.
        std::vector<ReadTask> tasks(std::min<size_t>(st.readers.size(), job.ops.size()));
        if (tasks.empty()) return Status();
        const size_t per = (job.ops.size() + tasks.size() - 1) / tasks.size();
        for (size_t i = 0; i < job.ops.size(); ++i) tasks[i / per].ops.push_back(job.ops[i]);
        auto load = std::make_shared<LoadInFlight>();
        load->rp = self->make_response_promise();
        for (const auto& t : tasks) load->left += t.ops.empty() ? 0 : 1;
        for (size_t i = 0; i < tasks.size(); ++i) {
          if (tasks[i].ops.empty()) continue;
          tasks[i].dir = job.dir;
          tasks[i].manifest = job.manifest;
          tasks[i].targets = job.targets;
          const uint64_t id = st.next_task++;
          st.tasks->emplace(id, ReaderTask{i, load});
          self->request(st.readers[i], caf::infinite, atom::read_v, std::move(tasks[i]))
              .then([self, id](const Status& s) { finish_task(*self->state.tasks, id, s); },
                    [self, id, i](caf::error& e) {
                      finish_task(*self->state.tasks, id,
                                  Status::internal("reader " + std::to_string(i) + ": " +
                                                   self->system().render(e)));
                    });
        }
        return load->rp;
      },
  };
}

}  // namespace

loader_actor spawn_loader(caf::actor_system& sys, ContextPtr ctx) {
  return sys.spawn(loader_fun, std::move(ctx));
}

}  // namespace ferry
