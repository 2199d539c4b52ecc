"""bench/profile_trace.py's summaries: on a GPU, the device's time, not the host's launches too.

No machine of ours has a GPU, so the traces here are made by hand in the layout xprof
gives them: framework op rows marked Host or Device, and trace events on processes and
threads named by metadata events (a GPU's process "/device:GPU:0" with its stream lines
and the "XLA Ops" line derived from them).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import profile_trace  # noqa: E402


def _framework_op_table(rows):
    columns = ["host_or_device", "type", "operation", "total_self_time"]
    return [{"cols": [{"id": c} for c in columns], "rows": [{"c": [{"v": v} for v in row]} for row in rows]}]


def _summarize_training(monkeypatch, rows, steps=2):
    monkeypatch.setattr(profile_trace, "_tool_data", lambda logdir, tool: _framework_op_table(rows))
    return profile_trace.summarize_training(Path("unused"), steps)


HOST_ROWS = [
    ("Host", "IDLE", "IDLE", 9000.0),
    ("Host", "MatMul", "model/feed_forward/MatMul", 400.0),
    ("Host", "Sum", "gradient_tape/model/norm/Sum", 200.0),
]


def test_a_cpu_profile_counts_the_host_rows(monkeypatch):
    summary = _summarize_training(monkeypatch, HOST_ROWS)
    assert summary["timeline"] == "host"
    assert summary["op_time_per_step_ms"] == pytest.approx((400 + 200) / 2 / 1e3, abs=0.05)
    assert {row["name"]: row["ms"] for row in summary["by_op_type"]} == {"MatMul": 0.2, "Sum": 0.1}
    assert {row["name"]: row["ms"] for row in summary["by_model_part"]} == {"feed_forward": 0.2, "grad:norm": 0.1}


def test_a_gpu_profile_counts_the_device_rows_only(monkeypatch):
    device_rows = [
        ("Device", "MatMul", "model/feed_forward/MatMul", 3000.0),
        ("Device", "Sum", "gradient_tape/model/norm/Sum", 1000.0),
    ]
    summary = _summarize_training(monkeypatch, HOST_ROWS + device_rows)
    assert summary["timeline"] == "device"
    assert {row["name"]: row["ms"] for row in summary["by_op_type"]} == {"MatMul": 1.5, "Sum": 0.5}
    assert summary["op_time_per_step_ms"] == 2.0


def _process(pid, name):
    return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}


def _thread(pid, tid, name):
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def _op(pid, tid, name, duration):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": duration, "ts": 0}


def _host_events():
    """Two steps on the host: the step spans, a wrapper, and the ops (on a CPU) or their launches (on a GPU)."""
    return [
        _process(1, "/host:CPU"),
        _thread(1, 11, "tf_Compute"),
        _op(1, 11, "train_step", 5000.0),
        _op(1, 11, "train_step", 7000.0),
        _op(1, 11, "ThunkExecutor::Execute", 4000.0),
        _op(1, 11, "dot.1", 100.0),
        _op(1, 11, "fusion.2", 60.0),
    ]


def _summarize_xla(monkeypatch, events):
    monkeypatch.setattr(profile_trace, "_tool_data", lambda logdir, tool: {"traceEvents": events})
    return profile_trace.summarize_xla_ops(Path("unused"), 2, outer="train_step")


def test_an_xla_cpu_trace_counts_every_operation_but_the_wrappers(monkeypatch):
    summary = _summarize_xla(monkeypatch, _host_events())
    assert summary["timeline"] == "host"
    assert summary["outer_ms"] == 6.0
    assert {row["name"]: row["ms"] for row in summary["by_op"]} == {"dot.1": 0.05, "fusion.2": 0.03}
    assert {row["name"]: row["ms"] for row in summary["by_op_kind"]} == {"dot": 0.05, "fusion": 0.03}


def test_a_serving_trace_spans_requests_with_the_signatures_event(monkeypatch):
    # TensorFlow names that event after the signature's function: it is the request, not an op.
    events = [
        _process(1, "/host:CPU"),
        _thread(1, 11, "tf_Compute"),
        _op(1, 11, "signature_wrapper_translate", 5000.0),
        _op(1, 11, "signature_wrapper_translate", 3000.0),
        _op(1, 11, "dot.1", 100.0),
    ]
    monkeypatch.setattr(profile_trace, "_tool_data", lambda logdir, tool: {"traceEvents": events})
    summary = profile_trace.summarize_xla_ops(Path("unused"), 2)
    assert summary["outer_ms"] == 4.0
    assert {row["name"]: row["ms"] for row in summary["by_op"]} == {"dot.1": 0.05}


def test_an_xla_gpu_trace_counts_the_gpus_xla_ops_line_once(monkeypatch):
    gpu = [
        _process(2, "/device:GPU:0"),
        _thread(2, 21, "Stream #7(Compute)"),
        _thread(2, 22, "XLA Ops"),
        _thread(2, 23, "XLA Modules"),
        _op(2, 21, "loop_fusion_kernel", 300.0),  # The kernels, on the stream...
        _op(2, 21, "gemm_kernel", 900.0),
        _op(2, 22, "fusion.2", 300.0),  # ...and the XLA operations they ran, on the derived line.
        _op(2, 22, "dot.1", 900.0),
        _op(2, 23, "cluster_0", 1200.0),
    ]
    summary = _summarize_xla(monkeypatch, _host_events() + gpu)
    assert summary["timeline"] == "device"
    assert summary["outer_ms"] == 6.0
    assert {row["name"]: row["ms"] for row in summary["by_op"]} == {"dot.1": 0.45, "fusion.2": 0.15}
    assert summary["op_time_ms"] == 0.6


@pytest.mark.parametrize(
    "argv",
    [
        ["--top", "20", "--results-dir", "elsewhere", "train", "--jit", "on"],
        ["train", "--top", "20", "--results-dir", "elsewhere", "--jit", "on"],
        ["--top", "5", "train", "--top", "20", "--results-dir", "elsewhere", "--jit", "on"],
    ],
)
def test_shared_options_work_before_and_after_the_command(monkeypatch, argv):
    """The commands recorded in results put `--top` first; `--results-dir` is usually given last."""
    monkeypatch.setattr(sys, "argv", ["profile_trace.py", *argv])
    args = profile_trace.parse_args()
    got = (args.command, args.top, args.results_dir, args.jit, args.logdir)
    assert got == ("train", 20, Path("elsewhere"), "on", None)


def test_shared_options_keep_their_defaults_when_not_given(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["profile_trace.py", "serving", "--saved-model", "m"])
    args = profile_trace.parse_args()
    assert (args.top, args.logdir, args.results_dir, args.batch) == (12, None, profile_trace.common.RESULTS_DIR, 1)
