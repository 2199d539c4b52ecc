"""Benchmark: beam-search decoding, per-step time vs output length, cached vs uncached; sentences/s.

Usage:
    python bench/decode.py                          # newest trained run under runs/, else random
    python bench/decode.py --run-dir runs/multi30k-small   # a given run
    python bench/decode.py --random-preset small    # a randomly initialised model

1. Per-step time (beam 4, batch 1 by default, a 16-token source). To decode a fixed
   number of steps, the search gets an `eos_id` the model never emits (the vocabulary
   size: `keras_transformer.decoding.beam_search(eos_id=...)` is there for this), and
   `max_output_length=L`: every hypothesis then runs to exactly L tokens. For each L in
   `--lengths` (10, 40, 160) and each mode (cached graph, cached XLA, uncached graph) the
   whole search is timed: `--repeats` rounds, each timing every L once (a short search
   several times in a row, averaged, to give each L about `--min-seconds` in all), so a
   drift of the machine's speed moves all lengths alike; the median over the rounds is
   T(L). Two per-step figures are derived:

       per_step_total    = T(L) / L                     (encoder + cache set-up amortised)
       per_step_marginal = (T(L) - T(1)) / (L - 1)      (the decoder steps alone)

   Targets: cached per_step_marginal at L=160 within 1.5x of L=10; cached T(160) at least
   4x below uncached T(160).

   With `--ctranslate2 DIR` (`python -m export --format ctranslate2` of the same run),
   CTranslate2 (float32, `intra_threads` 1 and 2: modes `ct2_1t`, `ct2_2t`) decodes the
   same sources, as pieces, the same way (`min_decoding_length` = `max_decoding_length`
   = L, no length penalty), in this process: the engines' steps side by side. Its
   `translate_batch` takes lists of pieces, so its searches do not include tokenizing.

   The machine's limit for a cached step: with one sentence, a step multiplies each
   decoder weight matrix by `beam` rows, one multiply-add per beam for each weight read,
   so memory reads, not FLOP/s, set its floor. Each cached figure is also given as the rate at
   which it reads the step's weights (`cached_step_weight_bytes` / per_step_marginal) and
   as a share of the peak read bandwidth measured in the same run
   (`common.peak_read_bandwidth`). The weights are a lower bound of a step's traffic
   (caches and activations come on top), so the share is a lower bound too.

2. Sentences/s translating the Multi30k test set (file order) with the run's
   `keras_transformer.translator.Translator` (text in, text out: tokenizer + beam 4 +
   detokenizer, one `tf.function`), in batches of 1 (`--batch1-sentences`, default the
   first 200) and of 32 (the 31 full batches), with the search in graph mode
   (`graph_batch_N`) and compiled by XLA (`xla_batch_N`, every shape compiled before
   timing). This needs a run directory's tokenizer: with a random model it is skipped.

Writes `bench/results/<machine>/decode.json`.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_transformer import decoding  # noqa: E402
from keras_transformer.model import Transformer  # noqa: E402
from keras_transformer.tokenizer import EOS_ID  # noqa: E402

MODES = {
    "cached": dict(use_cache=True, jit_compile=False),
    "cached_xla": dict(use_cache=True, jit_compile=True),
    "uncached": dict(use_cache=False, jit_compile=False),
}
# CTranslate2's modes (with --ctranslate2): its CPU threads.
CTRANSLATE2_MODES = {"ct2_1t": 1, "ct2_2t": 2}


def find_run_dir(root: Path) -> Path | None:
    """The most recently modified run directory under `root` with a config and a checkpoint."""
    candidates = []
    if root.is_dir():
        for config in root.glob("*/config.json"):
            run = config.parent
            if any(run.glob("checkpoints/ckpt-*.index")) or any(run.glob("averaged/ckpt-*.index")):
                candidates.append(run)
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def load_model(args):
    """(model, tokenizer or None, description)."""
    if args.run_dir:
        from keras_transformer import run_dir

        model = run_dir.load_model(args.run_dir)
        tokenizer = run_dir.load_tokenizer(args.run_dir)
        return model, tokenizer, {"run_dir": str(args.run_dir), "random_model": False}
    model = Transformer.from_preset(args.random_preset, args.vocab_size)
    model.build()
    return model, None, {"random_preset": args.random_preset, "random_model": True}


def model_description(model):
    return {
        "num_layers": model.num_layers,
        "d_model": model.d_model,
        "num_heads": model.num_heads,
        "d_ff": model.d_ff,
        "vocab_size": model.vocab_size,
        "params": int(model.count_params()),
    }


# Decoder weights a cached step does not read: the source's keys and values are
# projected once per sentence (`Transformer.init_cache`).
_PROJECTED_ONCE_PER_SENTENCE = re.compile(r"/cross_attention/(key|value)_(kernel|bias)$")


def cached_step_weight_bytes(model):
    """Bytes of weights one cached decoding step reads, whatever the batch or beam.

    The decoder's weights but the cross-attention key and value projections, plus the
    output projection `[d_model, vocab_size]` in the compute dtype (the target
    embedding lookup reads only the beams' rows and is left out).
    """
    decoder = sum(
        int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
        for w in model.decoder.weights
        if not _PROJECTED_ONCE_PER_SENTENCE.search(w.path)
    )
    output_projection = model.d_model * model.vocab_size * np.dtype(model.embedding.compute_dtype).itemsize
    return decoder + output_projection


def fixed_length_search(model, source_ids, length, mode, beam_size):
    """A function running one search that decodes exactly `length` tokens per hypothesis,
    and one giving the lengths that search decoded."""
    options = MODES[mode]
    never = model.vocab_size  # an id outside the vocabulary: no hypothesis ever ends early

    def run():
        return decoding.beam_search(
            model,
            source_ids,
            decoding.DecodingSettings(beam_size=beam_size, max_extra_length=length),
            max_output_length=length,
            eos_id=never,
            **options,
        )

    return run, lambda out: out.lengths.numpy()


def ctranslate2_fixed_length_search(translator, source_pieces, length, beam_size):
    """`fixed_length_search` for CTranslate2: EOS is forbidden before `length` tokens, and the search stops there."""

    def run():
        return translator.translate_batch(
            source_pieces,
            beam_size=beam_size,
            length_penalty=0,
            max_input_length=0,
            min_decoding_length=length,
            max_decoding_length=length,
        )

    return run, lambda out: np.array([len(result.hypotheses[0]) for result in out])


def open_ctranslate2(directory: Path, threads: int):
    """`(translator, pieces)`: a float32 CPU `ctranslate2.Translator` of an export, and its vocabulary."""
    import json

    import ctranslate2

    translator = ctranslate2.Translator(
        str(directory), device="cpu", compute_type="float32", intra_threads=threads, inter_threads=1
    )
    return translator, json.loads((directory / "shared_vocabulary.json").read_text(encoding="utf-8"))


def time_searches(make_search, lengths, rounds, min_seconds):
    """Median seconds per search for each of `lengths`, timed in interleaved rounds.

    `make_search(length)` gives a search function and a function of its output giving
    the lengths it decoded (checked to be `length`).

    Each round times every length once, a short search several times in a row
    (averaged, so that each length gets about `min_seconds` over all rounds): a drift
    of the machine's speed during the benchmark then moves every length alike, and
    the per-step figures, differences of these medians, stay comparable.
    """
    runs, first_call, calls = {}, {}, {}
    for length in lengths:
        run, decoded_lengths = make_search(length)
        start = time.perf_counter()
        out = run()
        common.sync(out)
        first_call[length] = time.perf_counter() - start
        if not np.all(decoded_lengths(out) == length):
            raise RuntimeError(f"expected {length} decoded tokens, got {decoded_lengths(out)}")
        start = time.perf_counter()
        common.sync(run())
        once = time.perf_counter() - start
        calls[length] = max(1, int(min_seconds / rounds / max(once, 1e-6)))
        runs[length] = run
    samples = {length: [] for length in lengths}
    for _ in range(rounds):
        for length in lengths:
            samples[length] += common.time_calls(runs[length], 1, calls_per_repeat=calls[length])
    return {
        length: {
            "first_call_s": first_call[length],
            "calls_per_repeat": calls[length],
            **common.summarize(samples[length]),
        }
        for length in lengths
    }


def per_step_benchmark(model, args, weight_bytes, peak_read_bytes_per_s):
    """Per-step times of every mode and length; a cached step's also as a weight-read rate."""
    rng = np.random.default_rng(0)
    source = rng.integers(4, model.vocab_size, size=(args.batch, args.source_length), dtype=np.int32)
    source[:, -1] = EOS_ID
    source_ids = tf.constant(source)
    results = []
    modes = list(args.modes) + (list(CTRANSLATE2_MODES) if args.ctranslate2 else [])
    for mode in modes:
        lengths = sorted(set([1] + args.lengths))
        if mode == "uncached":
            lengths = [length for length in lengths if length <= args.max_uncached_length]
        if mode in CTRANSLATE2_MODES:
            translator, pieces = open_ctranslate2(args.ctranslate2, CTRANSLATE2_MODES[mode])
            source_pieces = [[pieces[i] for i in row[:-1]] for row in source]  # CTranslate2 adds EOS

            def make_search(length, translator=translator, source_pieces=source_pieces):
                return ctranslate2_fixed_length_search(translator, source_pieces, length, args.beam_size)

        else:

            def make_search(length, mode=mode):
                return fixed_length_search(model, source_ids, length, mode, args.beam_size)

        try:
            timings = time_searches(make_search, lengths, args.repeats, args.min_seconds)
        except Exception as e:  # e.g. XLA unsupported on this device
            print(f"[decode] {mode}: FAILED {e!r}"[:400], flush=True)
            results += [{"mode": mode, "length": length, "error": repr(e)[:500]} for length in lengths]
            continue
        baseline = timings[1]["median_s"]
        for length in lengths:
            total = timings[length]["median_s"]
            marginal = None if length == 1 else (total - baseline) / (length - 1)
            result = {
                "mode": mode,
                "length": length,
                "batch": args.batch,
                "beam_size": args.beam_size,
                "source_length": args.source_length,
                "search": timings[length],
                "per_step_total_s": total / length,
                "per_step_marginal_s": marginal,
            }
            note = ""
            if mode in ("cached", "cached_xla") and marginal and marginal > 0:
                rate = weight_bytes / marginal
                result["weight_read_bytes_per_s"] = rate
                result["read_bandwidth_utilisation"] = rate / peak_read_bytes_per_s
                note = f", weights read at {rate / 1e9:5.1f} GB/s ({rate / peak_read_bytes_per_s:.0%} of peak)"
            results.append(result)
            print(
                f"[decode] {mode:10s} L={length:4d}: search {total * 1e3:8.1f} ms, "
                f"per step {total / length * 1e3:6.2f} ms (total/L)"
                + ("" if marginal is None else f", {marginal * 1e3:6.2f} ms (marginal)")
                + note,
                flush=True,
            )
    return results


def targets(per_step):
    def get(mode, length):
        for r in per_step:
            if r["mode"] == mode and r["length"] == length and "search" in r:
                return r
        return None

    out = {}
    for mode in ("cached", "cached_xla"):
        short, long = get(mode, 10), get(mode, 160)
        if short and long:
            ratio = long["per_step_marginal_s"] / short["per_step_marginal_s"]
            ratio_total = long["per_step_total_s"] / short["per_step_total_s"]
            out[f"{mode}_step_160_over_10"] = {
                "marginal": ratio,
                "total_over_length": ratio_total,
                "target": "<= 1.5",
                "met": ratio <= 1.5,
            }
        uncached = get("uncached", 160)
        if long and uncached:
            speedup = uncached["search"]["median_s"] / long["search"]["median_s"]
            out[f"{mode}_speedup_vs_uncached_160"] = {"speedup": speedup, "target": ">= 4", "met": speedup >= 4}
    return out


def multi30k_test_sentences(data_dir):
    from keras_transformer.corpora import load_multi30k

    corpus = load_multi30k(data_dir)
    return [source for source, _ in corpus.test]


def sentences_per_second(model, tokenizer, args):
    """Translator (text -> text, beam 4) over the Multi30k test sources, graph mode and XLA.

    Only full batches are timed, and each batch shape is met once before timing, so no
    XLA compilation is timed (a server compiles each shape once, at warm-up or first use).
    """
    from keras_transformer.translator import Translator

    if tokenizer is None:
        return {"skipped": "no run directory: no tokenizer"}
    sentences = multi30k_test_sentences(args.data_dir)
    results = {}
    for jit_compile in (False, True):
        translator = Translator(
            model, tokenizer, decoding=decoding.DecodingSettings(beam_size=args.beam_size), jit_compile=jit_compile
        )
        for batch_size, count in ((1, args.batch1_sentences), (32, args.batch32_sentences)):
            chosen = sentences[: count or len(sentences)]
            chosen = chosen[: len(chosen) // batch_size * batch_size]
            batches = [chosen[i : i + batch_size] for i in range(0, len(chosen), batch_size)]
            # Trace first; with XLA, also compile every (batch, length bucket) shape.
            for batch in batches if jit_compile else batches[:1]:
                common.sync(translator.translate(tf.constant(batch)))
            start = time.perf_counter()
            lengths = []
            for batch in batches:
                out = translator.translate(tf.constant(batch))
                lengths += [len(t.decode("utf-8").split()) for t in out["translation"].numpy()]
            seconds = time.perf_counter() - start
            key = f"{'xla' if jit_compile else 'graph'}_batch_{batch_size}"
            results[key] = {
                "sentences": len(chosen),
                "seconds": seconds,
                "sentences_per_s": len(chosen) / seconds,
                "mean_output_words": statistics.mean(lengths) if lengths else 0,
            }
            print(
                f"[decode] Translator {key}: {len(chosen) / seconds:.1f} sentences/s "
                f"({len(chosen)} sentences in {seconds:.1f} s)",
                flush=True,
            )
    return results


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=None, help="trained run (default: newest under runs/)")
    parser.add_argument("--random-preset", default=None, help="use a random model of this preset instead")
    parser.add_argument("--vocab-size", type=int, default=8000, help="vocabulary of a random model")
    parser.add_argument("--data-dir", default=None, help="Multi30k directory (default: MULTI30K_DIR / shared)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 40, 160])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--beam-size", type=int, default=decoding.DecodingSettings().beam_size)
    parser.add_argument("--batch", type=int, default=1, help="sentences per search in the per-step part")
    parser.add_argument("--source-length", type=int, default=16, help="source tokens (EOS included)")
    parser.add_argument("--max-uncached-length", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds over all lengths")
    parser.add_argument(
        "--min-seconds", type=float, default=2.0, help="time per length over all rounds (short searches repeat)"
    )
    parser.add_argument("--batch1-sentences", type=int, default=200, help="0: all")
    parser.add_argument("--batch32-sentences", type=int, default=0, help="0: all")
    parser.add_argument("--skip-sentences", action="store_true", help="only the per-step part")
    parser.add_argument(
        "--ctranslate2", type=Path, default=None,
        help="a CTranslate2 export of the same run: also time its steps (float32, 1 and 2 threads)",
    )
    parser.add_argument("--output-name", default="decode")
    common.add_load_args(parser)
    common.add_results_dir_arg(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    if args.data_dir is None:
        shared = common.REPO_ROOT.parent / "shared" / "data" / "multi30k"
        import os

        args.data_dir = os.environ.get("MULTI30K_DIR") or (str(shared) if shared.is_dir() else None)
    if args.run_dir is None and args.random_preset is None:
        args.run_dir = find_run_dir(common.REPO_ROOT / "runs")
        if args.run_dir is None:
            args.random_preset = "small"
            print("[decode] no trained run under runs/: using a random `small` model", flush=True)
    model, tokenizer, source = load_model(args)
    print(f"[decode] model: {source}", flush=True)
    load = common.quiet(args)
    payload = common.header("decode", args)
    payload["model"] = {**source, **model_description(model)}
    peak_read = common.peak_read_bandwidth()
    weight_bytes = cached_step_weight_bytes(model)
    print(
        f"[decode] peak read bandwidth {peak_read['best_bytes_per_s'] / 1e9:.1f} GB/s "
        f"({'XLA' if peak_read['best_xla'] else 'TensorFlow'}'s reduce_sum); a cached step reads "
        f"{weight_bytes / 1e6:.1f} MB of weights",
        flush=True,
    )
    payload["peak_read_bandwidth"] = peak_read
    payload["cached_step_weight_bytes"] = weight_bytes
    payload["per_step"] = per_step_benchmark(model, args, weight_bytes, peak_read["best_bytes_per_s"])
    payload["targets"] = targets(payload["per_step"])
    for key, value in payload["targets"].items():
        print(f"[decode] target {key}: {value}", flush=True)
    if not args.skip_sentences:
        payload["sentences_per_s"] = sentences_per_second(model, tokenizer, args)
    payload["load"] = common.finish_load(load)
    common.write_json(args.output_name, payload, args.results_dir)


if __name__ == "__main__":
    main()
