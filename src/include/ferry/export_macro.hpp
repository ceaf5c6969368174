// FERRY_EXPORT marks the public API: libferry.so is built with hidden
// visibility and exports only what carries it (and the typeinfo and vtables
// of the classes that do).
#pragma once

#if defined(__GNUC__) || defined(__clang__)
#define FERRY_EXPORT __attribute__((visibility("default")))
#else
#define FERRY_EXPORT
#endif
