// Faulting memory in ahead of a copy without writing it.
#pragma once

#include <cstdint>

namespace ferry {

// Faults [p, p + n) in writable without changing a byte (MADV_POPULATE_WRITE,
// Linux 5.14+); false where the kernel or the mapping refuses, and the pages
// then fault on use. One huge page per call: the kernel holds the process's
// mmap lock for a call's whole range, and every mmap or munmap of any other
// thread (a large malloc, UCX) waits for it. A 32 MiB call held it up to
// 0.27 s with both CPUs of the test VM busy.
bool populate_pages(void* p, uint64_t n);

// Host copies into a tensor fault its pages in ahead when it has none yet,
// and remember per thread the tensor they last found populated, to ask the
// kernel once per tensor. Forgets that on every thread: the memory of a
// tensor freed since may be back under the same address without its pages.
// Each load calls it before its first copy.
void forget_populated();

// Asks for transparent huge pages over memory a load is about to fill whole:
// [p, p + n) when none of its pages are there yet (a tensor just allocated),
// and the kernel gives huge pages only on request (enabled = madvise). One
// fault then zeroes 2 MiB instead of 512 faults of 4 KiB, which is most of
// a first load's time into fresh tensors, and costs no memory: every byte
// is written. With defrag = madvise that fault may compact memory first.
// False where it did not ask (too small, in use, the mode, the kernel).
bool advise_huge_pages(void* p, uint64_t n);

}  // namespace ferry
