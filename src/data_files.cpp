#include "data_files.hpp"

#include <functional>

#include "codec.hpp"
#include "layout.hpp"

namespace ferry {

int DataFileOptions::level() const {
  return compress_level(compress);
}

std::string DataFileOptions::extension() const {
  return level() > 0 ? kCompressedExtension : "safetensors";
}

Result<DataFileOptions> resolve_data_files(const Options& cfg, const SaveOptions& o,
                                           bool custom_writer) {
  DataFileOptions out;
  out.prefix = o.filename_prefix.value_or(cfg.filename_prefix);
  FERRY_RETURN_IF_ERROR(check_filename_prefix(out.prefix, "SaveOptions::filename_prefix"));
  if (!o.shard_size) {
    out.max_bytes = cfg.shard_size;
  } else if (*o.shard_size <= 0) {
    return Status::invalid_argument("SaveOptions::shard_size = " + std::to_string(*o.shard_size) +
                                    ": must be positive (leave it unset for no cap)");
  } else {
    out.max_bytes = static_cast<uint64_t>(*o.shard_size);
  }
  FERRY_ASSIGN_OR_RETURN(
      out.compress, parse_compress(o.compress.value_or(cfg.compress), "SaveOptions::compress"));
  // The function writes the bytes; Ferry cannot store them compressed.
  if (custom_writer) out.compress = "none";
  return out;
}

Status check_data_files(const DataFileOptions& o, const std::string& who) {
  FERRY_RETURN_IF_ERROR(check_filename_prefix(o.prefix, who + " file prefix"));
  FERRY_ASSIGN_OR_RETURN(std::string normal, parse_compress(o.compress, who + " compress"));
  if (normal != o.compress)
    return Status::invalid_argument(who + " compress '" + o.compress + "' is not normalized");
  return Status();
}

Result<std::vector<PlannedFile>> data_files(const LocalPlan& local, const RankPlan& plan,
                                            const DataFileOptions& o) {
  // The plan's chunks grouped by plan file, each group in plan order.
  std::vector<std::vector<FileSlice>> by_file(plan.files);
  for (const ChunkAssignment& a : plan.chunks) {
    if (a.item >= local.items.size() || a.file >= plan.files)
      return Status::internal("rank " + std::to_string(plan.rank) + "'s plan refers to item " +
                              std::to_string(a.item) + " / file " + std::to_string(a.file) +
                              " it does not have");
    const WriteItem& it = local.items[a.item];
    const Box& box = chunk_box(a, it);
    // Splits are along dim 0, so a chunk is one contiguous byte range of the
    // item's row-major bytes.
    uint64_t skip = 0;
    if (!box.offsets.empty() && it.box.sizes[0] > 0)
      skip = static_cast<uint64_t>(box.offsets[0] - it.box.offsets[0]) *
             (it.nbytes / static_cast<uint64_t>(it.box.sizes[0]));
    by_file[a.file].push_back({a.item, box, skip});
  }
  const std::string ext = o.extension();
  std::vector<PlannedFile> out;
  if (o.max_bytes == 0) {
    for (uint32_t f = 0; f < by_file.size(); ++f) {
      if (by_file[f].empty()) continue;  // a rank with nothing to write writes no file
      out.push_back({data_file_name(o.prefix, plan.rank, f, ext), std::move(by_file[f])});
    }
    return out;
  }
  // The cap decides the files: every chunk, in order, packed (and split
  // along dim 0 where needed) into files of at most max_bytes.
  std::vector<FileSlice> all;
  std::vector<ChunkRef> refs;
  for (auto& slices : by_file)
    for (auto& s : slices) {
      const WriteItem& it = local.items[s.item];
      refs.push_back({it.key, it.dtype, it.global_shape, s.box, nullptr});
      all.push_back(std::move(s));
    }
  if (all.empty()) return out;
  std::function<uint64_t(uint64_t)> stored;
  if (o.level() > 0) stored = [](uint64_t raw) { return max_stored_bytes(raw); };
  auto packed = pack_into_files(refs, o.max_bytes, stored);
  for (uint32_t f = 0; f < packed.size(); ++f) {
    PlannedFile pf{data_file_name(o.prefix, plan.rank, f, ext), {}};
    for (const FilePiece& p : packed[f]) {
      const FileSlice& src = all[p.source];
      pf.slices.push_back({src.item, p.chunk.box, src.skip + p.skip});
    }
    out.push_back(std::move(pf));
  }
  return out;
}

}  // namespace ferry
