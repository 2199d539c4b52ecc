"""The compute precision of training, and `auto`: the one the device computes fastest.

`--mixed-precision` takes `none` (float32), `bf16` (`mixed_bfloat16`: bfloat16 compute,
float32 weights), `fp16` (`mixed_float16`, with loss scaling) or `auto`, which picks by
the devices the run trains on:

* GPUs of compute capability 8.0 or more (Ampere and later) compute bfloat16 natively:
  `bf16`, which needs no loss scaling. Older GPUs: `fp16` (their tensor cores are float16's).
* CPUs with AMX (`amx_bf16`) or AVX512_BF16 may compute bfloat16 faster than float32, or
  slower: it differs from CPU to CPU (docs/performance.md). So `auto` measures it, a
  matmul in each precision (a fraction of a second), and takes `bf16` where it is at
  least `MIN_BF16_SPEEDUP` times as fast. Not with `--jit-compile`: XLA's CPU backend has
  no bfloat16 kernels, and bf16 steps ran slower than float32 under it.
* Any other CPU: `none`. Without native bfloat16 the conversions cost more than they save.

In a multi-worker run the chief decides for all (`training_run.choose_precision`). The
choice and its reason are logged and saved in the run's config.json
(`train.mixed_precision`, `train.precision_reason`); a resumed run keeps its precision.
"""

import dataclasses
import platform
from pathlib import Path

# --mixed-precision choices and their Keras dtype policies; `auto` resolves to one of them.
DTYPE_POLICIES = {"none": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}
AUTO = "auto"
CHOICES = (AUTO, *DTYPE_POLICIES)
# CPU flags (Linux /proc/cpuinfo names) of native bfloat16 matrix arithmetic.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
# Compute capability from which NVIDIA GPUs compute bfloat16 natively (Ampere).
BF16_GPU_CAPABILITY = (8, 0)
# How much faster than float32 a CPU's bf16 matmul must be for `auto` to train in bf16:
# a margin for the steps' other work, which bf16 does not speed up.
MIN_BF16_SPEEDUP = 1.2


@dataclasses.dataclass(frozen=True)
class Devices:
    """What `auto` looks at.

    Attributes:
        on_gpus: Whether the run trains on GPUs.
        gpu_capabilities: The compute capabilities of the run's GPUs (those reported).
        cpu_flags: The CPU's feature flags.
        cpu_bf16_speedup: How many times as fast a bf16 matmul ran as a float32 one on
            this CPU (`measure_bf16_speedup`); None when not measured.
    """

    on_gpus: bool = False
    gpu_capabilities: tuple[tuple[int, int], ...] = ()
    cpu_flags: frozenset[str] = frozenset()
    cpu_bf16_speedup: float | None = None


@dataclasses.dataclass(frozen=True)
class Precision:
    """A resolved precision: one of `DTYPE_POLICIES`, and why it was chosen."""

    name: str
    reason: str

    @property
    def dtype_policy(self):
        return DTYPE_POLICIES[self.name]


def resolve(requested, devices, jit_compile=False):
    """The `Precision` of `--mixed-precision requested` on `devices`.

    Args:
        requested: One of `CHOICES`.
        devices: The run's `Devices`.
        jit_compile: Whether steps are compiled with XLA.

    Raises:
        ValueError: For a value not in `CHOICES`.
    """
    if requested not in CHOICES:
        raise ValueError(f"mixed_precision must be one of {', '.join(CHOICES)}, got {requested!r}.")
    if requested != AUTO:
        return Precision(requested, "asked for")
    if devices.on_gpus and not devices.gpu_capabilities:
        return Precision("none", "auto: the GPUs report no compute capability")
    if devices.on_gpus:
        oldest = min(devices.gpu_capabilities)
        shown = f"{oldest[0]}.{oldest[1]}"
        if oldest >= BF16_GPU_CAPABILITY:
            return Precision("bf16", f"auto: GPUs of compute capability {shown} compute bfloat16 natively")
        return Precision("fp16", f"auto: GPUs of compute capability {shown} (below 8.0) compute float16, not bfloat16")
    native = ", ".join(sorted(flag for flag in BF16_CPU_FLAGS if flag in devices.cpu_flags))
    if not native:
        return Precision("none", "auto: this CPU has no native bfloat16 arithmetic (AMX or AVX512_BF16)")
    if jit_compile:
        return Precision("none", f"auto: this CPU has {native}, but XLA's CPU backend has no bfloat16 kernels "
                                 "(--jit-compile)")
    speedup = devices.cpu_bf16_speedup
    if speedup is None:
        return Precision("none", f"auto: this CPU has {native}, but bfloat16's speed was not measured")
    measured = f"bf16 matmuls ran {speedup:.2f}x as fast as float32"
    if speedup >= MIN_BF16_SPEEDUP:
        return Precision("bf16", f"auto: this CPU computes bfloat16 natively ({native}): {measured}")
    return Precision("none", f"auto: this CPU has {native}, but {measured} (bf16 needs {MIN_BF16_SPEEDUP}x)")


def cpu_flags(cpuinfo="/proc/cpuinfo"):
    """The CPU's feature flags, from Linux's /proc/cpuinfo (empty elsewhere)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")) and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def local_devices(strategy):
    """The `Devices` of the replicas of `strategy` on this machine; on a CPU with native bf16, its measured speed."""
    import tensorflow as tf

    names = [name.lower() for name in strategy.extended.worker_devices]
    if any("gpu" in name for name in names):
        details = (tf.config.experimental.get_device_details(gpu) for gpu in tf.config.list_physical_devices("GPU"))
        capabilities = tuple(tuple(info["compute_capability"]) for info in details if info.get("compute_capability"))
        return Devices(on_gpus=True, gpu_capabilities=capabilities)
    flags = cpu_flags() if platform.system() == "Linux" else frozenset()
    speedup = measure_bf16_speedup() if any(flag in flags for flag in BF16_CPU_FLAGS) else None
    return Devices(cpu_flags=flags, cpu_bf16_speedup=speedup)


def measure_bf16_speedup(size=1024, repeats=5):
    """How many times as fast a `size`-cubed matmul runs in bfloat16 as in float32 on the CPU (best of `repeats`)."""
    import time

    import tensorflow as tf

    seconds = {}
    for dtype in (tf.float32, tf.bfloat16):
        with tf.device("/CPU:0"):
            a = tf.random.stateless_normal([size, size], seed=(1, 2), dtype=tf.float32)
            a = tf.cast(a, dtype)
            matmul = tf.function(lambda x: tf.reduce_sum(tf.cast(tf.matmul(x, x), tf.float32)))
            matmul(a).numpy()  # Traced and warmed up.
            timings = []
            for _ in range(repeats):
                started = time.perf_counter()
                matmul(a).numpy()
                timings.append(time.perf_counter() - started)
        seconds[dtype] = min(timings)
    return seconds[tf.float32] / seconds[tf.bfloat16]
