"""Shared helpers of the benchmark scripts: machine facts, load hygiene, timing, peak FLOP/s, JSON.

Every script records, next to its numbers, the machine it ran on (CPU model, core count,
accelerators, library versions) and the load average before and after measuring, so a
figure measured while other work shared the cores can be recognised as such.

Nothing here is specific to a CPU: on a CUDA machine the same code times the GPU
(timings end with a host read of a result, which waits for the device).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
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
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine_info(with_keras: bool = True) -> dict:
    """CPU, cores, memory, accelerators and library versions.

    `with_keras=False` leaves Keras (and KerasHub) unimported, for the serving benchmark,
    whose process must hold only TensorFlow and tensorflow-text.
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    gpu_names = []
    for gpu in gpus:
        try:
            gpu_names.append(tf.config.experimental.get_device_details(gpu).get("device_name", gpu.name))
        except Exception:  # pragma: no cover - depends on the driver
            gpu_names.append(gpu.name)
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
        "memory_gib": None if mem_gib is None else round(mem_gib, 1),
        "gpus": gpu_names,
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


def bf16_supported() -> bool:
    """Whether bfloat16 matmuls are native: a GPU (Ampere+ assumed) or a CPU with AVX512_BF16/AMX."""
    if has_gpu():
        return True
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def sync(x) -> None:
    """Waits for `x` (a tensor or nest of tensors) to be computed, by reading one element."""
    import tensorflow as tf

    flat = tf.nest.flatten(x)
    if flat:
        t = flat[0]
        if hasattr(t, "numpy"):
            tf.reshape(t, [-1])[:1].numpy()


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


def peak_matmul_flops(dtype: str = "float32", n: int = 4096, repeats: int = 5) -> dict:
    """Measured peak matmul FLOP/s: best of `repeats` `[n, n] @ [n, n]` under `tf.function`.

    The denominator of the model FLOPs utilisation; measured in the same run as the
    model, so both see the same clocks and the same neighbours on a shared machine.

    Returns:
        `{"dtype", "n", "best_flops", "median_flops", "repeats_flops"}`.
    """
    import tensorflow as tf

    a = tf.cast(tf.random.normal((n, n), seed=1), dtype)
    b = tf.cast(tf.random.normal((n, n), seed=2), dtype)
    matmul = tf.function(lambda x, y: tf.linalg.matmul(x, y))
    sync(matmul(a, b))  # trace + warm-up
    sync(matmul(a, b))
    flops = 2.0 * n**3
    rates = [flops / t for t in time_calls(lambda: matmul(a, b), repeats)]
    return {
        "dtype": dtype,
        "n": n,
        "best_flops": max(rates),
        "median_flops": statistics.median(rates),
        "repeats_flops": [round(r) for r in rates],
    }


def write_json(name: str, payload: dict, out_dir: Path | str | None = None) -> Path:
    """Writes `payload` to `<out_dir or bench/results>/<name>.json` (atomically)."""
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
