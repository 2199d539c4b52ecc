"""Benchmark: our exported SavedModel against CTranslate2, the decoding peer: same weights, sentences and search.

Usage:
    python -m export --run-dir runs/RUN --out /tmp/peer-graph --alpha 0
    python -m export --run-dir runs/RUN --out /tmp/peer-xla --alpha 0 --jit-compile --xla-max-batch 32
    python -m export --format ctranslate2 --run-dir runs/RUN --out /tmp/peer-ct2
    python bench/decode_peers.py --saved-model /tmp/peer-graph --saved-model-xla /tmp/peer-xla \\
        --ctranslate2 /tmp/peer-ct2 --rounds 3          # ~20 min on 2 idle cores (1 round: ~8)
    python bench/decode_peers.py ... --engines ours-graph ct2-float32-1t --latency-sentences 20   # a quick trial

Engines, one row each (`--engines` picks some):

* `ours-graph`: the SavedModel's `serving_default` (text -> text, beam search in graph mode);
* `ours-xla`: the same from an export made with `--jit-compile` (the search compiled by XLA,
  batches of more than `--xla-max-batch` sentences that many at a time);
* `ct2-float32-1t`, `ct2-float32-2t`: CTranslate2 (`ctranslate2.Translator`, CPU, float32)
  with `intra_threads` 1 and 2 (and `inter_threads` 1: one request is computed at a time);
* `ct2-int8-1t`, `ct2-int8-2t`: the same weights quantized by CTranslate2 at load time
  (`compute_type="int8"`), a reference row: not the same arithmetic.

Each engine runs in a process of its own, one after the other (this script starts them
and collects their JSON), so that thread settings and peak memory are the engine's. A
SavedModel's process imports only `tensorflow` and `tensorflow_text` (as `serving.py`,
whose helpers it uses); a CTranslate2 process only `ctranslate2` and `sentencepiece`
(the source pieces are `SentencePieceProcessor(model_file=DIR/tokenizer.model)
.encode(text, out_type=str)`, the text `decode_pieces` of the output pieces; timings
include both, as the SavedModel's include its in-graph tokenizer). Each process records
what it imported.

One search for all (recorded in the JSON, `"settings"`): beam 4, no length normalisation
(our exports made with `--alpha 0`, CTranslate2's `length_penalty=0`), outputs of at
most the source length (EOS included) + 50 tokens and at least 1 token before EOS, no
scores asked for (`return_scores=False`). CTranslate2's `max_decoding_length` is one per
call: a batch gets its longest source's limit, where our search limits each sentence by
its own length (a difference only for a translation that runs to its limit). Before
measuring, a short process loads the SavedModels and refuses (one line naming the flag)
an export whose `serving_default` does not search with `--beam-size` (the width of
`translate_with_options`' n-best lists with the beam unset) and alpha 0 (its scores must
be `translate_with_options(alpha=0, min_length=1)`'s), or that is not (`--saved-model-xla`)
or is (`--saved-model`) compiled with XLA. The extra length (50) and minimum length (1)
cannot be told apart from the scores: export with the defaults of `python -m export`.
The CTranslate2 model must hold the SavedModels' tokenizer (`tokenizer.model`, the same
bytes), i.e. come from the same run.

Measured per engine, on the Multi30k test sources (English, in file order):

* memory: the resident set after loading, and the peak (`ru_maxrss`) while serving the
  batches of 32 (measured first, so that the peak is theirs: loading, warm-up, and for
  XLA the compilations of the batch shapes, included); the process's peak at its end too;
* every engine first translates each timed input once, untimed (the batches, then the
  single sentences), so that none is timed meeting a shape for the first time, as a
  steady-state server has met its shapes (XLA compiles each; oneDNN makes its kernels
  per shape);
* throughput with batches of 32 sentences (the full batches of `--batch-sentences`), and
  how many of these translations are the same text as `ours-graph`'s (a check that
  every engine computed the same thing; a few differences show up between searches
  of the same model: see `keras_transformer.ctranslate2_export.translate_ids`);
* latency of one sentence per request: p50 / p95 / mean over `--latency-sentences`
  requests, after `--warmup` requests;
* throughput with `--threads` (8) client threads each sending one sentence per request
  (`--thread-sentences` in all), with their latency percentiles.

With `--rounds N` the engines are measured in turn N times (a process each time) and each
figure the tables show (`MEDIAN_FIELDS`: sentences/s, p50, p95 and mean) is the median of
its N rounds (the peak memory the highest; `"rounds"` in an engine's record keeps them
all): these shared VMs drift by 10-30% within minutes, which would otherwise land on
whichever engine ran then. The record's other figures (seconds, p99, max, the memory
after loading) are its first complete round's.

Hygiene: the script waits for a quiet machine first (`--max-load`, as the other scripts),
then, before each engine, until other processes keep at most 0.3 cores busy (read from
/proc/stat: the load average still holds the previous engine's process), and records the
cores they kept busy while the engine ran (`"neighbours"`; above 0.3 the row is marked).
On 2 cores a neighbour on one of them hits CTranslate2's 2-thread rows hardest: its
OpenMP threads spin-wait for each other at every step (libgomp's default), which makes
them many times slower (`OMP_WAIT_POLICY=PASSIVE` avoids it, and is recorded when set).

Writes `bench/results/<machine>/decode_peers.json` (`--output-name` for another name);
`report.py` makes a table of it in RESULTS.md and `decode_peers.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (standard library only at import: no TensorFlow in a CTranslate2 process)

# name -> how it is run. `flag`: the command-line option giving its model.
ENGINES = {
    "ours-graph": {"kind": "savedmodel", "flag": "saved_model", "xla": False},
    "ours-xla": {"kind": "savedmodel", "flag": "saved_model_xla", "xla": True},
    "ct2-float32-1t": {"kind": "ctranslate2", "flag": "ctranslate2", "compute_type": "float32", "intra_threads": 1},
    "ct2-float32-2t": {"kind": "ctranslate2", "flag": "ctranslate2", "compute_type": "float32", "intra_threads": 2},
    "ct2-int8-1t": {"kind": "ctranslate2", "flag": "ctranslate2", "compute_type": "int8", "intra_threads": 1},
    "ct2-int8-2t": {"kind": "ctranslate2", "flag": "ctranslate2", "compute_type": "int8", "intra_threads": 2},
}
# The translations the others are compared with, and the row the ratios are over.
REFERENCE = "ours-graph"
RATIO_BASE = "ct2-float32-1t"
# Packages a process of each kind must not load (`keras_transformer.precision`, standard
# library only, is loaded by common.py to name the machine's folder: allowed).
FORBIDDEN_IMPORTS = {
    "savedmodel": ("keras_transformer", "keras_hub", "ctranslate2", "sentencepiece", "torch", "jax"),
    "ctranslate2": ("keras_transformer", "keras_hub", "tensorflow", "tensorflow_text", "keras", "torch", "jax"),
}
# Cores other processes may keep busy before an engine is measured (see `wait_for_idle_cores`).
# With a neighbour on one of 2 cores, CTranslate2 with 2 threads (OpenMP threads that spin
# at each barrier, libgomp's default) ran batches of 32 at 2-7 sentences/s instead of ~100.
NEIGHBOUR_LIMIT = 0.3
# Environment variables that change how the engines use their threads, recorded when set.
THREAD_ENVIRONMENT = (
    "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "CT2_USE_EXPERIMENTAL_PACKED_GEMM", "CT2_FORCE_CPU_ISA",
    "TF_ENABLE_ONEDNN_OPTS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS",
)
# The timings that are medians over `--rounds` (keys of an engine's record, dotted).
MEDIAN_FIELDS = (
    "batched.sentences_per_s", "single.p50_ms", "single.p95_ms", "single.mean_ms",
    "concurrent.sentences_per_s", "concurrent.latency.p50_ms", "concurrent.latency.p95_ms",
)
# Sentences the export check translates with both signatures.
CHECK_SENTENCES = 4
# Largest relative difference between serving_default's scores and alpha 0's for an export searching with alpha 0.
CHECK_SCORE_TOLERANCE = 1e-3
# The serving contract's names (keras_transformer.signatures, not imported here).
SERVING_SIGNATURE, OPTIONS_SIGNATURE = "serving_default", "translate_with_options"


def log(message: str) -> None:
    print(f"[decode_peers] {message}", file=sys.stderr, flush=True)


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


# --------------------------------------------------------------------------- memory


def rss_mb() -> float | None:
    """This process's resident set now, MiB (None where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """This process's peak resident set so far (`ru_maxrss`), MiB."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def cpu_busy_s() -> float | None:
    """CPU seconds all cores have spent busy since boot (steal time, the hypervisor's, included), from /proc/stat.

    None where /proc/stat is missing.
    """
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user .. steal (guest is in user)
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def neighbour_cores(seconds: float = 2.0) -> float | None:
    """Cores kept busy by other processes over `seconds` (this one sleeps meanwhile)."""
    before = cpu_busy_s()
    time.sleep(seconds)
    after = cpu_busy_s()
    return None if before is None or after is None else (after - before) / seconds


def wait_for_idle_cores(args, name: str) -> dict:
    """Waits (10 s chunks, up to --max-wait s) until other processes keep at most `NEIGHBOUR_LIMIT` cores busy.

    The load average cannot tell: the previous engine's process keeps it up for a minute
    after it ended. Skipped with --max-load -1.
    """
    start = time.monotonic()
    cores = neighbour_cores()
    waiting = args.max_load >= 0
    while waiting and cores is not None and cores > NEIGHBOUR_LIMIT and time.monotonic() - start < args.max_wait:
        log(f"{name}: other processes keep {cores:.1f} cores busy: waiting 10 s")
        time.sleep(10)
        cores = neighbour_cores()
    if waiting and cores is not None and cores > NEIGHBOUR_LIMIT:
        log(f"{name}: still {cores:.1f} cores busy after {args.max_wait:.0f} s: measuring anyway")
    return {"neighbour_cores_before": cores, "waited_s": round(time.monotonic() - start, 1)}


def third_party_modules() -> list[str]:
    """Top-level modules loaded in this process that are neither the standard library's nor bench/'s."""
    ours = {"common", "serving", Path(__file__).stem, "__main__"}
    names = {name.split(".")[0] for name in sys.modules}
    return sorted(
        n
        for n in names
        if n not in sys.stdlib_module_names and n not in ours and not n.startswith("_")
        and not re.fullmatch(r"[0-9a-f]{20,}(__mypyc)?", n)  # compiled helper modules of mypyc-built packages
    )


# --------------------------------------------------------------------------- engines (in a child process)


def full_batches(sentences: list[str], batch_sentences: int, batch_size: int) -> list[list[str]]:
    """The first `batch_sentences` sentences (all of them if fewer) in batches of `batch_size`, full ones only.

    Full batches only: in an XLA export a new batch size would time a compilation, and a
    last short batch would be a request of another kind.
    """
    count = min(batch_sentences, len(sentences)) // batch_size * batch_size
    return [sentences[i : i + batch_size] for i in range(0, count, batch_size)]


def ctranslate2_options(args) -> dict:
    """`translate_batch`'s options but `max_decoding_length` (per batch: `decoding_limit`)."""
    return {
        "beam_size": args.beam_size,
        "patience": 1,
        "length_penalty": 0,
        "max_input_length": 0,  # no cut: Multi30k's sources are far below our 256 tokens
        "min_decoding_length": args.min_length,
        "return_scores": False,
    }


def decoding_limit(source_pieces: list[list[str]], max_extra_length: int) -> int:
    """CTranslate2's `max_decoding_length` of a batch: its longest source, EOS included, + the extra length."""
    return max(len(pieces) for pieces in source_pieces) + 1 + max_extra_length


def open_ctranslate2(directory: Path, compute_type: str, intra_threads: int, args):
    """`(translate, info)`: text -> text through a `ctranslate2.Translator` and the model's SentencePiece model."""
    import ctranslate2
    import sentencepiece

    start = time.perf_counter()
    translator = ctranslate2.Translator(
        str(directory), device="cpu", compute_type=compute_type, inter_threads=1, intra_threads=intra_threads
    )
    tokenizer = sentencepiece.SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))
    load_s = time.perf_counter() - start
    options = ctranslate2_options(args)

    def translate(texts):
        sources = tokenizer.encode(list(texts), out_type=str)
        limit = decoding_limit(sources, args.max_extra_length)
        results = translator.translate_batch(sources, max_decoding_length=limit, **options)
        return [tokenizer.decode_pieces(result.hypotheses[0]) for result in results]

    info = {
        "model": str(directory),
        "load_s": load_s,
        "device": "cpu",
        "compute_type_asked": compute_type,
        "compute_type": translator.compute_type,
        "supported_compute_types": sorted(ctranslate2.get_supported_compute_types("cpu")),
        "intra_threads": intra_threads,
        "inter_threads": 1,
        "translate_batch_options": {**options, "max_decoding_length": "per batch: longest source + 1 + extra"},
        "versions": {"ctranslate2": ctranslate2.__version__, "sentencepiece": sentencepiece.__version__},
    }
    return translate, info


def load_savedmodel(path: Path):
    """`(loaded, serve, input_name, version_dir, load_s)` of an export, as TF Serving loads it."""
    import tensorflow as tf

    import serving  # bench/serving.py: imports tensorflow and tensorflow_text only

    version_dir = common.resolve_version_dir(path)
    start = time.perf_counter()
    loaded = tf.saved_model.load(str(version_dir))
    load_s = time.perf_counter() - start
    serve = loaded.signatures[SERVING_SIGNATURE]
    return loaded, serve, serving.signature_input_name(serve), version_dir, load_s


def open_savedmodel(path: Path, args):
    """`(translate, info)`: text -> text through the export's `serving_default`."""
    import tensorflow as tf
    import tensorflow_text

    import serving

    loaded, serve, input_name, version_dir, load_s = load_savedmodel(path)

    def translate(texts):
        out = serve(**{input_name: tf.constant(list(texts), tf.string)})
        return [text.decode("utf-8") for text in out["translation"].numpy()]

    translate.loaded = loaded  # the signature holds its module weakly: keep it alive
    info = {
        "model": str(version_dir),
        "load_s": load_s,
        "xla": serving.compiles_with_xla(version_dir),
        "early_stopping": serving.early_stopping_rule(loaded),
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads() or "default (all cores)",
        "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads() or "default",
        "versions": {"tensorflow": tf.__version__, "tensorflow_text": tensorflow_text.__version__},
    }
    return translate, info


def check_savedmodel(path: Path, flag: str, expect_xla: bool, sentences: list[str], args) -> dict:
    """What an export's `serving_default` searches with, read from its signatures; raises SystemExit
    (one line naming `flag`) for one that is not this benchmark's search."""
    import numpy as np
    import tensorflow as tf

    import serving

    loaded, serve, input_name, version_dir, _ = load_savedmodel(path)
    xla = serving.compiles_with_xla(version_dir)
    if xla != expect_xla:
        hint = "give it as --saved-model-xla" if xla else "give an export made with --jit-compile"
        raise SystemExit(f"{flag}: {version_dir} is {'' if xla else 'not '}compiled with XLA; {hint}.")
    record = {"model": str(version_dir), "xla": xla, "early_stopping": serving.early_stopping_rule(loaded)}
    options = loaded.signatures.get(OPTIONS_SIGNATURE)
    names = {"beam_size": 0, "alpha": 0.0, "max_length": 0, "min_length": args.min_length}  # beam 0: the export's own
    inputs = options.structured_input_signature[1] if options is not None else {}
    if set(inputs) != {input_name, *names}:
        record["settings_checked"] = f"no: no {OPTIONS_SIGNATURE} signature with the inputs {sorted(names)}"
        log(f"warning: {flag} {version_dir}: cannot read its search settings ({record['settings_checked']})")
        return record
    text = tf.constant(sentences[:CHECK_SENTENCES], tf.string)
    zero = options(**{input_name: text}, **{k: tf.constant(v, inputs[k].dtype) for k, v in names.items()})
    beam = int(zero["translations"].shape[1])
    if beam != args.beam_size:
        raise SystemExit(
            f"{flag}: {version_dir} searches with beam {beam}, not {args.beam_size}: export it with "
            f"--beam-size {args.beam_size}."
        )
    own = serve(**{input_name: text})
    own_scores, zero_scores = own["score"].numpy(), zero["score"].numpy()
    if not np.allclose(own_scores, zero_scores, rtol=CHECK_SCORE_TOLERANCE, atol=1e-4):
        raise SystemExit(
            f"{flag}: {version_dir} does not search with alpha 0 (serving_default's scores {own_scores.round(3)} "
            f"are not alpha 0's {zero_scores.round(3)}): export it with --alpha 0."
        )
    record["beam_size"] = beam
    record["settings_checked"] = (
        f"yes: beam {beam} ({OPTIONS_SIGNATURE}'s n-best width with the beam unset); alpha 0: serving_default's "
        f"scores of {len(own_scores)} sentences are {OPTIONS_SIGNATURE}(alpha=0, min_length={args.min_length})'s"
    )
    return record


def run_check(args, out: Path) -> None:
    """Child `--child check`: checks the SavedModels given (and asked for), writes `{flag: record}` or a refusal."""
    sentences = common.load_sentences(args.data_dir, args.source_lang)
    result = {"exports": {}}
    try:
        for name in args.engines:
            engine = ENGINES[name]
            if engine["kind"] == "savedmodel":
                flag = flag_name(engine["flag"])
                result["exports"][flag] = check_savedmodel(
                    getattr(args, engine["flag"]), flag, engine["xla"], sentences, args
                )
    except SystemExit as refusal:
        result["refusal"] = str(refusal)
    out.write_text(json.dumps(result, default=str))


def run_engine(name: str, args, out: Path) -> None:
    """Child `--child NAME`: measures one engine and writes its record (with its batched translations)."""
    engine = ENGINES[name]
    sentences = common.load_sentences(args.data_dir, args.source_lang)
    model = getattr(args, engine["flag"])
    if engine["kind"] == "savedmodel":
        translate, info = open_savedmodel(model, args)
    else:
        translate, info = open_ctranslate2(model, engine["compute_type"], engine["intra_threads"], args)
    record = {"engine": name, "kind": engine["kind"], **info, "rss_after_load_mb": rss_mb()}
    log(f"{name}: loaded in {info['load_s']:.2f} s, {record['rss_after_load_mb']:.0f} MiB resident")

    batches = full_batches(sentences, args.batch_sentences, args.batch_size)
    singles = sentences[: args.latency_sentences]

    # 1. Batches of 32, first: the peak resident set is then theirs (with loading and warm-up).
    start = time.perf_counter()
    first = translate(batches[0])
    record["first_request_s"] = time.perf_counter() - start
    record["example"] = {"source": batches[0][0], "translation": first[0]}
    for batch in batches:  # Every timed shape met first (see the module docstring).
        translate(batch)
    record["batched"], translations = common.time_batches(translate, batches)
    record["peak_rss_batched_mb"] = peak_rss_mb()
    record["rss_after_batched_mb"] = rss_mb()
    log(
        f"{name}: batches of {args.batch_size}: {record['batched']['sentences_per_s']:.1f} sentences/s, "
        f"peak {record['peak_rss_batched_mb']:.0f} MiB"
    )

    # 2. One sentence per request, one client.
    for i in range(args.warmup):
        translate([sentences[i % len(sentences)]])
    for text in sentences[: max(args.latency_sentences, args.thread_sentences)]:
        translate([text])
    record["single"] = common.time_single(translate, singles)
    log(f"{name}: 1 sentence/request: p50 {record['single']['p50_ms']:.1f} ms, p95 {record['single']['p95_ms']:.1f} ms")

    # 3. Concurrent clients, one sentence per request.
    record["concurrent"] = common.time_concurrent(translate, sentences[: args.thread_sentences], args.threads)
    log(
        f"{name}: {args.threads} client threads: {record['concurrent']['sentences_per_s']:.1f} sentences/s, "
        f"p50 {record['concurrent']['latency']['p50_ms']:.0f} ms"
    )
    record["peak_rss_mb"] = peak_rss_mb()

    unexpected = common.unexpected_imports(FORBIDDEN_IMPORTS[engine["kind"]])
    record["imports"] = {
        "third_party": third_party_modules(),
        "unexpected": unexpected,
        "ok": not unexpected,
    }
    record["translations"] = translations  # compared by the parent, not written out
    out.write_text(json.dumps(record, default=str))


# --------------------------------------------------------------------------- the parent


def run_child(child: str, argv: list[str], timeout: float | None = None) -> dict:
    """Runs this script as `--child CHILD` with the same arguments: its JSON, or `{"error": ...}`.

    A child still running after `timeout` seconds is killed.
    """
    with tempfile.TemporaryDirectory(prefix="decode_peers-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", child, "--child-output", str(out)]
        try:
            code = subprocess.run(command, stdin=subprocess.DEVNULL, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            error = f"killed after {timeout:.0f} s (--engine-timeout; a busy machine?)"
        else:
            error = None if code == 0 and out.is_file() else f"the process failed (exit code {code})"
        if error:
            log(f"{child}: {error}")
            return {"error": error}
        return json.loads(out.read_text())


def measure_engine(name: str, argv: list[str], args) -> dict:
    """One engine's record from a process of its own, with the machine's load while it ran."""
    quiet = wait_for_idle_cores(args, name)
    before, busy, ours, start = common.loadavg(), cpu_busy_s(), children_cpu_s(), time.perf_counter()
    record = {"engine": name, "kind": ENGINES[name]["kind"], **run_child(name, argv, args.engine_timeout)}
    record["process_s"] = time.perf_counter() - start
    record["load_average"] = {"before": before, "after": common.loadavg()}
    # Cores kept busy by other processes while the engine ran: the machine's busy CPU time less the child's.
    during = None if busy is None else (cpu_busy_s() - busy - (children_cpu_s() - ours)) / record["process_s"]
    busy_now = bool(during and during > NEIGHBOUR_LIMIT)
    record["neighbours"] = {**quiet, "neighbour_cores_during": during, "busy": busy_now}
    if record["neighbours"]["busy"]:
        log(f"{name}: other processes kept {during:.1f} cores busy meanwhile: its figures are pessimistic")
    return record


def median_record(runs: list[dict]) -> dict:
    """An engine's record over its rounds: the first complete one, each timing the median of the rounds'.

    The peak resident sets are the highest of the rounds'; `"rounds"` keeps each round's timings, and
    the neighbours of every round are checked (`"busy"` if any round had them).
    """
    complete = [run for run in runs if "batched" in run]
    if not complete:
        return runs[0]
    record = dict(complete[0])
    if len(runs) == 1:
        return record
    record["rounds"] = [{path: _field(run, path) for path in MEDIAN_FIELDS} for run in complete]
    for path in MEDIAN_FIELDS:
        _set_field(record, path, statistics.median(_field(run, path) for run in complete))
    for field in ("peak_rss_batched_mb", "peak_rss_mb"):
        record[field] = max(run[field] for run in complete)
    record["neighbours"] = {
        **record["neighbours"],
        "busy": any(run["neighbours"]["busy"] for run in runs),
        "neighbour_cores_during": max((run["neighbours"]["neighbour_cores_during"] or 0.0) for run in runs),
    }
    return record


def _field(record: dict, path: str):
    for key in path.split("."):
        record = record[key]
    return record


def _set_field(record: dict, path: str, value) -> None:
    """Sets `path` in `record`, copying the nested dicts on the way (they may be shared with a round's)."""
    *parents, last = path.split(".")
    for key in parents:
        record[key] = dict(record[key])
        record = record[key]
    record[last] = value


def check_ctranslate2_model(args) -> None:
    """Refuses a CTranslate2 directory without a model, or whose tokenizer is not the SavedModels'."""
    directory = args.ctranslate2
    for name in ("model.bin", "tokenizer.model"):
        if not (directory / name).is_file():
            raise SystemExit(
                f"--ctranslate2: {directory} holds no {name} (make it with python -m export --format ctranslate2)."
            )
    for flag in ("saved_model", "saved_model_xla"):
        path = getattr(args, flag)
        if path is None:
            continue
        asset = common.resolve_version_dir(path) / "assets" / "tokenizer.model"
        if asset.is_file() and asset.read_bytes() != (directory / "tokenizer.model").read_bytes():
            raise SystemExit(
                f"--ctranslate2: {directory}/tokenizer.model is not {flag_name(flag)}'s {asset}: export both "
                "from the same run."
            )


def agreement(records: dict, sentences: list[str]) -> None:
    """Adds to each record how many of its batched translations are the reference engine's (text equality)."""
    reference = records.get(REFERENCE, {}).get("translations")
    for name, record in records.items():
        translations = record.pop("translations", None)
        if reference is None or translations is None:
            continue
        differ = [i for i, (a, b) in enumerate(zip(reference, translations)) if a != b]
        record["agreement"] = {
            "with": REFERENCE,
            "same": len(reference) - len(differ),
            "of": len(reference),
            "differences": [
                {"sentence": i, "source": sentences[i], REFERENCE: reference[i], name: translations[i]}
                for i in differ[:5]
            ],
        }
        if name != REFERENCE:
            log(f"{name}: {len(reference) - len(differ)}/{len(reference)} batched translations are {REFERENCE}'s")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saved-model", type=Path, help="graph-mode export (made with --alpha 0), or its version dir")
    parser.add_argument("--saved-model-xla", type=Path, help="export made with --alpha 0 --jit-compile")
    parser.add_argument("--ctranslate2", type=Path, help="CTranslate2 model dir (export --format ctranslate2)")
    parser.add_argument(
        "--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES), help="engines to measure (default: all)"
    )
    parser.add_argument("--data-dir", default=None, help="Multi30k directory (default: MULTI30K_DIR / shared)")
    parser.add_argument("--source-lang", default="en")
    parser.add_argument("--warmup", type=int, default=10, help="untimed one-sentence requests first")
    parser.add_argument(
        "--latency-sentences", type=int, default=1000, help="one-sentence requests timed (default: the test set)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batch-sentences", type=int, default=1000, help="sentences sent in full batches")
    parser.add_argument("--threads", type=int, default=8, help="concurrent client threads")
    parser.add_argument("--thread-sentences", type=int, default=500, help="sentences sent by the threads")
    parser.add_argument("--beam-size", type=int, default=4, help="CTranslate2's beam; the exports' must be it")
    parser.add_argument("--max-extra-length", type=int, default=50, help="outputs: source length + this at most")
    parser.add_argument("--min-length", type=int, default=1, help="tokens before EOS at the least")
    parser.add_argument(
        "--engine-timeout", type=float, default=900.0, help="an engine's process is killed after this many s"
    )
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="measure the engines in turn this many times; each figure is the median of its rounds",
    )
    parser.add_argument("--output-name", default="decode_peers")
    common.add_load_args(parser)
    common.add_results_dir_arg(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.engines = list(dict.fromkeys(args.engines))  # once each, in the order given
    for name in args.engines:
        if getattr(args, ENGINES[name]["flag"]) is None:
            parser.error(f"engine {name} needs {flag_name(ENGINES[name]['flag'])} (or leave it out of --engines)")
    if args.batch_sentences < args.batch_size:
        parser.error("--batch-sentences must be at least --batch-size (full batches only).")
    counts = (args.latency_sentences, args.thread_sentences, args.threads, args.beam_size, args.rounds)
    if min(counts) < 1 or args.warmup < 0:
        parser.error("--latency-sentences, --thread-sentences, --threads, --beam-size and --rounds must be 1 or more.")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child == "check":
        return run_check(args, args.child_output)
    if args.child:
        return run_engine(args.child, args, args.child_output)

    date_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    started = time.perf_counter()
    sentences = common.load_sentences(args.data_dir, args.source_lang)
    if any(ENGINES[name]["kind"] == "ctranslate2" for name in args.engines):
        check_ctranslate2_model(args)
    exports = {}
    if any(ENGINES[name]["kind"] == "savedmodel" for name in args.engines):
        log("checking the SavedModels' search settings")
        checked = run_child("check", argv)
        if "error" in checked:
            raise SystemExit(f"The SavedModels could not be checked: {checked['error']} (see above).")
        if "refusal" in checked:
            raise SystemExit(checked["refusal"])
        exports = checked["exports"]
    load = common.quiet(args)

    # Engines in turn, round after round: a drift of the machine's speed reaches every engine alike.
    rounds = {name: [] for name in args.engines}
    for round_index in range(args.rounds):
        for i, name in enumerate(args.engines):
            log(f"round {round_index + 1}/{args.rounds}, engine {i + 1}/{len(args.engines)}: {name}")
            rounds[name].append(measure_engine(name, argv, args))
    records = {name: median_record(runs) for name, runs in rounds.items()}
    agreement(records, sentences)

    # Machine facts last: they import TensorFlow, which no measured process may share.
    payload = common.header("decode_peers", args, with_keras=False)
    payload["date_utc"] = date_utc
    versions = {}
    for record in records.values():
        versions.update(record.pop("versions", {}))
    payload["versions"] = versions
    payload["settings"] = {
        "beam_size": args.beam_size,
        "length_normalisation": "none: our exports search with alpha 0, CTranslate2 with length_penalty=0",
        "max_extra_length": args.max_extra_length,
        "max_output_length": (
            f"source length (EOS included) + {args.max_extra_length} tokens, EOS included: per sentence in our "
            f"search; CTranslate2's max_decoding_length is per call, so a batch gets its longest source's "
            f"(longest source + 1 + {args.max_extra_length})"
        ),
        "min_length": args.min_length,
        "return_scores": False,
        "ctranslate2_translate_batch": ctranslate2_options(args),
        "ctranslate2_threads": "intra_threads as the engine's name says, inter_threads 1; device cpu",
        "tensorflow_threads": "TensorFlow's defaults (every core)",
        "environment": {name: os.environ[name] for name in THREAD_ENVIRONMENT if name in os.environ},
        "batch_size": args.batch_size,
        "rounds": args.rounds,
    }
    payload["sentences"] = {
        "source": f"Multi30k test_2016_flickr.{args.source_lang}, in file order",
        "batched": sum(map(len, full_batches(sentences, args.batch_sentences, args.batch_size))),
        "single": min(args.latency_sentences, len(sentences)),
        "warmup": args.warmup,
        "every_timed_input_first": True,
        "concurrent": min(args.thread_sentences, len(sentences)),
        "threads": args.threads,
    }
    payload["exports"] = exports
    payload["reference"] = REFERENCE
    payload["ratio_base"] = RATIO_BASE
    payload["engines"] = list(records.values())
    payload["seconds"] = time.perf_counter() - started
    payload["load"] = common.finish_load(load, own_threads=args.threads)
    common.write_json(args.output_name, payload, args.results_dir)
    log(f"done in {payload['seconds'] / 60:.1f} min")


if __name__ == "__main__":
    main()
