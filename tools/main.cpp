// ferry: inspect, verify and clean checkpoint roots, export them, and run the
// demo. The commands and their flags are CLI11 subcommands (tools/*.cpp add
// them); CLI11 writes the help and refuses what they do not accept.

#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>
#include <string>

#include "tools/commands.hpp"

namespace {

// CLI11's help, with each flag's text wrapped to the terminal's 80 columns.
class Formatter : public CLI::Formatter {
 public:
  Formatter() {
    label("Usage", "usage");
    column_width(24);
  }

  std::string make_option_desc(const CLI::Option* opt) const override {
    const std::string text = CLI::Formatter::make_option_desc(opt);
    const size_t width = 80 - column_width_;
    std::string out, line;
    size_t at = 0;
    while (at < text.size()) {
      size_t end = text.find(' ', at);
      if (end == std::string::npos) end = text.size();
      const std::string word = text.substr(at, end - at);
      if (!line.empty() && line.size() + 1 + word.size() > width) {
        out += line + "\n";
        line.clear();
      }
      line += (line.empty() ? "" : " ") + word;
      at = end + 1;
    }
    return out + line;
  }
};

// The command CLI11 was parsing when it stopped, or null before one.
const CLI::App* selected(const CLI::App& app) {
  const auto subs = app.get_subcommands();
  return subs.empty() ? nullptr : subs.front();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Inspect, verify, clean and export checkpoint roots; launch ranks; run the demo.",
               "ferry");
  // Before the commands: they share the app's formatter.
  app.formatter(std::make_shared<Formatter>());
  app.require_subcommand(1);
  // A flag given twice keeps its last value, as the hand parser did.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  int rc = 0;
  ferry::cli::add_catalog_commands(app, &rc);
  ferry::cli::add_drill_commands(app, &rc);
  ferry::cli::add_export_command(app, &rc);
  ferry::cli::add_demo_command(app, &rc);
  ferry::cli::add_launch_command(app, &rc);
  // After the commands: a footer set before would be theirs too.
  app.footer("ferry COMMAND --help prints the flags of one command.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help: to stdout
    // A usage error: the exit code 2 of every usage error, before and after
    // CLI11 (whose own codes are 105-114).
    const CLI::App* sub = selected(app);
    if (sub != nullptr) {
      std::fprintf(stderr, "ferry %s: %s\n(ferry %s --help shows its usage)\n",
                   sub->get_name().c_str(), e.what(), sub->get_name().c_str());
      return 2;
    }
    if (argc < 2)
      std::fprintf(stderr, "ferry: a command is required\n");
    else if (argv[1][0] != '-')
      std::fprintf(stderr, "ferry: unknown command '%s'\n", argv[1]);
    else
      std::fprintf(stderr, "ferry: %s\n", e.what());
    std::fputs(app.help().c_str(), stderr);
    return 2;
  }
  return rc;
}
