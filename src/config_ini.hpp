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

// Reads the [ferry] keys (and ferry.* keys of other sections) of the INI file
// at `path`. `what` describes the file in errors ("config file /x.ini",
// "FERRY_CONFIG=/x.ini"); `origin` prefixes each setting's origin. Refuses
// anything but a regular file (a FIFO would block the start) and files over
// a few MiB.
Result<std::vector<Setting>> read_ini_file(const std::string& path, const std::string& origin,
                                           const std::string& what);

}  // namespace ferry
