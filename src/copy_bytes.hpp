// The one memcpy for tensor bytes on the host (snapshot, load, share ring).
//
// glibc 2.36 copies 4 KiB and more with `rep movsb`, and on AMD Zen cores
// that runs at a quarter of its speed when the destination lies less than
// 64 bytes past the source modulo 4 KiB: 1.5-2 GB/s against 6-7 GB/s on the
// test VM's EPYC. A tensor from malloc sits 16 bytes past a page and a
// staging block on one, so a load's copies met that case for whole ranks:
// in a 2-rank, 2,000-tensor load one rank copied at 0.6-0.7 GB/s and the
// other at 2.2-5.4 GB/s. Those copies take a plain AVX2 loop instead.
#pragma once

#include <cstddef>

namespace ferry {

void copy_bytes(void* dst, const void* src, size_t n);

#if defined(__x86_64__)
// Whether this CPU runs AVX2 (the copies' and xxh3_64_copy's fast paths).
bool has_avx2();
#endif

}  // namespace ferry
