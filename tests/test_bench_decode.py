"""bench/common.py's measured peaks (matmul FLOP/s, memory reads) and bench/decode.py's weights per cached step."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import common  # noqa: E402
import decode  # noqa: E402

from keras_transformer.model import Transformer  # noqa: E402


@pytest.mark.parametrize("policy, output_bytes", [("float32", 4), ("mixed_bfloat16", 2)])
def test_a_cached_step_reads_the_decoder_but_the_source_projections_and_the_output_projection(policy, output_bytes):
    num_layers, d_model, num_heads, d_ff, vocab = 2, 16, 4, 24, 50
    model = Transformer(
        vocab, num_layers=num_layers, d_model=d_model, num_heads=num_heads, d_ff=d_ff, dtype=policy
    )
    model.build()
    projection = d_model * d_model + d_model  # a kernel and its bias
    per_layer = (
        4 * projection  # self-attention: queries, keys, values, output
        + 2 * projection  # cross-attention: queries and output (keys and values once per sentence)
        + d_model * d_ff + d_ff + d_ff * d_model + d_model  # feed-forward network
        + 3 * 2 * d_model  # three layer norms, gain and bias
    )
    expected = num_layers * per_layer * 4 + d_model * vocab * output_bytes  # variables are float32
    assert decode.cached_step_weight_bytes(model) == expected


def test_the_peak_read_rate_is_the_array_size_over_the_fastest_kernels_best_time(monkeypatch):
    per_call = {False: [0.004, 0.002, 0.003], True: [0.001, 0.005, 0.006]}  # seconds, TF then XLA
    kernels = iter([False, True])
    monkeypatch.setattr(common, "calls_to_fill", lambda fn, seconds: 1)
    monkeypatch.setattr(common, "time_calls", lambda fn, repeats, calls: per_call[next(kernels)])
    peak = common.peak_read_bandwidth(size_mib=1, repeats=3)
    assert peak["array_bytes"] == 2**20
    assert peak["best_bytes_per_s"] == pytest.approx(2**20 / 0.001)
    assert peak["best_xla"] is True
    tf_kernel = next(k for k in peak["kernels"] if not k["xla"])
    assert tf_kernel["best_bytes_per_s"] == pytest.approx(2**20 / 0.002)
    assert tf_kernel["median_bytes_per_s"] == pytest.approx(2**20 / 0.003)


def test_the_peak_matmul_is_the_best_rate_over_sizes_and_kernels(monkeypatch):
    # Per size, TensorFlow's kernel then XLA's: seconds per call of each repeat.
    per_call = iter([[0.1, 0.2], [0.05, 0.3], [0.1, 0.4], [1.0, 2.0]])
    monkeypatch.setattr(common, "calls_to_fill", lambda fn, seconds: 1)
    monkeypatch.setattr(common, "time_calls", lambda fn, repeats, calls: next(per_call))
    peak = common.peak_matmul_flops("float32", sizes=(2, 3), repeats=2)
    assert peak["best_flops"] == pytest.approx(2 * 3**3 / 0.1)
    assert peak["best_shape"] == {"n": 3, "xla": False}
    xla_2 = next(s for s in peak["shapes"] if s["n"] == 2 and s["xla"])
    assert xla_2["best_flops"] == pytest.approx(2 * 2**3 / 0.05)
    assert xla_2["median_flops"] == pytest.approx((2 * 2**3 / 0.05 + 2 * 2**3 / 0.3) / 2)


def test_an_engine_over_rounds_gets_the_median_of_each_timing_and_its_highest_peak_memory():
    import decode_peers

    def run(batched, p50, peak, busy=False):
        return {
            "engine": "ours-graph",
            "batched": {"sentences_per_s": batched, "sentences": 992},
            "single": {"p50_ms": p50, "p95_ms": 2 * p50, "mean_ms": p50 + 1},
            "concurrent": {"sentences_per_s": batched / 2, "latency": {"p50_ms": 3 * p50, "p95_ms": 4 * p50}},
            "peak_rss_batched_mb": peak,
            "peak_rss_mb": peak + 10,
            "neighbours": {"busy": busy, "neighbour_cores_during": 0.5 if busy else 0.0},
            "translations": ["first round's"] if peak == 100 else ["other"],
        }

    runs = [run(90.0, 12.0, 100), run(60.0, 30.0, 120, busy=True), run(110.0, 10.0, 110)]
    record = decode_peers.median_record(runs)
    assert record["batched"] == {"sentences_per_s": 90.0, "sentences": 992}
    assert record["single"] == {"p50_ms": 12.0, "p95_ms": 24.0, "mean_ms": 13.0}
    assert record["concurrent"] == {"sentences_per_s": 45.0, "latency": {"p50_ms": 36.0, "p95_ms": 48.0}}
    assert (record["peak_rss_batched_mb"], record["peak_rss_mb"]) == (120, 130)
    assert record["neighbours"]["busy"] and record["neighbours"]["neighbour_cores_during"] == 0.5
    assert record["translations"] == ["first round's"]
    assert [r["batched.sentences_per_s"] for r in record["rounds"]] == [90.0, 60.0, 110.0]
    assert runs[0]["batched"]["sentences_per_s"] == 90.0 and runs[2]["single"]["p50_ms"] == 10.0  # rounds untouched
    failed = {
        "engine": "ours-graph",
        "error": "the process failed (exit code 1)",
        "neighbours": {"busy": False, "neighbour_cores_during": None},
    }
    assert decode_peers.median_record([failed, runs[2]])["batched"]["sentences_per_s"] == 110.0
    assert decode_peers.median_record([failed]) == failed


def test_both_engines_decode_exactly_the_asked_tokens_in_the_per_step_benchmark(tmp_path):
    # The per-step figures compare searches of L tokens: CTranslate2 is held there by its
    # minimum and maximum decoding lengths, ours by an EOS it never emits.
    pytest.importorskip("ctranslate2")
    import numpy as np
    import tensorflow as tf

    from keras_transformer import ctranslate2_export

    vocab = 40
    model = Transformer(vocab, num_layers=1, d_model=16, num_heads=2, d_ff=24, dropout_rate=0.0)
    model.build()
    # The decoder's output points at EOS's embedding: left alone, both engines stop after a token.
    eos_row = model.embedding.embeddings.numpy()[3]
    model.decoder.blocks[-1].feed_forward_norm.beta.assign(10.0 * eos_row / np.linalg.norm(eos_row))
    ctranslate2_export.export_model(model, ["<pad>", "<unk>", "<s>", "</s>"] + [f"▁w{i}" for i in range(4, vocab)],
                                    tmp_path / "ct2")
    source = np.array([[5, 9, 11, 3], [7, 8, 30, 3]], np.int32)  # EOS (3) last
    translator, pieces = decode.open_ctranslate2(tmp_path / "ct2", threads=1)
    source_pieces = [[pieces[i] for i in row[:-1]] for row in source]
    for length in (1, 7):
        for run, decoded_lengths in (
            decode.fixed_length_search(model, tf.constant(source), length, "cached", beam_size=4),
            decode.ctranslate2_fixed_length_search(translator, source_pieces, length, beam_size=4),
        ):
            assert list(decoded_lengths(run())) == [length, length]


def test_an_engine_times_full_batches_only_when_asked_for_more_sentences_than_the_test_set_has(
    tmp_path, monkeypatch
):
    # --batch-sentences 1024 over Multi30k's 1,000 test sentences: 31 batches of 32 (992 sentences), not a
    # 32nd batch of 8 timed with them.
    import json

    import decode_peers

    sentences = [f"sentence {i}" for i in range(1000)]
    monkeypatch.setattr(common, "load_sentences", lambda *args, **kwargs: sentences)
    sizes = []

    def open_fake(directory, compute_type, intra_threads, args):
        def translate(texts):
            sizes.append(len(texts))
            return [text.upper() for text in texts]

        return translate, {"load_s": 0.0}

    monkeypatch.setattr(decode_peers, "open_ctranslate2", open_fake)
    args = decode_peers.parse_args([
        "--ctranslate2", str(tmp_path), "--engines", "ct2-float32-1t", "--batch-sentences", "1024",
        "--latency-sentences", "2", "--thread-sentences", "2", "--threads", "1", "--warmup", "0",
    ])
    decode_peers.run_engine("ct2-float32-1t", args, tmp_path / "record.json")
    record = json.loads((tmp_path / "record.json").read_text())

    assert record["batched"]["sentences"] == 992 == len(record["translations"])
    assert set(sizes[: sizes.index(1)]) == {32}  # the batches (untimed once, then timed), then single sentences
    assert record["translations"] == [text.upper() for text in sentences[:992]]
    batches = decode_peers.full_batches(sentences, 1024, 32)
    assert sum(map(len, batches)) == 992 and {len(batch) for batch in batches} == {32}


def test_concurrent_clients_count_only_the_requests_that_were_translated():
    # 10 requests, every third one fails at once: 6 sentences translated (each taking >= 20 ms), 4 failed.
    import time

    def translate(texts):
        if int(texts[0]) % 3 == 0:
            raise RuntimeError("no position encodings")
        time.sleep(0.02)
        return texts

    record = common.time_concurrent(translate, [str(i) for i in range(10)], threads=2)

    assert (record["sentences"], record["latency"]["requests"]) == (6, 6)
    assert record["failed"] == 4
    assert record["sentences_per_s"] == pytest.approx(6 / record["seconds"])
    assert record["latency"]["p50_ms"] >= 20 and len(record["errors"]) == 4
    nothing = common.time_concurrent(lambda texts: 1 / 0, ["a", "b"], threads=2)
    assert (nothing["sentences"], nothing["failed"], nothing["latency"]["p50_ms"]) == (0, 2, None)
