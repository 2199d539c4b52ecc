"""`kt-export` (`python -m export`): export a trained run for TF Serving or CTranslate2, checked first.

    kt-export --run-dir RUN --out models/transformer [--version N]
    kt-export --format ctranslate2 --run-dir RUN --out models/transformer-ct2

The SavedModel translates with one `DecodingSettings`: the run's own (its beam size and
length penalty, `run_dir.decoding_settings`), with the flags given replacing theirs.
A CTranslate2 model takes its decoding options when it translates, so the decoding flags
(and `--version`, `--model-name`, `--jit-compile`) are for `--format savedmodel` only.
The libraries are `keras_transformer.saved_model` and `keras_transformer.ctranslate2_export`
(which needs the `ctranslate2` extra).
"""

import argparse
import itertools
import os
import sys
from pathlib import Path

from keras_transformer.cli import decoding_flags, xla_batch
from keras_transformer.cli.line_input import LineReader
from keras_transformer.decoding_settings import EARLY_STOPPING, MAX_BEAM_SIZE, DecodingSettings

# The command's name in its messages: kt-export when run so, else the repository's module.
PROG = Path(sys.argv[0]).name if Path(sys.argv[0]).name == "kt-export" else "python -m export"
FORMATS = ("savedmodel", "ctranslate2")
# Lines of --check-file the export is checked on, unless --check-lines says otherwise.
DEFAULT_CHECK_LINES = 16
# The flags of --format savedmodel alone (their defaults are None or False).
SAVEDMODEL_FLAGS = (
    "version", "model_name", "beam_size", "alpha", "max_extra_length", "min_length", "early_stopping", "jit_compile",
    "xla_max_batch", "max_source_length",
)


def preset_alphas():
    """'tiny 0.6, small 1, ...': each preset's length penalty, for the help text."""
    from keras_transformer.recipes import RECIPES

    return ", ".join(f"{name} {recipe.decoding.alpha:g}" for name, recipe in RECIPES.items())


def parse_args(argv=None):
    from keras_transformer.translator import DEFAULT_MAX_SOURCE_LENGTH

    defaults = DecodingSettings()
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Export a trained run as a SavedModel for TF Serving (versioned layout), or as a "
        "CTranslate2 model directory, checked against the in-process model before it is published.",
    )
    parser.add_argument("--run-dir", required=True, help="Training run directory.")
    parser.add_argument(
        "--out",
        required=True,
        help="Model base directory, e.g. models/transformer; with --format ctranslate2, the model "
        "directory to make (new or empty).",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="savedmodel",
        help="savedmodel (default): TF Serving's versioned layout; ctranslate2: a CTranslate2 model "
        '(pip install -e ".[ctranslate2]"; see docs/serving.md).',
    )
    parser.add_argument("--version", type=int, help="Version number (default: the next free one).")
    parser.add_argument(
        "--checkpoint",
        default="best",
        help='"best" (default), "averaged", "latest" or a checkpoint path.',
    )
    parser.add_argument(
        "--model-name", help="Model name in the warmup requests (default: --out's name)."
    )
    parser.add_argument(
        "--beam-size",
        type=int,
        help=f"serving_default's beam (1-{MAX_BEAM_SIZE}; default: the run's, usually {defaults.beam_size}).",
    )
    parser.add_argument(
        "--alpha",
        type=float,
        help=f"serving_default's length penalty (default: the run's; the presets': {preset_alphas()}).",
    )
    parser.add_argument(
        "--max-extra-length",
        type=int,
        help=f"Outputs: source length + this at most (default {defaults.max_extra_length}).",
    )
    parser.add_argument(
        "--min-length",
        type=int,
        help=f"serving_default's fewest tokens before EOS (default {defaults.min_length}: no sentence "
        "translates to an empty string; 0 lets EOS come first).",
    )
    parser.add_argument(
        "--max-source-length",
        type=int,
        help=f"Sources are cut to this many tokens, EOS included (default {DEFAULT_MAX_SOURCE_LENGTH}).",
    )
    # The flag's name before the lengths had one name each; old commands keep working.
    parser.add_argument(
        "--max-input-length", dest="max_source_length", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="Compile serving_default's beam search with XLA (faster per sentence on CPUs, see "
        "docs/performance.md; TF Serving then needs --xla_cpu_compilation_enabled=true on CPUs).",
    )
    xla_batch.add_flag(parser)
    parser.add_argument(
        "--early-stopping",
        choices=EARLY_STOPPING,
        help="When the beam search stops: exact (default, the paper's code: once no live "
        "hypothesis can win at any length it could reach) or current_length (once none wins "
        "at its next length, a heuristic; fewer steps, not always the exact result).",
    )
    parser.add_argument(
        "--check-file", help="Also check the export on this file's sentences (one per line)."
    )
    parser.add_argument(
        "--check-lines", type=int, help=f"Lines of --check-file to use (default {DEFAULT_CHECK_LINES})."
    )
    args = parser.parse_args(argv)
    decoding_flags.check(parser, args)
    if args.check_lines is not None and args.check_file is None:
        parser.error("--check-lines goes with --check-file.")
    if args.check_lines is not None and args.check_lines < 0:
        parser.error("--check-lines must be 0 or more.")
    if args.check_lines is None:
        args.check_lines = DEFAULT_CHECK_LINES
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out} is a file: give the directory to export to.")
    try:  # read now, before the model loads, so that a bad path fails at once
        args.check_sentences = read_check_sentences(args.check_file, args.check_lines)
    except OSError as error:
        parser.error(f"cannot read --check-file {args.check_file}: {error.strerror or error}.")
    xla_batch.check(parser, args)
    if args.format == "ctranslate2":
        given = [name for name in SAVEDMODEL_FLAGS if getattr(args, name) not in (None, False)]
        if given:
            parser.error(
                f"--{given[0].replace('_', '-')} is for --format savedmodel: a CTranslate2 model takes its "
                "decoding options when it translates."
            )
    elif args.max_source_length is None:
        args.max_source_length = DEFAULT_MAX_SOURCE_LENGTH
    return args


def read_check_sentences(path, lines):
    """The first `lines` sentences of `path`, split as translate.py splits its input (`LineReader`)."""
    if path is None:
        return []
    with open(path, "rb") as file:
        return [line.decode("utf-8", errors="replace") for line in itertools.islice(LineReader(file), lines)]


def decoding_settings(args):
    """The run's `DecodingSettings`, with the flags given replacing theirs.

    Raises:
        RunDirError: For a run directory without a readable config.json.
        ValueError: For a setting out of range.
    """
    from keras_transformer import run_dir

    return run_dir.decoding_settings(args.run_dir).replace(
        beam_size=args.beam_size,
        alpha=args.alpha,
        max_extra_length=args.max_extra_length,
        min_length=args.min_length,
        early_stopping=args.early_stopping,
    )


def main(argv=None):
    """Exports as the command line `argv` asks (default: `sys.argv[1:]`); returns the exit code (1 on failure)."""
    args = parse_args(argv)
    if args.format == "ctranslate2":
        return export_ctranslate2(args)
    from keras_transformer.run_dir import RunDirError
    from keras_transformer.saved_model import ExportError, export_run

    try:
        export_run(
            args.run_dir,
            args.out,
            version=args.version,
            which=args.checkpoint,
            model_name=args.model_name,
            check_sentences=args.check_sentences,
            decoding=decoding_settings(args),
            max_source_length=args.max_source_length,
            jit_compile=args.jit_compile,
            xla_max_batch=xla_batch.chosen(args),
        )
    except (ExportError, RunDirError, ValueError, OSError) as error:
        print(f"export failed: {error}", file=sys.stderr)
        return 1
    return 0


def export_ctranslate2(args):
    """`main` for `--format ctranslate2`: returns the exit code (1 on failure, in one line)."""
    from keras_transformer.run_dir import RunDirError
    from keras_transformer.saved_model import ExportError

    try:
        from keras_transformer import ctranslate2_export

        ctranslate2_export.export_run(
            args.run_dir,
            args.out,
            which=args.checkpoint,
            check_sentences=args.check_sentences,
        )
    except (ExportError, RunDirError, ImportError, ValueError, OSError) as error:
        print(f"export failed: {error}", file=sys.stderr)
        return 1
    return 0
