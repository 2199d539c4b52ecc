"""Where the time goes: TF profiler traces of a training step or of serving requests, summarised.

Usage:
    python bench/profile_trace.py train                                  # small, float32, ours
    python bench/profile_trace.py train --preset base --jit on --impl peer_noattndrop
    python bench/profile_trace.py serving --saved-model models/transformer-small-xla
    python bench/profile_trace.py serving --saved-model models/transformer-small-xla --batch 32

Each run writes a TensorBoard profile (`--logdir`, default `runs/profile/<name>`; open
it with `tensorboard --logdir ...`, Profile tab, which needs the `xprof` package of the
`bench` extra) and prints, and writes to `bench/results/<machine>/profile-<name>.json`, a summary
of the trace:

* `train`: the op time of `--steps` training steps (the `Trainer` step of
  `train_throughput.py`, same synthetic batch). In graph mode, per TensorFlow op type
  and per model part (attention, feed-forward, shared embedding, loss, Adam; forward
  and backward apart); with `--jit on`, per XLA operation kind and per operation
  (fusions, matmuls), as for serving.
* `serving`: the time of each XLA operation (fusions, matmuls, the top-k custom call)
  inside the beam search of `--requests` requests of `--batch` sentences (default 1),
  per request. Use a `--jit-compile` export (a graph-mode export shows TensorFlow ops
  instead).

XLA:CPU records its operations only with `XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true`,
which this script sets before TensorFlow starts. Op times are summed over the threads
that ran them, and XLA runs independent operations concurrently, so they add up to more
than the wall time on a multi-core machine and an operation sharing the cores looks
slower than it is alone.

On a GPU the summaries count the device's time only (`"timeline": "device"`): the
framework's device rows in graph mode, the GPU's "XLA Ops" line with XLA. The host rows
there are the launches of those kernels, and the GPU's stream lines hold the same
kernels again. This reading of GPU traces follows xprof's line names; it has not been
checked against a real GPU trace (none of our machines has one).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (standard library only at import)

# Parts of the model, matched in op names (Keras layer names) in this order.
_MODEL_PARTS = (
    "self_attention",
    "cross_attention",
    "feed_forward",
    "shared_embedding",
    "norm",
    "adam",
    "LogSoftmax",
    "SparseSoftmaxCrossEntropy",
)
# Trace events that wrap others (a request, an executor, a thread pool region, the search
# loop, the call of a fusion outlined by XLA).
_WRAPPERS = re.compile(
    r"^(ThreadpoolListener::Region|ThunkExecutor::Execute|signature_wrapper(_\w+)?|EagerExecute|"
    r"TFE_Py_ExecuteCancelable|EagerKernelExecute|KernelAndDeviceFunc::Run|ExecutorState::.*|"
    r"CpuExecutable::ExecuteAsyncOnStream|BlockUntilReady|SlinkyThreadPool::Await|EagerLocalExecute.*|while(\.\d+)?|"
    r"call(\.\d+)?)$"
)


def _xplane_paths(logdir: Path) -> list[str]:
    paths = sorted(glob.glob(str(logdir / "plugins" / "profile" / "*" / "*.xplane.pb")))
    if not paths:
        raise SystemExit(f"No profile was written under {logdir}.")
    return paths[-1:]  # the newest run


def _tool_data(logdir: Path, tool: str):
    try:
        from xprof.convert import raw_to_tool_data
    except ImportError:
        raise SystemExit("Summarising a profile needs the xprof package: pip install -e '.[bench]'") from None
    data, _ = raw_to_tool_data.xspace_to_tool_data(_xplane_paths(logdir), tool, {})
    if not data:
        raise SystemExit(f"The profiler's {tool} tool returned nothing for {logdir}.")
    return json.loads(data)


def _table_rows(table: dict) -> list[dict]:
    columns = [column["id"] for column in table["cols"]]
    return [dict(zip(columns, [cell.get("v") for cell in row["c"]])) for row in table["rows"]]


def _ranked(counter: collections.Counter, per: float, limit: int) -> list[dict]:
    total = sum(counter.values())
    return [
        {"name": name, "ms": round(us / per / 1e3, 3), "share": round(us / total, 4)}
        for name, us in counter.most_common(limit)
    ]


def summarize_training(logdir: Path, steps: int, limit: int = 20) -> dict:
    """Op self time per step, by op type and by model part (backward marked `grad:`).

    With a GPU in the trace, its device rows only; the host rows launch them.
    """
    rows = _table_rows(_tool_data(logdir, "framework_op_stats")[0])
    rows = [row for row in rows if row["type"] not in ("IDLE", "Dataset")]
    device_rows = [row for row in rows if row["host_or_device"] == "Device"]
    by_type, by_part = collections.Counter(), collections.Counter()
    for row in device_rows or rows:
        self_us = row["total_self_time"]
        by_type[row["type"]] += self_us
        name = row["operation"]
        part = next((p for p in _MODEL_PARTS if p.lower() in name.lower()), "other")
        by_part[("grad:" if "gradient_tape" in name else "") + part] += self_us
    return {
        "timeline": "device" if device_rows else "host",
        "op_time_per_step_ms": round(sum(by_type.values()) / steps / 1e3, 1),
        "by_op_type": _ranked(by_type, steps, limit),
        "by_model_part": _ranked(by_part, steps, limit),
    }


def summarize_xla_ops(logdir: Path, count: int, limit: int = 20, outer: str = "signature_wrapper") -> dict:
    """Time of the XLA operations (and TF ops) per request or step, from the trace events.

    `outer` names the event that spans one request or step (its total is reported as
    `outer_ms`), or begins its name followed by "_" (TensorFlow names a SavedModel
    signature's event after its function: `signature_wrapper_translate`). Events that
    only wrap others are left out of the op times. With a GPU in the trace, the op times
    are those of its "XLA Ops" line.
    """
    events = _tool_data(logdir, "trace_viewer")
    events = events["traceEvents"] if isinstance(events, dict) else events
    device_lines = _gpu_xla_op_lines(events)
    by_op, by_kind = collections.Counter(), collections.Counter()
    outer_us = 0.0
    for event in events:
        if event.get("ph") != "X":
            continue
        name, duration = event["name"], event.get("dur", 0.0)
        if name == outer or name.startswith(outer + "_"):
            outer_us += duration
            continue
        if _WRAPPERS.match(name) or (device_lines and (event.get("pid"), event.get("tid")) not in device_lines):
            continue
        by_op[name] += duration
        by_kind[re.sub(r"([._]\d+)+$", "", name)] += duration  # MatMul.84 -> MatMul
    return {
        "timeline": "device" if device_lines else "host",
        "outer_ms": round(outer_us / count / 1e3, 2),
        "op_time_ms": round(sum(by_op.values()) / count / 1e3, 2),
        "by_op_kind": _ranked(by_kind, count, limit),
        "by_op": _ranked(by_op, count, limit),
    }


def _gpu_xla_op_lines(events) -> set[tuple]:
    """`(pid, tid)` of the "XLA Ops" lines of the trace's GPUs (none on a CPU).

    xprof derives that line from the kernels on the GPU's streams, one event per XLA
    operation; the streams and the host's launches hold the same time again.
    """
    names = {
        (event["name"], event.get("pid"), event.get("tid")): event["args"].get("name", "")
        for event in events
        if event.get("ph") == "M" and event.get("name") in ("process_name", "thread_name")
    }
    gpus = {pid for (kind, pid, _), name in names.items() if kind == "process_name" and "/device:GPU:" in name}
    return {
        (pid, tid)
        for (kind, pid, tid), name in names.items()
        if kind == "thread_name" and pid in gpus and name == "XLA Ops"
    }


def profile_training(args) -> tuple[str, dict]:
    import train_throughput as tt  # first: it picks TensorFlow's CPU kernels as train.py does

    import tensorflow as tf

    strategy = tt.single_device_strategy()
    batch = args.batch or tt.DEFAULT_BATCH[args.preset]
    data = tt.synthetic_batch(batch, args.src_len, args.tgt_len, args.vocab_size)
    runner = tt.Runner(
        args.impl, args.preset, args.precision, args.jit == "on", args.vocab_size, data, "trainer",
        strategy, tempfile.mkdtemp(prefix="bench-profile-"),
    )
    runner.warm_up(2)
    name = f"train-{args.preset}-{args.precision}-{'xla' if args.jit == 'on' else 'graph'}-{args.impl}"
    logdir = Path(args.logdir or f"runs/profile/{name}")
    tf.profiler.experimental.start(str(logdir))
    runner.timed_repeat(args.steps)
    tf.profiler.experimental.stop()
    if args.jit == "on":
        xla = summarize_xla_ops(logdir, args.steps, outer="train_step")
        ops = {
            "timeline": xla["timeline"], "op_time_per_step_ms": xla["op_time_ms"], "by_op_kind": xla["by_op_kind"],
            "by_op": xla["by_op"],
        }
    else:
        ops = summarize_training(logdir, args.steps)
    summary = {
        "config": {
            "preset": args.preset, "precision": args.precision, "jit": args.jit, "impl": args.impl, "batch": batch
        },
        "step_s_under_profiler": round(runner.times[-1], 3),
        **ops,
    }
    return name, {"logdir": str(logdir), **summary}


def profile_serving(args) -> tuple[str, dict]:
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  (the SavedModel's SentencePiece ops)
    from serving import load_sentences, resolve_version_dir

    signature = tf.saved_model.load(str(resolve_version_dir(args.saved_model))).signatures["serving_default"]
    sentences = load_sentences(args.data_dir, "en", (args.warmup + args.requests) * args.batch)
    requests = [sentences[i : i + args.batch] for i in range(0, len(sentences), args.batch)]
    for request in requests[: args.warmup]:  # XLA compiles each bucket once
        signature(tf.constant(request))
    name = f"serving-{args.saved_model.name}" + (f"-batch{args.batch}" if args.batch > 1 else "")
    logdir = Path(args.logdir or f"runs/profile/{name}")
    started = time.perf_counter()
    tf.profiler.experimental.start(str(logdir))
    for request in requests[args.warmup :]:
        signature(tf.constant(request))["translation"].numpy()
    tf.profiler.experimental.stop()
    elapsed = time.perf_counter() - started
    xla = summarize_xla_ops(logdir, args.requests)
    summary = {
        "saved_model": str(args.saved_model),
        "requests": args.requests,
        "sentences_per_request": args.batch,
        "wall_ms_per_request_under_profiler": round(elapsed / args.requests * 1e3, 2),
        "timeline": xla["timeline"],
        "request_ms": xla["outer_ms"],
        "op_time_per_request_ms": xla["op_time_ms"],
        "by_op_kind": xla["by_op_kind"],
        "by_op": xla["by_op"],
    }
    return name, {"logdir": str(logdir), **summary}


def _add_shared_args(parser, with_defaults=True):
    def default(value):
        return value if with_defaults else argparse.SUPPRESS

    parser.add_argument("--logdir", default=default(None), help="profile directory (default runs/profile/<name>)")
    parser.add_argument("--top", type=int, default=default(12), help="rows printed per table")
    common.add_results_dir_arg(parser, default=default(common.RESULTS_DIR))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _add_shared_args(parser)
    # The same options after the command too (`train --top 20`), without defaults there:
    # argparse would let a sub-command's default overwrite a value given before it.
    shared = argparse.ArgumentParser(add_help=False)
    _add_shared_args(shared, with_defaults=False)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", parents=[shared], help="one configuration of train_throughput.py")
    train.add_argument("--preset", default="small")
    train.add_argument("--precision", default="float32", choices=["float32", "mixed_bfloat16", "mixed_float16"])
    train.add_argument("--jit", default="off", choices=["off", "on"])
    train.add_argument("--impl", default="ours", choices=["ours", "peer", "peer_noattndrop"])
    train.add_argument("--batch", type=int, default=None)
    train.add_argument("--src-len", type=int, default=24)
    train.add_argument("--tgt-len", type=int, default=24)
    train.add_argument("--vocab-size", type=int, default=8000)
    train.add_argument("--steps", type=int, default=3, help="profiled steps (after 3 warm-up steps)")
    serving = commands.add_parser(
        "serving", parents=[shared], help="requests to an exported SavedModel"
    )
    serving.add_argument("--saved-model", type=Path, required=True)
    serving.add_argument("--data-dir", default=None, help="Multi30k directory (default: MULTI30K_DIR / shared)")
    serving.add_argument("--warmup", type=int, default=40)
    serving.add_argument("--requests", type=int, default=20)
    serving.add_argument("--batch", type=int, default=1, help="sentences per request")
    return parser.parse_args()


def _print_table(title, rows, limit):
    print(f"[profile] {title}")
    for row in rows[:limit]:
        print(f"[profile]   {row['ms']:9.2f} ms  {row['share']:6.1%}  {row['name'][:100]}")


def main():
    args = parse_args()
    # XLA:CPU emits per-operation trace events only with this flag, read at start-up.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
    if args.command == "serving":
        name, summary = profile_serving(args)
        print(f"[profile] {summary['request_ms']:.1f} ms per request under the profiler")
        _print_table("per request, by XLA operation kind:", summary["by_op_kind"], args.top)
        _print_table("per request, single operations:", summary["by_op"], args.top)
    else:
        name, summary = profile_training(args)
        print(f"[profile] step {summary['step_s_under_profiler'] * 1e3:.0f} ms under the profiler; "
              f"op time {summary['op_time_per_step_ms']:.0f} ms per step (summed over threads)")
        if args.jit == "on":
            _print_table("per step, by XLA operation kind:", summary["by_op_kind"], args.top)
            _print_table("per step, single operations:", summary["by_op"], args.top)
        else:
            _print_table("per step, by op type:", summary["by_op_type"], args.top)
            _print_table("per step, by model part:", summary["by_model_part"], args.top)
    payload = common.header(f"profile-{name}", args)
    payload.update(summary)
    common.write_json(f"profile-{name}", payload, args.results_dir)


if __name__ == "__main__":
    main()
