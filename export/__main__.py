"""`python -m export --run-dir RUN --out models/transformer [--version N]`: see `export`."""

import argparse
import itertools
import sys

from export.saved_model import ExportError, export_run
from keras_transformer.decoding import DEFAULT_MIN_LENGTH, EARLY_STOPPING
from keras_transformer.run_dir import RunDirError
from keras_transformer.translator import DEFAULT_MAX_INPUT_LENGTH, MAX_BEAM_SIZE


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m export",
        description="Export a trained run as a SavedModel for TF Serving (versioned layout), "
        "checked against the in-process model before it is published.",
    )
    parser.add_argument("--run-dir", required=True, help="Training run directory.")
    parser.add_argument(
        "--out", required=True, help="Model base directory, e.g. models/transformer."
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
        help=f"serving_default's beam (1-{MAX_BEAM_SIZE}; default: the run's, usually 4).",
    )
    parser.add_argument(
        "--alpha", type=float, help="serving_default's length penalty (default: the run's, usually 0.6)."
    )
    parser.add_argument(
        "--max-extra-length", type=int, default=50, help="Outputs: source length + this at most."
    )
    parser.add_argument(
        "--min-length",
        type=int,
        default=DEFAULT_MIN_LENGTH,
        help=f"serving_default's fewest tokens before EOS (default {DEFAULT_MIN_LENGTH}: no sentence "
        "translates to an empty string; 0 lets EOS come first).",
    )
    parser.add_argument(
        "--max-input-length",
        type=int,
        default=DEFAULT_MAX_INPUT_LENGTH,
        help="Sources are cut to this many tokens, EOS included.",
    )
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="Compile serving_default's beam search with XLA (about 3x faster for one "
        "sentence on a 2-core CPU; TF Serving then needs --xla_cpu_compilation_enabled=true "
        "on CPUs).",
    )
    parser.add_argument(
        "--early-stopping",
        choices=EARLY_STOPPING,
        default="exact",
        help="When the beam search stops: exact (default, the paper's code: once no live "
        "hypothesis can win at any length it could reach) or current_length (once none wins "
        "at its next length, a heuristic; fewer steps, not always the exact result).",
    )
    parser.add_argument(
        "--check-file", help="Also check the export on this file's sentences (one per line)."
    )
    parser.add_argument("--check-lines", type=int, default=16, help="Lines of --check-file to use.")
    args = parser.parse_args(argv)
    if args.min_length < 0:
        parser.error("--min-length must be 0 or more.")
    return args


def read_check_sentences(path, lines):
    if path is None:
        return []
    with open(path, encoding="utf-8", errors="replace") as file:
        return [line.rstrip("\n") for line in itertools.islice(file, lines)]


def main(argv=None):
    args = parse_args(argv)
    try:
        export_run(
            args.run_dir,
            args.out,
            version=args.version,
            which=args.checkpoint,
            model_name=args.model_name,
            check_sentences=read_check_sentences(args.check_file, args.check_lines),
            max_extra_length=args.max_extra_length,
            min_length=args.min_length,
            max_input_length=args.max_input_length,
            jit_compile=args.jit_compile,
            early_stopping=args.early_stopping,
            # Unset, they are the run's own (see Translator.from_run_dir).
            **{name: getattr(args, name) for name in ("beam_size", "alpha") if getattr(args, name) is not None},
        )
    except (ExportError, RunDirError, ValueError, OSError) as error:
        print(f"export failed: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
