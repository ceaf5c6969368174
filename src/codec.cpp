// zstd frames for compressed chunks; see codec.hpp for the format.

#include "codec.hpp"

#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <thread>

#include "checksum.hpp"
#include "work_queue.hpp"

namespace ferry {
namespace {

// O_DIRECT wants buffers, offsets and lengths aligned; 4096 covers every
// device Ferry targets (the loader assumes the same).
constexpr uint64_t kAlign = 4096;

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

}  // namespace

uint64_t max_stored_bytes(uint64_t raw, uint64_t frame_bytes) {
  const uint64_t full = raw / frame_bytes, rest = raw % frame_bytes;
  // + 4: the content checksum each frame carries.
  uint64_t n = full * (ZSTD_compressBound(frame_bytes) + 4);
  if (rest) n += ZSTD_compressBound(rest) + 4;
  return n;
}

int compress_level(const std::string& compress) {
  const std::string head = std::string(kCodecZstd) + ":";
  if (compress.compare(0, head.size(), head) != 0) return 0;
  return std::atoi(compress.c_str() + head.size());
}

Result<std::vector<Compressed>> compress_spans(const std::vector<RawSpan>& spans, int level,
                                               uint32_t threads, uint64_t frame_bytes) {
  std::vector<Compressed> out(spans.size());
  // Every frame of every span is one job: a state of many small tensors and
  // one of a few large ones both keep every thread busy.
  struct Job {
    size_t span;
    uint64_t frame;
  };
  std::vector<Job> jobs;
  std::vector<size_t> first_job(spans.size());
  for (size_t s = 0; s < spans.size(); ++s) {
    out[s].raw_bytes = spans[s].bytes;
    out[s].frame_bytes = frame_bytes;
    first_job[s] = jobs.size();
    for (uint64_t f = 0; f * frame_bytes < spans[s].bytes; ++f) jobs.push_back({s, f});
  }
  std::vector<std::vector<uint8_t>> parts(jobs.size());
  std::vector<std::string> errors(jobs.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    std::unique_ptr<ZSTD_CCtx, decltype(&ZSTD_freeCCtx)> cctx(ZSTD_createCCtx(), ZSTD_freeCCtx);
    for (size_t j = next++; j < jobs.size(); j = next++) {
      if (!cctx) {
        errors[j] = "no memory for a zstd context";
        continue;
      }
      const RawSpan& span = spans[jobs[j].span];
      const uint64_t at = jobs[j].frame * frame_bytes;
      const uint64_t len = std::min(frame_bytes, span.bytes - at);
      parts[j].resize(ZSTD_compressBound(len));
      // Each frame carries its own content checksum, so a damaged frame is
      // caught on decode even in a checkpoint saved without block checksums.
      ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_compressionLevel, level);
      ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_checksumFlag, 1);
      const size_t got =
          ZSTD_compress2(cctx.get(), parts[j].data(), parts[j].size(), span.data + at, len);
      if (ZSTD_isError(got)) {
        errors[j] = ZSTD_getErrorName(got);
        continue;
      }
      parts[j].resize(got);
    }
  };
  const size_t nthreads = std::max<size_t>(1, std::min<size_t>(threads, jobs.size()));
  {
    WorkQueue helpers("ferry.zstd", nthreads - 1, WorkQueue::AtStop::run_queued);
    for (size_t t = 1; t < nthreads; ++t) helpers.post(work);
    work();
  }  // every helper's work done
  for (size_t s = 0; s < spans.size(); ++s) {
    uint64_t total = 0;
    const size_t end = s + 1 < spans.size() ? first_job[s + 1] : jobs.size();
    for (size_t j = first_job[s]; j < end; ++j) {
      if (!errors[j].empty())
        return Status::internal(spans[s].who + ": zstd frame " + std::to_string(jobs[j].frame) +
                                ": " + errors[j]);
      total += parts[j].size();
      out[s].frame_ends.push_back(total);
    }
    out[s].data.reserve(total);
    for (size_t j = first_job[s]; j < end; ++j) {
      out[s].data.insert(out[s].data.end(), parts[j].begin(), parts[j].end());
      std::vector<uint8_t>().swap(parts[j]);
    }
  }
  return out;
}

Result<Compressed> compress_frames(const uint8_t* raw, uint64_t n, int level, uint32_t threads,
                                   const std::string& who, uint64_t frame_bytes) {
  FERRY_ASSIGN_OR_RETURN(std::vector<Compressed> one,
                         compress_spans({{raw, n, who}}, level, threads, frame_bytes));
  return std::move(one[0]);
}

Status decompress_frames(const uint8_t* stored, uint64_t stored_len,
                         const std::vector<uint64_t>& frame_ends, uint64_t frame_bytes,
                         uint64_t raw_bytes, uint64_t first, uint64_t count, uint8_t* out,
                         const std::string& who) {
  if (first + count > frame_ends.size())
    return Status::corruption(who + ": frames " + std::to_string(first) + "+" +
                              std::to_string(count) + " past the chunk's " +
                              std::to_string(frame_ends.size()));
  std::unique_ptr<ZSTD_DCtx, decltype(&ZSTD_freeDCtx)> dctx(ZSTD_createDCtx(), ZSTD_freeDCtx);
  if (!dctx) return Status::internal(who + ": no memory for a zstd context");
  const uint64_t base = first ? frame_ends[first - 1] : 0;
  for (uint64_t i = first; i < first + count; ++i) {
    const uint64_t begin = (i ? frame_ends[i - 1] : 0) - base;
    const uint64_t end = frame_ends[i] - base;
    const uint64_t want = std::min(frame_bytes, raw_bytes - i * frame_bytes);
    if (end < begin || end > stored_len)
      return Status::corruption(who + ": frame " + std::to_string(i) + " lies outside the data");
    const size_t got = ZSTD_decompressDCtx(dctx.get(), out + (i - first) * frame_bytes, want,
                                           stored + begin, end - begin);
    if (ZSTD_isError(got) || got != want)
      return Status::corruption(
          who + ": zstd frame " + std::to_string(i) + " does not decode (" +
          (ZSTD_isError(got) ? std::string(ZSTD_getErrorName(got))
                             : std::to_string(got) + " of " + std::to_string(want) + " bytes") +
          ")");
  }
  return Status();
}

Status read_compressed(File& f, const std::string& path, const Manifest& m, const ReadOp& op,
                       std::vector<uint8_t>* raw) {
  const ManifestTensor& t = m.tensors[op.tensor];
  const ManifestChunk& c = t.chunks[op.chunk];
  const std::string who = "tensor '" + t.key + "' (chunk " + c.entry + ") of file " + path;
  raw->resize(op.length);
  if (op.length == 0) return Status();
  const uint64_t fb = c.frame_bytes;
  const uint64_t first = op.chunk_offset / fb;
  const uint64_t last = (op.chunk_offset + op.length - 1) / fb;
  if (last >= c.frame_ends.size())
    return Status::corruption(who + ": raw bytes past its last frame");
  // Stored range of the frames, widened to whole checksum blocks.
  uint64_t s0 = first ? c.frame_ends[first - 1] : 0, s1 = c.frame_ends[last];
  const uint64_t cb = m.checksum_block_bytes;
  const bool sums = !c.checksums.empty() && cb > 0;
  const uint64_t r0 = sums ? s0 / cb * cb : s0;
  const uint64_t r1 = sums ? std::min((s1 + cb - 1) / cb * cb, c.byte_length) : s1;
  const uint64_t a0 = (c.byte_offset + r0) / kAlign * kAlign;
  const uint64_t a1 = (c.byte_offset + r1 + kAlign - 1) / kAlign * kAlign;
  std::unique_ptr<uint8_t, FreeDeleter> buf(
      static_cast<uint8_t*>(std::aligned_alloc(kAlign, std::max<uint64_t>(kAlign, a1 - a0))));
  if (!buf) return Status::internal(who + ": no memory for a read of " + std::to_string(a1 - a0));
  FERRY_ASSIGN_OR_RETURN(size_t got, f.pread(buf.get(), a1 - a0, a0));
  const uint64_t at = c.byte_offset + r0 - a0;  // where stored byte r0 is in buf
  if (got < at + (r1 - r0))
    return Status::corruption("file " + path + " is truncated: " + who + " needs bytes up to " +
                              std::to_string(c.byte_offset + r1));
  if (sums) {
    for (uint64_t b = r0 / cb; b * cb < r1; ++b) {
      const uint64_t n = std::min(cb, c.byte_length - b * cb);
      if (b >= c.checksums.size() || xxh3_64(buf.get() + at + (b * cb - r0), n) != c.checksums[b])
        return Status::corruption("checksum mismatch in " + who + " (stored block " +
                                  std::to_string(b) + ")");
    }
  }
  // The frames' raw bytes, no more: the last frame of a chunk is short.
  const uint64_t end = std::min(c.raw_length, (last + 1) * fb);
  if (end < op.chunk_offset + op.length)
    return Status::corruption(who + ": raw bytes past its raw length");
  std::unique_ptr<uint8_t[]> frames(new (std::nothrow) uint8_t[end - first * fb]);
  if (!frames)
    return Status::internal(who + ": no memory to decode " + std::to_string(end - first * fb) +
                            " bytes");
  FERRY_RETURN_IF_ERROR(decompress_frames(buf.get() + at + (s0 - r0), s1 - s0, c.frame_ends, fb,
                                          c.raw_length, first, last - first + 1, frames.get(),
                                          who));
  std::memcpy(raw->data(), frames.get() + (op.chunk_offset - first * fb), op.length);
  return Status();
}

}  // namespace ferry
