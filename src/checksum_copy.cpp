// xxh3_64_copy: XXH3-64's long-input loop over the library's own AVX2 stripe
// and scramble steps (its header, inlined here with the AVX2 variants
// compiled for that target alone), each 64-byte stripe stored to the
// destination right after it was loaded. Only this file sees the header in
// that mode: every name it defines stays local.
#include <cstring>

#include "checksum.hpp"
#include "copy_bytes.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#define XXH_INLINE_ALL
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#include <xxhash.h>
#endif

namespace ferry {
namespace {

#if defined(__x86_64__)
constexpr size_t kStripe = XXH_STRIPE_LEN;

// The library's hashLong loop with the default secret (checked against
// xxh3_64 for every regime by checksum_test): blocks of stripes, a scramble
// after each block, the last partial block, then the input's last stripe
// again (it overlaps what was hashed; it is not stored twice). Streaming
// stores want an aligned destination: the first `head` bytes go by memcpy,
// and each stripe then stores the 64 bytes `head` past its start (in the
// cache: the next stripe's line was prefetched).
XXH_TARGET_AVX2 uint64_t fused_avx2(uint8_t* dst, const uint8_t* in, size_t len) {
  XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
  const xxh_u8* secret = XXH3_kSecret;
  const size_t secret_size = sizeof(XXH3_kSecret);
  const size_t per_block = (secret_size - kStripe) / XXH_SECRET_CONSUME_RATE;
  const size_t block_len = kStripe * per_block;
  const size_t blocks = (len - 1) / block_len;
  const size_t head = (32 - reinterpret_cast<uintptr_t>(dst) % 32) % 32;
  std::memcpy(dst, in, head);
  size_t stored = head;
  auto stripe = [&](size_t at, const xxh_u8* key) XXH_TARGET_AVX2 {
    XXH_PREFETCH(in + at + 384);
    XXH3_accumulate_512_avx2(acc, in + at, key);
    if (stored + kStripe > len) return;
    for (size_t k = 0; k < kStripe; k += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + stored + k),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i_u*>(in + stored + k)));
    stored += kStripe;
  };
  for (size_t b = 0; b < blocks; ++b) {
    for (size_t s = 0; s < per_block; ++s)
      stripe(b * block_len + s * kStripe, secret + s * XXH_SECRET_CONSUME_RATE);
    XXH3_scrambleAcc_avx2(acc, secret + secret_size - kStripe);
  }
  const size_t stripes = ((len - 1) - block_len * blocks) / kStripe;
  for (size_t s = 0; s < stripes; ++s)
    stripe(blocks * block_len + s * kStripe, secret + s * XXH_SECRET_CONSUME_RATE);
  XXH3_accumulate_512_avx2(acc, in + len - kStripe,
                           secret + secret_size - kStripe - XXH_SECRET_LASTACC_START);
  // Streaming stores are weakly ordered: fenced before the caller reports
  // the copy done.
  _mm_sfence();
  std::memcpy(dst + stored, in + stored, len - stored);
  return XXH3_mergeAccs(acc, secret + XXH_SECRET_MERGEACCS_START,
                        static_cast<xxh_u64>(len) * XXH_PRIME64_1);
}
#endif

}  // namespace

uint64_t xxh3_64_copy(void* dst, const void* src, size_t len) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
#if defined(__x86_64__)
  // Longer inputs take XXH3's long loop.
  if (len > XXH3_MIDSIZE_MAX && has_avx2()) return fused_avx2(d, s, len);
#endif
  const uint64_t sum = xxh3_64(s, len);
  copy_bytes(d, s, len);
  return sum;
}

}  // namespace ferry
