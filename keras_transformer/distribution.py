"""Choosing a `tf.distribute.Strategy`, and the few facts about it the trainer needs.

The trainer is written once for every strategy: per-replica batches come from
`strategy.distribute_datasets_from_function` and the step runs under `strategy.run`.
What differs is chosen here:

* `TF_CONFIG` naming two or more tasks (chief/worker) -> `MultiWorkerMirroredStrategy`:
  synchronous data parallelism across machines (each over its local GPUs).
* an explicit `devices` list -> `MirroredStrategy` over them (one device:
  `OneDeviceStrategy`). CPU devices beyond the first are logical devices split off the
  one physical CPU (`split_cpu`). Every device must exist: a GPU that TensorFlow does not
  see, or a CPU device beyond the split, is an error rather than a silent run on another
  device.
* otherwise -> `MirroredStrategy` over all local GPUs, or `OneDeviceStrategy` on the only
  GPU; without GPUs, `cpu_replicas` replicas that split the CPU (one: `OneDeviceStrategy`
  on the CPU).

Why split a CPU for speed: a step of a small model is many small ops, which TensorFlow's
intra-op threads share out poorly; replicas that each run their own batch's ops on their
share of the cores keep every core busy (see docs/performance.md).

`MultiWorkerMirroredStrategy` and `split_cpu` must run before TensorFlow initializes its
devices, i.e. before any other TensorFlow op: call `make_strategy` first thing.
"""

import json
import logging
import os
import weakref

import tensorflow as tf

logger = logging.getLogger(__name__)


def split_cpu(num_devices):
    """Splits the physical CPU into `num_devices` logical devices `/cpu:0 .. /cpu:N-1`, sharing out its cores.

    The devices share one pool of intra-op threads, so the pool is cut to each device's
    share of the cores (at least one thread), and the inter-op pool given a thread per
    device at least, so that the replicas' ops run side by side; a size that
    `TF_NUM_INTRAOP_THREADS`, `TF_NUM_INTEROP_THREADS` or `tf.config.threading` set stays.

    Args:
        num_devices: How many logical CPU devices to create.

    Raises:
        RuntimeError: If TensorFlow has already initialized its devices with another split.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == num_devices:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)]
        )
    except RuntimeError as error:
        raise RuntimeError(
            f"Cannot split the CPU into {num_devices} devices: TensorFlow already initialized its "
            f"devices ({error}). Create the strategy before running any TensorFlow op."
        ) from None
    _share_threads(num_devices)


def _share_threads(num_devices):
    """Cuts TensorFlow's thread pools for `num_devices` replicas on a CPU (see `split_cpu`); sizes already set stay."""
    threading = tf.config.threading
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not (threading.get_intra_op_parallelism_threads() or _threads_from_env("TF_NUM_INTRAOP_THREADS")):
        threading.set_intra_op_parallelism_threads(max(1, cores // num_devices))
    # TensorFlow's default inter-op pool has a thread per core.
    if not (threading.get_inter_op_parallelism_threads() or _threads_from_env("TF_NUM_INTEROP_THREADS")):
        threading.set_inter_op_parallelism_threads(max(cores, num_devices))


def _threads_from_env(name):
    """The pool size environment variable `name` sets, or 0: TensorFlow reads 0 (or no number) as its default."""
    try:
        return max(0, int(os.environ.get(name, "0")))
    except ValueError:
        return 0


def cluster_task_count(tf_config=None):
    """Number of chief and worker tasks named by `TF_CONFIG` (0 when it is unset).

    Args:
        tf_config: The JSON text of `TF_CONFIG`; defaults to the environment variable.

    Raises:
        ValueError: If `TF_CONFIG` is not a JSON object whose "cluster" maps job names
            to lists of addresses.
    """
    text = os.environ.get("TF_CONFIG", "") if tf_config is None else tf_config
    if not text:
        return 0
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"TF_CONFIG is not valid JSON ({error}): {text[:200]!r}") from None
    cluster = config.get("cluster", {}) if isinstance(config, dict) else None
    jobs = [cluster.get(job, []) for job in ("chief", "worker")] if isinstance(cluster, dict) else None
    if jobs is None or not all(isinstance(tasks, list) for tasks in jobs):
        raise ValueError(
            'TF_CONFIG must be a JSON object such as {"cluster": {"worker": ["host1:port", "host2:port"]}, '
            f'"task": {{"type": "worker", "index": 0}}}}, got {text[:200]!r}.'
        )
    return sum(len(tasks) for tasks in jobs)


def make_strategy(devices=None, cpu_replicas=1):
    """The strategy for this process; see the module docstring for the rules.

    Args:
        devices: Optional device names, e.g. `["GPU:0", "GPU:1"]` or `["CPU:0", "CPU:1"]`.
            Ignored (must be None) under a multi-worker `TF_CONFIG`.
        cpu_replicas: Without `devices`, a multi-worker `TF_CONFIG` or GPUs: how many
            replicas split the CPU (see `split_cpu`).

    Returns:
        A `tf.distribute.Strategy`.

    Raises:
        ValueError: For a malformed `TF_CONFIG`, `devices` combined with a multi-worker
            one, or `devices` naming a device that does not exist (or one device twice).
    """
    if cluster_task_count() > 1:
        if devices:
            raise ValueError("--devices cannot be combined with a multi-worker TF_CONFIG.")
        return tf.distribute.MultiWorkerMirroredStrategy()
    if devices:
        devices = [_canonical_device(name) for name in devices]
        _check_distinct(devices)
        cpu_count = sum(name.startswith("/cpu:") for name in devices)
        if cpu_count > 1:
            split_cpu(max(int(name.split(":")[1]) for name in devices if name.startswith("/cpu:")) + 1)
        _check_devices_exist(devices)
    elif not tf.config.get_visible_devices("GPU") and cpu_replicas > 1:
        split_cpu(cpu_replicas)
        devices = [f"/cpu:{index}" for index in range(cpu_replicas)]
    else:
        gpus = tf.config.list_logical_devices("GPU")
        devices = [gpu.name for gpu in gpus] or ["/cpu:0"]
    if len(devices) == 1:
        return tf.distribute.OneDeviceStrategy(devices[0])
    return tf.distribute.MirroredStrategy(devices)


def _canonical_device(name):
    """'GPU:1', 'gpu:1' or '/device:GPU:1' -> '/gpu:1'."""
    parts = name.strip().lower().replace("/device:", "").lstrip("/").split(":")
    if len(parts) != 2 or parts[0] not in ("cpu", "gpu") or not parts[1].isdigit():
        raise ValueError(f"Device {name!r} is not of the form CPU:N or GPU:N.")
    return f"/{parts[0]}:{parts[1]}"


def _check_distinct(devices):
    """Raises ValueError if a canonical device name is repeated (two replicas cannot share a device)."""
    repeated = sorted({name for name in devices if devices.count(name) > 1})
    if repeated:
        raise ValueError(f"Device {_display(repeated[0])} is listed twice; list each device once.")


def _check_devices_exist(devices):
    """Raises ValueError unless every canonical name in `devices` is an existing device.

    TensorFlow would otherwise place the work of a missing device elsewhere without a
    word (a missing GPU on the CPU). Visible GPUs and the CPU split are read without
    initializing TensorFlow's devices, which `split_cpu` needs left undone.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    available = {
        "gpu": len(tf.config.get_visible_devices("GPU")),
        "cpu": len(tf.config.get_logical_device_configuration(cpu) or [cpu]),
    }
    for name in devices:
        kind, index = name.lstrip("/").split(":")
        if int(index) < available[kind]:
            continue
        if kind == "gpu":
            seen = f"GPU:0 to GPU:{available['gpu'] - 1}" if available["gpu"] else "no GPU"
            raise ValueError(f"Device {_display(name)} does not exist: TensorFlow sees {seen} on this machine.")
        raise ValueError(
            f"Device {_display(name)} does not exist: this process has {available['cpu']} CPU device(s). "
            "Logical CPU devices (for testing several replicas) are made only when two or more CPU "
            "devices are listed together, e.g. CPU:0,CPU:1."
        )


def _display(name):
    """'/gpu:1' -> 'GPU:1', as users write it."""
    return name.lstrip("/").upper()


def runs_on_cpus_only(strategy):
    """Whether every replica of `strategy` computes on a CPU."""
    return all(tf.DeviceSpec.from_string(device).device_type == "CPU" for device in strategy.extended.worker_devices)


def prepare_for_float16(strategy):
    """Call before building float16 computations to run under `strategy`; a workaround for TensorFlow 2.21.

    On CPUs, Grappler's remapper fuses a MatMul and the BiasAdd (or Add) after it into
    one oneDNN operation that for float16 has only oneDNN's reference kernel
    (`ONEDNN_VERBOSE=1` shows `inner_product,ref:any`), orders of magnitude slower than
    the unfused ops (see docs/performance.md). When every replica runs on a CPU this turns
    the remapper off, with a warning; a float16 step then takes about as long as a float32 one.

    The setting is process-wide: functions of any precision first run afterwards are not
    fused either, which leaves float32 steps no slower (see docs/performance.md).
    On GPUs nothing changes.

    Args:
        strategy: The strategy the float16 computations will run under.
    """
    if not runs_on_cpus_only(strategy) or tf.config.optimizer.get_experimental_options().get("remapping") is False:
        return
    tf.config.optimizer.set_experimental_options({"remapping": False})
    logger.warning(
        "float16 on CPUs: Grappler's MatMul+BiasAdd fusion is turned off for this process "
        "(TensorFlow 2.21 runs the fused float16 kernel about 1000x slower). Even so, float16 "
        "trains no faster than float32 on a CPU."
    )


def num_workers(strategy):
    """How many processes (workers) train together under `strategy`."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    cluster = resolver.cluster_spec().as_dict()
    return max(1, len(cluster.get("chief", [])) + len(cluster.get("worker", [])))


def is_chief(strategy):
    """Whether this process writes checkpoints, summaries and translations.

    The chief is the "chief" task, or worker 0 when the cluster has no chief.
    """
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or resolver.task_type is None:
        return True
    if resolver.task_type == "chief":
        return True
    has_chief = bool(resolver.cluster_spec().as_dict().get("chief"))
    return resolver.task_type == "worker" and resolver.task_id == 0 and not has_chief


def worker_index(strategy):
    """This worker's position among the workers: 0 on the chief."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or resolver.task_type is None:
        return 0
    has_chief = bool(resolver.cluster_spec().as_dict().get("chief"))
    if resolver.task_type == "chief":
        return 0
    return resolver.task_id + (1 if has_chief else 0)


class WorkerLostError(RuntimeError):
    """Another worker of a multi-worker run stopped without warning (killed, crashed, lost its machine)."""


# What a collective raises when a worker it waits for is gone: its connection dropped, or
# the coordination service missed its heartbeats.
PEER_FAILURES = (tf.errors.UnavailableError, tf.errors.AbortedError)


def worker_lost_error(error, when, resume):
    """A `WorkerLostError` for `error`, one of `PEER_FAILURES`: what happened `when`, and `resume` (how to go on)."""
    # TensorFlow's message runs to pages (the Python stack of the collective op); the
    # cause follows "aborted by:", e.g. "... tasks are unhealthy (stopped sending heartbeats):
    # /job:worker/replica:0/task:1" or "recvmsg:Connection reset by peer", before gRPC's details.
    text = str(error)
    cause = text.split("aborted by:", 1)[1] if "aborted by:" in text else text.strip().split("\n", 1)[0]
    for tail in ("The error could be from a previous operation", "Additional GRPC error information"):
        cause = cause.split(tail, 1)[0]
    cause = " ".join(cause.split())[:300] or type(error).__name__
    return WorkerLostError(
        f"Another worker stopped without warning, {when} (TensorFlow: {cause}). Synchronous training cannot go "
        f"on without it, so this worker stops too. {resume}"
    )


def any_worker(strategy, flag):
    """Whether `flag` is true on any worker: a collective, so every worker must call it.

    With a single worker this is `flag` itself, without any collective.

    Args:
        strategy: The strategy.
        flag: This worker's Python bool.

    Returns:
        The same bool on every worker.
    """
    if num_workers(strategy) == 1:
        return bool(flag)
    return float(_sum_over_replicas(strategy, tf.constant(float(flag)))) > 0.0


def mean_over_workers(strategy, value):
    """The mean of a Python float over the workers: a collective, so every worker must call it.

    With a single worker this is `value` itself, without any collective.
    """
    if num_workers(strategy) == 1:
        return float(value)
    # Every replica of a worker holds the worker's value; workers have as many replicas each.
    return float(_sum_over_replicas(strategy, tf.constant(float(value)))) / strategy.num_replicas_in_sync


def chief_choice(strategy, index, choices):
    """The chief's `index` (one of `range(choices)`) on every worker: a collective, so every worker must call it.

    For what each worker could decide differently (a measurement, its own devices), so that
    all decide as the chief did. With a single worker this is `index` itself.
    """
    if num_workers(strategy) == 1:
        return index
    vote = tf.one_hot(index if is_chief(strategy) else -1, choices)  # -1: a row of zeros.
    return int(tf.argmax(_sum_over_replicas(strategy, vote)))


def _sum_over_replicas(strategy, value):
    """The sum of `value` over every replica of every worker (a tf.function per strategy, traced per shape)."""
    if strategy not in _SUMS:
        _SUMS[strategy] = tf.function(
            lambda value: strategy.reduce(
                tf.distribute.ReduceOp.SUM, strategy.run(tf.identity, args=(value,)), axis=None
            )
        )
    return _SUMS[strategy](value)


# strategy -> its `_sum_over_replicas` function.
_SUMS = weakref.WeakKeyDictionary()


def barrier(strategy):
    """Blocks until every worker got here (e.g. until the chief wrote shared files)."""
    any_worker(strategy, False)
