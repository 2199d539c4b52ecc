"""The range checks of the decoding flags `translate.py`, `python -m export` and the client take.

A value out of range is a usage error, never read as "unset" (a signature's 0 or -1,
which would quietly give the served model's own setting), and so are NaN and infinity.
The lengths and the beam go to the model as int32: a larger value would wrap around.
"""

import math

from keras_transformer.decoding_settings import MAX_ALPHA

INT32_MAX = 2**31 - 1

# Flag (its `args` name), the least and the largest value, and how the error says the range.
_RANGES = (
    ("beam_size", 1, INT32_MAX, "at least 1"),
    ("alpha", 0, MAX_ALPHA, "0 or more"),
    ("max_length", 1, INT32_MAX, "at least 1"),
    ("min_length", 0, INT32_MAX, "0 or more"),
)


def check(parser, args):
    """Exits with a usage error at the first of those flags the parser has that is given out of range."""
    for name, least, most, bound in _RANGES:
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = f"--{name.replace('_', '-')}"
        if not math.isfinite(value):  # NaN passes any comparison with `least`
            parser.error(f"{flag} must be a finite number, got {value}.")
        if value < least:
            parser.error(f"{flag} must be {bound}.")
        if value > most:
            parser.error(f"{flag} must be at most {_shown(most)}, got {_shown(value)}.")


def _shown(number):
    return f"{number:,}" if isinstance(number, int) else f"{number:g}"
