#include "checkpoint_fn.hpp"

#include <cxxabi.h>

#include <algorithm>
#include <exception>
#include <future>
#include <map>

#include "checksum.hpp"

namespace ferry {

Result<StateDict> planned_state_dict(const FileLayout& planned,
                                     const std::vector<PlannedSource>& sources,
                                     DeviceBackend* device,
                                     std::deque<std::vector<uint8_t>>* staged) {
  StateDict sd;
  for (size_t c = 0; c < planned.chunks.size(); ++c) {
    const LaidOutChunk& lc = planned.chunks[c];
    const TensorView& v = sources[c].view;
    void* data = static_cast<uint8_t*>(v.data) + sources[c].offset;
    if (!v.device.is_host() || !v.is_contiguous()) {
      if (!device || !staged)
        return Status::invalid_argument(
            "checkpoint_fn: tensor '" + lc.chunk.key + "' is " +
            (v.device.is_host() ? std::string("not contiguous") : "on " + v.device.to_string()) +
            " and there is no device to copy it to host memory");
      const uint64_t n = static_cast<uint64_t>(lc.chunk.box.numel()) * dtype_size(lc.chunk.dtype);
      staged->emplace_back(std::max<uint64_t>(n, 1));
      std::promise<Status> copied;
      device->copy_out(v, sources[c].offset, n, staged->back().data(),
                       [&copied](Status s) { copied.set_value(std::move(s)); });
      Status s = copied.get_future().get();
      if (!s.ok())
        return s.with_context("checkpoint_fn: copying tensor '" + lc.chunk.key +
                              "' to host memory: ");
      data = staged->back().data();
    }
    FERRY_RETURN_IF_ERROR(sd.add(lc.entry, TensorView(data, lc.chunk.dtype, lc.chunk.box.sizes)));
  }
  return sd;
}

Status run_checkpoint_fn(const CheckpointFn& fn, const StateDict& planned,
                         const std::string& path) {
  Status s;
  try {
    s = fn(planned, path);
  } catch (abi::__forced_unwind&) {
    throw;  // the thread is being ended (an interpreter exiting around a stuck function)
  } catch (const std::exception& e) {
    s = Status::aborted(std::string("raised: ") + e.what());
  } catch (...) {
    s = Status::aborted("raised an exception that is not a std::exception");
  }
  return s.ok() ? s : s.with_context("checkpoint_fn writing " + path + ": ");
}

Result<FileLayout> adopt_written_file(Filesystem& fs, const std::string& path,
                                      const FileLayout& planned, uint64_t checksum_block_bytes,
                                      std::vector<std::vector<uint64_t>>* sums, bool fsync) {
  auto info = fs.stat(path);
  if (!info.ok() && info.status().code() == StatusCode::not_found)
    return Status::invalid_argument("checkpoint_fn wrote nothing: no file at " + path);
  if (!info.ok()) return info.status();
  if (info->size == 0)
    return Status::invalid_argument("checkpoint_fn wrote nothing: " + path + " is empty");
  FERRY_ASSIGN_OR_RETURN(auto f, fs.open(path, OpenOptions{}));
  std::string prefix(8, '\0');
  FERRY_ASSIGN_OR_RETURN(size_t got, f->pread(prefix.data(), 8, 0));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(prefix[i]);
  if (got != 8 || n > info->size - 8 || n > (100ull << 20)) {
    // torch.save's zip archive (or an old-style pickle) is the usual mistake.
    const bool torch_save =
        prefix.compare(0, 4, "PK\x03\x04") == 0 || static_cast<uint8_t>(prefix[0]) == 0x80;
    return Status::invalid_argument(
        "checkpoint_fn wrote " + path + ", which is not a safetensors file" +
        (torch_save ? " (it is torch.save's format)" : " (header length)") +
        ": a checkpoint_fn must write a safetensors file holding exactly the tensors it is "
        "given, under their names (e.g. safetensors.torch.save_file(state_dict, filename))");
  }
  prefix.resize(8 + n);
  FERRY_ASSIGN_OR_RETURN(got, f->pread(prefix.data() + 8, n, 8));
  if (got != n) return Status::invalid_argument(path + ": truncated safetensors header");
  auto h = parse_safetensors_header(prefix, info->size);
  if (!h.ok()) return h.status().with_context("checkpoint_fn wrote " + path + ": ");

  std::map<std::string, const SafetensorsEntry*> by_name;
  for (const auto& e : h->entries) by_name[e.name] = &e;
  FileLayout out;
  out.name = planned.name;
  out.header = prefix;
  out.size = info->size;
  sums->clear();
  std::vector<uint8_t> buf;
  for (const LaidOutChunk& lc : planned.chunks) {
    auto it = by_name.find(lc.entry);
    if (it == by_name.end())
      return Status::invalid_argument("checkpoint_fn wrote " + path + " without planned tensor '" +
                                      lc.entry + "'");
    const SafetensorsEntry& e = *it->second;
    if (e.dtype != dtype_name(lc.chunk.dtype) || e.shape != lc.chunk.box.sizes)
      return Status::invalid_argument("checkpoint_fn wrote " + path + ": tensor '" + lc.entry +
                                      "' is " + e.dtype + " " + shape_to_string(e.shape) +
                                      ", the plan has " + dtype_name(lc.chunk.dtype) + " " +
                                      shape_to_string(lc.chunk.box.sizes));
    by_name.erase(it);
    LaidOutChunk w = lc;
    w.offset = h->data_start + e.begin;
    w.length = e.end - e.begin;
    // The file holds the function's raw tensor, whatever the plan laid out:
    // frames of a compressed plan would describe bytes that are not there.
    w.chunk.compressed = nullptr;
    std::vector<uint64_t> blocks;
    for (uint64_t off = 0; checksum_block_bytes > 0 && off < w.length;
         off += checksum_block_bytes) {
      const uint64_t len = std::min(checksum_block_bytes, w.length - off);
      buf.resize(len);
      FERRY_ASSIGN_OR_RETURN(got, f->pread(buf.data(), len, w.offset + off));
      if (got != len) return Status::io_error(path + ": short read while checksumming");
      blocks.push_back(xxh3_64(buf.data(), len));
    }
    sums->push_back(std::move(blocks));
    out.chunks.push_back(std::move(w));
  }
  if (!by_name.empty())
    return Status::invalid_argument("checkpoint_fn wrote " + path + " with tensor '" +
                                    by_name.begin()->first + "', which the plan does not have");
  if (fsync) {
    // Read-only descriptors fsync the file's data all the same.
    FERRY_RETURN_IF_ERROR(f->sync());
  }
  FERRY_RETURN_IF_ERROR(f->close());
  return out;
}

}  // namespace ferry
