// ferry export CKPT OUT: the consolidated safetensors copy (ferry/export.hpp).

#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>

#include "ferry/export.hpp"
#include "ferry/runtime.hpp"
#include "tools/commands.hpp"
#include "tools/flags.hpp"

namespace ferry::cli {

namespace {

struct ExportArgs {
  std::string from, out;
  ExportOptions options;
};

int run_export(const ExportArgs& a) {
  // One process of its own: a small pool is enough, the load streams
  // through it.
  RuntimeArgs ra;
  ra.set("pool-bytes", "64MiB");
  auto rt = Runtime::create(ra);
  if (!rt.ok()) return failed("export", rt.status());
  auto index = export_checkpoint(**rt, a.from, a.out, a.options);
  if (!index.ok()) return failed("export", index.status());
  std::printf("%s\n", index->c_str());
  return 0;
}

}  // namespace

void add_export_command(CLI::App& app, int* rc) {
  auto a = std::make_shared<ExportArgs>();
  CLI::App* cmd = app.add_subcommand(
      "export", "the checkpoint as plain safetensors files with a Hugging Face index");
  cmd->add_option("CKPT", a->from, "a step directory, or a root: its latest checkpoint")
      ->required()
      ->type_name("");
  cmd->add_option("OUT", a->out, "the directory the files go to")->required()->type_name("");
  add_size_flag(*cmd, "--max-shard-bytes", &a->options.max_shard_bytes,
                "most bytes per file (default 5GiB); a larger tensor gets a file of its own");
  add_size_flag(*cmd, "--block-bytes", &a->options.block_bytes,
                "memory for the copy, plus one row (default 256MiB)");
  cmd->footer(
      "Writes every tensor of a checkpoint, whole, into OUT/model-0000i-of-0000N.safetensors\n"
      "and OUT/model.safetensors.index.json; every byte is checksum-verified on the way.\n"
      "Sizes are written as in the settings: 4096, 64MiB, 5GiB, 8KB.");
  cmd->callback([rc, a] { *rc = run_export(*a); });
}

}  // namespace ferry::cli
