"""Benchmark: the exported SavedModel, loaded as TF Serving loads it: latency and throughput.

Usage:
    python -m export --run-dir runs/RUN --out /tmp/exported     # writes /tmp/exported/<version>/
    python bench/serving.py --saved-model /tmp/exported          # a version dir, or its parent

This process imports only `tensorflow` and `tensorflow_text` (whose ops the SavedModel's
tokenizer needs), never `keras_transformer` (nor `keras_hub`): `tf.saved_model.load` and the
`serving_default` signature (text -> translation, score) are all that TF Serving has.
The script checks this and records it (`"imports_only_tf_and_tf_text"`).

Measured on the Multi30k test sources (English, in file order):

* latency of one sentence per request: p50 / p95 / mean over `--latency-sentences`
  requests (after `--warmup` requests);
* throughput with batches of 32 sentences per request (the full batches of
  `--batch-sentences`);
* throughput with `--threads` (8) concurrent client threads, each sending one sentence
  per request (TensorFlow runs the requests' graphs concurrently), with their latency
  percentiles.

An export made with `--jit-compile` (recorded as `"xla"`) compiles each (batch size,
source length bucket) once: with one, every timed request is sent once before timing.
The export's early stop (`--early-stopping`: "exact", or "current_length", which stops
sooner) is recorded as `"early_stopping"` ("exact" for exports made before the option).

Target: the `small` preset's SavedModel (beam 4) translates one sentence with p50 <= 40 ms.

Writes `bench/results/<machine>/serving.json` (`--output-name` for another name, e.g. `serving-xla`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (standard library only at import)

import tensorflow as tf  # noqa: E402
import tensorflow_text  # noqa: E402, F401  (registers the SentencePiece ops of the SavedModel)
from common import load_sentences, resolve_version_dir  # noqa: E402  (profile_trace.py imports them from here)

TARGET_P50_MS = 40.0


def signature_input_name(signature) -> str:
    _, kwargs = signature.structured_input_signature
    if len(kwargs) != 1:
        raise SystemExit(f"serving_default takes {sorted(kwargs)}; expected one string input.")
    return next(iter(kwargs))


def compiles_with_xla(version_dir: Path) -> bool:
    """Whether the SavedModel holds a function that must be compiled with XLA."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((version_dir / "saved_model.pb").read_bytes())
    return any(
        function.attr["_XlaMustCompile"].b
        for meta_graph in proto.meta_graphs
        for function in meta_graph.graph_def.library.function
    )


def early_stopping_rule(loaded) -> str:
    """The loaded export's early stop; exports older than the option searched "exact"."""
    rule = getattr(loaded, "early_stopping_rule", None)
    return "exact" if rule is None else rule.numpy().decode()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saved-model", type=Path, required=True, help="export dir or its <version>/ dir")
    parser.add_argument("--data-dir", default=None, help="Multi30k directory (default: MULTI30K_DIR / shared)")
    parser.add_argument("--source-lang", default="en")
    parser.add_argument("--warmup", type=int, default=10, help="untimed requests first")
    parser.add_argument("--latency-sentences", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batch-sentences", type=int, default=1000, help="sentences sent in batches")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--thread-sentences", type=int, default=400, help="sentences sent by the threads")
    parser.add_argument("--output-name", default="serving")
    common.add_load_args(parser)
    common.add_results_dir_arg(parser)
    args = parser.parse_args()

    version_dir = resolve_version_dir(args.saved_model)
    sentences = load_sentences(args.data_dir, args.source_lang)
    load = common.quiet(args)
    payload = common.header("serving", args, with_keras=False)
    payload["saved_model"] = str(version_dir)
    payload["xla"] = compiles_with_xla(version_dir)

    start = time.perf_counter()
    loaded = tf.saved_model.load(str(version_dir))
    payload["load_s"] = time.perf_counter() - start
    payload["early_stopping"] = early_stopping_rule(loaded)
    serve = loaded.signatures["serving_default"]
    input_name = signature_input_name(serve)
    payload["signature"] = {
        "input": input_name,
        "outputs": sorted(serve.structured_outputs),
    }

    def request(texts):
        out = serve(**{input_name: tf.constant(texts, tf.string)})
        return {name: value.numpy() for name, value in out.items()}

    start = time.perf_counter()
    first = request(sentences[:1])
    payload["first_request_s"] = time.perf_counter() - start
    payload["example"] = {
        "source": sentences[0],
        **{k: (v[0].decode("utf-8") if v.dtype == object else float(v[0])) for k, v in first.items()},
    }
    # Full batches only: in an XLA export a new batch size would time a compilation.
    chosen = sentences[: args.batch_sentences // args.batch_size * args.batch_size]
    batches = [chosen[i : i + args.batch_size] for i in range(0, len(chosen), args.batch_size)]
    for i in range(args.warmup):
        request(sentences[i % len(sentences) : i % len(sentences) + 1])
    request(batches[0])  # warm the batch shape path too
    if payload["xla"]:
        # XLA compiles once per (batch size, source length bucket): meet every shape the
        # timed requests will, as a server that has run a while has.
        for text in sentences[: args.latency_sentences]:
            request([text])
        for batch in batches:
            request(batch)

    def translate(texts):
        return [text.decode("utf-8") for text in request(texts)["translation"]]

    # 1. One sentence per request, one client.
    payload["single"] = common.time_single(translate, sentences[: args.latency_sentences])
    p50 = payload["single"]["p50_ms"]
    payload["target_p50"] = {"p50_ms": p50, "target_ms": TARGET_P50_MS, "met": p50 <= TARGET_P50_MS}
    print(
        f"[serving] 1 sentence/request: p50 {p50:.1f} ms, p95 {payload['single']['p95_ms']:.1f} ms "
        f"(target p50 <= {TARGET_P50_MS:.0f} ms: {'met' if p50 <= TARGET_P50_MS else 'MISSED'})",
        flush=True,
    )

    # 2. Batches of 32 sentences, one client.
    payload["batched"], _ = common.time_batches(translate, batches)
    print(
        f"[serving] batches of {args.batch_size}: {payload['batched']['sentences_per_s']:.1f} sentences/s",
        flush=True,
    )

    # 3. Concurrent clients, one sentence per request.
    payload["concurrent"] = common.time_concurrent(translate, sentences[: args.thread_sentences], args.threads)
    print(
        f"[serving] {args.threads} client threads: {payload['concurrent']['sentences_per_s']:.1f} sentences/s, "
        f"p50 {payload['concurrent']['latency']['p50_ms']:.0f} ms",
        flush=True,
    )

    # (`import tensorflow` itself loads parts of `keras`; our package must not be loaded, but for
    # the standard-library module common.py reads the CPU's flags with.)
    imported = common.unexpected_imports()
    payload["imports_only_tf_and_tf_text"] = not imported
    payload["unexpected_imports"] = imported
    payload["load"] = common.finish_load(load, own_threads=args.threads)
    common.write_json(args.output_name, payload, args.results_dir)


if __name__ == "__main__":
    main()
