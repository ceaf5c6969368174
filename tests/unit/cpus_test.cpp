#include <sched.h>

#include <catch2/catch.hpp>
#include <thread>

#include "cpus.hpp"

using ferry::usable_cpus;

TEST_CASE("usable_cpus counts the CPUs the affinity mask allows, not the machine's", "[cpus]") {
  cpu_set_t all;
  CPU_ZERO(&all);
  REQUIRE(::sched_getaffinity(0, sizeof(all), &all) == 0);
  CHECK(usable_cpus() == static_cast<unsigned>(CPU_COUNT(&all)));

  // Held to one CPU, as taskset or a cpuset would hold the process.
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  REQUIRE(::sched_setaffinity(0, sizeof(one), &one) == 0);
  const unsigned held = usable_cpus();
  REQUIRE(::sched_setaffinity(0, sizeof(all), &all) == 0);
  CHECK(held == 1);
  CHECK(usable_cpus() == static_cast<unsigned>(CPU_COUNT(&all)));
}
