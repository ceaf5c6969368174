// FERRY_EXPORT marks the public API: libferry.so is built with hidden
// visibility and exports only what carries it (and the typeinfo and vtables
// of the classes that do).
#pragma once

#if defined(__GNUC__) || defined(__clang__)
// A standard attribute, so it sits beside others: class [[nodiscard]] FERRY_EXPORT X.
#define FERRY_EXPORT [[gnu::visibility("default")]]
#else
#define FERRY_EXPORT
#endif
