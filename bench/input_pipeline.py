"""Benchmark: tokens per second delivered by the training input pipeline on Multi30k.

Usage:
    python bench/input_pipeline.py --data-dir ../shared/data/multi30k

Builds the training dataset exactly as training does (default token budget, shuffled,
bucketed, padded, prefetched), iterates one warm-up epoch, which tokenizes the corpus and
fills the cache, then times `--epochs` more epochs. Tokens are the non-padding source and
target ids the model sees (`source_ids` and `labels`, EOS included), so the figure compares
directly with `train_throughput.py`'s tokens/s: the input pipeline should be at least 20x
faster than training so it never starves it.

Next to wall-clock time, the process CPU time of each epoch is recorded: on a shared
machine, tokens per CPU-second is the steadier figure of the pipeline's cost.

Writes `bench/results/<machine>/input_pipeline.json`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: E402  (sets TF_CPP_MIN_LOG_LEVEL before TensorFlow loads)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_text  # noqa: E402

from keras_transformer.corpora import load_multi30k  # noqa: E402
from keras_transformer.data import (  # noqa: E402
    DEFAULT_MAX_LENGTH,
    DEFAULT_TOKEN_BUDGET,
    make_training_dataset,
)
from keras_transformer.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", help="Multi30k directory (default: MULTI30K_DIR, cache)")
    parser.add_argument("--token-budget", type=int, default=DEFAULT_TOKEN_BUDGET)
    parser.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs after warm-up")
    parser.add_argument("--output-name", default="input_pipeline")
    common.add_load_args(parser)
    common.add_results_dir_arg(parser)
    return parser.parse_args()


def count_epoch(dataset: tf.data.Dataset) -> dict:
    """Iterates one epoch, counting batches, real tokens and padded tokens."""
    batches = real = padded = 0
    for (source_ids, _), labels in dataset.as_numpy_iterator():
        batches += 1
        real += np.count_nonzero(source_ids) + np.count_nonzero(labels)
        padded += source_ids.size + labels.size
    return {"batches": batches, "tokens": int(real), "padded_tokens": int(padded)}


def time_epoch(dataset: tf.data.Dataset) -> tuple[float, float]:
    """Wall-clock and process CPU seconds to iterate one epoch without touching batches."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in dataset:
        pass
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    args = parse_args()
    corpus = load_multi30k(args.data_dir)
    load = common.quiet(args)
    payload = common.header("input_pipeline", args)
    payload["machine"]["tensorflow_text"] = tensorflow_text.__version__

    start = time.perf_counter()
    tokenizer = train_tokenizer(corpus.training_sentences(), vocab_size=args.vocab_size)
    tokenizer_seconds = time.perf_counter() - start
    dataset = make_training_dataset(
        corpus.train,
        tokenizer,
        token_budget=args.token_budget,
        max_length=args.max_length,
        seed=0,
    )
    warm_up_wall, warm_up_cpu = time_epoch(dataset)  # Tokenizes and fills the cache.
    epoch = count_epoch(dataset)
    walls, cpus = zip(*(time_epoch(dataset) for _ in range(args.epochs)))
    tokens_per_second = epoch["tokens"] / statistics.median(walls)
    tokens_per_cpu_second = epoch["tokens"] / statistics.median(cpus)

    payload.update(
        {
            "corpus": "multi30k en-de train",
            "pairs": len(corpus.train),
            "vocab_size": tokenizer.vocab_size,
            "tokens_counted": "non-padding source_ids + labels (EOS included) per epoch",
            "tokens_per_epoch": epoch["tokens"],
            "padded_tokens_per_epoch": epoch["padded_tokens"],
            "padding_share": round(1 - epoch["tokens"] / epoch["padded_tokens"], 4),
            "batches_per_epoch": epoch["batches"],
            "tokenizer_training_s": round(tokenizer_seconds, 3),
            "warm_up_epoch": {
                "wall_s": round(warm_up_wall, 3),
                "cpu_s": round(warm_up_cpu, 3),
                "tokens_per_s": round(epoch["tokens"] / warm_up_wall),
            },
            "epochs": {
                "wall_s": [round(seconds, 3) for seconds in walls],
                "cpu_s": [round(seconds, 3) for seconds in cpus],
            },
            "tokens_per_s": round(tokens_per_second),
            "tokens_per_cpu_s": round(tokens_per_cpu_second),
            "load": common.finish_load(load),
        }
    )
    common.write_json(args.output_name, payload, args.results_dir)
    print(
        f"[input] {tokens_per_second:,.0f} tokens/s ({tokens_per_cpu_second:,.0f} per CPU-second) "
        f"after warm-up; {epoch['tokens']:,} tokens in {epoch['batches']} batches per epoch, "
        f"{payload['padding_share']:.1%} padding; warm-up epoch "
        f"{payload['warm_up_epoch']['tokens_per_s']:,} tokens/s",
        flush=True,
    )


if __name__ == "__main__":
    main()
