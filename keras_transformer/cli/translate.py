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

A first line on stderr names the weights that translate: the run's checkpoint (and which
`--checkpoint` it is), or the export's version directory.

Input is read as it arrives, never whole: a batch is what has arrived when its first
line is read, up to `--batch-size` lines, so a sentence typed at a terminal or written
to a pipe is answered at once, and a file of any size is translated in full batches
with bounded memory. Lines end at "\\n" only, as the corpus reader's; a line's trailing
"\\r" (CRLF files) and a leading byte order mark are dropped; invalid UTF-8 is passed on
(stderr names the first such line).

When translations go to a file (`--output`, or stdout redirected), stderr gets a
progress line every `PROGRESS_SECONDS` with the sentences translated so far and their
rate, and one at the end (none when they go to a terminal, where they are the
progress); sentences typed at a terminal get a first line saying how input ends. The
`--output` file is emptied only when the first translations are ready: a command that
fails before (a model that does not load, an option it refuses) leaves it as it was;
one interrupted later keeps the translations written so far. When the search is XLA's
(`--jit-compile`, or `serving_default` of an export made with it), a first line on
stderr says that each new batch shape waits for its XLA compilation.

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
import contextlib
import os
import re
import stat
import sys
import time
from pathlib import Path

import tensorflow as tf
import tensorflow_text  # noqa: F401  Registers the SentencePiece ops a SavedModel needs.

from keras_transformer import error_text
from keras_transformer import signatures as signature_table
from keras_transformer.cli import decoding_flags, interrupts, line_input, xla_batch
from keras_transformer.decoding_settings import EARLY_STOPPING, DecodingSettings

# The command's name in its messages: kt-translate when run so, else the repository's script.
PROG = Path(sys.argv[0]).name if Path(sys.argv[0]).name == "kt-translate" else "translate.py"
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
        help=f"Output cap: most output tokens, EOS included (default: source length + the export's "
        f"--max-extra-length, else {defaults.max_extra_length}).",
    )
    parser.add_argument(
        "--min-length",
        type=int,
        help=f"Fewest tokens before EOS (default: the export's, else {defaults.min_length}: a sentence never "
        "translates to an empty line; 0 lets EOS come first).",
    )
    output_form = parser.add_mutually_exclusive_group()  # --n-best prints every score already
    output_form.add_argument(
        "--n-best", action="store_true", help="Print all beam_size hypotheses per sentence."
    )
    output_form.add_argument("--scores", action="store_true", help="Print 'score<TAB>translation'.")
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
        "batch shape compiles once, for tens of seconds: worth it for hundreds of sentences "
        "or more). Not with --n-best or --max-length, which use the "
        "graph-mode options signature; an export made with --jit-compile uses XLA by itself.",
    )
    xla_batch.add_flag(parser)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="Most sentences per batch (a batch holds the input lines that have arrived, up to this many; "
        "default 32).",
    )
    parser.add_argument(
        "--input", help="File of sentences, one per line, read as it is translated (default: stdin)."
    )
    parser.add_argument(
        "--output",
        help="File the translations are written to (default: stdout); emptied when the first ones are ready.",
    )
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
    if args.sentences and args.input:
        parser.error("give sentences as arguments or --input, not both.")
    decoding_flags.check(parser, args)
    if args.jit_compile and (args.saved_model or args.n_best or args.max_length is not None):
        parser.error("--jit-compile goes with --run-dir, without --n-best and --max-length.")
    xla_batch.check(parser, args)
    if args.early_stopping is not None and args.saved_model:
        parser.error("--early-stopping goes with --run-dir; an export searches as it was exported.")
    if args.checkpoint is not None and args.saved_model:
        parser.error("--checkpoint goes with --run-dir; a SavedModel holds one set of weights.")
    if args.attention is not None and (args.saved_model or len(args.sentences) != 1 or args.input):
        why = "a SavedModel does not return its attention" if args.saved_model else "it draws one translation"
        parser.error(f"--attention goes with --run-dir and one sentence given as an argument ({why}).")
    return args


def wants_options(args):
    """Whether `translate_with_options` is needed: n-best, a length cap, or SavedModel options."""
    chosen = args.beam_size is not None or args.alpha is not None or args.min_length is not None
    return args.n_best or args.max_length is not None or (args.saved_model is not None and chosen)


def load_translator(args):
    """`(module, signatures)`: an in-process `Translator` for --run-dir, else the loaded SavedModel.

    Says on stderr which weights it loaded. Keep `module` referenced while using
    `signatures`: it owns their variables and resources.
    """
    if args.saved_model:
        directory = version_directory(args.saved_model)
        try:
            module = tf.saved_model.load(str(directory))
        # A damaged or partly copied export (a cut variables file is an IndexError, as for checkpoints).
        except (OSError, ValueError, IndexError, tf.errors.OpError) as error:
            raise LoadError(f"cannot load the SavedModel in {directory}: {error_text.first_line(error)}") from None
        print(f"{PROG}: translating with {directory}", file=sys.stderr)
        return module, module.signatures
    from keras_transformer import run_dir

    module = run_translator(args)
    print(f"{PROG}: translating with {run_dir.checkpoint_label(args.run_dir, args.checkpoint or 'best')}",
          file=sys.stderr)
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


def compiles_on_first_batches(args):
    """Whether the signature `translate_fn` calls is searched with XLA, which compiles each new batch shape."""
    if args.saved_model:
        # translate_with_options is never compiled (see `Translator`).
        return not wants_options(args) and holds_xla_functions(version_directory(args.saved_model))
    return args.jit_compile


def holds_xla_functions(directory):
    """Whether the SavedModel in `directory` has a function that must be compiled with XLA."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((Path(directory) / "saved_model.pb").read_bytes())
    return any(
        function.attr["_XlaMustCompile"].b
        for meta_graph in proto.meta_graphs
        for function in meta_graph.graph_def.library.function
    )


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
    """`--output`'s `OutputFile`, else `None` for stdout.

    Raises:
        OSError: If the file cannot be written, or is the file the sentences are read
            from (`--input`, or stdin), which writing would erase before it is read.
    """
    if args.output is None:
        return None
    if os.path.exists(args.output):
        source, name = _input_file_status(args)
        if source is not None and os.path.samestat(source, os.stat(args.output)):
            raise OSError(f"it is the {name}, which writing would erase before it is read")
    return OutputFile(args.output)


def _input_file_status(args):
    """`(os.stat_result, name)` of the file sentences are read from, else `(None, None)`."""
    if args.sentences:
        return None, None
    if args.input:
        return os.stat(args.input), "--input file"
    try:
        return os.fstat(sys.stdin.fileno()), "file on stdin"
    except (OSError, ValueError):  # No file behind stdin (closed, or replaced by a test's).
        return None, None


class OutputFile:
    """`--output`: opened when the command starts, emptied when the first translations are ready.

    Opened for appending, which fails at once on a path that cannot be written but keeps
    what the file holds: a model that does not load, or refuses the first batch, leaves
    the file as it was. Only a regular file is emptied: a pipe or a device (`>(gzip > f)`,
    `/dev/stdout`) has nothing to empty and cannot be truncated. Use it as a context
    manager.
    """

    def __init__(self, path):
        self.path = path
        self._file = open(path, "a", encoding="utf-8")
        self._emptied = not stat.S_ISREG(os.fstat(self._file.fileno()).st_mode)

    def stream(self):
        """The file as a text stream, emptied at the first call."""
        if not self._emptied:
            self._file.truncate(0)
            self._emptied = True
        return self._file

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        # Each batch was flushed: what is left unwritten is a failed write's, already told.
        with contextlib.suppress(OSError):
            self._file.close()


def input_batches(args, stream):
    """Batches of sentences as bytes: the arguments', else `stream`'s lines as they arrive (see `line_input`)."""
    return line_input.sentence_batches(
        args.sentences, stream, args.batch_size, lambda message: print(f"{PROG}: {message}", file=sys.stderr))


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
    """Translates as the command line `argv` asks (default: `sys.argv[1:]`); returns the exit code.

    2 for bad input, 130 after Ctrl-C, 1 when stdout's reader leaves (`| head`); the
    translations written before an interruption stay written.
    """
    args = parse_args(argv)
    return interrupts.exit_code_of(lambda: _translate(args), PROG)


def _translate(args):
    try:
        # Opened first: a missing file should not wait for the model to load.
        stream = open_input(args)
    except OSError as error:
        return fail(f"cannot read --input {args.input}: {error.strerror or error}.")
    try:
        output = open_output(args)
    except OSError as error:
        return fail(f"cannot write --output {args.output}: {error.strerror or error}.")
    if args.attention:  # Checked now: the picture is drawn after the model has loaded and translated.
        folder = os.path.dirname(os.path.abspath(args.attention))
        if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            return fail(f"cannot write --attention {args.attention}: {folder} is not a writable directory.")
    with contextlib.ExitStack() as closing:
        for opened in (stream if args.input else None, output):  # The files opened here, not stdin.
            if opened is not None:
                closing.enter_context(opened)
        try:
            # Loaded before stdin is read: whoever types sentences learns of a bad model path at once.
            module, signatures = load_translator(args)  # `module` must outlive the signatures.
        except LoadError as error:
            return fail(error)
        if compiles_on_first_batches(args):  # Else the first batch is a silent wait.
            print(f"{PROG}: XLA compiles the search for each new batch shape first, for tens of seconds.",
                  file=sys.stderr)
        if not (args.sentences or args.input) and _is_terminal(sys.stdin):  # Else the command seems to hang.
            print(f"{PROG}: translating the lines typed here; Ctrl-D ends.", file=sys.stderr)
        try:
            results = translate_all(translate_fn(signatures, args), input_batches(args, stream), args, output)
        except tf.errors.InvalidArgumentError as error:  # An option the model refuses.
            return fail(refusal(error))
        except OSError as error:  # A full disk.
            if isinstance(error, BrokenPipeError):  # `| head`: the reader left (interrupts.exit_code_of).
                raise
            if output is None:
                interrupts.discard_stdout()
            return fail(f"cannot write {_output_name(args)}: {error.strerror or error}.")
    if args.attention:  # With one sentence argument (see parse_args): `results` are its.
        try:
            translation = results[signature_table.TRANSLATION.name][0].numpy()
            write_attention(module, os.fsencode(args.sentences[0]), translation, args.attention)
            print(f"{PROG}: drew the attention of the translation in {args.attention}", file=sys.stderr)
        except OSError as error:
            return fail(f"cannot write --attention {args.attention}: {error.strerror or error}.")
    return 0


def translate_all(translate, sentence_batches, args, output):
    """Translates and prints batch by batch; returns the last batch's outputs (`None` without input)."""
    translated, results = 0, None
    to_file = output is not None or not _is_terminal(sys.stdout)
    progress = FileProgress(args.output or "stdout") if to_file else None
    for batch in sentence_batches:
        results = translate(tf.constant(batch, dtype=tf.string))
        stream = sys.stdout if output is None else output.stream()
        print_results(results, translated, args, stream)
        stream.flush()  # Each batch is seen as soon as it is translated.
        translated += len(batch)
        if progress is not None:
            progress.update(translated)
    if output is not None:
        output.stream()  # Emptied also when there was no input.
    if progress is not None:
        progress.done(translated)
    return results


def _output_name(args):
    return f"--output {args.output}" if args.output else "the translations to stdout"


def _is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # Replaced (by a test's capture), or closed.
        return False


def _sentences(count):
    return f"{count:,} sentence{'' if count == 1 else 's'}"


class FileProgress:
    """Progress lines on stderr while translations go to a file: every `PROGRESS_SECONDS`, and at the end."""

    def __init__(self, path):
        self._path = path
        self._start = self._last = time.monotonic()

    def update(self, translated):
        now = time.monotonic()
        if now - self._last >= PROGRESS_SECONDS:
            self._last = now
            print(f"{PROG}: {_sentences(translated)} translated ({self._rate(translated, now)})", file=sys.stderr)

    def done(self, translated):
        now = time.monotonic()
        print(f"{PROG}: translated {_sentences(translated)} in {now - self._start:.1f} s "
              f"({self._rate(translated, now)}) into {self._path}", file=sys.stderr)

    def _rate(self, translated, now):
        elapsed = now - self._start
        return f"{translated / elapsed:.1f} sentences/s" if elapsed > 0 else "- sentences/s"
