// A Filesystem that injects faults into any other one: errors (ENOSPC, EIO)
// at the n-th call of an operation or at a seeded rate, short writes, added
// latency, and a power cut that throws away what a real machine would lose
// (unsynced bytes, entries whose directory was never fsynced, renames whose
// parent directory was never fsynced). It journals what the power cut needs
// to a side file, so the cut can be applied by another process after the
// writer was SIGKILLed. Selected without recompiling through a spec string
// (FERRY_FAULTS).
//
// Part of the drills library (src/drills/, target ferry_drills), which ships
// in release builds because users run these drills: the wrapper is
// fault_fs.cpp, the power-cut model cut_model.*, its journal
// fault_journal.*, and the spec parser fault_spec.cpp.
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "drills/http_faults.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/status.hpp"

namespace ferry {

// The operation kinds faults are selected by. `sync` is File::sync and
// Filesystem::sync_dir; `mkdir` is mkdir and mkdirs (one call each, however
// many directories mkdirs makes); `write` is File::pwrite; `read` is
// File::pread. stat and list are never faulted: they are how a test looks.
enum class FaultOp : uint8_t {
  open,
  write,
  read,
  sync,
  rename,
  mkdir,
  unlink,
  rmdir,
  truncate,
  close,
};
constexpr size_t kFaultOpCount = 10;
const char* fault_op_name(FaultOp op);  // "open", "write", ... as in a spec

struct FaultRule {
  enum class Action : uint8_t {
    error,        // fail the call with `error`, doing nothing
    short_write,  // (write only) write a prefix of the buffer, then fail with `error`
    latency,      // sleep `latency` before every matching call (per `per_bytes` of it)
    // block the triggered call until release_stalls() (a hung NFS mount, a
    // disk that stopped answering); then the call goes on as if unfaulted
    stall,
  };
  Action action = Action::error;
  bool any_op = false;  // match every operation kind; `op` is ignored
  FaultOp op = FaultOp::write;
  int error = ENOSPC;  // errno of error and short_write
  // Trigger of error, short_write and stall: the nth matching call (counted per
  // rule, from 1), every call from the nth on when `sticky` (a disk that
  // stays full), or, when nth is 0, each matching call with probability
  // rate_num/rate_den drawn from a generator seeded with `seed`.
  uint64_t nth = 0;
  bool sticky = false;
  uint64_t rate_num = 0;
  uint64_t rate_den = 0;
  uint64_t seed = 1;
  // Only calls whose path contains this substring match (empty: all). A
  // trailing '$' anchors it at the end of the path ("/root$"). Paths are
  // compared after normalisation (absolute, no "//", "/./" or trailing '/');
  // a rename matches on either side.
  std::string path_contains;
  std::chrono::microseconds latency{0};
  // latency only: > 0 sleeps `latency` per this many bytes a read or write
  // moves, in proportion (a storage rate: latency:read:10ms:per=1048576 is
  // 100 MiB/s whatever the size of each read).
  uint64_t per_bytes = 0;

  std::string to_string() const;  // the spec form, e.g. "enospc:write:3:path=step-"
};

struct FaultOptions {
  std::vector<FaultRule> rules;
  // Side file of power-cut events; empty: none (power_cut() still works in
  // this process). An existing journal is read back and continued, so a
  // restarted process knows what its predecessor left undurable.
  std::string journal_path;
  // `http:` items: faults under the S3 store (http_faults.hpp), which the
  // runtime installs in its S3 client; filesystem_from_spec ignores them.
  std::vector<HttpFaultRule> http_rules;
};

// Parses a spec (see filesystem_from_spec). invalid_argument names the part
// that is wrong.
Result<FaultOptions> parse_fault_spec(const std::string& spec);

// Thread-safe: a File may be used from several threads, as with the POSIX
// one. Files keep the shared state alive, so they may outlive this object.
//
// The power-cut model (what a machine that loses power right now keeps):
// - A file's bytes are durable up to its length at the last successful
//   File::sync; a file never synced keeps nothing (length 0); a file that
//   existed before it was first opened through this wrapper is assumed
//   durable at the length it had then. O_TRUNC and File::truncate lower the
//   durable length at once (metadata changes are modelled as immediate).
// - A file or directory created through this wrapper survives only if its
//   parent directory was sync_dir'ed after the creation (fsync of the file
//   itself is not enough, as POSIX says; ext4 is kinder).
// - A rename survives only if the destination's parent, and the source's
//   parent when it differs, were both sync_dir'ed after it; otherwise it is
//   undone, and a regular file (or empty directory) that the rename replaced
//   is put back with the content it had just before the rename.
// - Directories are tracked by path: a rename of a directory carries the
//   state of everything under it, so "sync_dir(step)" after
//   "rename(pending, step)" counts for entries created in pending.
// Simplifications, all on the side of losing less than a real crash may:
// - Overwrites inside the durable length are kept, not rolled back (Ferry
//   never rewrites synced bytes), and a truncate is never undone.
// - unlink and rmdir are durable at once: a deleted file never comes back.
// - Replaced files larger than 64 MiB are not saved, so such a rename, when
//   undone, leaves the destination missing.
// - Only operations made through this wrapper (or recorded in its journal)
//   are known; hard links, symlinks and ".." in paths are not modelled.
// - With a journal, events are appended after the operation succeeded, with
//   one write(2) each (no fsync: the journal has to survive the process, not
//   the machine). A SIGKILL between an operation and its line loses that one
//   event: a create or rename then survives the cut, a sync counts as not
//   done (the caller never saw it return).
class FaultFilesystem : public FilesystemWrapper {
 public:
  // No faults and no journal until rules are added; power_cut() works.
  explicit FaultFilesystem(std::shared_ptr<Filesystem> target);
  ~FaultFilesystem() override;

  // Opens (or continues) the journal when options name one.
  static Result<std::shared_ptr<FaultFilesystem>> create(std::shared_ptr<Filesystem> target,
                                                         FaultOptions options);

  void add_rule(const FaultRule& rule);
  void clear_rules();
  // Calls seen of one kind, faulted or not, faults injected so far, and
  // calls a latency rule slowed down (a count, so tests need no upper bound
  // on wall time, which a loaded machine cannot keep).
  uint64_t calls(FaultOp op) const;
  uint64_t injected() const;
  uint64_t delayed() const;
  // Calls blocked by a stall rule right now, and ever.
  uint64_t stalled_now() const;
  uint64_t stalled_total() const;
  // Waits up to `timeout` until at least `n` calls were ever stalled; false
  // if fewer were. Lets a test act while a call hangs, without sleeping.
  bool wait_stalled(uint64_t n, std::chrono::milliseconds timeout) const;
  // Lets every stalled call go on, and turns stall rules off for good (a
  // later match passes at once). The destructor releases them too.
  void release_stalls();

  Result<std::unique_ptr<File>> open(const std::string& path, const OpenOptions& o) override;
  Status mkdir(const std::string& path) override;
  Status mkdirs(const std::string& path) override;
  Status rename(const std::string& from, const std::string& to) override;
  // Faulted as a rename; a power cut before its directory sync undoes it.
  Status rename_noreplace(const std::string& from, const std::string& to) override;
  Status unlink(const std::string& path) override;
  Status rmdir(const std::string& path) override;
  Status sync_dir(const std::string& path) override;

  // Applies the power-cut model to the target filesystem: undoes undurable
  // renames and creations, newest first, then truncates every tracked file
  // to its durable length; then forgets it all (what is left is durable) and
  // marks the journal so that replaying it again changes nothing. Faults are
  // not injected into the cut itself. Returns the first error that is not
  // not_found (something already gone is fine) after trying everything.
  // REQUIRES: no other thread is using this filesystem; files open at the
  // cut are not used afterwards (their process "died").
  Status power_cut();

  // The same cut, from the journal a FaultFilesystem wrote (possibly in a
  // process that was SIGKILLed), applied to `fs`.
  static Status apply_power_cut_from_journal(Filesystem& fs, const std::string& journal_path);

  struct Impl;  // shared with the files it opens

 private:
  std::shared_ptr<Impl> impl_;
};

// Wraps `base` as a spec says; an empty spec returns `base` itself.
//   spec   := item (',' item)*
//   item   := 'journal=' PATH      journal of power-cut events
//           | 'path=' SUBSTR       default path filter of every fault
//           | 'seed=' N            default seed of every rate fault
//           | 'http:' ...          an S3 request fault (http_faults.hpp)
//           | fault
//   fault  := action ':' op [':' trigger] (':' option)*
//   action := enospc | eio | short | latency | stall
//   op     := open|write|read|sync|rename|mkdir|unlink|rmdir|truncate|close|any
//   trigger:= N | N+ | rate=A/B    for enospc, eio, short, stall (short: write only)
//           | DURATION             for latency: 250us, 5ms, 1s
//   option := rate=A/B | seed=N | path=SUBSTR
//           | per=BYTES            latency per BYTES a read or write moves
// Examples: "enospc:write:3", "eio:sync:1", "enospc:write:rate=1/128:seed=7",
// "short:write:2", "latency:write:5ms", "enospc:write:1+:path=step-,journal=/j",
// "stall:write:1" (the first pwrite never returns in a process that cannot
// call release_stalls()), "http:503:part:1-2" (the first two attempts of
// multipart parts answer 503 SlowDown), "http:500:put:1+:key=MANIFEST".
// Values cannot contain ',' (nor ':' inside a fault).
Result<std::shared_ptr<Filesystem>> filesystem_from_spec(std::shared_ptr<Filesystem> base,
                                                         const std::string& spec);

// filesystem_from_spec with the value of the environment variable `var`;
// `base` itself when the variable is unset or empty.
Result<std::shared_ptr<Filesystem>> filesystem_from_env(std::shared_ptr<Filesystem> base,
                                                        const char* var = "FERRY_FAULTS");

}  // namespace ferry
