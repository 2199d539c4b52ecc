"""`--xla-max-batch`, the flag `translate.py` and `python -m export` both take with `--jit-compile`."""

from keras_transformer.decoding_settings import DEFAULT_XLA_MAX_BATCH


def add_flag(parser):
    parser.add_argument(
        "--xla-max-batch",
        type=int,
        help=f"With --jit-compile, the most sentences searched at once (default {DEFAULT_XLA_MAX_BATCH}); "
        "larger batches are searched that many at a time.",
    )


def check(parser, args):
    """Exits with a usage error when --xla-max-batch is given without --jit-compile, or below 1."""
    if args.xla_max_batch is not None and not args.jit_compile:
        parser.error("--xla-max-batch needs --jit-compile.")
    if args.xla_max_batch is not None and args.xla_max_batch < 1:
        parser.error("--xla-max-batch must be at least 1.")


def chosen(args):
    """The largest batch to search with XLA: the flag's, else the default."""
    return DEFAULT_XLA_MAX_BATCH if args.xla_max_batch is None else args.xla_max_batch
