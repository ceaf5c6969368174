// How many CPUs this process may run on, for sizing its thread pools.
#pragma once

#include <sched.h>

#include <algorithm>
#include <thread>

namespace ferry {

// The calling thread's affinity mask (a container's cpuset, taskset), which
// std::thread::hardware_concurrency ignores: on a 64-CPU host a job held to
// 2 CPUs would otherwise start threads for 64. The machine's count where the
// mask cannot be read.
inline unsigned usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0)
    return static_cast<unsigned>(CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace ferry
