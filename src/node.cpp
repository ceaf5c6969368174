#include "node.hpp"

#include <unistd.h>

#include <cstdio>

namespace ferry {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

std::string node_identity() {
  std::string boot;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof(buf), f) != nullptr) boot = buf;
    std::fclose(f);
  }
  while (!boot.empty() && (boot.back() == '\n' || boot.back() == ' ')) boot.pop_back();
  return boot + ":" + host_name();
}

}  // namespace ferry
