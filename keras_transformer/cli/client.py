"""`python -m export.client`: translate with a TF Serving model server, over REST or gRPC.

    python -m export.client --rest http://localhost:8501 --model transformer "A sentence."
    python -m export.client --grpc localhost:8500 --model transformer --beam-size 8 < input.txt

Without options, requests go to `serving_default`; with any of `--beam-size`, `--alpha`,
`--max-length`, `--min-length` or `--n-best`, to `translate_with_options`, the options
not given being the served model's own (`keras_transformer.signatures`). The command
sends `--batch-size` sentences per request (default 32: a whole file in one request is
slower, see docs/performance.md) and prints each batch's translations as they come. Over
REST it needs the standard library only (`keras_transformer.serving_client`).
"""

import argparse
import codecs
import os
import sys
from pathlib import Path

from keras_transformer import serving_client, signatures

# The command's name in its messages: kt-client when run so, else the repository's module.
PROG = Path(sys.argv[0]).name if Path(sys.argv[0]).name == "kt-client" else "python -m export.client"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Translate with a TF Serving model server (REST or gRPC).",
    )
    server = parser.add_mutually_exclusive_group(required=True)
    server.add_argument("--rest", metavar="URL", help="REST base URL, e.g. http://localhost:8501.")
    server.add_argument("--grpc", metavar="HOST:PORT", help="gRPC address, e.g. localhost:8500.")
    parser.add_argument("--model", default="transformer", help="Served model name.")
    parser.add_argument("--version", type=int, help="Model version (default: the latest served).")
    parser.add_argument("--beam-size", type=int, help="Use translate_with_options with this beam.")
    parser.add_argument(
        "--alpha", type=float, help="Use translate_with_options with this length penalty."
    )
    parser.add_argument(
        "--max-length",
        type=int,
        help="Use translate_with_options with this output cap (its max_length input: most output tokens).",
    )
    parser.add_argument(
        "--min-length",
        type=int,
        help="Use translate_with_options with this many tokens before EOS at the least (0: may be empty).",
    )
    parser.add_argument(
        "--n-best", action="store_true", help="Print every hypothesis (translate_with_options)."
    )
    parser.add_argument("--scores", action="store_true", help="Print 'score<TAB>translation'.")
    parser.add_argument(
        "--batch-size", type=int, default=32, help="Sentences per request (default: 32)."
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="Seconds to wait for each answer (default: 60)."
    )
    parser.add_argument(
        "sentences", nargs="*", help="Sentences to translate; default: lines of stdin."
    )
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1.")
    if args.timeout <= 0:
        parser.error("--timeout must be more than 0.")
    if args.min_length is not None and args.min_length < 0:
        parser.error("--min-length must be 0 or more.")
    return args


def read_sentences(args):
    """The sentences of the arguments or of stdin's lines, as valid str.

    Bytes that are not UTF-8 become U+FFFD here: JSON and protobuf strings cannot carry
    them (the model would read them as U+FFFD too). A line's "\\r\\n" and a byte order
    mark at the start of the input are not text.
    """
    if args.sentences:
        return [os.fsencode(sentence).decode("utf-8", errors="replace") for sentence in args.sentences]
    lines = sys.stdin.buffer.read().removeprefix(codecs.BOM_UTF8).split(b"\n")  # "\n" only: lines stay aligned.
    if lines[-1] == b"":
        lines.pop()
    return [line.rstrip(b"\r").decode("utf-8", errors="replace") for line in lines]


def request_options(args):
    """`translate_with_options` inputs if any option was given, else `None` (`serving_default`).

    The options not given are unset: the served model's own (see `keras_transformer.signatures`).
    """
    given = dict(beam_size=args.beam_size, alpha=args.alpha, max_length=args.max_length, min_length=args.min_length)
    if all(value is None for value in given.values()) and not args.n_best:
        return None
    return signatures.options_request(**given)


def main(argv=None):
    """Translates as the command line `argv` asks (default: `sys.argv[1:]`); returns the exit code."""
    args = parse_args(argv)
    sentences = read_sentences(args)
    translate = serving_client.translate_rest if args.rest else serving_client.translate_grpc
    for start in range(0, len(sentences), args.batch_size):
        try:
            results = translate(
                args.rest or args.grpc,
                args.model,
                sentences[start : start + args.batch_size],
                options=request_options(args),
                version=args.version,
                timeout=args.timeout,
            )
        except serving_client.ServingError as error:
            print(f"translation failed: {error}", file=sys.stderr)
            return 1
        print_results(results, start, args)
        sys.stdout.flush()  # Each batch as it comes: a long input shows its progress.
    return 0


def print_results(results, first_index, args):
    for index, result in enumerate(results, start=first_index):
        if args.n_best:
            for translation, score in zip(
                result[signatures.TRANSLATIONS.name], result[signatures.SCORES.name], strict=True
            ):
                print(f"{index} ||| {translation} ||| {score:.4f}")
        elif args.scores:
            print(f"{result[signatures.SCORE.name]:.4f}\t{result[signatures.TRANSLATION.name]}")
        else:
            print(result[signatures.TRANSLATION.name])
