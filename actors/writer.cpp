// Writer: blocking file I/O on its own thread (a detached actor), so the
// scheduler's threads never wait on the disk. It returns each block's lease
// as soon as its pwrite is done and fsyncs once per file, at the end.
//
// The writers own the descriptors of a save: a file is opened, truncated,
// fsynced and closed here only. A file's blocks are spread over all writers,
// so after a failure the planner first has every writer drain its mailbox
// (`drain`), then has one of them close the files (`close`): no descriptor
// is closed while another writer may still be inside a call on it.
//
//   (stateless) write | open | seal | syncdir | drain | close | custom, one at a time

#include "actors/messages.hpp"
#include "actors/writer_actor.hpp"
#include "checkpoint_fn.hpp"
#include "drills/kill_point.hpp"

namespace ferry {

namespace {

struct writer_state {
  static inline const char* name = "ferry.writer";
  ContextPtr ctx;
  planner_actor planner;
};

writer_actor::behavior_type writer_fun(writer_actor::stateful_pointer<writer_state> self,
                                       ContextPtr ctx, planner_actor planner) {
  self->state.ctx = std::move(ctx);
  self->state.planner = std::move(planner);
  return {
      [self](atom::write, const WriteBlock& w) {
        auto& st = self->state;
        Status status;
        auto data = st.ctx->pool->data(w.block.lease);
        if (!data.ok()) {
          status = data.status();
        } else {
          status = w.file->pwrite(*data, w.write_len, w.block.offset);
          if (status.ok()) kill_point("writer.write");
        }
        // Returning the block first lets the snapshot refill it while the
        // planner handles the report (or the serializer hash it, when it
        // deferred that to keep the snapshot's core free).
        if (w.return_to)
          self->send(w.return_to, atom::back_v, w.block);
        else
          st.ctx->pool->release(w.block.lease);
        self->send(st.planner, atom::written_v, w.block.save, w.block.file, w.block.len, status);
      },
      [self](atom::open, const std::vector<std::string>& paths, bool direct) -> FileSet {
        FileSet out;
        OpenOptions o;
        o.write = o.create = o.exclusive = true;
        o.direct = direct;
        for (const auto& p : paths) {
          auto f = self->state.ctx->fs->open(p, o);
          if (!f.ok()) {
            out.status = f.status();
            out.files.clear();
            return out;
          }
          out.files.emplace_back(std::move(f).value());
          kill_point("writer.open");
        }
        return out;
      },
      // Cuts the O_DIRECT padding, makes the file durable and closes it.
      [self](atom::seal, const std::shared_ptr<File>& f, uint64_t size) -> Status {
        FERRY_RETURN_IF_ERROR(f->truncate(size));
        if (self->state.ctx->opts.fsync) {
          FERRY_RETURN_IF_ERROR(f->sync());
          kill_point("writer.fsync");
        }
        FERRY_RETURN_IF_ERROR(f->close());
        kill_point("writer.close");
        return Status();
      },
      // A barrier: answered after every block queued here before it.
      [](atom::drain) { return true; },
      // The end of a failed save (after every writer drained): its errors
      // are moot, the save already has one.
      [](atom::close, const std::vector<std::shared_ptr<File>>& files) {
        for (const auto& f : files) (void)f->close();
        return true;
      },
      // Blocking like every other call here: the function writes the file.
      [self](atom::custom, const CustomWrite& w) -> CustomWritten {
        CustomWritten out;
        out.status = run_checkpoint_fn(w.fn, w.planned, w.path);
        if (!out.status.ok()) return out;
        auto l = adopt_written_file(*self->state.ctx->fs, w.path, w.layout, w.checksum_block_bytes,
                                    &out.sums, w.fsync);
        if (l.ok())
          out.layout = std::move(l).value();
        else
          out.status = l.status();
        return out;
      },
      [self](atom::syncdir, const std::string& dir) -> Status {
        FERRY_RETURN_IF_ERROR(self->state.ctx->fs->sync_dir(dir));
        kill_point("dir.fsync");
        return Status();
      },
  };
}

}  // namespace

writer_actor spawn_writer(caf::local_actor* parent, ContextPtr ctx, planner_actor planner) {
  return parent->spawn<caf::detached + caf::linked>(writer_fun, std::move(ctx), std::move(planner));
}

}  // namespace ferry
