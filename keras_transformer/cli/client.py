"""`python -m export.client`: translate with a TF Serving model server, over REST or gRPC.

    python -m export.client --rest http://localhost:8501 --model transformer "A sentence."
    python -m export.client --grpc localhost:8500 --model transformer --beam-size 8 < input.txt

Without options, requests go to `serving_default`; with any of `--beam-size`, `--alpha`,
`--max-length`, `--min-length` or `--n-best`, to `translate_with_options`, the options
not given being the served model's own (`keras_transformer.signatures`). The command
sends at most `--batch-size` sentences per request (default 32: a whole file in one
request is slower, see docs/performance.md), reading stdin as it arrives as
`translate.py` does, and prints each batch's translations as they come. Over REST it
needs the standard library only (`keras_transformer.serving_client`).
"""

import argparse
import sys
from pathlib import Path

from keras_transformer import serving_client, signatures
from keras_transformer.cli import decoding_flags, interrupts, line_input

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
    parser.add_argument("--model", default="transformer", help="Served model name (default: transformer).")
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
    output_form = parser.add_mutually_exclusive_group()  # --n-best prints every score already
    output_form.add_argument(
        "--n-best", action="store_true", help="Print every hypothesis (translate_with_options)."
    )
    output_form.add_argument("--scores", action="store_true", help="Print 'score<TAB>translation'.")
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
    if args.rest and "://" not in args.rest:
        parser.error(f"--rest takes a URL with its scheme, e.g. http://{args.rest}.")
    decoding_flags.check(parser, args)
    return args


def sentence_batches(args):
    """Batches of at most `--batch-size` sentences as valid str: the arguments', else stdin's lines as they arrive.

    Stdin is read as `translate.py` reads it (`line_input`): a typed line is sent at
    once, a file in full batches, never whole. Bytes that are not UTF-8 become U+FFFD
    here, and the first such line is told on stderr: JSON and protobuf strings cannot
    carry them (the model would read them as U+FFFD too).
    """
    stream = None if args.sentences else sys.stdin.buffer
    for batch in line_input.sentence_batches(args.sentences, stream, args.batch_size, _report):
        yield [sentence.decode("utf-8", errors="replace") for sentence in batch]


def _report(message):
    print(f"{PROG}: {message}", file=sys.stderr)


def request_options(args):
    """`translate_with_options` inputs if any option was given, else `None` (`serving_default`).

    The options not given are unset: the served model's own (see `keras_transformer.signatures`).
    """
    given = dict(beam_size=args.beam_size, alpha=args.alpha, max_length=args.max_length, min_length=args.min_length)
    if all(value is None for value in given.values()) and not args.n_best:
        return None
    return signatures.options_request(**given)


def main(argv=None):
    """Translates as the command line `argv` asks (default: `sys.argv[1:]`); returns the exit code.

    1 when the server fails a request (the translations before it are printed), 2 for
    bad input, 130 after Ctrl-C.
    """
    args = parse_args(argv)
    if args.grpc and (missing := _missing_grpc_package()):
        print(f'{PROG}: error: --grpc needs tensorflow-serving-api (pip install -e ".[serving]"): {missing}',
              file=sys.stderr)
        return 2
    return interrupts.exit_code_of(lambda: _translate(args), PROG)


def _translate(args):
    translate = serving_client.translate_rest if args.rest else serving_client.translate_grpc
    sent = 0
    for batch in sentence_batches(args):
        try:
            results = translate(
                args.rest or args.grpc,
                args.model,
                batch,
                options=request_options(args),
                version=args.version,
                timeout=args.timeout,
            )
        except serving_client.ServingError as error:
            print(f"{PROG}: error: translation failed: {error}", file=sys.stderr)
            return 1
        print_results(results, sent, args)
        sys.stdout.flush()  # Each batch as it comes: a long input shows its progress.
        sent += len(batch)
    return 0


def _missing_grpc_package():
    """The import error of the gRPC client's packages, else `None`."""
    try:
        import grpc  # noqa: F401
        from tensorflow_serving.apis import prediction_service_pb2_grpc  # noqa: F401
    except ImportError as error:
        return str(error)
    return None


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
