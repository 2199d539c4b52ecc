"""Turns the benchmark JSON files into a Markdown summary and PNG plots.

Usage:
    python bench/report.py                 # reads and writes this machine's bench/results/<machine>/
    python bench/report.py --results DIR   # e.g. bench/results/amd-epyc, written with --results-dir

Reads `train_throughput.json`, `decode.json` and `decode-*.json`, `serving*.json`,
`decode_peers*.json` and `profile-*.json` (whichever exist), and writes:

* `RESULTS.md`: the machine, then one table per benchmark, with the targets marked met
  or missed, and a warning where the machine was busy during a measurement;
* `train_throughput.png`: training tokens/s per configuration (preset, precision, XLA),
  one bar per implementation;
* `decode_step_time.png` (`decode-NAME_step_time.png`): beam-search time per decoding
  step vs output length (log-log), cached (graph / XLA), uncached and CTranslate2's;
* `decode_peers.png`: sentences/s with batches of 32 and the one-sentence p50 of each
  engine of `decode_peers.py` (our SavedModel in graph mode and with XLA, CTranslate2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import common  # bench/ is on sys.path when run as a script

RESULTS_DIR = common.RESULTS_DIR  # this machine's folder, bench/results/<machine>/

IMPL_LABELS = {
    "ours": "ours (keras_transformer)",
    "peer": "KerasHub (dropout 0.1 incl. attention)",
    "peer_noattndrop": "KerasHub (no attention dropout)",
}
PRECISION_SHORT = {"float32": "fp32", "mixed_bfloat16": "bf16", "mixed_float16": "fp16"}


def load(results_dir: Path, name: str):
    path = results_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def load_named(results_dir: Path, *patterns: str):
    """`(stem, payload)` of every JSON matching `patterns`, shortest name first (`NAME.json`,
    then the `NAME-*.json` written with `--output-name`)."""
    paths = {path for pattern in patterns for path in results_dir.glob(pattern)}
    return [(path.stem, json.loads(path.read_text())) for path in sorted(paths, key=lambda p: (len(p.name), p.name))]


def fmt(value, digits=0):
    if value is None:
        return "–"
    return f"{value:,.{digits}f}"


def met(flag):
    return "met" if flag else "**missed**"


def device_name(machine):
    """What the benchmarks ran on: the first GPU if there was one (they run on GPU:0), else the CPU."""
    if machine.get("gpus"):
        return machine["gpus"][0] + (" (TF32 on)" if machine.get("tf32_enabled") else "")
    return f"{machine['cpu']}, {machine['cpu_cores']} cores"


def machine_line(payload):
    m = payload["machine"]
    gpus = ", ".join(m.get("gpus") or []) or "no GPU"
    versions = f"TF {m.get('tensorflow')}" + (f", Keras {m['keras']}" if m.get("keras") else "")
    if m.get("keras_hub"):
        versions += f", KerasHub {m['keras_hub']}"
    features = [
        name for key, name in (("cpu_avx512f", "AVX-512"), ("cpu_avx512_bf16", "AVX512_BF16"), ("cpu_amx_bf16", "AMX"))
        if m.get(key)
    ]
    if "cpu_avx512f" in m and not features:
        features = ["no AVX-512"]
    details = ", ".join([f"{m.get('cpu_cores')} cores", *features, f"{m.get('memory_gib')} GiB"])
    cpu = f"{m.get('cpu')} ({details})"
    return f"{cpu}, {gpus}; {versions}"


def load_note(payload):
    load = payload.get("load") or {}
    before, after = load.get("load_before"), load.get("load_after")
    text = f"load average before {before[0] if before else '?'}, after {after[0] if after else '?'}"
    if payload["machine"].get("onednn") is not None:  # older results do not record it
        text += f"; TensorFlow's oneDNN CPU kernels {'on' if payload['machine']['onednn'] else 'off'}"
    if load.get("busy"):
        text += " — **the machine was busy (other jobs on the cores): figures are pessimistic and noisy**"
    return text


# --------------------------------------------------------------------------- training


def peak_line(peaks):
    """The peaks the MFU is over: the best square matmul per dtype, and which one it was."""
    if not any("shapes" in peak for peak in peaks.values()):  # older results: 4096² without XLA only
        return (
            "Peak matmul (4096², best of 5, same run): "
            + ", ".join(f"{k} {v['best_flops'] / 1e9:.0f} GFLOP/s" for k, v in peaks.items())
            + "."
        )
    sizes = sorted({shape["n"] for peak in peaks.values() for shape in peak["shapes"]})
    return (
        f"Peak matmul (the best square matmul of sizes {', '.join(map(str, sizes))}, with and without XLA, "
        "best of 5 each, same run): "
        + ", ".join(
            f"{k} {v['best_flops'] / 1e9:.0f} GFLOP/s ({v['best_shape']['n']}², "
            f"{'XLA' if v['best_shape']['xla'] else 'no XLA'})"
            for k, v in peaks.items()
        )
        + "."
    )


def train_section(payload):
    lines = ["## Training throughput", ""]
    lines.append(f"`{payload['command']}` — {payload['date_utc']}; {load_note(payload)}.")
    peaks = payload.get("peak_matmul", {})
    if peaks:
        lines.append(peak_line(peaks))
    results = [r for r in payload["results"]]
    if results:
        r0 = results[0]
        lines.append(
            f"Synthetic batches, source and target {r0['src_len']} tokens each, no padding; "
            + ", ".join(
                sorted({f"{r['preset']}: batch {r['batch']} ({r['tokens_per_step']} tokens/step)" for r in results})
            )
            + f"; step = `{r0.get('step', 'trainer')}`."
        )
    lines += [
        "",
        "| preset | precision | XLA | implementation | tokens/s | step ms (median) | model TFLOP/s | MFU "
        "| MFU (fp32 peak) | ours ÷ this |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ours = {}
    for r in results:
        if r["impl"] == "ours" and "tokens_per_s" in r:
            ours[(r["preset"], r["precision"], r["jit_compile"])] = r["tokens_per_s"]
    for r in results:
        key = (r["preset"], r["precision"], r["jit_compile"])
        if "tokens_per_s" not in r:
            lines.append(
                f"| {r['preset']} | {PRECISION_SHORT.get(r['precision'], r['precision'])} | "
                f"{'on' if r['jit_compile'] else 'off'} | {r['impl']} | failed: {r.get('error', '')[:60]} | | | | | |"
            )
            continue
        ratio = "" if r["impl"] == "ours" or key not in ours else f"{ours[key] / r['tokens_per_s']:.2f}×"
        lines.append(
            f"| {r['preset']} | {PRECISION_SHORT.get(r['precision'], r['precision'])} | "
            f"{'on' if r['jit_compile'] else 'off'} | {r['impl']} | {fmt(r['tokens_per_s'])} | "
            f"{fmt(r['step_time']['median_s'] * 1e3)} | {r['model_flops_per_s'] / 1e12:.3f} | "
            f"{r['mfu']:.1%} | {r['mfu_vs_float32_peak']:.1%} | {ratio} |"
        )
    if any("shapes" in peak for peak in peaks.values()):
        xla_note = (
            "Each peak is the faster of TensorFlow's own kernel and XLA's: XLA on a CPU computes "
            "bfloat16 dots in float32, so on a CPU without AMX the bf16 peak can be that rate."
        )
    else:
        xla_note = (
            "XLA on a CPU computes bfloat16 dots in float32, so where the bf16 peak is below the "
            "float32 one (a CPU without AMX), a bf16 XLA step can pass 100% of the bf16 peak: read "
            "the fp32 column there."
        )
    lines += [
        "",
        "MFU: model FLOPs/s over the measured peak of the step's precision (bf16 peak for "
        "mixed_bfloat16, fp16 peak for mixed_float16); MFU (fp32 peak): over the float32 peak "
        f"(TF32 on Ampere and newer GPUs unless disabled). {xla_note} "
        "`peer`: KerasHub `TransformerEncoder`/`TransformerDecoder` with "
        "`dropout=0.1` (which also drops attention weights); `peer_noattndrop`: the same "
        "with attention-weight dropout off, i.e. exactly our architecture.",
        "",
    ]
    return lines


def plot_train(payload, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in payload["results"] if "tokens_per_s" in r]
    if not results:
        return None
    configs = []
    for r in results:
        key = (r["preset"], r["precision"], r["jit_compile"])
        if key not in configs:
            configs.append(key)
    impls = [i for i in IMPL_LABELS if any(r["impl"] == i for r in results)]
    width = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(configs) + 2), 4.8))
    colors = {"ours": "#1f77b4", "peer": "#ff7f0e", "peer_noattndrop": "#fdbf6f"}
    for i, impl in enumerate(impls):
        xs, ys = [], []
        for j, key in enumerate(configs):
            for r in results:
                if (r["preset"], r["precision"], r["jit_compile"]) == key and r["impl"] == impl:
                    xs.append(j + (i - (len(impls) - 1) / 2) * width)
                    ys.append(r["tokens_per_s"])
        bars = ax.bar(xs, ys, width, label=IMPL_LABELS[impl], color=colors.get(impl))
        ax.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7, rotation=90, padding=2)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels(
        [f"{p}\n{PRECISION_SHORT.get(q, q)}, XLA {'on' if j else 'off'}" for p, q, j in configs], fontsize=9
    )
    ax.set_ylabel("training tokens/s (source + target)")
    ax.set_yscale("log")
    ax.set_title(f"Training throughput — {device_name(payload['machine'])}", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.margins(y=0.25)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    path = out / "train_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- decoding


def decode_section(payload):
    model = payload.get("model", {})
    desc = (
        f"{'random' if model.get('random_model') else 'trained'} model "
        f"({model.get('num_layers')} layers, d_model {model.get('d_model')}, vocab {model.get('vocab_size')}"
        + (f", run `{model['run_dir']}`" if model.get("run_dir") else "")
        + ")"
    )
    lines = ["## Decoding (beam search)", ""]
    lines.append(f"`{payload['command']}` — {payload['date_utc']}; {desc}; {load_note(payload)}.")
    per_step = [r for r in payload.get("per_step", []) if "search" in r]
    if per_step:
        r0 = per_step[0]
        lines.append(
            f"Beam {r0['beam_size']}, batch {r0['batch']}, {r0['source_length']}-token source, "
            "EOS suppressed so every hypothesis runs to exactly L tokens. "
            "Per step = (T(L) − T(1)) / (L − 1) (decoder steps alone); total/L includes the encoder."
        )
        if any(r["mode"].startswith("ct2_") for r in per_step):
            lines.append(
                "`ct2_1t`, `ct2_2t`: CTranslate2 (float32, 1 and 2 threads) on the same weights and sources, "
                "in the same process, held to L tokens by its minimum and maximum decoding lengths; "
                "its searches take pieces, so they do not tokenize."
            )
        lengths = sorted({r["length"] for r in per_step if r["length"] > 1})
        lines.append("")
        lines += mode_by_length_table(
            per_step,
            lengths,
            lambda n: f"L={n}: search ms / per-step ms",
            lambda r: f"{r['search']['median_s'] * 1e3:,.0f} / {r['per_step_marginal_s'] * 1e3:.2f}",
        )
        lines += memory_bound_lines(payload, per_step, lengths)
    targets = payload.get("targets", {})
    if targets:
        lines += ["", "| target | measured | result |", "| --- | ---: | --- |"]
        for key, t in targets.items():
            if "marginal" in t:
                lines.append(
                    f"| {key.split('_step')[0]}: per-step time at L=160 ≤ 1.5× L=10 | "
                    f"{t['marginal']:.2f}× (total/L: {t['total_over_length']:.2f}×) | {met(t['met'])} |"
                )
            else:
                lines.append(
                    f"| {key.split('_speedup')[0]} ≥ 4× faster than uncached, 160 tokens | "
                    f"{t['speedup']:.1f}× | {met(t['met'])} |"
                )
    sps = payload.get("sentences_per_s")
    if sps and "skipped" not in sps:
        lines += [
            "",
            "| Multi30k test, Translator (text → text, beam 4) | sentences | sentences/s |",
            "| --- | ---: | ---: |",
        ]
        for key, v in sps.items():
            lines.append(f"| {key.replace('_', ' ')} | {v['sentences']} | {v['sentences_per_s']:.1f} |")
    elif sps:
        lines += ["", f"Sentences/s: skipped ({sps['skipped']})."]
    lines.append("")
    return lines


def memory_bound_lines(payload, per_step, lengths):
    """The cached steps as weight-read rates against the measured peak (recorded since 2026-11-25)."""
    peak = payload.get("peak_read_bandwidth")
    rated = [r for r in per_step if "weight_read_bytes_per_s" in r]
    if not peak or not rated:
        return []
    best = "XLA's" if peak["best_xla"] else "TensorFlow's"
    lines = [
        "",
        f"A cached step reads at least {payload['cached_step_weight_bytes'] / 1e6:.1f} MB of weights "
        "(the decoder's, less the source's key and value projections, plus the output projection), "
        "one multiply-add per beam for each weight, so its floor is the time to read them. "
        f"Peak read bandwidth (sum of a {peak['array_bytes'] // 2**20} MiB float32 array, TensorFlow's and "
        f"XLA's kernels, best of 5, same run): {peak['best_bytes_per_s'] / 1e9:.1f} GB/s ({best}). "
        "Weights read per second (weights / per-step time) and their share of that peak, "
        "a lower bound (caches and activations are read too):",
        "",
    ]
    return lines + mode_by_length_table(
        rated,
        lengths,
        lambda n: f"L={n}",
        lambda r: f"{r['weight_read_bytes_per_s'] / 1e9:.1f} GB/s ({r['read_bandwidth_utilisation']:.0%})",
    )


def mode_by_length_table(rows, lengths, header, cell):
    """A Markdown table of decode results `rows`: a line per mode, a column per output length.

    Modes come in the order they first appear; `header(length)` and `cell(row)` give the
    text, and "–" fills a length a mode lacks.
    """
    lines = [
        "| mode | " + " | ".join(header(n) for n in lengths) + " |",
        "| --- | " + " | ".join("---:" for _ in lengths) + " |",
    ]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        cells = []
        for n in lengths:
            match = [r for r in rows if r["mode"] == mode and r["length"] == n]
            cells.append(cell(match[0]) if match else "–")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines


def plot_decode(payload, out: Path, stem: str = "decode"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    per_step = [r for r in payload.get("per_step", []) if "search" in r and r["length"] > 1]
    if not per_step:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.6))
    styles = {"cached": ("#1f77b4", "o-"), "cached_xla": ("#2ca02c", "s-"), "uncached": ("#d62728", "^-")}
    for mode in dict.fromkeys(r["mode"] for r in per_step):
        rows = sorted((r for r in per_step if r["mode"] == mode), key=lambda r: r["length"])
        color, style = styles.get(mode, (None, "o-"))
        ax.plot(
            [r["length"] for r in rows],
            [r["per_step_total_s"] * 1e3 for r in rows],
            style.replace("-", ":"),
            color=color,
            alpha=0.45,
            label=f"{mode}: search time / L",
        )
        # The marginal estimate can come out <= 0 when steps are far cheaper than the noise.
        rows = [r for r in rows if r["per_step_marginal_s"] and r["per_step_marginal_s"] > 0]
        xs = [r["length"] for r in rows]
        ys = [r["per_step_marginal_s"] * 1e3 for r in rows]
        ax.plot(xs, ys, style, color=color, label=f"{mode}: per step (T(L) - T(1)) / (L - 1)")
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    lengths = sorted({r["length"] for r in per_step})
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(n) for n in lengths])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("output length L (tokens, fixed: EOS suppressed)")
    ax.set_ylabel("ms per decoding step")
    r0 = per_step[0]
    ax.set_title(
        f"Beam search (beam {r0['beam_size']}, batch {r0['batch']}) — {device_name(payload['machine'])}", fontsize=10
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / ("decode_step_time.png" if stem == "decode" else f"{stem}_step_time.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- serving


def serving_section(payload):
    search = "beam search compiled with XLA" if payload.get("xla") else "beam search in graph mode"
    if payload.get("early_stopping", "exact") != "exact":
        search += f", early stop `{payload['early_stopping']}`"
    lines = [
        f"## Serving: {search}, `{payload['saved_model']}` (SavedModel, `tf.saved_model.load`, "
        "tensorflow + tensorflow_text only)",
        "",
    ]
    lines.append(f"`{payload['command']}` — {payload['date_utc']}; {load_note(payload)}.")
    s, b, c = payload.get("single", {}), payload.get("batched", {}), payload.get("concurrent", {})
    lines += [
        "",
        "| measurement | value |",
        "| --- | ---: |",
        f"| 1 sentence/request: p50 / p95 latency | {fmt(s.get('p50_ms'), 1)} / {fmt(s.get('p95_ms'), 1)} ms |",
        f"| batches of {b.get('batch_size', 32)}: throughput | {fmt(b.get('sentences_per_s'), 1)} sentences/s |",
        f"| {c.get('threads', 8)} client threads, 1 sentence/request: throughput | "
        f"{fmt(c.get('sentences_per_s'), 1)} sentences/s (p50 {fmt((c.get('latency') or {}).get('p50_ms'), 0)} ms)"
        + (f" ⚠ {c['failed']} requests failed" if c.get("failed") else "") + " |",
        f"| SavedModel load time | {fmt(payload.get('load_s'), 1)} s |",
    ]
    t = payload.get("target_p50")
    if t:
        lines += [
            "",
            f"Target p50 ≤ {t['target_ms']:.0f} ms for one sentence: {t['p50_ms']:.1f} ms, {met(t['met'])}.",
        ]
    lines.append("")
    return lines


# --------------------------------------------------------------------------- decoding peers


def engine_label(record):
    """An engine's row name: ours (graph / XLA) or CTranslate2 (compute type, threads)."""
    name = record["engine"]
    if record.get("kind") == "ctranslate2":
        threads = record.get("intra_threads")
        return f"CTranslate2 {record.get('compute_type_asked', '')}, {threads} thread{'s' if threads != 1 else ''}"
    return {"ours-graph": "ours, graph mode", "ours-xla": "ours, XLA"}.get(name, name)


def ratio(value, base):
    return f"{value / base:.2f}×" if value and base else "–"


def decode_peers_section(payload):
    """The engines of `decode_peers.py`: a row each, ratios over CTranslate2 float32 with 1 thread."""
    settings, sentences = payload["settings"], payload["sentences"]
    engines = payload["engines"]
    by_name = {r["engine"]: r for r in engines}
    base = by_name.get(payload.get("ratio_base", "ct2-float32-1t"), {})
    base_batched = (base.get("batched") or {}).get("sentences_per_s")
    base_p50 = (base.get("single") or {}).get("p50_ms")
    reference = payload.get("reference", "ours-graph")
    lines = ["## Decoding peers: our SavedModel and CTranslate2, same weights and search", ""]
    lines.append(f"`{payload['command']}` — {payload['date_utc']}; {load_note(payload)}.")
    warmed = (
        " (every engine translated each timed input once first: XLA compiles each shape, oneDNN makes its "
        "kernels per shape)"
        if sentences.get("every_timed_input_first")
        else " (XLA: every timed shape compiled first)"
    )
    rounds = settings.get("rounds", 1)
    in_rounds = f", {rounds} rounds of them (each figure the median of its rounds)" if rounds > 1 else ""
    lines.append(
        f"Multi30k test sources in file order; beam {settings['beam_size']}, no length normalisation (our "
        f"exports: alpha 0; CTranslate2: `length_penalty=0`), at most source length + "
        f"{settings['max_extra_length']} tokens (CTranslate2: per batch, its longest source's limit), at least "
        f"{settings['min_length']} token. Each engine in a process of its own, one after the other{in_rounds}; our "
        "SavedModels through `serving_default` (TensorFlow's threads: every core), CTranslate2 on the CPU "
        "with `intra_threads` 1 or 2 (`inter_threads` 1). Batches of "
        f"{settings['batch_size']}: {sentences['batched']} sentences; one sentence per request: "
        f"{sentences['single']} requests after {sentences['warmup']} warm-up ones{warmed}; "
        f"{sentences['threads']} client threads: {sentences['concurrent']} sentences, one per "
        "request. Timings include tokenizing and detokenizing."
    )
    base_name = engine_label(base) if base else "CTranslate2 float32, 1 thread"
    lines += [
        "",
        f"| engine | batches of {settings['batch_size']}: sentences/s | 1 sentence: p50 / p95 / mean ms "
        f"| {sentences['threads']} threads: sentences/s (p50 / p95 ms) | MiB resident: after load / peak "
        f"serving batches | same translation as {reference} | sentences/s ÷ {base_name} | p50 ÷ {base_name} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in engines:
        if "batched" not in r:
            lines.append(f"| {engine_label(r)} | failed: {r.get('error', '')[:60]} | | | | | | |")
            continue
        s, b, c = r["single"], r["batched"], r["concurrent"]
        busy = " ⚠" if (r.get("neighbours") or {}).get("busy") else ""
        agree = r.get("agreement")
        same = f"{agree['same']} / {agree['of']}" if agree else "–"
        is_base = r is base  # its ratios are 1
        cells = [
            f"{engine_label(r)}{busy}",
            fmt(b["sentences_per_s"], 1),
            f"{fmt(s['p50_ms'], 1)} / {fmt(s['p95_ms'], 1)} / {fmt(s['mean_ms'], 1)}",
            f"{fmt(c['sentences_per_s'], 1)} ({fmt(c['latency']['p50_ms'])} / {fmt(c['latency']['p95_ms'])})"
            + (f" ⚠ {c['failed']} failed" if c.get("failed") else ""),
            f"{fmt(r.get('rss_after_load_mb'))} / {fmt(r.get('peak_rss_batched_mb'))}",
            same,
            "1" if is_base else ratio(b["sentences_per_s"], base_batched),
            "1" if is_base else ratio(s["p50_ms"], base_p50),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Ratios over {base_name}: sentences/s above 1× and p50 below 1× are faster than it. The peak resident "
        "set (`ru_maxrss`) is the process's while it served the batches (measured first), with loading, warm-up "
        "and, for XLA, the compilations of the batch shapes. int8 is CTranslate2's quantization of the same "
        "float32 weights at load time: a reference, not the same arithmetic.",
    ]
    busy = [r for r in engines if (r.get("neighbours") or {}).get("busy")]
    if busy:
        lines += [
            "",
            "⚠ **Other processes kept cores busy while these rows were measured: "
            + ", ".join(f"{engine_label(r)} ({r['neighbours']['neighbour_cores_during']:.1f} cores)" for r in busy)
            + "**; their figures are pessimistic, CTranslate2's 2-thread rows' most (its OpenMP threads "
            "spin-wait for each other).",
        ]
    exports = payload.get("exports", {})
    unchecked = [flag for flag, e in exports.items() if not str(e.get("settings_checked", "")).startswith("yes")]
    if unchecked:
        lines += ["", f"Search settings not read from {', '.join(unchecked)} (no options signature)."]
    # int8 computes something else: its differences are expected, the others' are news.
    same_arithmetic = [r for r in engines if r.get("compute_type_asked") != "int8"]
    differences = [(r, d) for r in same_arithmetic for d in (r.get("agreement") or {}).get("differences", [])[:3]]
    if differences:
        lines += ["", f"Translations (of the batches) that differ from {reference}'s, int8's left out:", ""]
        lines += [
            f"* {engine_label(r)}, sentence {d['sentence']}: `{d[r['engine']]}` ({reference}: `{d[reference]}`)"
            for r, d in differences[:8]
        ]
    lines.append("")
    return lines


def plot_decode_peers(payload, out: Path, name="decode_peers"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["engines"] if "batched" in r]
    if not rows:
        return None
    labels = [
        engine_label(r).replace("CTranslate2 ", "CTranslate2\n").replace(", ", "\n")
        + ("\n(busy machine)" if (r.get("neighbours") or {}).get("busy") else "")
        for r in rows
    ]
    # Ours blue, CTranslate2 orange, its int8 reference light orange.
    colors = [
        "#1f77b4" if r.get("kind") == "savedmodel" else "#fdbf6f" if r.get("compute_type_asked") == "int8"
        else "#ff7f0e"
        for r in rows
    ]
    batch = payload["settings"]["batch_size"]
    panels = (
        (f"batches of {batch}: sentences/s (higher is better)", [r["batched"]["sentences_per_s"] for r in rows],
         "{:,.0f}"),
        ("1 sentence per request: p50 ms (lower is better)", [r["single"]["p50_ms"] for r in rows], "{:,.1f}"),
    )
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 1.9 * len(rows) + 1), 4.6))
    for ax, (title, values, form) in zip(axes, panels):
        bars = ax.bar(range(len(rows)), values, color=colors)
        ax.bar_label(bars, labels=[form.format(v) for v in values], fontsize=7, padding=2)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"Our SavedModel (blue) and CTranslate2 (orange; int8 light), beam {payload['settings']['beam_size']} "
        f"— {device_name(payload['machine'])}",
        fontsize=10,
    )
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def profile_section(payload, rows=8):
    """The top rows of a `profile_trace.py` summary (training step or serving requests)."""
    config = payload.get("config")
    if config:
        title = "training step, " + ", ".join(f"{k} {v}" for k, v in config.items())
        intro = (
            f"{payload['step_s_under_profiler'] * 1e3:.0f} ms per step under the profiler; op time "
            f"{payload['op_time_per_step_ms']:.0f} ms per step, summed over the threads that ran the ops."
        )
        unit = "ms/step"
    else:
        title = f"serving requests, `{payload['saved_model']}`"
        intro = f"{payload['request_ms']:.1f} ms per single-sentence request under the profiler."
        unit = "ms/request"
    if "by_op_type" in payload:  # a graph-mode step: TensorFlow ops
        tables = [("op type", payload["by_op_type"]), ("model part (`grad:` = backward)", payload["by_model_part"])]
    else:  # an XLA step or serving requests: XLA operations
        tables = [("XLA operation kind", payload["by_op_kind"]), ("single operation", payload["by_op"])]
    lines = [f"## Profile: {title}", "", f"`{payload['command']}` — {payload['date_utc']}. {intro}", ""]
    for name, table in tables:
        lines += [f"| {name} | {unit} | share |", "| --- | ---: | ---: |"]
        lines += [f"| {row['name'][:90]} | {row['ms']:.2f} | {row['share']:.1%} |" for row in table[:rows]]
        lines.append("")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    out = args.results
    train = load(out, "train_throughput")
    decodes = load_named(out, "decode.json", "decode-*.json")  # e.g. batches, or CTranslate2's steps
    servings = [payload for _, payload in load_named(out, "serving*.json")]  # e.g. an XLA export
    peers = load_named(out, "decode_peers*.json")
    lines = ["# Benchmark results", ""]
    first = train or (decodes[0][1] if decodes else None) or (servings[0] if servings else None) or (
        peers[0][1] if peers else None
    )
    if first is None:
        raise SystemExit(f"No benchmark results in {out}; run the benchmarks first (see bench/README.md).")
    lines += [f"Machine: {machine_line(first)}.", ""]
    # Another machine's results live in a directory of their own (the scripts' --results-dir).
    others = sorted(sub.name for sub in out.iterdir() if sub.is_dir() and (sub / "RESULTS.md").exists())
    if others:
        lines += ["Other machines: " + ", ".join(f"[{name}]({name}/RESULTS.md)" for name in others) + ".", ""]
    images = []
    if train:
        lines += train_section(train)
        images.append(plot_train(train, out))
    for stem, decode in decodes:
        lines += decode_section(decode)
        images.append(plot_decode(decode, out, stem))
    for serving in servings:
        lines += serving_section(serving)
    for stem, peer in peers:
        lines += decode_peers_section(peer)
        images.append(plot_decode_peers(peer, out, stem))
    for path in sorted(out.glob("profile-*.json")):
        lines += profile_section(json.loads(path.read_text()))
    for image in images:
        if image is not None:
            lines += [f"![{image.stem}]({image.name})", ""]
    (out / "RESULTS.md").write_text("\n".join(lines))
    print(f"[report] wrote {out / 'RESULTS.md'}" + "".join(f", {p}" for p in images if p))


if __name__ == "__main__":
    main()
