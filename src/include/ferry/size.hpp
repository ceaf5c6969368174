// Byte sizes as every Ferry setting writes them ("512MiB", "8KB", "4096"):
// one parser for the settings, the `ferry` CLI's flags and the test workers.
#pragma once

#include <cstdint>
#include <string>

#include "ferry/export_macro.hpp"
#include "ferry/status.hpp"

namespace ferry {

// A whole number of bytes with an optional suffix, in any case: B;
// K/KiB, M/MiB, G/GiB, T/TiB (powers of 1024); KB, MB, GB, TB (powers of
// 1000). Blanks around the number and the suffix are ignored; zero is a size
// (callers that need a positive one say so). invalid_argument naming the text
// and what was expected otherwise: fractions, negatives, other units, a count
// past 2^64.
FERRY_EXPORT Result<uint64_t> parse_size(const std::string& text);

}  // namespace ferry
