// ferry: inspect, verify and clean checkpoint roots, and run the demo.

#include <cstdio>
#include <cstring>

#include "tools/commands.hpp"

namespace {

struct Command {
  const char* name;
  int (*run)(const ferry::cli::Args&);
  const char* synopsis;  // one line in `ferry --help`
  const char* help;      // `ferry NAME --help`; empty: the command prints its own
};

const Command kCommands[] = {
    {"ls", ferry::cli::cmd_ls,
     "ls ROOT [--verify]   committed checkpoints (step, commit seq, size, LATEST) and\n"
     "                       pending saves with their lease",
     "usage: ferry ls ROOT [--verify]\n"
     "  Lists the committed checkpoints of ROOT, newest first, with step, commit\n"
     "  sequence, size and tensors, marks the latest, and lists pending saves with\n"
     "  their lease (live or expired, owner). --verify re-reads every checkpoint and\n"
     "  exits 1 when the latest one is corrupt.\n"},
    {"inspect", ferry::cli::cmd_inspect,
     "inspect CKPT|ROOT    every tensor: dtype, shape, chunks, files, checksums",
     "usage: ferry inspect CKPT|ROOT\n"
     "  Shows a checkpoint's manifest: tensors, chunks, files and checksums, and\n"
     "  checks each data file's header. A ROOT means its latest checkpoint.\n"},
    {"verify", ferry::cli::cmd_verify,
     "verify CKPT|ROOT     re-read every byte and check it against the manifest",
     "usage: ferry verify CKPT|ROOT\n"
     "  Re-reads every byte of a checkpoint and checks it against the manifest;\n"
     "  exits 1 on any problem (CORRUPT: damaged or malformed; UNREADABLE: only\n"
     "  I/O errors such as permissions), 3 when it found none but chunks saved\n"
     "  without checksums could not be checked (UNCHECKED). A ROOT means its\n"
     "  latest checkpoint.\n"},
    {"gc", ferry::cli::cmd_gc,
     "gc ROOT              remove pending directories whose lease expired",
     "usage: ferry gc ROOT\n"
     "  Removes pending directories whose lease expired and leftovers of crashed\n"
     "  saves, and puts back a step that a crashed overwrite left aside.\n"},
    {"config", ferry::cli::cmd_config,
     "config               every [ferry] setting with its default",
     "usage: ferry config\n  Prints every [ferry] setting with its default and help.\n"},
    {"kill-points", ferry::cli::cmd_kill_points,
     "kill-points          the named kill points of FERRY_KILL_AT (crash tests)",
     "usage: ferry kill-points\n  Lists the kill points FERRY_KILL_AT=<point>[:<nth>][@<rank>] "
     "accepts.\n"},
    {"power-cut", ferry::cli::cmd_power_cut,
     "power-cut JOURNAL    drop what a FERRY_FAULTS journal says was not durable",
     "usage: ferry power-cut JOURNAL\n"
     "  Applies the power-cut model to what the FERRY_FAULTS journal JOURNAL\n"
     "  recorded: drops what was not durable.\n"},
    {"export", ferry::cli::cmd_export,
     "export CKPT OUT      the checkpoint as plain safetensors files (full shapes)\n"
     "                       with a Hugging Face model.safetensors.index.json",
     "usage: ferry export CKPT|ROOT OUT [--max-shard-bytes N] [--block-bytes N]\n"
     "  Writes every tensor of a checkpoint (a ROOT means its latest), whole, into\n"
     "  OUT/model-0000i-of-0000N.safetensors files of at most N bytes each (default\n"
     "  5 GiB; a larger tensor gets a file of its own) and\n"
     "  OUT/model.safetensors.index.json. Every byte is checksum-verified on the way;\n"
     "  memory stays within --block-bytes (default 256 MiB) plus one row.\n"},
    {"demo", ferry::cli::cmd_demo,
     "demo [flags]         a training loop that checkpoints in the background\n"
     "                       (ferry demo --help for its flags)",
     ""},
    {"launch", ferry::cli::cmd_launch,
     "launch -n N -- CMD   start N ranks of CMD with the torchrun environment\n"
     "                       (ferry launch --help for its flags)",
     ""},
};

void usage(FILE* out) {
  std::fprintf(out, "usage: ferry <command> [args]   (ferry <command> --help for one command)\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %s\n", c.synopsis);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  ferry::cli::Args args(argv + 2, argv + argc);
  for (const Command& c : kCommands) {
    if (cmd != c.name) continue;
    // Before the command sees its arguments, so that "--help" is never taken
    // for a path. demo and launch have flags of their own and print them.
    if (*c.help != '\0') {
      for (const auto& a : args) {
        if (a == "--help" || a == "-h") {
          std::fputs(c.help, stdout);
          return 0;
        }
      }
    }
    return c.run(args);
  }
  std::fprintf(stderr, "ferry: unknown command '%s'\n", cmd.c_str());
  usage(stderr);
  return 2;
}
