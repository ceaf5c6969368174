// The `ferry` CLI's subcommands. Each takes the arguments after its name and
// returns the process exit code.
#pragma once

#include <string>
#include <vector>

#include "ferry/status.hpp"

namespace ferry::cli {

using Args = std::vector<std::string>;

int cmd_ls(const Args& args);
int cmd_inspect(const Args& args);
int cmd_verify(const Args& args);
int cmd_gc(const Args& args);
int cmd_config(const Args& args);
// The drill commands live beside the drills (src/drills/cli/).
int cmd_kill_points(const Args& args);
int cmd_power_cut(const Args& args);
int cmd_demo(const Args& args);
int cmd_launch(const Args& args);
int cmd_export(const Args& args);

// "1.50 GiB"
std::string human_bytes(double bytes);

// `s` safe to print to a terminal: control characters (C0, DEL, C1), bytes
// that are not well-formed UTF-8 and backslashes become "\xNN" / "\\".
std::string printable(const std::string& s);

// 0 when `args` is one argument; else prints the usage `what` and returns 2.
int need_one(const Args& args, const char* what);

// Prints "ferry CMD: <why>" to stderr; 1, the exit code of a command that
// failed.
int failed(const char* cmd, const Status& why);

}  // namespace ferry::cli
