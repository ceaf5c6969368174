"""Byte sizes as every Ferry setting writes them ("512MiB", "8KB", "4096"),
for the flags of `python3 -m ferry`: the same texts accepted and refused, and
the same bytes, as ferry::parse_size (src/options.cpp); tests/size_cases.txt
holds the cases both are checked against."""

from __future__ import annotations

_DIGITS = "0123456789"
# The C++ trim's blanks: no newline.
_BLANKS = " \t\r\f\v"
_MAX = (1 << 64) - 1
_SUFFIXES = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
    "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
}
_EXPECTED = ("expected a size like 512MiB (a whole number of bytes, optionally with a suffix "
             "B, KB/MB/GB/TB, KiB/MiB/GiB/TiB or K/M/G/T)")


def _ascii_lower(s: str) -> str:
    # str.lower() would fold non-ASCII letters (the Kelvin sign to "k"); C's tolower does not.
    return "".join(chr(ord(c) + 32) if "A" <= c <= "Z" else c for c in s)


def _why(text: str) -> str | int:
    t = text.strip(_BLANKS)
    n = 0
    while n < len(t) and t[n] in _DIGITS:
        n += 1
    if n == 0:
        return "a size cannot be negative" if t.startswith("-") else _EXPECTED
    number = int(t[:n])
    if number > _MAX:
        return "too large for a 64-bit byte count"
    mult = _SUFFIXES.get(_ascii_lower(t[n:].strip(_BLANKS)))
    if mult is None:
        return _EXPECTED
    if number * mult > _MAX:
        return "too large for a 64-bit byte count"
    return number * mult


def parse_size(text: str) -> int:
    """The bytes of `text`: a whole number with an optional suffix in any
    case, B; K/KiB, M/MiB, G/GiB, T/TiB (powers of 1024); KB, MB, GB, TB
    (powers of 1000); blanks around the number and the suffix ignored; zero
    is a size. ValueError naming the text and what was expected otherwise."""
    got = _why(text)
    if isinstance(got, str):
        raise ValueError("'%s' is not a size: %s" % (text, got))
    return got
