// The power-cut model of the fault-injecting filesystem: which namespace
// changes and which bytes a machine that loses power now would keep. It is a
// function of the event sequence alone, so the live FaultFilesystem and a
// replay of its journal (fault_journal.hpp) build the same state by calling
// the same methods. Internal to the drills library.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ferry/filesystem.hpp"
#include "ferry/status.hpp"

namespace ferry::drills {

// The model compares paths as strings, so every spelling of one path must
// become the same string: absolute (a journal is replayed by another process,
// maybe in another directory), no empty or "." components. ".." is kept as
// written: resolving it lexically is wrong through symlinks.
std::string normalize_path(const std::string& p);

// A file written through the wrapper, followed across renames.
struct Node {
  std::string path;      // where it is now (normalised)
  uint64_t size = 0;     // its length as the live process knows it (unused in replay)
  uint64_t synced = 0;   // durable length
  bool removed = false;  // unlinked or replaced: no longer in the model
};

// What a rename replaced, to put back when the rename is undone.
struct Saved {
  enum class Kind : uint8_t { none, file, dir };
  Kind kind = Kind::none;
  std::shared_ptr<const std::string> data;  // in memory (live process)
  std::string side_file;                    // or in a journal side file
};

// A namespace change that a power cut would lose, and the directories
// whose sync_dir would make it durable.
struct PendingOp {
  enum class Kind : uint8_t { create, rename };
  Kind kind = Kind::create;
  bool is_dir = false;  // create: a directory
  std::string path;     // create: the new entry; rename: the source
  std::string to;       // rename: the destination
  std::vector<std::string> needs;
  Saved saved;
};

// Not thread-safe: the owner locks.
class CutModel {
 public:
  // The bytes a rename replaced: kept in memory by the live process, read
  // from a side file when a journal is replayed.
  using Loader = std::function<Result<std::string>(const Saved&)>;

  std::shared_ptr<Node> find(const std::string& path) const;

  std::shared_ptr<Node> created(const std::string& path, bool is_dir);

  // A write-open of a file that existed: what it held then counts as durable,
  // unless the open truncated it.
  std::shared_ptr<Node> opened(const std::string& path, bool truncated, uint64_t size);

  void synced(const std::string& path, uint64_t size);

  void truncated(const std::string& path, uint64_t size);

  void renamed(const std::string& from, const std::string& to, Saved saved);

  // Returns the ops this made durable (their saved files are not needed).
  std::vector<PendingOp> dir_synced(const std::string& dir);

  // unlink and rmdir are taken as durable at once (see the header): what
  // was at `path` leaves the model, and so do the pending ops that would
  // have to undo something there.
  std::vector<PendingOp> removed(const std::string& path);

  std::vector<std::string> side_files() const;

  void reset();

  // Undoes the pending namespace ops newest first, then truncates files.
  // Newest first because each op's paths are those of the state right after
  // it: walking back one op at a time, each undo finds its paths where it
  // recorded them (an undone rename moves the paths of older ops back with
  // it). Renames and creations are interleaved in that one walk rather than
  // all renames first: a file created and then renamed must be renamed back
  // before its creation can be undone at its first name. Truncation comes
  // last, when every surviving file is at its final path.
  Status cut(Filesystem& fs, const Loader& load);

 private:
  std::shared_ptr<Node> track(const std::string& path, uint64_t size, uint64_t synced);

  std::vector<std::string> keys_under(const std::string& dir) const;

  void drop_nodes_under(const std::string& path);

  // Carries the files under `from` and the paths of the first `ops` pending
  // ops along with a rename.
  void move(const std::string& from, const std::string& to, size_t ops);

  std::map<std::string, std::shared_ptr<Node>> nodes_;
  std::vector<PendingOp> pending_;  // oldest first
};

}  // namespace ferry::drills
