// The `ferry` CLI's subcommands. Each file adds its commands, with their
// flags, to the CLI11 app; a command's callback runs it and leaves the
// process exit code in *rc.
#pragma once

#include <string>

#include "ferry/status.hpp"

namespace CLI {
class App;
}

namespace ferry::cli {

// ls, inspect, verify, gc, config
void add_catalog_commands(CLI::App& app, int* rc);
// kill-points, power-cut: they live beside the drills (src/drills/cli/).
void add_drill_commands(CLI::App& app, int* rc);
void add_export_command(CLI::App& app, int* rc);
void add_demo_command(CLI::App& app, int* rc);
void add_launch_command(CLI::App& app, int* rc);

// "1.50 GiB"
std::string human_bytes(double bytes);

// `s` safe to print to a terminal: control characters (C0, DEL, C1), bytes
// that are not well-formed UTF-8 and backslashes become "\xNN" / "\\".
std::string printable(const std::string& s);

// Prints "ferry CMD: <why>" to stderr; 1, the exit code of a command that
// failed.
int failed(const char* cmd, const Status& why);

}  // namespace ferry::cli
