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

}  // namespace ferry
