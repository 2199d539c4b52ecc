"""The serving contract: signature names, their inputs and outputs, and the "unset" rule, in one table.

An exported translator (`keras_transformer.translator.Translator`, written by
`keras_transformer.saved_model`) has two signatures:

* `serving_default`: `text` -> `translation`, `score`, with the decoding settings
  fixed at export. Every input and output has a batch dimension, so TF Serving's
  row format (`{"instances": [...]}`) and its request batching take it.
* `translate_with_options`: `text` and four scalar options -> the same two outputs
  and the n-best lists `translations`, `scores`. Scalars have no batch dimension:
  requests use the columnar format (`{"inputs": {...}}`), and TF Serving's batching
  refuses the signature (see `export/batching.config`).

The options follow one rule: a value below the option's `smallest` is unset and means
the model's own setting (what `serving_default` uses); clients send `unset` (0 or -1)
for it. For `max_length` the model's own is no cap beyond the source length +
`max_extra_length`. A `beam_size` over `MAX_BEAM_SIZE` is refused (INVALID_ARGUMENT,
"beam_size is at most 16"), not clipped, and so are an `alpha` over `MAX_ALPHA`
("alpha is at most 10", which `DecodingSettings` and the command lines refuse too) and
an input of another rank than its shape here (INVALID_ARGUMENT, "min_length must be a
scalar, got the shape] [2]"), except a `text` with as many strings as rows (`[batch, 1]`,
`[batch, 1, 1]`, `[0, n]`), which is read as `[batch]`.

`SIGNATURES` is read by `Translator` (its input specs and the unset rule), by the
export's self-check, by the REST and gRPC clients (`keras_transformer.serving_client`)
and by `translate.py`. Standard library only: the REST client runs where TensorFlow
does not.
"""

import dataclasses

from keras_transformer.decoding_settings import MAX_ALPHA, MAX_BEAM_SIZE

SERVING_SIGNATURE = "serving_default"
OPTIONS_SIGNATURE = "translate_with_options"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One input or output of a signature.

    Attributes:
        name: Its key in requests and responses.
        dtype: A `tf.DType` name: "string" (UTF-8 text), "int32" or "float32".
        shape: `None` for the batch dimension (and the n-best one); `()` for a scalar.
        meaning: What it holds (documentation: no code reads it).
    """

    name: str
    dtype: str
    shape: tuple
    meaning: str

    @property
    def batched(self) -> bool:
        """Whether it has a batch dimension (TF Serving's row format and batching need one)."""
        return len(self.shape) > 0

    @property
    def shape_words(self) -> str:
        """Its shape as error messages say it (inputs are scalars or vectors)."""
        return "a vector [batch]" if self.batched else "a scalar"


@dataclasses.dataclass(frozen=True)
class Option(TensorInfo):
    """A scalar option of `translate_with_options`, with its unset rule.

    Attributes:
        smallest: Values below it are unset: the model's own setting.
        unset: What a client sends for "the model's own setting".
    """

    smallest: float = 0
    unset: float = -1

    def is_set(self, value) -> bool:
        """Whether `value` (a number, or a tensor for a boolean tensor) asks for a setting of its own."""
        return value >= self.smallest


@dataclasses.dataclass(frozen=True)
class Signature:
    """A signature of an exported translator: its name, inputs and outputs, in order."""

    name: str
    inputs: tuple
    outputs: tuple

    @property
    def options(self) -> tuple:
        """The inputs that are `Option`s."""
        return tuple(tensor for tensor in self.inputs if isinstance(tensor, Option))

    @property
    def batched(self) -> bool:
        """Whether every input and output has a batch dimension: the row format and batching take it."""
        return all(tensor.batched for tensor in (*self.inputs, *self.outputs))

    def input(self, name) -> TensorInfo:
        """The input called `name`."""
        return next(tensor for tensor in self.inputs if tensor.name == name)

    def input_dtypes(self) -> dict:
        """`{name: dtype}` of the inputs: what a request's tensors are made as."""
        return {tensor.name: tensor.dtype for tensor in self.inputs}


TEXT = TensorInfo(
    "text", "string", (None,),
    "UTF-8 sentences; blank ones translate to \"\" with score 0.0, longer ones than the model's "
    "max_source_length are translated from their beginning",
)
TRANSLATION = TensorInfo("translation", "string", (None,), "the best translation of each sentence")
SCORE = TensorInfo(
    "score", "float32", (None,),
    "its summed token log-probability divided by the length penalty ((5 + tokens) / 6) ** alpha",
)
TRANSLATIONS = TensorInfo(
    "translations", "string", (None, None),
    "the n-best list of each sentence, beam_size long, best first; an empty slot holds \"\"",
)
SCORES = TensorInfo(
    "scores", "float32", (None, None), "the n-best list's scores; an empty slot holds -1e9 (decoding.NEG_INF)"
)
BEAM_SIZE = Option(
    "beam_size", "int32", (), f"beams, and hypotheses returned per sentence, at most {MAX_BEAM_SIZE}",
    smallest=1, unset=0,
)
ALPHA = Option(
    "alpha", "float32", (), f"the length penalty's strength, at most {MAX_ALPHA:g}", smallest=0.0, unset=-1.0
)
MAX_LENGTH = Option(
    "max_length", "int32", (),
    "most output tokens (EOS included), on top of the source length + max_extra_length "
    "(decoding's max_output_length)",
    smallest=1, unset=0,
)
MIN_LENGTH = Option(
    "min_length", "int32", (), "tokens generated before EOS at the least (0 lets a translation be \"\")",
    smallest=0, unset=-1,
)

SERVING_DEFAULT = Signature(SERVING_SIGNATURE, (TEXT,), (TRANSLATION, SCORE))
TRANSLATE_WITH_OPTIONS = Signature(
    OPTIONS_SIGNATURE, (TEXT, BEAM_SIZE, ALPHA, MAX_LENGTH, MIN_LENGTH), (TRANSLATION, SCORE, TRANSLATIONS, SCORES)
)
SIGNATURES = {signature.name: signature for signature in (SERVING_DEFAULT, TRANSLATE_WITH_OPTIONS)}


def options_request(**given) -> dict:
    """`translate_with_options`' option inputs: the `given` values, `unset` for those given as `None` or not at all.

    Raises:
        TypeError: For a name that is not an option.
    """
    names = [option.name for option in TRANSLATE_WITH_OPTIONS.options]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise TypeError(f"{OPTIONS_SIGNATURE} has no option {', '.join(unknown)}; its options are {', '.join(names)}.")
    return {
        option.name: option.unset if given.get(option.name) is None else given[option.name]
        for option in TRANSLATE_WITH_OPTIONS.options
    }
