#include "verify.hpp"

#include <map>

#include "box.hpp"
#include "catalog.hpp"
#include "checksum.hpp"
#include "layout.hpp"
#include "manifest.hpp"

namespace ferry {

Status check_data_file_header(Filesystem& fs, const std::string& dir, uint32_t file_index,
                              const Manifest& m) {
  const ManifestFile& mf = m.files[file_index];
  const std::string path = join_path(dir, mf.name);
  FERRY_ASSIGN_OR_RETURN(FileInfo info, fs.lstat(path));
  if (info.is_symlink)
    return Status::corruption(path + ": is a symbolic link, which Ferry never follows");
  if (!info.is_regular) return Status::corruption(path + ": not a regular file");
  if (info.size != mf.size)
    return Status::corruption(path + ": size " + std::to_string(info.size) + ", manifest says " +
                              std::to_string(mf.size));
  FERRY_ASSIGN_OR_RETURN(auto f, fs.open(path, OpenOptions{}));
  std::string prefix(8, '\0');
  FERRY_ASSIGN_OR_RETURN(size_t got, f->pread(prefix.data(), 8, 0));
  if (got != 8) return Status::corruption(path + ": shorter than a safetensors header");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(prefix[i]);
  if (n > mf.size - 8 || n > (100ull << 20))
    return Status::corruption(path + ": safetensors header length " + std::to_string(n) +
                              " is impossible for a file of " + std::to_string(mf.size) + " bytes");
  prefix.resize(8 + n);
  FERRY_ASSIGN_OR_RETURN(got, f->pread(prefix.data() + 8, n, 8));
  if (got != n) return Status::corruption(path + ": truncated safetensors header");
  if (mf.header_bytes != 0 && (mf.header_bytes != prefix.size() ||
                               xxh3_64(prefix.data(), prefix.size()) != mf.header_checksum))
    return Status::corruption(path +
                              ": safetensors header does not match its checksum in the "
                              "manifest");
  auto h = parse_safetensors_header(prefix, mf.size);
  if (!h.ok()) return h.status().with_context(path + ": ");

  std::map<std::string, const SafetensorsEntry*> by_name;
  for (const auto& e : h->entries) by_name[e.name] = &e;
  size_t expected = 0;
  for (const ManifestTensor& t : m.tensors) {
    for (const ManifestChunk& c : t.chunks) {
      if (c.file != file_index) continue;
      ++expected;
      auto it = by_name.find(c.entry);
      if (it == by_name.end())
        return Status::corruption(path + ": safetensors header lacks entry '" + c.entry +
                                  "' of tensor '" + t.key + "'");
      const SafetensorsEntry& e = *it->second;
      // A compressed chunk's entry is a U8 blob of its stored bytes.
      const bool typed =
          c.codec.empty() ? e.dtype == dtype_name(t.dtype) && e.shape == c.sizes : e.dtype == "U8";
      if (!typed || h->data_start + e.begin != c.byte_offset || e.end - e.begin != c.byte_length)
        return Status::corruption(path + ": safetensors entry '" + c.entry + "' of tensor '" +
                                  t.key + "' disagrees with the manifest");
    }
  }
  if (expected != h->entries.size())
    return Status::corruption(path + ": safetensors header has " +
                              std::to_string(h->entries.size()) + " entries, manifest expects " +
                              std::to_string(expected));
  return Status();
}

Status check_manifest_coverage(const Manifest& m) {
  for (const ManifestTensor& t : m.tensors) {
    const std::string who = "malformed manifest: tensor '" + t.key + "'";
    uint64_t numel = 1;
    bool overflow = false;
    for (int64_t d : t.global_shape)
      overflow =
          overflow || d < 0 || __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel);
    uint64_t bytes = 0;
    if (overflow || __builtin_mul_overflow(numel, dtype_size(t.dtype), &bytes))
      return Status::corruption(who + ": global shape " + shape_to_string(t.global_shape) + " of " +
                                dtype_name(t.dtype) + " holds 2^64 bytes or more");
    // decode_manifest checked that chunks lie inside the tensor and never
    // overlap, so they cover it exactly when their elements add up.
    uint64_t covered = 0;
    for (const ManifestChunk& c : t.chunks) {
      uint64_t n = 1;
      for (int64_t s : c.sizes) n *= static_cast<uint64_t>(s);
      covered += n;
    }
    if (covered != numel)
      return Status::corruption(who + ": its chunks cover " + std::to_string(covered) + " of its " +
                                std::to_string(numel) + " elements");
  }
  return Status();
}

Result<CheckpointInfo> latest_valid(Filesystem& fs, const std::string& root) {
  FERRY_ASSIGN_OR_RETURN(auto all, list_checkpoints(fs, root));
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (!it->status.ok()) continue;
    auto rep = verify_checkpoint(fs, it->path);
    if (rep.ok() && rep->ok()) return *it;
  }
  return Status::not_found("no committed checkpoint in " + root + " verifies");
}

Result<VerifyReport> verify_checkpoint(Filesystem& fs, const std::string& dir) {
  FERRY_ASSIGN_OR_RETURN(Manifest m, read_manifest(fs, dir));
  VerifyReport rep;
  Status shape = check_manifest_coverage(m);
  if (!shape.ok()) rep.problems.push_back(shape.with_context(dir + ": "));
  std::vector<bool> file_ok(m.files.size(), true);
  for (uint32_t i = 0; i < m.files.size(); ++i) {
    ++rep.files;
    Status s = check_data_file_header(fs, dir, i, m);
    if (!s.ok()) {
      rep.problems.push_back(s);
      file_ok[i] = false;
    }
  }
  std::map<uint32_t, std::unique_ptr<File>> open;
  std::vector<uint8_t> buf;
  const uint64_t cb = m.checksum_block_bytes;
  for (const ManifestTensor& t : m.tensors) {
    for (const ManifestChunk& c : t.chunks) {
      ++rep.chunks;
      if (c.checksums.empty()) {
        // Saved with checksum = false: nothing says what its bytes should be.
        ++rep.unchecked_chunks;
        rep.unchecked_bytes += c.byte_length;
        continue;
      }
      if (!file_ok[c.file]) continue;
      const std::string path = join_path(dir, m.files[c.file].name);
      auto& f = open[c.file];
      if (!f) {
        auto r = fs.open(path, OpenOptions{});
        if (!r.ok()) {
          rep.problems.push_back(r.status());
          file_ok[c.file] = false;
          continue;
        }
        f = std::move(r).value();
      }
      for (size_t b = 0; b < c.checksums.size(); ++b) {
        const uint64_t off = b * cb;
        const uint64_t n = std::min(cb, c.byte_length - off);
        buf.resize(n);
        auto got = f->pread(buf.data(), n, c.byte_offset + off);
        if (!got.ok()) {
          rep.problems.push_back(got.status());
          break;
        }
        rep.bytes_checked += *got;
        if (*got != n || xxh3_64(buf.data(), n) != c.checksums[b]) {
          rep.problems.push_back(Status::corruption(
              path + ": checksum mismatch in tensor '" + t.key + "' chunk " + c.entry + " block " +
              std::to_string(b) + " (bytes " + std::to_string(c.byte_offset + off) + ".." +
              std::to_string(c.byte_offset + off + n) + ")"));
        }
      }
    }
  }
  return rep;
}

}  // namespace ferry

namespace ferry {

const char* VerifyReport::verdict() const {
  bool corrupt = false;
  for (const Status& p : problems) corrupt = corrupt || p.code() != StatusCode::io_error;
  if (corrupt) return "CORRUPT";
  if (!problems.empty()) return "UNREADABLE";
  if (unchecked_chunks > 0) return "UNCHECKED";
  return "OK";
}

}  // namespace ferry
