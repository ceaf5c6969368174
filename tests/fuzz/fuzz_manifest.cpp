// libFuzzer target for ferry::decode_manifest (src/include/ferry/manifest.hpp).
//
// Invariants checked on every input:
//  - decode_manifest returns (a value or a non-ok Status) without crashing,
//    within the per-input time limit of fuzz_guard.hpp;
//  - a decoded manifest round-trips: e1 = encode(decode(input)) decodes again,
//    and encoding that second value gives e1 byte for byte;
//  - a decoded manifest drives a load's planning (src/load_plan.cpp): the
//    plan of a whole tensor, or of its first rows, stays inside the chunks,
//    the files and the caller's box, and its runs and shared ranges are
//    computed without crashing; work and memory follow the box asked for
//    (at most 1 MiB here) and the manifest's size, never a size it claims;
//  - verify_checkpoint (src/verify.cpp) on the manifest, with data files in
//    memory as long as it says (up to 1 MiB; longer ones are shorter than
//    claimed), returns a report or an error without crashing.
//
// The frame carries an xxh3-64 of its payload, which random mutation almost
// never gets right, so each input is also decoded a second time with the
// frame's payload length and checksum recomputed: that copy reaches the Cap'n
// Proto payload and the semantic checks behind the checksum.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <string_view>

#include "catalog.hpp"
#include "checksum.hpp"
#include "ferry/filesystem.hpp"
#include "fuzz_guard.hpp"
#include "load_plan.hpp"
#include "manifest.hpp"
#include "verify.hpp"

namespace {

constexpr const char* kTarget = "fuzz_manifest";

// The most bytes one planned load asks for, and of data files held in
// memory (files past it are empty: shorter than the manifest says).
constexpr uint64_t kBoxBytes = 1ull << 20;
constexpr uint64_t kFileBytes = 1ull << 20;
constexpr char kDir[] = "/fuzz-ckpt";

// Read-only files in memory: the MANIFEST and the data files, whose bytes
// depend on their name only. Everything else goes to the wrapped filesystem
// and is never reached by verify.
class MemoryFile : public ferry::File {
 public:
  MemoryFile(std::string path, const std::string* bytes) : path_(std::move(path)), bytes_(bytes) {}
  const std::string& path() const override { return path_; }
  bool direct() const override { return false; }
  ferry::Status pwrite(const void*, size_t, uint64_t) override {
    return ferry::Status::invalid_argument("read-only: " + path_);
  }
  ferry::Result<size_t> pread(void* data, size_t len, uint64_t offset) override {
    if (offset >= bytes_->size()) return size_t{0};
    const size_t n = std::min<uint64_t>(len, bytes_->size() - offset);
    std::memcpy(data, bytes_->data() + offset, n);
    return n;
  }
  ferry::Status truncate(uint64_t) override {
    return ferry::Status::invalid_argument("read-only: " + path_);
  }
  ferry::Status sync() override { return ferry::Status(); }
  ferry::Status close() override { return ferry::Status(); }

 private:
  std::string path_;
  const std::string* bytes_;
};

class MemoryFs : public ferry::FilesystemWrapper {
 public:
  MemoryFs() : FilesystemWrapper(ferry::posix_filesystem()) {}
  std::map<std::string, std::string> files;  // by path
  ferry::Result<std::unique_ptr<ferry::File>> open(const std::string& p,
                                                   const ferry::OpenOptions& o) override {
    auto it = files.find(p);
    if (o.write || it == files.end()) return ferry::Status::not_found("open " + p);
    return std::unique_ptr<ferry::File>(new MemoryFile(p, &it->second));
  }
  ferry::Result<ferry::FileInfo> stat(const std::string& p) override {
    auto it = files.find(p);
    if (it == files.end()) return ferry::Status::not_found("stat " + p);
    ferry::FileInfo info;
    info.size = it->second.size();
    info.is_regular = true;
    return info;
  }
  // verify reads the MANIFEST and checks each data file through lstat: from
  // the wrapped filesystem it would stop at the first, untested.
  ferry::Result<ferry::FileInfo> lstat(const std::string& p) override { return stat(p); }
};

void check_verify(std::string_view bytes, const ferry::Manifest& m) {
  MemoryFs fs;
  fs.files[std::string(kDir) + "/" + ferry::kManifestFileName] = std::string(bytes);
  uint64_t left = kFileBytes;
  for (const ferry::ManifestFile& f : m.files) {
    std::string data(std::min(f.size, left), '\0');
    left -= data.size();
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 + f.name.size());
    fs.files[std::string(kDir) + "/" + f.name] = std::move(data);
  }
  auto rep = ferry::verify_checkpoint(fs, kDir);
  if (!rep.ok() && rep.status().message().empty())
    ferry::fuzz::fail(kTarget, "verify_checkpoint returned an error without a message");
  // A manifest that decoded is one verify reads too: an error about reading
  // it means verify was never driven past it.
  if (!rep.ok() && rep.status().code() == ferry::StatusCode::not_found &&
      rep.status().message().find(ferry::kManifestFileName) != std::string::npos)
    ferry::fuzz::fail(kTarget, "verify_checkpoint did not find the MANIFEST in memory: " +
                                   rep.status().to_string());
}

// One request for tensor `t`: all of it, or as many of its first rows as
// fit kBoxBytes (a caller's memory bounds what it asks for).
bool request_for(const ferry::ManifestTensor& t, uint32_t entry, uint64_t budget,
                 ferry::LoadRequest* req) {
  req->entry = entry;
  req->key = t.key;
  req->dtype = t.dtype;
  req->global_shape = t.global_shape;
  req->box.offsets.assign(t.global_shape.size(), 0);
  req->box.sizes = t.global_shape;
  uint64_t row = ferry::dtype_size(t.dtype);
  for (size_t d = 1; d < t.global_shape.size(); ++d) {
    const auto n = static_cast<uint64_t>(t.global_shape[d]);
    if (n != 0 && row > budget / n) return false;
    row *= n;
  }
  if (t.global_shape.empty() || row == 0) return row <= budget;
  req->box.sizes[0] = std::min<int64_t>(t.global_shape[0], static_cast<int64_t>(budget / row));
  return req->box.sizes[0] > 0;
}

void check_plan(const ferry::Manifest& m) {
  std::vector<ferry::LoadRequest> requests;
  uint64_t budget = kBoxBytes;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    ferry::LoadRequest req;
    if (!request_for(m.tensors[i], static_cast<uint32_t>(requests.size()), budget, &req)) continue;
    uint64_t bytes = ferry::dtype_size(req.dtype);
    for (int64_t s : req.box.sizes) bytes *= static_cast<uint64_t>(s);
    budget -= std::min(budget, bytes);
    requests.push_back(std::move(req));
  }
  auto ops = ferry::make_load_plan(m, requests);
  if (!ops.ok()) {
    if (ops.status().message().empty())
      ferry::fuzz::fail(kTarget, "make_load_plan returned an error without a message");
    return;
  }
  for (const ferry::ReadOp& op : *ops) {
    if (op.tensor >= m.tensors.size() || op.chunk >= m.tensors[op.tensor].chunks.size() ||
        op.file >= m.files.size() || op.entry >= requests.size())
      ferry::fuzz::fail(kTarget, "a planned read names a tensor, chunk, file or entry not there");
    const ferry::ManifestChunk& c = m.tensors[op.tensor].chunks[op.chunk];
    if (op.chunk_offset + op.length > c.raw_bytes() ||
        (c.codec.empty() && op.file_offset + op.length > m.files[op.file].size))
      ferry::fuzz::fail(kTarget, "a planned read of tensor '" + m.tensors[op.tensor].key +
                                     "' runs past its chunk or its file");
    const ferry::LoadRequest& req = requests[op.entry];
    uint64_t box_bytes = ferry::dtype_size(req.dtype);
    for (int64_t s : req.box.sizes) box_bytes *= static_cast<uint64_t>(s);
    ferry::for_each_copy(
        op, ferry::dtype_size(req.dtype), [&](uint64_t src, uint64_t dst, uint64_t n) {
          if (src + n > op.length || dst + n > box_bytes)
            ferry::fuzz::fail(kTarget, "a planned copy of tensor '" + req.key +
                                           "' reads past its read or writes past the caller's box");
        });
  }
  (void)ferry::needed_ranges(*ops, m);
  (void)ferry::make_read_runs(*ops, m, 32ull << 20, 4096, 8ull << 20);
}

void check_round_trip(std::string_view bytes) {
  ferry::Result<ferry::Manifest> first = ferry::decode_manifest(bytes);
  if (!first.ok()) {
    if (first.status().message().empty())
      ferry::fuzz::fail(kTarget, "decode_manifest returned an error without a message");
    return;
  }
  check_plan(first.value());
  check_verify(bytes, first.value());
  const std::string e1 = ferry::encode_manifest(first.value());
  ferry::Result<ferry::Manifest> second = ferry::decode_manifest(e1);
  if (!second.ok())
    ferry::fuzz::fail(kTarget, "a decoded manifest, encoded again, does not decode: " +
                                   second.status().to_string());
  const std::string e2 = ferry::encode_manifest(second.value());
  if (e1 != e2)
    ferry::fuzz::fail(
        kTarget, "encode(decode(encode(m))) differs from encode(m): " + std::to_string(e1.size()) +
                     " vs " + std::to_string(e2.size()) + " bytes");
}

uint64_t get_le(std::string_view b, size_t pos, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(b[pos + i])) << (8 * i);
  return v;
}

void put_u64(std::string* s, size_t pos, uint64_t v) {
  for (size_t i = 0; i < 8; ++i) (*s)[pos + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

// The input with its payload length and checksum made to match the bytes
// that follow them (frame layout: docs/format.md). False when the input is
// too short to hold a payload header or already matches.
bool fix_frame(std::string_view in, std::string* out) {
  size_t pos = 8 + 4;  // magic, format version
  if (in.size() < pos + 4) return false;
  const uint64_t features = get_le(in, pos, 4);
  pos += 4;
  for (uint64_t i = 0; i < features; ++i) {
    if (in.size() < pos + 2) return false;
    pos += 2 + get_le(in, pos, 2);
  }
  if (in.size() < pos + 16) return false;
  const size_t payload = pos + 16;
  const uint64_t len = in.size() - payload;
  const uint64_t sum = ferry::xxh3_64(in.data() + payload, len);
  if (get_le(in, pos, 8) == len && get_le(in, pos + 8, 8) == sum) return false;
  out->assign(in.data(), in.size());
  put_u64(out, pos, len);
  put_u64(out, pos + 8, sum);
  return true;
}

}  // namespace

static int one_input(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  check_round_trip(input);
  std::string fixed;
  if (fix_frame(input, &fixed)) check_round_trip(fixed);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ferry::fuzz::timed(kTarget, data, size, one_input);
}
