// ferry export: the checkpoint's tensors, whole, in plain safetensors files.
// Reading goes through Runtime::load_report with shards of rows as targets,
// which is exactly a resharded load, so every byte is checksum-verified and
// memory stays within one batch.

#include "ferry/export.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>

#include "actors/runtime_access.hpp"
#include "catalog.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/runtime.hpp"
#include "layout.hpp"
#include "manifest.hpp"
#include "object_fs.hpp"
#include "verify.hpp"

namespace ferry {

namespace {

constexpr char kIndexName[] = "model.safetensors.index.json";

uint64_t tensor_bytes(const ManifestTensor& t) {
  uint64_t n = dtype_size(t.dtype);
  for (int64_t d : t.global_shape) n *= static_cast<uint64_t>(d);
  return n;
}

// Keys in order, cut into files of at most `cap` bytes (a larger tensor
// alone). At least one file, so an empty checkpoint still exports.
std::vector<std::vector<const ManifestTensor*>> group_files(const Manifest& m, uint64_t cap) {
  std::vector<std::vector<const ManifestTensor*>> files(1);
  uint64_t used = 0;
  for (const ManifestTensor& t : m.tensors) {
    const uint64_t n = tensor_bytes(t);
    if (!files.back().empty() && used + n > cap) {
      files.emplace_back();
      used = 0;
    }
    files.back().push_back(&t);
    used += n;
  }
  return files;
}

// A piece to load: rows [row, row + rows) of a tensor (all of a 0-d one),
// landing at `file_offset` of the file being written.
struct Piece {
  const ManifestTensor* t;
  int64_t row = 0;
  int64_t rows = 0;
  uint64_t bytes = 0;
  uint64_t file_offset = 0;
};

// Loads `batch` into one buffer and writes each piece where it belongs.
Status flush(Runtime& rt, const std::string& dir, std::vector<Piece>& batch, File& out,
             std::vector<char>& buf) {
  if (batch.empty()) return Status();
  uint64_t total = 0;
  for (const Piece& p : batch) total += p.bytes;
  buf.resize(total);
  StateDict sd;
  uint64_t at = 0;
  for (const Piece& p : batch) {
    const ManifestTensor& t = *p.t;
    std::vector<int64_t> shape = t.global_shape;
    std::optional<Shard> shard;
    if (!shape.empty() && p.rows != shape[0]) {
      shape[0] = p.rows;
      std::vector<int64_t> offsets(shape.size(), 0);
      offsets[0] = p.row;
      shard = Shard{t.global_shape, offsets};
    }
    FERRY_RETURN_IF_ERROR(sd.add(t.key, TensorView(buf.data() + at, t.dtype, shape), shard));
    at += p.bytes;
  }
  auto report = rt.load_report(sd, dir);
  if (!report.ok()) return report.status();
  at = 0;
  for (const Piece& p : batch) {
    FERRY_RETURN_IF_ERROR(out.pwrite(buf.data() + at, p.bytes, p.file_offset));
    at += p.bytes;
  }
  batch.clear();
  return Status();
}

// A fresh file beside `path` for its bytes until they are whole: a new name
// and O_EXCL (with the O_NOFOLLOW of every open), so that nothing already
// there (a link someone planted, a crashed export's leftover) is written
// through.
Result<std::pair<std::string, std::unique_ptr<File>>> create_temp(Filesystem& fs,
                                                                  const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid()) + "-" +
                          std::to_string(counter.fetch_add(1, std::memory_order_relaxed));
  OpenOptions w;
  w.write = w.create = w.exclusive = true;
  FERRY_ASSIGN_OR_RETURN(auto out, fs.open(tmp, w));
  return std::make_pair(tmp, std::move(out));
}

Status fill_file(Runtime& rt, const std::string& dir,
                 const std::vector<const ManifestTensor*>& tensors, const std::string& header,
                 File* out, const ExportOptions& o) {
  FERRY_RETURN_IF_ERROR(out->pwrite(header.data(), header.size(), 0));
  std::vector<Piece> batch;
  std::vector<char> buf;
  uint64_t batch_bytes = 0;
  uint64_t pos = header.size();
  for (const ManifestTensor* t : tensors) {
    const uint64_t n = tensor_bytes(*t);
    if (n == 0) continue;
    const int64_t rows = t->global_shape.empty() ? 1 : t->global_shape[0];
    const uint64_t row_bytes = n / static_cast<uint64_t>(rows);
    const int64_t step =
        t->global_shape.empty()
            ? 1
            : static_cast<int64_t>(std::max<uint64_t>(1, o.block_bytes / row_bytes));
    for (int64_t r = 0; r < rows; r += step) {
      Piece p{t, r, std::min(step, rows - r), 0, pos};
      p.bytes = static_cast<uint64_t>(p.rows) * row_bytes;
      if (batch_bytes && batch_bytes + p.bytes > o.block_bytes) {
        FERRY_RETURN_IF_ERROR(flush(rt, dir, batch, *out, buf));
        batch_bytes = 0;
      }
      batch.push_back(p);
      batch_bytes += p.bytes;
      pos += p.bytes;
    }
  }
  FERRY_RETURN_IF_ERROR(flush(rt, dir, batch, *out, buf));
  FERRY_RETURN_IF_ERROR(out->sync());
  return out->close();
}

// Written aside and renamed into place, so OUT never holds a partial file;
// a failure removes what it wrote.
Status write_file(Runtime& rt, Filesystem& fs, const std::string& dir,
                  const std::vector<const ManifestTensor*>& tensors, const std::string& header,
                  const std::string& path, const ExportOptions& o) {
  FERRY_ASSIGN_OR_RETURN(auto tmp, create_temp(fs, path));
  Status s = fill_file(rt, dir, tensors, header, tmp.second.get(), o);
  if (s.ok()) s = fs.rename(tmp.first, path);
  if (!s.ok()) (void)fs.unlink(tmp.first);  // the first error is the one to report
  return s;
}

Status write_small_file(Filesystem& fs, const std::string& path, const std::string& text) {
  FERRY_ASSIGN_OR_RETURN(auto tmp, create_temp(fs, path));
  Status s = tmp.second->pwrite(text.data(), text.size(), 0);
  if (s.ok()) s = tmp.second->sync();
  if (s.ok()) s = tmp.second->close();
  if (s.ok()) s = fs.rename(tmp.first, path);
  if (!s.ok()) (void)fs.unlink(tmp.first);  // the first error is the one to report
  return s;
}

std::string file_name(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

}  // namespace

Result<std::string> export_checkpoint(Runtime& rt, const std::string& checkpoint,
                                      const std::string& out_dir, const ExportOptions& o) {
  if (rt.world_size() != 1)
    return Status::invalid_argument("export needs a single-process runtime, this one has " +
                                    std::to_string(rt.world_size()) + " ranks");
  if (o.max_shard_bytes == 0 || o.block_bytes == 0)
    return Status::invalid_argument("export: max_shard_bytes and block_bytes must be positive");
  if (is_object_root(out_dir))
    return Status::unsupported("export writes into a directory, not into " + out_dir);
  // The checkpoint may be on an object root (s3://), with the runtime's S3 settings.
  const S3StoreOptions s3 = s3_store_options(detail::RuntimeAccess::context(rt).opts);
  auto fs = with_object_roots(posix_filesystem(), [s3] { return s3; });
  const RootHold hold(fs, checkpoint);
  FERRY_ASSIGN_OR_RETURN(std::string dir, resolve_checkpoint(*fs, checkpoint));
  FERRY_ASSIGN_OR_RETURN(Manifest m, read_manifest(*fs, dir));
  // A size past 2^64 would be written as a wrapped safetensors entry.
  FERRY_RETURN_IF_ERROR(check_manifest_coverage(m).with_context("export " + dir + ": "));
  FERRY_RETURN_IF_ERROR(fs->mkdirs(out_dir));

  // Ferry's own keys ("ferry.*") describe how Ferry stored the state; the
  // user's keys travel on.
  std::vector<std::pair<std::string, std::string>> meta = {{"format", "pt"},
                                                           {"ferry.step", std::to_string(m.step)}};
  for (const auto& kv : m.metadata) {
    // The Python package's non-tensor values belong to the state: they travel
    // whoever runs the export (CLI, C, Python): JSON leaves as "ferry.leaves",
    // typed ones (tuples, pickle) as "ferry.values" with "ferry.pickled"
    // naming those holding pickle, and how per-rank copies decode as
    // "ferry.per_rank".
    for (const char* k : {"leaves", "values", "pickled", "per_rank"})
      if (kv.first == std::string("ferry.python.") + k)
        meta.emplace_back(std::string("ferry.") + k, kv.second);
    if (kv.first.rfind("ferry.", 0) != 0) meta.push_back(kv);
  }
  for (const auto& kv : o.metadata) meta.push_back(kv);

  const auto files = group_files(m, o.max_shard_bytes);
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string name = file_name(i, files.size());
    std::vector<SafetensorsEntry> entries;
    uint64_t off = 0;
    for (const ManifestTensor* t : files[i]) {
      const uint64_t n = tensor_bytes(*t);
      entries.push_back({t->key, dtype_name(t->dtype), t->global_shape, off, off + n});
      off += n;
      weight_map[t->key] = name;
    }
    total += off;
    auto header = safetensors_header(entries, meta, 8);
    if (!header.ok()) return header.status().with_context("export " + dir + ": ");
    Status s = write_file(rt, *fs, dir, files[i], *header, join_path(out_dir, name), o);
    if (!s.ok()) return s.with_context("export " + dir + " to " + join_path(out_dir, name) + ": ");
  }

  std::string index = "{\n  \"metadata\": {\n    \"ferry_step\": " + std::to_string(m.step) +
                      ",\n    \"total_size\": " + std::to_string(total) +
                      "\n  },\n  \"weight_map\": {";
  bool first = true;
  for (const auto& [key, file] : weight_map) {
    index += std::string(first ? "" : ",") + "\n    " + json_string(key) + ": " + json_string(file);
    first = false;
  }
  index += weight_map.empty() ? "}\n}\n" : "\n  }\n}\n";
  const std::string index_path = join_path(out_dir, kIndexName);
  FERRY_RETURN_IF_ERROR(write_small_file(*fs, index_path, index));
  FERRY_RETURN_IF_ERROR(fs->sync_dir(out_dir));
  return index_path;
}

}  // namespace ferry
