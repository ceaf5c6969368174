#include "drills/fault_journal.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

#include "drills/fields.hpp"

namespace ferry::drills {
namespace {

constexpr char kJournalHeader[] = "ferry-fault-journal 1";

// Journal fields are separated by spaces, one event a line, so paths are
// percent-encoded where they hold a space, a control byte or '%'.
std::string encode_field(const std::string& s) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    if (c <= 0x20 || c == '%' || c == 0x7f) {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

bool decode_field(const std::string& s, std::string* out) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  out->clear();
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      *out += s[i];
      continue;
    }
    if (i + 2 >= s.size()) return false;
    int hi = hex(s[i + 1]), lo = hex(s[i + 2]);
    if (hi < 0 || lo < 0) return false;
    *out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return true;
}

}  // namespace

Result<std::string> read_local_file(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Status::from_errno(errno, "open", path);
  std::string out;
  char buf[65536];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return Status::from_errno(err, "read", path);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

namespace {

Status write_all(int fd, const std::string& bytes, const std::string& path) {
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::from_errno(errno, "write", path);
    }
    if (n == 0) return Status::from_errno(ENOSPC, "write", path);
    p += n;
    left -= static_cast<size_t>(n);
  }
  return Status::ok_status();
}

Status write_local_file(const std::string& path, const std::string& bytes) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Status::from_errno(errno, "open", path);
  Status st = write_all(fd, bytes, path);
  if (::close(fd) != 0 && st.ok()) st = Status::from_errno(errno, "close", path);
  return st;
}

}  // namespace

Status append_local_line(const std::string& path, const std::string& line) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Status::from_errno(errno, "open", path);
  Status st = write_all(fd, line, path);
  ::close(fd);
  return st;
}

namespace {

// Feeds one journal line to the model. False if it is not a valid event.
bool replay_line(CutModel& model, const std::string& line) {
  std::vector<std::string> f = split(line, ' ');
  std::string a, b;
  uint64_t n = 0, t = 0;
  if (f[0] == "C" && f.size() == 3 && (f[1] == "f" || f[1] == "d") && decode_field(f[2], &a)) {
    model.created(a, f[1] == "d");
  } else if (f[0] == "O" && f.size() == 4 && parse_u64(f[1], &t) && parse_u64(f[2], &n) &&
             decode_field(f[3], &a)) {
    model.opened(a, t != 0, n);
  } else if (f[0] == "S" && f.size() == 3 && parse_u64(f[1], &n) && decode_field(f[2], &a)) {
    model.synced(a, n);
  } else if (f[0] == "T" && f.size() == 3 && parse_u64(f[1], &n) && decode_field(f[2], &a)) {
    model.truncated(a, n);
  } else if (f[0] == "R" && f.size() == 4 && decode_field(f[2], &a) && decode_field(f[3], &b)) {
    Saved saved;
    if (f[1] == "d") {
      saved.kind = Saved::Kind::dir;
    } else if (f[1].compare(0, 2, "f:") == 0) {
      saved.kind = Saved::Kind::file;
      if (!decode_field(f[1].substr(2), &saved.side_file)) return false;
    } else if (f[1] != "-") {
      return false;
    }
    model.renamed(a, b, std::move(saved));
  } else if (f[0] == "D" && f.size() == 2 && decode_field(f[1], &a)) {
    model.dir_synced(a);
  } else if (f[0] == "U" && f.size() == 2 && decode_field(f[1], &a)) {
    model.removed(a);
  } else if (f[0] == "X" && f.size() == 1) {
    model.reset();
  } else {
    return false;
  }
  return true;
}

}  // namespace

Status replay_journal(CutModel& model, const std::string& text, const std::string& path) {
  std::vector<std::string> lines = split(text, '\n');
  lines.pop_back();  // after the last '\n': empty or torn
  if (lines.empty() || lines[0] != kJournalHeader)
    return Status::corruption("fault journal " + path + ": does not start with '" + kJournalHeader +
                              "'");
  for (size_t i = 1; i < lines.size(); ++i) {
    // Every rank of a job may share one journal: each process that found it
    // empty wrote the header, so a repeated header is not an event.
    if (lines[i] == kJournalHeader) continue;
    if (!replay_line(model, lines[i]))
      return Status::corruption("fault journal " + path + " line " + std::to_string(i + 1) +
                                ": bad event '" + lines[i] + "'");
  }
  return Status::ok_status();
}

// The journal: a header line, then one event a line, fields separated by
// spaces, paths normalised and percent-encoded, each written after the
// operation succeeded:
//   C f|d PATH         created a file / a directory
//   O 0|1 SIZE PATH    opened an existing file for writing (1: truncated)
//   S SIZE PATH        File::sync made SIZE bytes durable
//   T SIZE PATH        File::truncate
//   R SAVED FROM TO    rename; SAVED is '-', 'd' (replaced an empty directory)
//                      or 'f:SIDEFILE' (replaced a file, saved there)
//   D PATH             sync_dir
//   U PATH             unlink or rmdir
//   X                  a power cut was applied: forget everything before
std::string journal_created(const std::string& path, bool is_dir) {
  return std::string(is_dir ? "C d " : "C f ") + encode_field(path);
}

std::string journal_opened(const std::string& path, bool truncated, uint64_t size) {
  return std::string(truncated ? "O 1 " : "O 0 ") + std::to_string(size) + " " + encode_field(path);
}

std::string journal_synced(const std::string& path, uint64_t size) {
  return "S " + std::to_string(size) + " " + encode_field(path);
}

std::string journal_truncated(const std::string& path, uint64_t size) {
  return "T " + std::to_string(size) + " " + encode_field(path);
}

std::string journal_renamed(const std::string& from, const std::string& to, const Saved& saved) {
  std::string kind = "-";
  if (saved.kind == Saved::Kind::dir) kind = "d";
  // A file kept only in memory cannot be put back by another process.
  if (saved.kind == Saved::Kind::file && !saved.side_file.empty())
    kind = "f:" + encode_field(saved.side_file);
  return "R " + kind + " " + encode_field(from) + " " + encode_field(to);
}

std::string journal_dir_synced(const std::string& path) {
  return "D " + encode_field(path);
}

std::string journal_removed(const std::string& path) {
  return "U " + encode_field(path);
}

std::string journal_cut() {
  return "X";
}

Status Journal::open(const std::string& path, CutModel& model) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Status::from_errno(errno, "open fault journal", path);
  ::close(fd);
  FERRY_ASSIGN_OR_RETURN(std::string text, read_local_file(path));
  if (text.empty())
    FERRY_RETURN_IF_ERROR(append_local_line(path, std::string(kJournalHeader) + "\n"));
  else
    FERRY_RETURN_IF_ERROR(replay_journal(model, text, path));
  path_ = path;
  return Status::ok_status();
}

Status Journal::append(const std::string& event) {
  if (path_.empty()) return Status::ok_status();
  return append_local_line(path_, event + "\n")
      .with_context("fault journal (the operation itself succeeded): ");
}

Result<std::string> Journal::save_side_file(const std::string& bytes) {
  // The pid keeps the names of ranks sharing one journal apart.
  std::string side =
      path_ + ".saved-" + std::to_string(::getpid()) + "-" + std::to_string(side_counter_++);
  FERRY_RETURN_IF_ERROR(write_local_file(side, bytes));
  return side;
}

Status apply_journal(Filesystem& fs, const std::string& journal_path) {
  FERRY_ASSIGN_OR_RETURN(std::string text, read_local_file(journal_path));
  CutModel model;
  FERRY_RETURN_IF_ERROR(replay_journal(model, text, journal_path));
  std::vector<std::string> side = model.side_files();
  Status st = model.cut(fs, [](const Saved& s) -> Result<std::string> {
    if (s.side_file.empty())
      return Status::not_found("a replaced file was not saved (no side file)");
    return read_local_file(s.side_file);
  });
  // A torn last line would glue onto the marker: start it on its own line.
  const std::string marker = journal_cut() + "\n";
  Status journaled = append_local_line(
      journal_path, (!text.empty() && text.back() != '\n') ? "\n" + marker : marker);
  for (const std::string& f : side) ::unlink(f.c_str());
  return st.ok() ? journaled : st;
}

}  // namespace ferry::drills
