"""Shared helpers of the benchmark scripts: machine facts, load hygiene, timing, peak FLOP/s, JSON.

Every script records, next to its numbers, the machine it ran on (CPU model, core count,
accelerators, library versions) and the load average before and after measuring, so a
figure measured while other work shared the cores can be recognised as such.

Nothing here is specific to a CPU: on a CUDA machine the same code times the GPU
(timings end with a host read of a result, which waits for the device).
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

# Each machine's results live in a folder of their own: RESULTS_DIR, bench/results/<machine>/,
# is set below, after `machine_folder`; `--results-dir` chooses another.
RESULTS_ROOT = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent

if str(REPO_ROOT) not in sys.path:  # `python bench/x.py` from anywhere, without installing
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (zeros where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return [0.0, 0.0, 0.0]


def wait_for_quiet(max_load: float | None, max_wait_s: float = 600.0, chunk_s: float = 20.0) -> dict:
    """Waits (in chunks) until the 1-minute load average is at most `max_load`.

    Gives up after `max_wait_s` and measures anyway; the returned record says so, and the
    scripts copy it into their JSON ("busy": true) so the figures carry the warning.

    Args:
        max_load: Threshold of the 1-minute load average; None skips the wait.
        max_wait_s: Longest total wait.
        chunk_s: Sleep between checks.

    Returns:
        `{"load_before": [...], "waited_s": float, "busy": bool}`.
    """
    start = time.monotonic()
    load = loadavg()
    if max_load is not None:
        while load[0] > max_load and time.monotonic() - start < max_wait_s:
            print(f"[bench] load average {load[0]:.2f} > {max_load}: waiting {chunk_s:.0f} s", flush=True)
            time.sleep(chunk_s)
            load = loadavg()
    busy = max_load is not None and load[0] > max_load
    if busy:
        print(f"[bench] still busy (load {load[0]:.2f}) after {max_wait_s:.0f} s: measuring anyway", flush=True)
    return {"load_before": load, "waited_s": round(time.monotonic() - start, 1), "busy": busy}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    from keras_transformer import precision  # Standard library only: TensorFlow may load later.

    return set(precision.cpu_flags())


def machine_folder(model: str | None = None, flags: set[str] | None = None) -> str:
    """This machine's folder under bench/results/: CPU vendor and family, then `-amx` or `-avx512`.

    E.g. `amd-epyc` (AVX2 only), `amd-epyc-avx512`, `intel-xeon-avx512`, `intel-xeon-amx`.
    """
    model = cpu_model() if model is None else model
    flags = cpu_flags() if flags is None else flags
    words = re.sub(r"\((R|TM)\)|@.*", " ", model, flags=re.IGNORECASE).lower().split()
    name = "-".join(filter(None, (re.sub(r"[^a-z0-9]+", "", word) for word in words[:2]))) or "unknown"
    if "amx_tile" in flags:
        return f"{name}-amx"
    return f"{name}-avx512" if "avx512f" in flags else name


RESULTS_DIR = RESULTS_ROOT / machine_folder()


def use_train_py_cpu_kernels() -> None:
    """TensorFlow's CPU kernels as `train.py` chooses them (`keras_transformer.cpu_kernels`).

    Call before TensorFlow is imported, so that a training benchmark times the kernels
    training uses; `TF_ENABLE_ONEDNN_OPTS` set in the environment wins.
    """
    from keras_transformer import cpu_kernels

    cpu_kernels.configure()


def onednn_enabled():
    """Whether TensorFlow runs its oneDNN CPU kernels (None if this TensorFlow cannot tell)."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return None


def machine_info(with_keras: bool = True) -> dict:
    """CPU, cores, memory, accelerators and library versions.

    `with_keras=False` leaves Keras (and KerasHub) unimported, for the serving benchmark,
    whose process must hold only TensorFlow and tensorflow-text.
    """
    import tensorflow as tf

    gpus = gpu_details()
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    flags = cpu_flags()
    info = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_avx512_bf16": "avx512_bf16" in flags,
        "cpu_amx_bf16": "amx_bf16" in flags,
        "cpu_avx512f": "avx512f" in flags,
        "onednn": onednn_enabled(),
        "memory_gib": None if mem_gib is None else round(mem_gib, 1),
        "gpus": [gpu["name"] for gpu in gpus],
        "gpu_compute_capabilities": [gpu["compute_capability"] for gpu in gpus],
        # On Ampere and newer GPUs TensorFlow runs float32 matmuls in TF32 by default.
        "tf32_enabled": bool(gpus) and tf.config.experimental.tensor_float_32_execution_enabled(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "platform": platform.platform(),
    }
    if with_keras:
        import keras

        info["keras"] = keras.__version__
        try:
            import keras_hub

            info["keras_hub"] = keras_hub.__version__
        except ImportError:
            pass
    try:
        import tensorflow_text

        info["tensorflow_text"] = tensorflow_text.__version__
    except (ImportError, AttributeError):
        pass
    return info


def has_gpu() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def gpu_details() -> list[dict]:
    """`{"name", "compute_capability"}` of each GPU (capability None where the driver does not say)."""
    import tensorflow as tf

    details = []
    for gpu in tf.config.list_physical_devices("GPU"):
        try:
            found = tf.config.experimental.get_device_details(gpu)
        except Exception:  # pragma: no cover - depends on the driver
            found = {}
        capability = found.get("compute_capability")
        details.append({"name": found.get("device_name", gpu.name), "compute_capability": capability})
    return details


def bf16_supported() -> bool:
    """Whether bfloat16 matmuls are native: GPUs of compute capability 8.0 (Ampere) or more,
    or, without a GPU, a CPU with AVX512_BF16 or AMX."""
    gpus = gpu_details()
    if gpus:
        return all(gpu["compute_capability"] and tuple(gpu["compute_capability"]) >= (8, 0) for gpu in gpus)
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_precisions() -> list[str]:
    """float32, and the mixed precision the device runs natively: bfloat16 where it can,
    float16 on older GPUs (Volta, Turing), none on a CPU without bfloat16."""
    if bf16_supported():
        return ["float32", "mixed_bfloat16"]
    return ["float32", "mixed_float16"] if has_gpu() else ["float32"]


def sync(x) -> None:
    """Waits for `x` (a tensor or nest of tensors) to be computed, by reading one element."""
    import tensorflow as tf

    flat = tf.nest.flatten(x)
    if flat:
        t = flat[0]
        if hasattr(t, "numpy"):
            tf.reshape(t, [-1])[:1].numpy()


def calls_to_fill(fn, seconds: float) -> int:
    """How many calls of `fn()` take at least `seconds` together, from one synced call.

    One call per repeat is enough on a CPU, but on a GPU a call can take a fraction of a
    millisecond, which the dispatch and the final sync would swamp.
    """
    start = time.perf_counter()
    sync(fn())
    return max(1, math.ceil(seconds / max(time.perf_counter() - start, 1e-9)))


def time_calls(fn, repeats: int, calls_per_repeat: int = 1) -> list[float]:
    """Seconds per call of `fn()` for each of `repeats` repeats (each `calls_per_repeat` calls).

    The result of the last call of each repeat is synced, so asynchronous device work
    is included.
    """
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(calls_per_repeat):
            out = fn()
        sync(out)
        times.append((time.perf_counter() - start) / calls_per_repeat)
    return times


def summarize(times: list[float]) -> dict:
    """Median, min, max and every repeat, in seconds."""
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "repeats_s": [round(t, 6) for t in times],
    }


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile (0-100), linear interpolation between closest ranks."""
    data = sorted(values)
    if not data:
        return float("nan")
    k = (len(data) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


PEAK_SIZES = (1024, 2048, 3072, 4096)


def _rates_per_kernel(fn, work: float, repeats: int, min_repeat_s: float) -> list[dict]:
    """`work` per second done by `fn()` run by TensorFlow's kernels and compiled by XLA.

    Each is timed `repeats` times, each repeat making as many calls as fill
    `min_repeat_s`. Returns `[{"xla", "calls_per_repeat", "rates"}]`, TensorFlow's first.
    """
    import tensorflow as tf

    kernels = []
    for xla in (False, True):
        run = tf.function(fn, jit_compile=xla)
        sync(run())  # trace (and compile) + warm-up
        calls = calls_to_fill(run, min_repeat_s)
        kernels.append({
            "xla": xla,
            "calls_per_repeat": calls,
            "rates": [work / t for t in time_calls(run, repeats, calls)],
        })
    return kernels


def peak_matmul_flops(
    dtype: str = "float32", sizes=PEAK_SIZES, repeats: int = 5, min_repeat_s: float = 0.2
) -> dict:
    """Measured peak matmul FLOP/s: the best `[n, n] @ [n, n]` over `sizes`, with and without XLA.

    The denominator of the model FLOPs utilisation; measured in the same run as the
    model, so both see the same clocks and the same neighbours on a shared machine.
    Why several sizes and both kernels: one shape can miss the machine's limit by far.
    On a 2-core AMD EPYC with AVX2 (2026-11-25), TensorFlow's default CPU matmul outside
    XLA (Eigen's there) ran 4096² at 88 GFLOP/s and 3072² at 151, XLA's dot both at ~150,
    and an XLA training step then reached "122%" of the 4096² figure.
    Each shape is timed `repeats` times, each repeat making as many calls as fill
    `min_repeat_s` (one on a CPU, hundreds on a GPU). On an Ampere or newer GPU,
    "float32" matmuls use TF32 unless it is disabled (`machine_info` records the setting).

    Returns:
        `{"dtype", "best_flops", "best_shape": {"n", "xla"}, "shapes": [...]}`, one entry
        of `shapes` per size and kernel: `{"n", "xla", "calls_per_repeat", "best_flops",
        "median_flops", "repeats_flops"}`.
    """
    import tensorflow as tf

    shapes = []
    for n in sizes:
        a = tf.cast(tf.random.normal((n, n), seed=1), dtype)
        b = tf.cast(tf.random.normal((n, n), seed=2), dtype)
        for kernel in _rates_per_kernel(functools.partial(tf.linalg.matmul, a, b), 2.0 * n**3, repeats, min_repeat_s):
            rates = kernel["rates"]
            shapes.append({
                "n": n,
                "xla": kernel["xla"],
                "calls_per_repeat": kernel["calls_per_repeat"],
                "best_flops": max(rates),
                "median_flops": statistics.median(rates),
                "repeats_flops": [round(r) for r in rates],
            })
    best = max(shapes, key=lambda shape: shape["best_flops"])
    return {
        "dtype": dtype,
        "best_flops": best["best_flops"],
        "best_shape": {"n": best["n"], "xla": best["xla"]},
        "shapes": shapes,
    }


def peak_read_bandwidth(size_mib: int = 256, repeats: int = 5, min_repeat_s: float = 0.2) -> dict:
    """Measured peak memory read rate, bytes/s: summing a float32 array of `size_mib` MiB.

    The denominator of a decoding step's bandwidth utilisation. A beam-search step of
    one sentence multiplies every decoder weight matrix by a few rows (the beams), so
    it does one multiply-add per beam for each weight it reads: its floor is set by
    how fast the weights can be read, not by FLOP/s. The array is far larger than a CPU's
    caches (and lives in a GPU's memory when there is one). Both TensorFlow's own
    reduction and XLA's are timed, best of `repeats` each, and the faster one is the
    peak: on a 2-core AMD EPYC (2026-11-25), 256 MiB read at 25.5 GB/s with TensorFlow's
    kernel and 14.5 GB/s with XLA's.

    Returns:
        `{"best_bytes_per_s", "best_xla", "array_bytes", "kernels": [...]}`, one entry of
        `kernels` per kernel: `{"xla", "calls_per_repeat", "best_bytes_per_s",
        "median_bytes_per_s"}`.
    """
    import tensorflow as tf

    array = tf.Variable(tf.ones([size_mib * 2**20 // 4]), trainable=False)
    array_bytes = size_mib * 2**20
    kernels = [
        {
            "xla": kernel["xla"],
            "calls_per_repeat": kernel["calls_per_repeat"],
            "best_bytes_per_s": max(kernel["rates"]),
            "median_bytes_per_s": statistics.median(kernel["rates"]),
        }
        for kernel in _rates_per_kernel(lambda: tf.reduce_sum(array), array_bytes, repeats, min_repeat_s)
    ]
    best = max(kernels, key=lambda kernel: kernel["best_bytes_per_s"])
    return {
        "best_bytes_per_s": best["best_bytes_per_s"],
        "best_xla": best["xla"],
        "array_bytes": array_bytes,
        "kernels": kernels,
    }


# --------------------------------------------------------------------------- serving measurements
# Shared by serving.py (a SavedModel) and decode_peers.py (a SavedModel or CTranslate2, each
# in a process of its own): standard library only, so that a CTranslate2 process holds no
# TensorFlow. `translate(texts)` is one request, a list of sentences in, their
# translations (str) out.


def load_sentences(data_dir: str | None, source_lang: str, limit: int | None = None) -> list[str]:
    """The Multi30k test sources (`test_2016_flickr.<source_lang>`), in file order, blank lines dropped.

    Looked up in `data_dir`, then `$MULTI30K_DIR`, then the shared data directory next to
    the repository (`../shared/data/multi30k`).
    """
    candidates = [
        data_dir,
        os.environ.get("MULTI30K_DIR"),
        str(REPO_ROOT.parent / "shared" / "data" / "multi30k"),
    ]
    for directory in candidates:
        if directory and (Path(directory) / f"test_2016_flickr.{source_lang}").is_file():
            lines = (Path(directory) / f"test_2016_flickr.{source_lang}").read_text(encoding="utf-8").splitlines()
            return [line.strip() for line in lines if line.strip()][:limit]
    raise SystemExit("Multi30k test sources not found: pass --data-dir or set MULTI30K_DIR.")


def resolve_version_dir(path: Path) -> Path:
    """`path` if it holds a saved_model.pb, else its highest numeric version subdirectory."""
    if (path / "saved_model.pb").is_file():
        return path
    versions = [p for p in path.iterdir() if p.is_dir() and p.name.isdigit() and (p / "saved_model.pb").is_file()]
    if not versions:
        raise SystemExit(f"{path} holds no SavedModel (no saved_model.pb, no numeric version directory).")
    return max(versions, key=lambda p: int(p.name))


def latency_percentiles(seconds: list[float]) -> dict:
    """p50, p95, p99, mean and max of request times, in ms (None if no request)."""
    ms = [s * 1e3 for s in seconds]
    if not ms:
        return {"requests": 0, **dict.fromkeys(("p50_ms", "p95_ms", "p99_ms", "mean_ms", "max_ms"))}
    return {
        "requests": len(ms),
        "p50_ms": percentile(ms, 50),
        "p95_ms": percentile(ms, 95),
        "p99_ms": percentile(ms, 99),
        "mean_ms": statistics.mean(ms),
        "max_ms": max(ms),
    }


def time_single(translate, texts: list[str]) -> dict:
    """One sentence per request, one client: latency percentiles and the outputs' mean word count."""
    timings, words = [], []
    for text in texts:
        start = time.perf_counter()
        out = translate([text])
        timings.append(time.perf_counter() - start)
        words.append(len(out[0].split()))
    return {**latency_percentiles(timings), "mean_output_words": statistics.mean(words)}


def time_batches(translate, batches: list[list[str]]) -> tuple[dict, list[str]]:
    """One client sending `batches` one after the other: sentences/s, batch latency, and the translations."""
    times, translations = [], []
    start = time.perf_counter()
    for batch in batches:
        t0 = time.perf_counter()
        translations += translate(batch)
        times.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - start
    sentences = sum(len(batch) for batch in batches)
    record = {
        "batch_size": len(batches[0]),
        "sentences": sentences,
        "seconds": seconds,
        "sentences_per_s": sentences / seconds,
        "batch_latency": latency_percentiles(times),
    }
    return record, translations


def time_concurrent(translate, texts: list[str], threads: int) -> dict:
    """`threads` client threads taking `texts` from one queue, one sentence per request: sentences/s, latency.

    Only the requests that returned a translation count (`sentences`, the rate, the latency); the
    others are `failed`, with the first `errors`.
    """
    import queue
    import threading

    work = queue.Queue()
    for text in texts:
        work.put(text)
    timings, errors = [], []
    lock = threading.Lock()

    def client():
        while True:
            try:
                text = work.get_nowait()
            except queue.Empty:
                return
            t0 = time.perf_counter()
            try:
                translate([text])
            except Exception as e:  # recorded, not raised; not a translated sentence
                with lock:
                    errors.append(repr(e)[:300])
                continue
            with lock:
                timings.append(time.perf_counter() - t0)

    clients = [threading.Thread(target=client) for _ in range(threads)]
    start = time.perf_counter()
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    seconds = time.perf_counter() - start
    return {
        "threads": threads,
        "sentences": len(timings),
        "seconds": seconds,
        "sentences_per_s": len(timings) / seconds,
        "latency": latency_percentiles(timings),
        "failed": len(errors),
        "errors": errors[:5],
    }


# What this module loads of the package to name the machine's folder (standard library
# only, no model code): not an import a serving process is to be blamed for.
OWN_PACKAGE_MODULES = ("keras_transformer", "keras_transformer.precision")


def unexpected_imports(packages=("keras_transformer", "keras_hub")) -> list[str]:
    """The modules of `packages` loaded in this process, less `OWN_PACKAGE_MODULES`."""
    return sorted(
        name for name in sys.modules if name.split(".")[0] in packages and name not in OWN_PACKAGE_MODULES
    )


def write_json(name: str, payload: dict, out_dir: Path | str | None = None) -> Path:
    """Writes `payload` to `<out_dir or bench/results/<machine>>/<name>.json` (atomically)."""
    out = Path(out_dir) if out_dir else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(path)
    print(f"[bench] wrote {path}", flush=True)
    return path


def header(benchmark: str, args, with_keras: bool = True) -> dict:
    """The common top of every result file."""
    return {
        "benchmark": benchmark,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([f"python {os.path.relpath(sys.argv[0], REPO_ROOT)}"] + sys.argv[1:]),
        "args": {k: v for k, v in vars(args).items()},
        "machine": machine_info(with_keras),
    }


def add_results_dir_arg(parser, default=RESULTS_DIR) -> None:
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=default,
        help=f"directory of the JSON (default: this machine's, bench/results/{RESULTS_DIR.name}; "
        "each machine's results go in a directory of their own, read by report.py --results)",
    )


def add_load_args(parser) -> None:
    parser.add_argument(
        "--max-load",
        type=float,
        default=1.0,
        help="wait (up to --max-wait s) until the 1-minute load average is at most this; "
        "-1 to skip the wait",
    )
    parser.add_argument("--max-wait", type=float, default=600.0, help="longest wait for a quiet machine, s")


def quiet(args) -> dict:
    return wait_for_quiet(None if args.max_load < 0 else args.max_load, args.max_wait)


def finish_load(record: dict, own_threads: int = 0) -> dict:
    """Adds the load after measuring; a 1-minute load above what the benchmark itself
    keeps runnable marks the run busy.

    A benchmark keeps up to the core count runnable, or `own_threads` if it runs more
    concurrent work (the serving benchmark's client threads); more than that means
    neighbours.
    """
    after = loadavg()
    record["load_after"] = after
    ours = max(os.cpu_count() or 1, own_threads)
    record["busy"] = bool(record.get("busy")) or after[0] > ours + 0.5
    return record
