// ferry: inspect, verify and clean checkpoint roots, and run the demo.

#include <cstdio>
#include <cstring>

#include "tools/commands.hpp"

namespace {

void usage(FILE* out) {
  std::fprintf(out,
               "usage: ferry <command> [args]\n"
               "  ls ROOT              committed checkpoints: step, commit seq, size, LATEST\n"
               "  inspect CKPT         every tensor: dtype, shape, chunks, files, checksums\n"
               "  verify CKPT          re-read every byte and check it against the manifest\n"
               "  gc ROOT              remove pending directories whose lease expired\n"
               "  config               every [ferry] setting with its default\n"
               "  kill-points          the named kill points of FERRY_KILL_AT (crash tests)\n"
               "  power-cut JOURNAL    drop what a FERRY_FAULTS journal says was not durable\n"
               "  demo [flags]         a training loop that checkpoints in the background\n"
               "                       (ferry demo --help for its flags)\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  ferry::cli::Args args(argv + 2, argv + argc);
  if (cmd == "ls") return ferry::cli::cmd_ls(args);
  if (cmd == "inspect") return ferry::cli::cmd_inspect(args);
  if (cmd == "verify") return ferry::cli::cmd_verify(args);
  if (cmd == "gc") return ferry::cli::cmd_gc(args);
  if (cmd == "config") return ferry::cli::cmd_config(args);
  if (cmd == "kill-points") return ferry::cli::cmd_kill_points(args);
  if (cmd == "power-cut") return ferry::cli::cmd_power_cut(args);
  if (cmd == "demo") return ferry::cli::cmd_demo(args);
  if (cmd == "launch") return ferry::cli::cmd_launch(args);
  std::fprintf(stderr, "ferry: unknown command '%s'\n", cmd.c_str());
  usage(stderr);
  return 2;
}
