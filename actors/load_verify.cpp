// Checksum checks and device copies of loaded bytes (load_verify.hpp).

#include "actors/load_verify.hpp"

#include <algorithm>

#include "checksum.hpp"

namespace ferry {

namespace {

// Checks the sum of checksum block `i` of one read; the error names rank,
// tensor and file.
Status check_block(const RankContext& ctx, const Manifest& m, const ReadOp& op,
                   const std::string& path, uint32_t i, uint64_t sum) {
  const ManifestChunk& c = m.tensors[op.tensor].chunks[op.chunk];
  const uint32_t block = op.first_block + i;
  if (block >= c.checksums.size() || sum != c.checksums[block])
    return Status::corruption("rank " + std::to_string(ctx.rank) +
                              ": checksum mismatch in tensor '" + m.tensors[op.tensor].key +
                              "' (chunk " + c.entry + ", block " + std::to_string(block) +
                              ") of file " + path);
  return Status();
}

// Verifies checksum block `i` of one read (at `buf`, the read's first byte).
Status verify_block(const RankContext& ctx, const Manifest& m, const ReadOp& op,
                    const std::string& path, const uint8_t* buf, uint32_t i) {
  const uint64_t begin = static_cast<uint64_t>(i) * m.checksum_block_bytes;
  const uint64_t n = std::min<uint64_t>(m.checksum_block_bytes, op.length - begin);
  return check_block(ctx, m, op, path, i, xxh3_64(buf + begin, n));
}

}  // namespace

Status verify_blocks(const RankContext& ctx, const Manifest& m, const ReadOp& op,
                     const std::string& path, const uint8_t* buf) {
  if (m.tensors[op.tensor].chunks[op.chunk].checksums.empty()) return Status();
  for (uint32_t i = 0; i < op.nblocks; ++i)
    FERRY_RETURN_IF_ERROR(verify_block(ctx, m, op, path, buf, i));
  return Status();
}

void copy_runs(const RankContext& ctx, const std::string& key, const uint8_t* src,
               const TensorView& target, const std::vector<DeviceBackend::Run>& runs,
               CopyLatch& latch) {
  if (runs.empty()) return;
  latch.add();
  ctx.device->copy_in_runs(src, target, runs, [&latch, &key](Status st) {
    // The device names itself and the CUDA error; only we know the tensor.
    if (!st.ok()) st = st.with_context("tensor '" + key + "': ");
    latch.arrive(std::move(st));
  });
}

Status verify_and_copy(const RankContext& ctx, const Manifest& m, const ReadOp& op,
                       const std::string& path, const uint8_t* buf, const TensorView& target,
                       CopyLatch& latch, UnverifiedTensors* unverified) {
  const bool checked = !m.tensors[op.tensor].chunks[op.chunk].checksums.empty();
  const uint64_t cb = checked ? m.checksum_block_bytes : op.length;
  uint64_t verified = checked ? 0 : op.length;  // bytes of the read checked so far
  Status s;
  const std::string& key = m.tensors[op.tensor].key;
  // The copies out of the blocks checked so far, issued as one batch before
  // the next block is hashed.
  std::vector<DeviceBackend::Run> runs;
  auto verify_to = [&](uint64_t end) {
    copy_runs(ctx, key, buf, target, runs, latch);
    runs.clear();
    while (s.ok() && verified < end) {
      s = verify_block(ctx, m, op, path, buf, static_cast<uint32_t>(verified / cb));
      verified = std::min(op.length, verified + cb);
    }
  };
  for_each_copy(op, dtype_size(target.dtype), [&](uint64_t src, uint64_t dst, uint64_t n) {
    while (n > 0 && s.ok()) {
      const uint64_t block_end = std::min(op.length, verified + cb);
      if (checked && src == verified && n >= block_end - src) {
        const uint64_t k = block_end - src;
        if (auto sum = ctx.device->copy_in_summed(buf + src, target, dst, k)) {
          s = check_block(ctx, m, op, path, static_cast<uint32_t>(src / cb), *sum);
          if (!s.ok() && unverified) unverified->add(key);
          verified = block_end;
          src += k;
          dst += k;
          n -= k;
          continue;
        }
      }
      if (src >= verified) verify_to(src + 1);
      if (!s.ok()) return;
      const uint64_t k = std::min(n, verified - src);
      runs.push_back({src, dst, k});
      src += k;
      dst += k;
      n -= k;
    }
  });
  verify_to(op.length);
  return s;
}

}  // namespace ferry
