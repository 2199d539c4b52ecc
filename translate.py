"""Translate sentences with a trained run or an exported SavedModel.

    python translate.py --run-dir runs/multi30k-small "A man is riding a bike."
    python translate.py --saved-model models/transformer < sentences.en > sentences.de
    python translate.py --saved-model models/transformer --beam-size 8 --n-best --input val.en

Sentences come from the arguments, else from `--input` or stdin, one per line, and are
translated in batches of `--batch-size`; translations are printed in input order, one
per line (`--scores`: "score<TAB>translation"; `--n-best`: "index ||| translation |||
score" for every hypothesis). Sources longer than the translator's maximum input length
(256 tokens by default) are translated from their beginning only; empty lines give
empty lines.

With `--run-dir`, the run's best checkpoint (the averaged one, unless training went on
past it or the run was last given `--average-last 0`) is loaded into an in-process
`Translator`, with the beam size and length penalty the run was evaluated with unless
given; with `--saved-model`, a version directory or a model base directory (its highest
version is used) is loaded with `tf.saved_model.load`.
"""

import argparse
import codecs
import os
import re
import sys
from pathlib import Path

import tensorflow as tf
import tensorflow_text  # noqa: F401  Registers the SentencePiece ops a SavedModel needs.

DEFAULT_BEAM_SIZE = 4
DEFAULT_ALPHA = 0.6


class LoadError(Exception):
    """A --run-dir, --saved-model, --checkpoint or --beam-size no translator loads with, for main to report."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-dir", help="Training run directory.")
    source.add_argument(
        "--saved-model", help="Exported model: a version directory or the base directory."
    )
    parser.add_argument(
        "--checkpoint",
        help='With --run-dir: "best" (default), "averaged", "latest" or a path.',
    )
    parser.add_argument(
        "--beam-size",
        type=int,
        help=f"Beam size (default: the run's or the export's, else {DEFAULT_BEAM_SIZE}; 1 is greedy).",
    )
    parser.add_argument(
        "--alpha", type=float, help=f"Length penalty (default: the run's or the export's, else {DEFAULT_ALPHA})."
    )
    parser.add_argument(
        "--max-length", type=int, help="Most output tokens (default: source length + 50)."
    )
    parser.add_argument(
        "--min-length",
        type=int,
        help="Fewest tokens before EOS (default: the export's, else 1: a sentence never translates "
        "to an empty line; 0 lets EOS come first).",
    )
    parser.add_argument(
        "--n-best", action="store_true", help="Print all beam_size hypotheses per sentence."
    )
    parser.add_argument(
        "--early-stopping",
        help="With --run-dir: when the beam search stops, exact (default) or current_length "
        "(sooner, not always the exact result); an export searches as it was exported.",
    )
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="With --run-dir: compile the beam search with XLA (faster per sentence; each "
        "batch shape compiles once). Not with --n-best or --max-length, which use the "
        "graph-mode options signature; an export made with --jit-compile uses XLA by itself.",
    )
    parser.add_argument("--scores", action="store_true", help="Print 'score<TAB>translation'.")
    parser.add_argument("--batch-size", type=int, default=32, help="Sentences per batch.")
    parser.add_argument("--input", help="File of sentences, one per line (default: stdin).")
    parser.add_argument("sentences", nargs="*", help="Sentences to translate.")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1.")
    if args.beam_size is not None and args.beam_size < 1:
        parser.error("--beam-size must be at least 1.")
    if args.alpha is not None and args.alpha < 0:
        parser.error("--alpha must be 0 or more.")
    if args.max_length is not None and args.max_length < 1:
        parser.error("--max-length must be at least 1.")
    if args.min_length is not None and args.min_length < 0:
        parser.error("--min-length must be 0 or more.")
    if args.jit_compile and (args.saved_model or args.n_best or args.max_length is not None):
        parser.error("--jit-compile goes with --run-dir, without --n-best and --max-length.")
    if args.early_stopping is not None and args.saved_model:
        parser.error("--early-stopping goes with --run-dir; an export searches as it was exported.")
    if args.checkpoint is not None and args.saved_model:
        parser.error("--checkpoint goes with --run-dir; a SavedModel holds one set of weights.")
    return args


def wants_options(args):
    """Whether `translate_with_options` is needed: n-best, a length cap, or SavedModel options."""
    chosen = args.beam_size is not None or args.alpha is not None or args.min_length is not None
    return args.n_best or args.max_length is not None or (args.saved_model is not None and chosen)


def load_translator(args):
    """`(module, signatures)`: an in-process `Translator` for --run-dir, else the loaded SavedModel.

    Keep `module` referenced while using `signatures`: it owns their variables and resources.
    """
    if args.saved_model:
        module = tf.saved_model.load(str(version_directory(args.saved_model)))
        return module, module.signatures
    # Imported here: a SavedModel needs TensorFlow only, not this package (nor Keras).
    from keras_transformer.run_dir import RunDirError
    from keras_transformer.translator import Translator

    # Unset, the beam size and length penalty are the run's own (see Translator.from_run_dir).
    given = {
        "beam_size": args.beam_size,
        "alpha": args.alpha,
        "early_stopping": args.early_stopping,
        "min_length": args.min_length,
    }
    options = {name: value for name, value in given.items() if value is not None}
    try:
        module = Translator.from_run_dir(
            args.run_dir, args.checkpoint or "best", jit_compile=args.jit_compile, **options
        )
    except (RunDirError, ValueError) as error:  # ValueError: a --beam-size or --early-stopping it refuses.
        raise LoadError(error) from None
    return module, module.signatures()


def translate_fn(signatures, args):
    """`text [batch] -> outputs` through the signature the options need."""
    if not wants_options(args):
        return lambda text: signatures["serving_default"](text=text)
    # Unset options (0, -1.0, -1) are serving_default's own: the export's, or the run's.
    options = {
        "beam_size": tf.constant(args.beam_size or 0),
        "alpha": tf.constant(-1.0 if args.alpha is None else args.alpha, tf.float32),
        "max_length": tf.constant(args.max_length or 0),
        "min_length": tf.constant(-1 if args.min_length is None else args.min_length),
    }
    return lambda text: signatures["translate_with_options"](text=text, **options)


def version_directory(path):
    """`path` if it holds a SavedModel, else its highest-numbered version subdirectory.

    Raises:
        LoadError: When neither holds a `saved_model.pb`.
    """
    path = Path(path)
    if (path / "saved_model.pb").is_file():
        return path
    versions = sorted((p for p in path.glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
    if not versions:
        raise LoadError(f"{path} holds neither a saved_model.pb nor numbered version directories.")
    if not (versions[-1] / "saved_model.pb").is_file():
        raise LoadError(f"{versions[-1]}, the highest version in {path}, holds no saved_model.pb.")
    return versions[-1]


def open_input(args):
    """The binary stream sentences are read from: `--input`'s file, else stdin (`None` with arguments)."""
    if args.sentences:
        return None
    return open(args.input, "rb") if args.input else sys.stdin.buffer


def read_sentences(args, stream):
    """Sentences as UTF-8 bytes (invalid bytes are passed on; the translator copes)."""
    if args.sentences:
        # fsencode: the bytes as given, also those that are not UTF-8.
        return [os.fsencode(sentence) for sentence in args.sentences]
    with stream:
        data = stream.read().removeprefix(codecs.BOM_UTF8)  # An editor's mark, not text.
    lines = data.split(b"\n")  # On "\n" only, as the corpus reader: a stray "\r" must not shift lines.
    if lines[-1] == b"":
        lines.pop()
    return [line.rstrip(b"\r") for line in lines]


def batches(items, size):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def print_results(results, first_index, args):
    for offset, translation in enumerate(results["translation"].numpy()):
        if args.n_best:
            for text, score in zip(
                results["translations"][offset].numpy(),
                results["scores"][offset].numpy(),
                strict=True,
            ):
                print(f"{first_index + offset} ||| {text.decode()} ||| {score:.4f}")
        elif args.scores:
            print(f"{results['score'][offset].numpy():.4f}\t{translation.decode()}")
        else:
            print(translation.decode())


def fail(message):
    """Prints a one-line error the way argparse does; returns the exit code for bad input."""
    print(f"translate.py: error: {message}", file=sys.stderr)
    return 2


def refusal(error):
    """The message of the model's failed assertion (e.g. "beam_size is at most 16"), else TensorFlow's."""
    found = re.search(r"assertion failed: \[([^\]]*)\]", error.message)
    return f"the model refused the request: {found.group(1) if found else error.message}"


def main(argv=None):
    """Translates as the command line `argv` asks; returns the exit code (2 for bad input)."""
    args = parse_args(argv)
    try:
        # Opened first: a missing file should not wait for the model to load.
        stream = open_input(args)
    except OSError as error:
        return fail(f"cannot read --input {args.input}: {error.strerror or error}.")
    try:
        # Loaded before stdin is read: whoever types sentences learns of a bad model path at once.
        module, signatures = load_translator(args)  # `module` must outlive the signatures.
    except LoadError as error:
        return fail(error)
    sentences = read_sentences(args, stream)
    translate = translate_fn(signatures, args)
    for index, batch in enumerate(batches(sentences, args.batch_size)):
        try:
            results = translate(tf.constant(batch, dtype=tf.string))
        except tf.errors.InvalidArgumentError as error:  # An option the model refuses.
            return fail(refusal(error))
        print_results(results, index * args.batch_size, args)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
