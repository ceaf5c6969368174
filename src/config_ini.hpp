// The strict reader of CAF-syntax INI files:
// Ferry parses its own [ferry] section instead of trusting CAF's option
// binding, because CAF 0.17 drops values it cannot parse without a word.
// Internal: the public entry points are parse_ini_settings and
// read_ini_settings in ferry/options.hpp.
#pragma once

#include <string>
#include <vector>

#include "ferry/options.hpp"

namespace ferry {

// The bytes of the INI file at `path` (the checks below; `what` names it).
Result<std::string> read_ini_text(const std::string& path, const std::string& what);

// Reads the [ferry] keys (and ferry.* keys of other sections) of the INI file
// at `path`. `what` describes the file in errors ("config file /x.ini",
// "FERRY_CONFIG=/x.ini"); `origin` prefixes each setting's origin. Refuses
// anything but a regular file (a FIFO would block the start) and files over
// a few MiB.
Result<std::vector<Setting>> read_ini_file(const std::string& path, const std::string& origin,
                                           const std::string& what);

// load_options (ferry/options.hpp), also handing back the actor config
// file's bytes ("" when there is none) so that CAF parses what Ferry read
// rather than opening the file a second time.
Result<Options> load_options(const std::vector<Setting>& code, const std::string& config_file,
                             std::string* actor_config);

}  // namespace ferry
