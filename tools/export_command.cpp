// ferry export CKPT OUT: the consolidated safetensors copy (ferry/export.hpp).

#include <cstdio>
#include <cstdlib>

#include "ferry/export.hpp"
#include "ferry/runtime.hpp"
#include "tools/commands.hpp"

namespace ferry::cli {

namespace {

bool parse_count(const std::string& s, uint64_t* out) {
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 19)
    return false;
  *out = std::strtoull(s.c_str(), nullptr, 10);
  return *out > 0;
}

}  // namespace

int cmd_export(const Args& args) {
  std::vector<std::string> paths;
  ExportOptions o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--max-shard-bytes" || a == "--block-bytes") {
      uint64_t* target = a == "--max-shard-bytes" ? &o.max_shard_bytes : &o.block_bytes;
      if (i + 1 >= args.size() || !parse_count(args[i + 1], target)) {
        std::fprintf(stderr, "ferry export: %s takes a positive whole number of bytes\n",
                     a.c_str());
        return 2;
      }
      ++i;
    } else if (a.rfind("--", 0) == 0) {
      std::fprintf(stderr, "ferry export: unknown flag %s\n", a.c_str());
      return 2;
    } else {
      paths.push_back(a);
    }
  }
  if (paths.size() != 2) {
    std::fprintf(stderr,
                 "usage: ferry export CKPT|ROOT OUT [--max-shard-bytes N] [--block-bytes N]\n");
    return 2;
  }
  // One process of its own: a small pool is enough, the load streams
  // through it.
  RuntimeArgs ra;
  ra.set("pool-bytes", "64MiB");
  auto rt = Runtime::create(ra);
  if (!rt.ok()) return failed("export", rt.status());
  auto index = export_checkpoint(**rt, paths[0], paths[1], o);
  if (!index.ok()) return failed("export", index.status());
  std::printf("%s\n", index->c_str());
  return 0;
}

}  // namespace ferry::cli
