// ls, inspect, verify, gc, config: read-only views of a root (gc aside).

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <memory>

#include "ferry/catalog.hpp"
#include "ferry/options.hpp"
#include "tools/commands.hpp"

namespace ferry::cli {

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

int failed(const char* cmd, const Status& why) {
  std::fprintf(stderr, "ferry %s: %s\n", cmd, printable(why.to_string()).c_str());
  return 1;
}

std::string printable(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  auto escape = [&out](unsigned char c) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "\\x%02x", c);
    out += buf;
  };
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '\\') {
      out += "\\\\";
      ++i;
      continue;
    }
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7f)
        escape(c);
      else
        out += static_cast<char>(c);
      ++i;
      continue;
    }
    // Well-formed UTF-8 passes, but not the C1 controls (U+0080..U+009F),
    // which some terminals obey as escape sequences; any other byte is escaped.
    size_t len = c >= 0xf0 && c < 0xf5 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c < 0xe0 ? 2 : 0;
    uint32_t cp = len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
    bool good = len != 0 && i + len <= s.size();
    for (size_t k = 1; good && k < len; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      good = (d & 0xc0) == 0x80;
      cp = (cp << 6) | (d & 0x3f);
    }
    const uint32_t min = len == 2 ? 0x80 : len == 3 ? 0x800 : 0x10000;
    good = good && cp >= min && cp >= 0xa0 && cp <= 0x10ffff && (cp < 0xd800 || cp > 0xdfff);
    if (!good) {
      escape(c);
      ++i;
      continue;
    }
    out.append(s, i, len);
    i += len;
  }
  return out;
}

namespace {

// --verify re-reads every checkpoint and marks the newest one that verifies.
int run_ls(const std::string& root, bool verify) {
  const Catalog catalog;
  auto all = catalog.list(root);
  if (!all.ok()) return failed("ls", all.status());
  auto latest = catalog.latest(root);
  std::printf("%-16s %12s %10s %12s %8s  %s\n", "CHECKPOINT", "STEP", "SEQ", "SIZE", "TENSORS", "");
  bool valid_marked = false;
  bool latest_corrupt = false;
  // Committed (and corrupt) newest first, then pending saves; displaced
  // steps are gc's business and not shown.
  std::vector<CheckpointInfo> newest_first, pending;
  for (const auto& c : *all) {
    if (c.state == CheckpointState::committed || c.state == CheckpointState::corrupt)
      newest_first.push_back(c);
    else if (c.state == CheckpointState::pending)
      pending.push_back(c);
  }
  std::reverse(newest_first.begin(), newest_first.end());
  for (const auto& c : newest_first) {
    const std::string name = c.path.substr(c.path.find_last_of('/') + 1);
    if (!c.status.ok()) {
      std::printf("%-16s %12" PRIu64 " %10s %12s %8s  UNREADABLE: %s\n", name.c_str(), c.step, "-",
                  "-", "-", printable(c.status.to_string()).c_str());
      continue;
    }
    std::string mark;
    if (latest.ok() && latest->path == c.path) mark = "LATEST";
    if (c.latest_hint && mark.empty()) mark = "(LATEST file points here)";
    if (verify) {
      auto rep = catalog.verify(c.path);
      const bool good = rep.ok() && rep->ok();
      const std::string verdict = !rep.ok() ? "UNREADABLE"
                                  : !good   ? rep->verdict()
                                  : rep->unchecked_chunks > 0
                                      ? "verified (bytes unchecked: saved without checksums)"
                                      : "verified";
      mark += std::string(mark.empty() ? "" : " ") + verdict;
      if (!good && latest.ok() && latest->path == c.path) latest_corrupt = true;
      if (good && !valid_marked) {
        mark += " (latest valid)";
        valid_marked = true;
      }
    }
    std::printf("%-16s %12" PRIu64 " %10" PRIu64 " %12s %8" PRIu64 "  %s\n", name.c_str(), c.step,
                c.commit_seq, human_bytes(c.bytes).c_str(), c.tensors, mark.c_str());
  }
  if (newest_first.empty()) std::printf("(no committed checkpoints in %s)\n", root.c_str());
  // Pending saves, so that a crashed one is visible before gc takes it.
  const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  for (const auto& p : pending) {
    const std::string name = p.path.substr(p.path.find_last_of('/') + 1);
    std::string state;
    if (!p.has_lease) {
      state = "no readable lease, " + std::to_string((now - p.mtime_unix_ms) / 1000) +
              " s old (gc takes it after a grace period)";
    } else if (p.lease.expires_unix_ms < now) {
      state = "lease expired " + std::to_string((now - p.lease.expires_unix_ms) / 1000) +
              " s ago, owner " + p.lease.owner + " (gc takes it)";
    } else {
      state = "lease live for " + std::to_string((p.lease.expires_unix_ms - now) / 1000) +
              " s, owner " + p.lease.owner;
    }
    std::printf("pending %s  %s\n", printable(name).c_str(), printable(state).c_str());
  }
  if (latest_corrupt) {
    std::fprintf(stderr, "ferry ls: the latest checkpoint %s does not verify\n",
                 printable(latest->path).c_str());
    return 1;
  }
  return 0;
}

int run_inspect(const std::string& path) {
  auto m = Catalog().manifest(path, ManifestOptions{/*check_headers=*/true});
  if (!m.ok()) return failed("inspect", m.status());
  std::printf("checkpoint %s\n  step %" PRIu64 ", commit seq %" PRIu64
              ", world size %d, job %s, id %s\n  fsynced %s, checksum block %s, %zu files, %s\n",
              printable(m->path).c_str(), m->step, m->commit_seq, m->world_size,
              printable(m->job_id).c_str(), printable(m->checkpoint_id).c_str(),
              m->fsynced ? "yes" : "no", human_bytes(m->checksum_block_bytes).c_str(),
              m->files.size(), human_bytes(m->bytes).c_str());
  // Keys, values and names are the saver's bytes: a control character
  // printed raw would drive the terminal.
  for (const auto& [k, v] : m->metadata)
    std::printf("  meta %s = %s\n", printable(k).c_str(), printable(v).c_str());
  uint64_t raw = 0, stored = 0, frames = 0;
  for (const auto& t : m->tensors)
    for (const auto& c : t.chunks) {
      if (c.codec.empty()) continue;
      raw += c.raw_bytes;
      stored += c.byte_length;
      frames += c.frames;
    }
  if (raw > 0)
    std::printf("  codec zstd: %s raw in %s stored, ratio %.2fx, %" PRIu64 " frames\n",
                human_bytes(raw).c_str(), human_bytes(stored).c_str(),
                stored ? double(raw) / double(stored) : 0.0, frames);
  int rc = 0;
  std::printf("files:\n");
  for (uint32_t i = 0; i < m->files.size(); ++i) {
    const ManifestFileInfo& f = m->files[i];
    std::printf("  [%u] %s  %s  rank %d  header %s\n", i, printable(f.name).c_str(),
                human_bytes(f.size).c_str(), f.rank,
                f.header.ok() ? "ok" : printable(f.header.to_string()).c_str());
    if (!f.header.ok()) rc = 1;
  }
  if (!m->coverage.ok()) {
    std::printf("%s\n", printable(m->coverage.to_string()).c_str());
    rc = 1;
  }
  std::printf("tensors:\n");
  for (const auto& t : m->tensors) {
    std::printf("  %s  %s %s  %zu chunk(s)\n", printable(t.key).c_str(), dtype_name(t.dtype),
                shape_to_string(t.global_shape).c_str(), t.chunks.size());
    for (const auto& c : t.chunks) {
      std::printf("    offsets %s sizes %s  file [%u] %s bytes %" PRIu64 "..%" PRIu64,
                  shape_to_string(c.offsets).c_str(), shape_to_string(c.sizes).c_str(), c.file,
                  printable(m->files[c.file].name).c_str(), c.byte_offset,
                  c.byte_offset + c.byte_length);
      if (!c.checksums.empty())
        std::printf("  xxh3 %016" PRIx64 "%s", c.checksums[0],
                    c.checksums.size() > 1 ? " ..." : "");
      std::printf("  (%zu block checksum%s)", c.checksums.size(),
                  c.checksums.size() == 1 ? "" : "s");
      if (!c.codec.empty())
        std::printf("  %s %" PRIu64 " -> %" PRIu64 " bytes (%.2fx), %" PRIu64 " frame%s of %s",
                    printable(c.codec).c_str(), c.raw_bytes, c.byte_length,
                    c.byte_length ? double(c.raw_bytes) / double(c.byte_length) : 0.0, c.frames,
                    c.frames == 1 ? "" : "s", human_bytes(c.frame_bytes).c_str());
      std::printf("\n");
    }
  }
  return rc;
}

int run_verify(const std::string& path) {
  const Catalog catalog;
  auto dir = catalog.resolve(path);
  if (!dir.ok()) return failed("verify", dir.status());
  auto rep = catalog.verify(*dir);
  if (!rep.ok()) return failed("verify", rep.status());
  for (const auto& p : rep->problems) std::printf("PROBLEM %s\n", printable(p.to_string()).c_str());
  if (rep->unchecked_chunks > 0)
    std::printf("NOT CHECKED: %" PRIu64
                " chunk(s), %s, were saved without checksums "
                "(checksum = false): nothing says what their bytes should be\n",
                rep->unchecked_chunks, human_bytes(rep->unchecked_bytes).c_str());
  std::printf("%s: %" PRIu64 " files, %" PRIu64 " chunks, %s checked, %zu problem(s) in %s\n",
              rep->verdict(), rep->files, rep->chunks, human_bytes(rep->bytes_checked).c_str(),
              rep->problems.size(), printable(*dir).c_str());
  if (!rep->ok()) return 1;
  return rep->unchecked_chunks > 0 ? 3 : 0;
}

int run_gc(const std::string& root) {
  auto rep = Catalog().gc(root);
  if (!rep.ok()) return failed("gc", rep.status());
  // Names in a root are anyone's bytes: printed escaped.
  for (const auto& p : rep->restored)
    std::printf("restored %s (a crashed overwrite had moved it aside)\n", printable(p).c_str());
  for (const auto& p : rep->removed)
    std::printf("removed %s (lease expired)\n", printable(p).c_str());
  for (const auto& p : rep->discarded) std::printf("removed %s (leftover)\n", printable(p).c_str());
  for (const auto& p : rep->kept) std::printf("kept    %s (lease live)\n", printable(p).c_str());
  for (const auto& f : rep->failed)
    std::fprintf(stderr, "ferry gc: %s (out of sight; the next gc tries again)\n",
                 printable(f.status.to_string()).c_str());
  std::printf("%zu removed, %zu kept, %zu not deleted\n", rep->removed.size(), rep->kept.size(),
              rep->failed.size());
  return rep->failed.empty() ? 0 : 1;
}

int run_config() {
  std::printf("[ferry]\n");
  for (const auto& o : option_infos())
    std::printf("; %s\n%s = %s\n", o.help, o.key, o.default_value);
  return 0;
}

}  // namespace

void add_catalog_commands(CLI::App& app, int* rc) {
  struct Values {
    std::string ls, inspect, verify, gc;
    bool verify_all = false;
  };
  // The callbacks hold the values, and the app holds the callbacks.
  auto v = std::make_shared<Values>();

  CLI::App* ls =
      app.add_subcommand("ls", "committed checkpoints (step, seq, size, LATEST) and pending saves");
  ls->add_option("ROOT", v->ls, "the checkpoint root")->required()->type_name("");
  ls->add_flag("--verify", v->verify_all,
               "re-read every checkpoint, mark the newest that verifies, and exit 1 when the "
               "latest one is corrupt");
  ls->footer(
      "Lists the committed checkpoints of ROOT, newest first, with step, commit sequence,\n"
      "size and tensors, marks the latest, and lists pending saves with their lease (live\n"
      "or expired, owner).");
  ls->callback([rc, v] { *rc = run_ls(v->ls, v->verify_all); });

  CLI::App* inspect =
      app.add_subcommand("inspect", "every tensor: dtype, shape, chunks, files, checksums");
  inspect->add_option("CKPT", v->inspect, "a step directory, or a root: its latest checkpoint")
      ->required()
      ->type_name("");
  inspect->footer(
      "Shows a checkpoint's manifest: tensors, chunks, files and checksums, and checks each\n"
      "data file's header.");
  inspect->callback([rc, v] { *rc = run_inspect(v->inspect); });

  CLI::App* verify =
      app.add_subcommand("verify", "re-read every byte and check it against the manifest");
  verify->add_option("CKPT", v->verify, "a step directory, or a root: its latest checkpoint")
      ->required()
      ->type_name("");
  verify->footer(
      "Exits 1 on any problem (CORRUPT: damaged or malformed; UNREADABLE: only I/O errors\n"
      "such as permissions), 3 when it found none but chunks saved without checksums\n"
      "could not be checked (UNCHECKED).");
  verify->callback([rc, v] { *rc = run_verify(v->verify); });

  CLI::App* gc = app.add_subcommand("gc", "remove pending directories whose lease expired");
  gc->add_option("ROOT", v->gc, "the checkpoint root")->required()->type_name("");
  gc->footer(
      "Removes pending directories whose lease expired and leftovers of crashed saves, and\n"
      "puts back a step that a crashed overwrite left aside.");
  gc->callback([rc, v] { *rc = run_gc(v->gc); });

  CLI::App* config = app.add_subcommand("config", "every [ferry] setting with its default");
  config->footer("Prints every [ferry] setting with its default and help.");
  config->callback([rc] { *rc = run_config(); });
}

}  // namespace ferry::cli
