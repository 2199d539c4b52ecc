"""How translations are searched: `DecodingSettings`, one object for the search, translators, evaluation, CLIs, export.

The paper's settings are the defaults: beam size 4, length penalty alpha = 0.6 and
outputs of at most source length + 50 tokens (Vaswani et al., 2017, section 6.1); add
the minimum length (1: no empty translation) and the early-stopping rule
(`keras_transformer.search_core`). They are written here and nowhere else.

Standard library only, so that recipes, run settings and command lines can hold and
check decoding settings before TensorFlow is imported. `keras_transformer.decoding`
re-exports every name.
"""

import dataclasses
import operator

# The early stops of the search; see `keras_transformer.search_core`.
EARLY_STOPPING = ("exact", "current_length")
# Tokens generated before EOS at the least: no empty translation.
DEFAULT_MIN_LENGTH = 1
# Largest beam a translator accepts: the served search's buffers grow with it.
MAX_BEAM_SIZE = 16
# Largest length penalty: ((5 + length) / 6) ** alpha stays far inside float32 for any output
# length the model reaches; a larger alpha overflows it, and every score is then -0.
MAX_ALPHA = 10.0
# Most sentences a compiled translator searches at once; larger batches are searched that
# many at a time: most of a larger compiled batch's speed, with fewer compilations and less memory.
DEFAULT_XLA_MAX_BATCH = 16


def check_early_stopping(early_stopping):
    """Raises a ValueError unless `early_stopping` is one of `EARLY_STOPPING`."""
    if early_stopping not in EARLY_STOPPING:
        raise ValueError(f"early_stopping must be one of {EARLY_STOPPING}, got {early_stopping!r}.")


@dataclasses.dataclass(frozen=True)
class DecodingSettings:
    """How translations are searched: one object for the search, translators, evaluation, CLIs and export.

    Args:
        beam_size: Beams per sentence, 1 to `MAX_BEAM_SIZE` (the paper: 4; 1 is greedy).
        alpha: Length penalty strength, 0 to `MAX_ALPHA` (the paper: 0.6).
        max_extra_length: Outputs have at most source length + this many tokens (the paper: 50).
        min_length: Tokens generated before EOS at the least (1: no empty translation;
            0 lets EOS come first).
        early_stopping: One of `EARLY_STOPPING`: "exact" (the paper's code) or
            "current_length" (fewer steps, not always the exact result); see
            `keras_transformer.search_core`.

    Raises:
        ValueError: For a value out of range, naming the field.
        TypeError: For a length or beam size that is no integer (NumPy's integers are).
    """

    beam_size: int = 4
    alpha: float = 0.6
    max_extra_length: int = 50
    min_length: int = DEFAULT_MIN_LENGTH
    early_stopping: str = "exact"

    def __post_init__(self):
        # Python numbers: NumPy's pass the range checks but are no `int` to the search (nor to JSON).
        for name in ("beam_size", "max_extra_length", "min_length"):
            object.__setattr__(self, name, _integer(name, getattr(self, name)))
        object.__setattr__(self, "alpha", float(self.alpha))
        if not 1 <= self.beam_size <= MAX_BEAM_SIZE:
            raise ValueError(f"beam_size must be between 1 and {MAX_BEAM_SIZE}, got {self.beam_size}.")
        if not self.alpha >= 0:
            raise ValueError(f"alpha must be 0 or more, got {self.alpha}.")
        if self.alpha > MAX_ALPHA:
            raise ValueError(f"alpha must be at most {MAX_ALPHA:g}, got {self.alpha:g}.")
        if self.max_extra_length < 0:
            raise ValueError(f"max_extra_length must be 0 or more, got {self.max_extra_length}.")
        if self.min_length < 0:
            raise ValueError(f"min_length must be 0 or more, got {self.min_length}.")
        check_early_stopping(self.early_stopping)

    def replace(self, **changes):
        """A copy with `changes`; `None` values keep the current setting (unset flags)."""
        return dataclasses.replace(self, **{name: value for name, value in changes.items() if value is not None})


def _integer(name, value):
    """`value` as a Python int; a number that is no integer (2.5, 4.0, True) is a TypeError naming `name`."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}.")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}.") from None
