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
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (standard library only at import)

import tensorflow as tf  # noqa: E402
import tensorflow_text  # noqa: E402, F401  (registers the SentencePiece ops of the SavedModel)

TARGET_P50_MS = 40.0


def resolve_version_dir(path: Path) -> Path:
    """`path` if it holds a saved_model.pb, else its highest numeric version subdirectory."""
    if (path / "saved_model.pb").is_file():
        return path
    versions = [p for p in path.iterdir() if p.is_dir() and p.name.isdigit() and (p / "saved_model.pb").is_file()]
    if not versions:
        raise SystemExit(f"{path} holds no SavedModel (no saved_model.pb, no numeric version directory).")
    return max(versions, key=lambda p: int(p.name))


def load_sentences(data_dir: str | None, source_lang: str, limit: int | None = None) -> list[str]:
    candidates = [
        data_dir,
        os.environ.get("MULTI30K_DIR"),
        str(common.REPO_ROOT.parent / "shared" / "data" / "multi30k"),
    ]
    for directory in candidates:
        if directory and (Path(directory) / f"test_2016_flickr.{source_lang}").is_file():
            lines = (Path(directory) / f"test_2016_flickr.{source_lang}").read_text(encoding="utf-8").splitlines()
            return [line.strip() for line in lines if line.strip()][:limit]
    raise SystemExit("Multi30k test sources not found: pass --data-dir or set MULTI30K_DIR.")


def signature_input_name(signature) -> str:
    _, kwargs = signature.structured_input_signature
    if len(kwargs) != 1:
        raise SystemExit(f"serving_default takes {sorted(kwargs)}; expected one string input.")
    return next(iter(kwargs))


def latency_percentiles(seconds: list[float]) -> dict:
    ms = [s * 1e3 for s in seconds]
    return {
        "requests": len(ms),
        "p50_ms": common.percentile(ms, 50),
        "p95_ms": common.percentile(ms, 95),
        "p99_ms": common.percentile(ms, 99),
        "mean_ms": statistics.mean(ms),
        "max_ms": max(ms),
    }


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

    # 1. One sentence per request, one client.
    timings, words = [], []
    for text in sentences[: args.latency_sentences]:
        t0 = time.perf_counter()
        out = request([text])
        timings.append(time.perf_counter() - t0)
        words.append(len(out["translation"][0].split()))
    payload["single"] = {**latency_percentiles(timings), "mean_output_words": statistics.mean(words)}
    p50 = payload["single"]["p50_ms"]
    payload["target_p50"] = {"p50_ms": p50, "target_ms": TARGET_P50_MS, "met": p50 <= TARGET_P50_MS}
    print(
        f"[serving] 1 sentence/request: p50 {p50:.1f} ms, p95 {payload['single']['p95_ms']:.1f} ms "
        f"(target p50 <= {TARGET_P50_MS:.0f} ms: {'met' if p50 <= TARGET_P50_MS else 'MISSED'})",
        flush=True,
    )

    # 2. Batches of 32 sentences, one client.
    batch_times = []
    start = time.perf_counter()
    for batch in batches:
        t0 = time.perf_counter()
        request(batch)
        batch_times.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - start
    payload["batched"] = {
        "batch_size": args.batch_size,
        "sentences": len(chosen),
        "seconds": seconds,
        "sentences_per_s": len(chosen) / seconds,
        "batch_latency": latency_percentiles(batch_times),
    }
    print(f"[serving] batches of {args.batch_size}: {len(chosen) / seconds:.1f} sentences/s", flush=True)

    # 3. Concurrent clients, one sentence per request.
    work = queue.Queue()
    for text in sentences[: args.thread_sentences]:
        work.put(text)
    thread_timings = []
    lock = threading.Lock()
    errors = []

    def client():
        while True:
            try:
                text = work.get_nowait()
            except queue.Empty:
                return
            t0 = time.perf_counter()
            try:
                request([text])
            except Exception as e:  # pragma: no cover - recorded, not raised
                errors.append(repr(e)[:300])
            with lock:
                thread_timings.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client) for _ in range(args.threads)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    payload["concurrent"] = {
        "threads": args.threads,
        "sentences": len(thread_timings),
        "seconds": seconds,
        "sentences_per_s": len(thread_timings) / seconds,
        "latency": latency_percentiles(thread_timings),
        "errors": errors[:5],
    }
    print(
        f"[serving] {args.threads} client threads: {len(thread_timings) / seconds:.1f} sentences/s, "
        f"p50 {payload['concurrent']['latency']['p50_ms']:.0f} ms",
        flush=True,
    )

    # (`import tensorflow` itself loads parts of `keras`; our package must not be loaded.)
    imported = sorted(m for m in ("keras_transformer", "keras_hub") if m in sys.modules)
    payload["imports_only_tf_and_tf_text"] = not imported
    payload["unexpected_imports"] = imported
    payload["load"] = common.finish_load(load, own_threads=args.threads)
    common.write_json(args.output_name, payload, args.results_dir)


if __name__ == "__main__":
    main()
