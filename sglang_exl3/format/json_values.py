"""What a JSON value read from a checkpoint's metadata must be, where a count, an index or a number belongs.

JSON `true` and `false` load as Python bools, which are ints: every rule that wants a number uses these instead of
`isinstance(v, int)`, so a boolean is refused rather than read as 1 or 0.
"""

from __future__ import annotations


def is_int(value) -> bool:
    """A JSON integer (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A JSON integer or float (not a boolean)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
