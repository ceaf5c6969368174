// Writer: blocking file I/O on its own thread (a detached actor), so the
// scheduler's threads never wait on the disk. It returns each block's lease
// as soon as its pwrite is done and fsyncs once per file, at the end. The
// I/O itself is a StorageWriter's (src/storage_writer.hpp): Ferry's own
// files (PosixStorageWriter), or the caller's checkpoint_fn.
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
#include "storage_writer.hpp"

namespace ferry {

namespace {

struct writer_state {
  static inline const char* name = "ferry.writer";
  ContextPtr ctx;
  planner_actor planner;
  std::unique_ptr<PosixStorageWriter> storage;
};

writer_actor::behavior_type writer_fun(writer_actor::stateful_pointer<writer_state> self,
                                       ContextPtr ctx, planner_actor planner) {
  self->state.storage =
      std::make_unique<PosixStorageWriter>(ctx->fs, ctx->opts.direct_io, ctx->opts.fsync);
  self->state.ctx = std::move(ctx);
  self->state.planner = std::move(planner);
  return {
      [self](atom::write, const WriteBlock& w) {
        auto& st = self->state;
        Status status;
        auto data = st.ctx->pool->data(w.block.lease);
        if (!data.ok())
          status = data.status();
        else
          status = st.storage->write(*w.file, *data, w.write_len, w.block.offset);
        // Returning the block first lets the snapshot refill it while the
        // planner handles the report (or the serializer hash it, when it
        // deferred that to keep the snapshot's core free).
        if (w.return_to)
          self->send(w.return_to, atom::back_v, w.block);
        else
          st.ctx->pool->release(w.block.lease);
        self->send(st.planner, atom::written_v, w.block.save, w.block.file, w.block.len, status);
      },
      [self](atom::open, const std::vector<std::string>& paths) -> FileSet {
        FileSet out;
        auto files = self->state.storage->open_checkpoint(paths);
        if (files.ok())
          out.files = std::move(files).value();
        else
          out.status = files.status();
        return out;
      },
      [self](atom::seal, const std::shared_ptr<File>& f, uint64_t size) -> Status {
        return self->state.storage->finish_file(0, f.get(), size);
      },
      // A barrier: answered after every block queued here before it.
      [](atom::drain) { return true; },
      // The end of a failed save (after every writer drained): its errors
      // are moot, the save already has one.
      [self](atom::close, const std::vector<std::shared_ptr<File>>& files) {
        self->state.storage->abort(files);
        return true;
      },
      [self](atom::syncdir, const std::string& dir) -> Status {
        return self->state.storage->commit(dir);
      },
      // Blocking like every other call here: the function writes the files.
      [](atom::custom, const CustomWrite& w) -> CustomWritten {
        CustomWritten out;
        auto& s = *w.storage;
        auto opened = s.open_checkpoint(w.paths);
        out.status = opened.status();
        for (size_t f = 0; out.status.ok() && f < w.paths.size(); ++f) {
          out.status = s.finish_file(f, nullptr, 0);
          if (out.status.ok()) {
            out.layouts.push_back(s.written_layout(f));
            out.sums.push_back(s.written_sums(f));
          }
        }
        if (out.status.ok()) out.status = s.commit(w.pending_dir);
        if (!out.status.ok()) s.abort({});
        return out;
      },
  };
}

}  // namespace

writer_actor spawn_writer(caf::local_actor* parent, ContextPtr ctx, planner_actor planner) {
  return parent->spawn<caf::detached + caf::linked>(writer_fun, std::move(ctx), std::move(planner));
}

}  // namespace ferry
