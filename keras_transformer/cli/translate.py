"""`kt-translate` (`python translate.py`): translate sentences with a trained run or an exported SavedModel.

    kt-translate --run-dir runs/multi30k-small "A man is riding a bike."
    kt-translate --saved-model models/transformer < sentences.en > sentences.de
    kt-translate --saved-model models/transformer --beam-size 8 --n-best --input val.en
    kt-translate --run-dir runs/multi30k-small --attention dog.png "A dog runs."

Sentences come from the arguments, else from `--input` or stdin, one per line, and are
translated in batches of at most `--batch-size`; translations are printed (to `--output`
if given) in input order, one per line (`--scores`: "score<TAB>translation";
`--n-best`: "index ||| translation ||| score" for every hypothesis), and flushed after
each batch. Sources longer than the translator's `max_source_length` (tokens, EOS
included) are translated from their beginning only; empty lines give empty lines.

Input is read as it arrives, never whole: a batch is what has arrived when its first
line is read, up to `--batch-size` lines, so a sentence typed at a terminal or written
to a pipe is answered at once, and a file of any size is translated in full batches
with bounded memory. Lines end at "\\n" only, as the corpus reader's; a line's trailing
"\\r" (CRLF files) and a leading byte order mark are dropped; invalid UTF-8 is passed on.

With `--output`, the terminal is free for progress: a line on stderr every
`PROGRESS_SECONDS` with the sentences translated so far and their rate, and one at the
end (none when translations go to stdout, where they are the progress).

`--attention FILE.png` (with `--run-dir`, for one sentence given as an argument) draws
the encoder-decoder attention of the translation, teacher forced on the translation as
the tokenizer splits it: a heatmap per decoder layer, mean over heads, source pieces
across and translation pieces down (see `keras_transformer.attention_plot`).

With `--run-dir`, the run's best checkpoint (the averaged one while it is current, else
the one with the best validation BLEU, else the latest: `run_dir.checkpoint_path`) is
loaded into an in-process `Translator`, with the run's `DecodingSettings` (the beam size
and length penalty it was evaluated with) and the flags given replacing theirs; with
`--saved-model`, a version directory or a model base directory (its highest version is
used) is loaded with `tf.saved_model.load`. Either is called through the signatures of
`keras_transformer.signatures`: `serving_default`, or `translate_with_options` for
`--n-best`, `--max-length` (the output cap, the signature's `max_length` input) and, with
a SavedModel, any decoding flag (the flags not given are unset: the export's own).
"""

import argparse
import codecs
import collections
import contextlib
import os
import re
import select
import sys
import time
from pathlib import Path

import tensorflow as tf
import tensorflow_text  # noqa: F401  Registers the SentencePiece ops a SavedModel needs.

from keras_transformer import signatures as signature_table
from keras_transformer.cli import xla_batch
from keras_transformer.decoding_settings import EARLY_STOPPING, DecodingSettings

# The command's name in its messages: kt-translate when run so, else the repository's script.
PROG = Path(sys.argv[0]).name if Path(sys.argv[0]).name == "kt-translate" else "translate.py"
# Bytes asked of the input at a time: a few batches of typical lines, never the whole input.
READ_CHUNK_BYTES = 1 << 16
# Seconds between progress lines on stderr while translating into an --output file.
PROGRESS_SECONDS = 10.0


class LoadError(Exception):
    """A --run-dir, --saved-model, --checkpoint or --beam-size no translator loads with, for main to report."""


def parse_args(argv=None):
    defaults = DecodingSettings()
    parser = argparse.ArgumentParser(
        prog=PROG, description="Translate sentences with a trained run or an exported SavedModel."
    )
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
        help=f"Beam size (default: the run's or the export's, else {defaults.beam_size}; 1 is greedy).",
    )
    parser.add_argument(
        "--alpha", type=float, help=f"Length penalty (default: the run's or the export's, else {defaults.alpha})."
    )
    parser.add_argument(
        "--max-length",
        type=int,
        help=f"Output cap: most output tokens (default: source length + {defaults.max_extra_length}).",
    )
    parser.add_argument(
        "--min-length",
        type=int,
        help=f"Fewest tokens before EOS (default: the export's, else {defaults.min_length}: a sentence never "
        "translates to an empty line; 0 lets EOS come first).",
    )
    parser.add_argument(
        "--n-best", action="store_true", help="Print all beam_size hypotheses per sentence."
    )
    parser.add_argument(
        "--early-stopping",
        choices=EARLY_STOPPING,
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
    xla_batch.add_flag(parser)
    parser.add_argument("--scores", action="store_true", help="Print 'score<TAB>translation'.")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="Most sentences per batch (a batch holds the input lines that have arrived, up to this many).",
    )
    parser.add_argument(
        "--input", help="File of sentences, one per line, read as it is translated (default: stdin)."
    )
    parser.add_argument("--output", help="File the translations are written to (default: stdout).")
    parser.add_argument(
        "--attention",
        metavar="FILE.png",
        help="With --run-dir and one sentence argument: also draw the encoder-decoder attention of its "
        "translation (a heatmap per decoder layer, mean over heads) as a PNG.",
    )
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
    xla_batch.check(parser, args)
    if args.early_stopping is not None and args.saved_model:
        parser.error("--early-stopping goes with --run-dir; an export searches as it was exported.")
    if args.checkpoint is not None and args.saved_model:
        parser.error("--checkpoint goes with --run-dir; a SavedModel holds one set of weights.")
    if args.attention is not None and (args.saved_model or len(args.sentences) != 1 or args.input):
        parser.error(
            "--attention goes with --run-dir and one sentence given as an argument (a SavedModel "
            "does not return its attention)."
        )
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
    module = run_translator(args)
    return module, module.signatures()


def run_translator(args):
    """The in-process `Translator` of --run-dir, with the decoding flags given replacing the run's."""
    # Imported here: a SavedModel needs TensorFlow only, not the model's code (nor Keras).
    from keras_transformer import run_dir
    from keras_transformer.translator import Translator

    try:
        # Unset, the settings are the run's own.
        decoding = run_dir.decoding_settings(args.run_dir).replace(
            beam_size=args.beam_size, alpha=args.alpha, early_stopping=args.early_stopping, min_length=args.min_length
        )
        return Translator.from_run_dir(
            args.run_dir, args.checkpoint or "best", decoding=decoding, jit_compile=args.jit_compile,
            xla_max_batch=xla_batch.chosen(args),
        )
    except (run_dir.RunDirError, ValueError) as error:  # ValueError: a --beam-size it refuses.
        raise LoadError(error) from None


def translate_fn(signatures, args):
    """`text [batch] -> outputs` through the signature the options need."""
    if not wants_options(args):
        return lambda text: signatures[signature_table.SERVING_SIGNATURE](text=text)
    # Unset options are serving_default's own: the export's, or the run's.
    options = signature_table.options_request(
        beam_size=args.beam_size, alpha=args.alpha, max_length=args.max_length, min_length=args.min_length
    )
    inputs = {
        name: tf.constant(value, signature_table.TRANSLATE_WITH_OPTIONS.input(name).dtype)
        for name, value in options.items()
    }
    return lambda text: signatures[signature_table.OPTIONS_SIGNATURE](text=text, **inputs)


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


def open_output(args):
    """The text stream translations are written to: `--output`'s file (UTF-8), else `None` for stdout.

    Raises:
        OSError: If the file cannot be written, or is the `--input` file (which opening it would empty).
    """
    if args.output is None:
        return None
    if args.input and os.path.exists(args.output) and os.path.samefile(args.input, args.output):
        raise OSError("it is the --input file, which writing would erase before it is read")
    return open(args.output, "w", encoding="utf-8")


class LineReader:
    """The lines of a binary stream, read a chunk at a time as they arrive.

    Lines end at "\\n" only, as the corpus reader's: a stray "\\r" inside a line does not
    split it. A line's trailing "\\r"s (CRLF files) and the first line's UTF-8 byte order
    mark (an editor's mark, not text) are dropped; a last line without "\\n" is a line.
    Bytes are not decoded: invalid UTF-8 is passed on (the translator copes).

    A stream with a file descriptor is read with `os.read`, past any Python buffer:
    nothing else may have read from it. Memory holds what one read returned at most,
    beyond the line being completed.
    """

    def __init__(self, stream, chunk_bytes=READ_CHUNK_BYTES):
        self._stream = stream
        self._chunk_bytes = chunk_bytes
        self._fd = _file_descriptor(stream)
        self._lines = collections.deque()  # Whole lines read and not yet returned.
        self._partial = []  # The pieces of the line being read.
        self._at_end = False
        self._first = True

    def __iter__(self):
        while (line := self.next_line()) is not None:
            yield line

    def next_line(self):
        """The next line, waiting for it if need be; `None` at the end of the input."""
        while not self._lines and not self._at_end:
            self._read_chunk()
        if not self._lines:
            return None
        line = self._lines.popleft()
        if self._first:
            self._first = False
            line = line.removeprefix(codecs.BOM_UTF8)
        return line.rstrip(b"\r")

    def line_ready(self):
        """Whether `next_line` returns without waiting: a whole line, or the end, has arrived."""
        while not self._lines and not self._at_end and self._readable_now():
            self._read_chunk()
        return bool(self._lines) or self._at_end

    def _read_chunk(self):
        if self._fd is not None:
            chunk = os.read(self._fd, self._chunk_bytes)
        else:
            chunk = _read_some(self._stream, self._chunk_bytes)
        if not chunk:
            self._at_end = True  # Never read again: a terminal would wait for a second Ctrl-D.
            if self._partial:
                self._lines.append(b"".join(self._partial))
                self._partial = []
            return
        *whole, rest = chunk.split(b"\n")
        if whole:
            whole[0] = b"".join([*self._partial, whole[0]])
            self._partial = []
            self._lines.extend(whole)
        if rest:
            self._partial.append(rest)

    def _readable_now(self):
        """Whether a read returns without waiting (always, for a stream `select` cannot poll)."""
        if self._fd is None:
            return True
        try:
            return bool(select.select([self._fd], [], [], 0)[0])
        except (OSError, ValueError):  # Windows pipes: a batch then waits until it is full or the input ends.
            return True


def _file_descriptor(stream):
    """`stream`'s file descriptor, or `None` for an in-memory stream such as `io.BytesIO`."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the latter.
        return None


def _read_some(stream, size):
    """Up to `size` bytes of a stream without a file descriptor, with one read if it allows."""
    return stream.read1(size) if hasattr(stream, "read1") else stream.read(size)


def arriving_batches(lines, size):
    """Batches of the lines of a `LineReader`: the first waited for, then those already there, up to `size`."""
    while (first := lines.next_line()) is not None:
        batch = [first]
        while len(batch) < size and lines.line_ready():
            line = lines.next_line()
            if line is None:
                break
            batch.append(line)
        yield batch


def input_batches(args, stream):
    """Batches of sentences as UTF-8 bytes: the arguments', else `stream`'s lines as they arrive."""
    if not args.sentences:
        yield from arriving_batches(LineReader(stream), args.batch_size)
        return
    # fsencode: the bytes as given, also those that are not UTF-8.
    sentences = [os.fsencode(sentence) for sentence in args.sentences]
    for start in range(0, len(sentences), args.batch_size):
        yield sentences[start : start + args.batch_size]


def read_sentences(args, stream):
    """All sentences as UTF-8 bytes, as `input_batches` gives them (invalid bytes are passed on)."""
    with contextlib.closing(stream) if stream is not None else contextlib.nullcontext():
        return [sentence for batch in input_batches(args, stream) for sentence in batch]


def print_results(results, first_index, args, file=None):
    """Prints a batch's translations as the options ask, to `file` (default: stdout)."""
    for offset, translation in enumerate(results[signature_table.TRANSLATION.name].numpy()):
        if args.n_best:
            for text, score in zip(
                results[signature_table.TRANSLATIONS.name][offset].numpy(),
                results[signature_table.SCORES.name][offset].numpy(),
                strict=True,
            ):
                print(f"{first_index + offset} ||| {text.decode()} ||| {score:.4f}", file=file)
        elif args.scores:
            print(f"{results[signature_table.SCORE.name][offset].numpy():.4f}\t{translation.decode()}", file=file)
        else:
            print(translation.decode(), file=file)


def write_attention(translator, sentence, translation, path):
    """Draws the attention of `translator` (a `Translator`) while it writes `translation`, as a PNG at `path`.

    Teacher forced on the translation as the tokenizer splits it, which is nearly always
    the split the search produced; the source is cut as `translate` cuts it.
    """
    # Imported here: only --attention needs matplotlib.
    from keras_transformer import attention_plot, data, evaluation
    from keras_transformer.tokenizer import EOS_ID

    tokenizer = translator.tokenizer
    sources = data.make_translation_dataset([sentence], tokenizer, max_source_length=translator.max_source_length)
    source_ids = next(iter(sources))
    output_ids = [[*tokenizer.tokenize([translation])[0].numpy(), EOS_ID]]
    [attention] = evaluation.translation_attention(translator.model, tokenizer, source_ids, output_ids)
    figure = attention_plot.attention_figure(attention.layers, attention.source_pieces, attention.output_pieces)
    attention_plot.save_png(figure, path)


def fail(message):
    """Prints a one-line error the way argparse does; returns the exit code for bad input."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def refusal(error):
    """The message of the model's failed assertion (e.g. "beam_size is at most 16"), else TensorFlow's."""
    found = re.search(r"assertion failed: \[([^\]]*)\]", error.message)
    return f"the model refused the request: {found.group(1) if found else error.message}"


def main(argv=None):
    """Translates as the command line `argv` asks (default: `sys.argv[1:]`); returns the exit code (2 for bad input)."""
    args = parse_args(argv)
    try:
        # Opened first: a missing file should not wait for the model to load.
        stream = open_input(args)
    except OSError as error:
        return fail(f"cannot read --input {args.input}: {error.strerror or error}.")
    try:
        output = open_output(args)
    except OSError as error:
        return fail(f"cannot write --output {args.output}: {error.strerror or error}.")
    with contextlib.ExitStack() as closing:
        for opened in (stream if args.input else None, output):  # The files opened here, not stdin.
            if opened is not None:
                closing.enter_context(opened)
        try:
            # Loaded before stdin is read: whoever types sentences learns of a bad model path at once.
            module, signatures = load_translator(args)  # `module` must outlive the signatures.
        except LoadError as error:
            return fail(error)
        try:
            results = translate_all(translate_fn(signatures, args), input_batches(args, stream), args, output)
        except tf.errors.InvalidArgumentError as error:  # An option the model refuses.
            return fail(refusal(error))
    if args.attention:  # With one sentence argument (see parse_args): `results` are its.
        try:
            translation = results[signature_table.TRANSLATION.name][0].numpy()
            write_attention(module, os.fsencode(args.sentences[0]), translation, args.attention)
        except OSError as error:
            return fail(f"cannot write --attention {args.attention}: {error.strerror or error}.")
    return 0


def translate_all(translate, sentence_batches, args, output):
    """Translates and prints batch by batch; returns the last batch's outputs (`None` without input)."""
    translated, results = 0, None
    progress = FileProgress(args.output) if output is not None else None
    for batch in sentence_batches:
        results = translate(tf.constant(batch, dtype=tf.string))
        print_results(results, translated, args, output)
        (output or sys.stdout).flush()  # Each batch is seen as soon as it is translated.
        translated += len(batch)
        if progress is not None:
            progress.update(translated)
    if progress is not None:
        progress.done(translated)
    return results


class FileProgress:
    """Progress lines on stderr while translations go to a file: every `PROGRESS_SECONDS`, and at the end."""

    def __init__(self, path):
        self._path = path
        self._start = self._last = time.monotonic()

    def update(self, translated):
        now = time.monotonic()
        if now - self._last >= PROGRESS_SECONDS:
            self._last = now
            print(f"{PROG}: {translated:,} sentences translated ({self._rate(translated, now)})", file=sys.stderr)

    def done(self, translated):
        now = time.monotonic()
        print(f"{PROG}: translated {translated:,} sentences in {now - self._start:.1f} s "
              f"({self._rate(translated, now)}) into {self._path}", file=sys.stderr)

    def _rate(self, translated, now):
        elapsed = now - self._start
        return f"{translated / elapsed:.1f} sentences/s" if elapsed > 0 else "- sentences/s"
