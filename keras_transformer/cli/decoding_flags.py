"""The range checks of the decoding flags `translate.py`, `python -m export` and the client take.

A value out of range is a usage error, never read as "unset" (a signature's 0 or -1,
which would quietly give the served model's own setting), and so are NaN and infinity.
"""

import math

# Flag (its `args` name), the least value, and how the error says it.
_LEAST = (
    ("beam_size", 1, "at least 1"),
    ("alpha", 0, "0 or more"),
    ("max_length", 1, "at least 1"),
    ("min_length", 0, "0 or more"),
)


def check(parser, args):
    """Exits with a usage error at the first of those flags the parser has that is given out of range."""
    for name, least, bound in _LEAST:
        value = getattr(args, name, None)
        if value is not None and not math.isfinite(value):  # NaN passes any comparison with `least`
            parser.error(f"--{name.replace('_', '-')} must be a finite number, got {value}.")
        if value is not None and value < least:
            parser.error(f"--{name.replace('_', '-')} must be {bound}.")
