// The journal of the fault-injecting filesystem: a side file recording each
// event of the power-cut model (cut_model.hpp) as it happens, so that the cut
// can be applied by another process after the writer was SIGKILLed
// (FaultFilesystem::apply_power_cut_from_journal). The format is defined
// here only: the writer formats events with the journal_* functions and
// replay_journal reads them back. Internal to the drills library.
//
// The journal and the files it refers to are local files written with plain
// POSIX calls, never through a wrapped Filesystem: faults and the power cut
// must not touch them.
#pragma once

#include <cstdint>
#include <string>

#include "drills/cut_model.hpp"
#include "ferry/status.hpp"

namespace ferry::drills {

// One event a line, without its newline.
std::string journal_created(const std::string& path, bool is_dir);
std::string journal_opened(const std::string& path, bool truncated, uint64_t size);
std::string journal_synced(const std::string& path, uint64_t size);
std::string journal_truncated(const std::string& path, uint64_t size);
std::string journal_renamed(const std::string& from, const std::string& to, const Saved& saved);
std::string journal_dir_synced(const std::string& path);
std::string journal_removed(const std::string& path);
std::string journal_cut();  // a power cut was applied: what came before is settled

// Appends events to one journal file. Not thread-safe: the owner locks, so
// that the journal's order is the order in which the operations happened.
class Journal {
 public:
  bool enabled() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

  // Opens `path`, creating it with its header line; a journal left by an
  // earlier process is replayed into `model` and continued, since what that
  // process did not make durable is still at risk.
  Status open(const std::string& path, CutModel& model);

  // Appends one event with one write(2), so the line is whole or absent when
  // the process is killed (no fsync: the journal has to survive the process,
  // not the machine). A no-op when no journal is open.
  Status append(const std::string& event);

  // Keeps the bytes a rename replaced in a new side file next to the
  // journal, so that another process can put them back.
  Result<std::string> save_side_file(const std::string& bytes);

 private:
  std::string path_;
  uint64_t side_counter_ = 0;
};

// Feeds a whole journal to `model`. A last line without its newline is a
// write the writer did not finish (it died): ignored. `path` names the
// journal in errors.
Status replay_journal(CutModel& model, const std::string& text, const std::string& path);

// Applies the cut a journal describes to `fs`, then marks the journal so that
// replaying it again changes nothing.
Status apply_journal(Filesystem& fs, const std::string& journal_path);

// The local side files (journal and saved replaced files).
Result<std::string> read_local_file(const std::string& path);
Status append_local_line(const std::string& path, const std::string& line);

}  // namespace ferry::drills
