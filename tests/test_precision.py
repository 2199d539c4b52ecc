"""`--mixed-precision auto`: the choice for each kind of device (faked), and how a run records and keeps it."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from keras_transformer import distribution, precision, run_dir
from keras_transformer.cli import train as train_cli
from keras_transformer.precision import Devices
from fake_runs import ROOT, SUBPROCESS_TIMEOUT, local_tf_configs, multi30k_files  # noqa: E402

AMX_XEON = frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16", "avx512_bf16"})
AVX512_BF16_EPYC = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2_ONLY = frozenset({"avx2", "fma"})


@pytest.mark.parametrize(
    "devices, jit_compile, expected",
    [
        (Devices(True, ((8, 0),), AVX2_ONLY), False, "bf16"),  # A100
        (Devices(True, ((9, 0), (8, 6)), AVX2_ONLY), False, "bf16"),  # H100 + RTX 3090
        (Devices(True, ((7, 5),), AMX_XEON), False, "fp16"),  # T4: its tensor cores are float16's
        (Devices(True, ((8, 0), (7, 0)), AVX2_ONLY), False, "fp16"),  # the oldest GPU decides
        (Devices(False, (), AMX_XEON, 6.0), False, "bf16"),
        (Devices(False, (), AVX512_BF16_EPYC, 1.8), False, "bf16"),  # as on an AMD EPYC
        (Devices(False, (), AVX512_BF16_EPYC, 0.54), False, "none"),  # as on an Intel Xeon without AMX
        (Devices(False, (), AVX512_BF16_EPYC, 1.19), False, "none"),  # not enough to pay for the rest of a step
        (Devices(False, (), AVX512_BF16_EPYC, precision.MIN_BF16_SPEEDUP), False, "bf16"),  # "at least" the margin
        (Devices(False, (), AVX512_BF16_EPYC, None), False, "none"),  # not measured
        (Devices(False, (), AVX512_BF16_EPYC, 1.8), True, "none"),  # XLA's CPU backend: no bfloat16 kernels
        (Devices(True, ((8, 0),), AVX2_ONLY), True, "bf16"),  # XLA on GPUs has them
        (Devices(False, (), AVX2_ONLY, 3.0), False, "none"),  # no native bf16, whatever a measurement said
        (Devices(), False, "none"),  # no flags known (not Linux)
        (Devices(True, (), AVX2_ONLY), False, "none"),  # GPUs that report no compute capability
    ],
)
def test_auto_picks_bf16_where_the_device_computes_it_natively_and_faster(devices, jit_compile, expected):
    chosen = precision.resolve("auto", devices, jit_compile=jit_compile)
    assert chosen.name == expected and chosen.reason.startswith("auto: ")
    if devices.cpu_bf16_speedup is not None and not jit_compile and expected == "bf16":
        assert f"{devices.cpu_bf16_speedup:.2f}x as fast as float32" in chosen.reason
    assert chosen.dtype_policy == {"none": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}[expected]


@pytest.mark.parametrize("asked", ["none", "bf16", "fp16"])
def test_a_precision_asked_for_is_taken_on_any_device(asked):
    assert precision.resolve(asked, Devices(False, (), AVX2_ONLY)).name == asked
    assert precision.resolve(asked, Devices(True, ((8, 0),), AMX_XEON), jit_compile=True).name == asked
    with pytest.raises(ValueError, match="mixed_precision must be one of auto, none, bf16, fp16, got 'fp8'"):
        precision.resolve("fp8", Devices())


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    x86, arm = tmp_path / "x86", tmp_path / "arm"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\nbugs\t\t: spectre\n")
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert precision.cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert precision.cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert precision.cpu_flags(tmp_path / "missing") == frozenset()


def test_a_cpu_strategy_has_no_gpus_and_this_machines_flags(monkeypatch):
    assert tf.config.list_physical_devices("GPU") == []  # What this test assumes: the CI has no GPU.
    strategy = distribution.make_strategy()
    for flags, measured in ((AVX2_ONLY, False), (AVX512_BF16_EPYC, True)):
        monkeypatch.setattr(precision, "cpu_flags", lambda flags=flags: flags)
        devices = precision.local_devices(strategy)
        assert devices.gpu_capabilities == () and devices.cpu_flags == flags
        assert (devices.cpu_bf16_speedup is not None) == measured  # Measured only where bf16 is native.
    assert devices.cpu_bf16_speedup > 0


def test_the_bf16_speedup_is_the_ratio_of_the_two_matmul_times(monkeypatch):
    """Timed with a fake clock: float32 matmuls take 3 ticks, bfloat16 ones 2 (the fastest of the repeats)."""
    ticks = iter([0, 3, 10, 14, 20, 23,  # float32: 3, 4, 3
                  30, 32, 40, 43, 50, 52])  # bfloat16: 2, 3, 2
    import time

    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    assert precision.measure_bf16_speedup(size=8, repeats=3) == 3 / 2


def test_auto_keeps_the_precision_a_run_chose(tmp_path):
    run = tmp_path / "run"
    run_dir.write_config(run, {"data": {"corpus": "multi30k"}, "train": {"preset": "tiny", "mixed_precision": "bf16"}})
    for flags in ([], ["--mixed-precision", "auto"]):
        args = train_cli.build_parser().parse_args(["--run-dir", str(run), *flags])
        assert train_cli.resolve_settings(args)[0].mixed_precision == "bf16"
    new = train_cli.resolve_settings(train_cli.build_parser().parse_args(["--run-dir", str(tmp_path / "new")]))[0]
    assert new.mixed_precision == "auto"  # resolved when the run starts, on its devices


def test_a_new_run_given_another_runs_precision_by_a_config_file_says_so(tmp_path):
    other_reason = "auto: this CPU computes bfloat16 natively (avx512_bf16): bf16 matmuls ran 1.94x as fast as float32"
    config = tmp_path / "config.json"
    train = {"preset": "tiny", "mixed_precision": "bf16", "precision_reason": other_reason}
    config.write_text(json.dumps({"train": train}))
    args = train_cli.build_parser().parse_args(["--config", str(config), "--run-dir", str(tmp_path / "new")])
    settings = train_cli.resolve_settings(args)[0]
    assert settings.mixed_precision == "bf16"
    assert settings.precision_reason == f"--config {config} (whose run chose it: {other_reason})"


_TRAIN_WITH_CPU_FLAGS = """
import sys
from keras_transformer import precision
precision.cpu_flags = lambda cpuinfo=None: frozenset(sys.argv[1].split(","))
precision.measure_bf16_speedup = lambda: 1.8  # What this CPU would measure does not matter here.
from keras_transformer.cli import train
sys.exit(train.main(sys.argv[2:]))
"""


def _train(cpu_flags, *flags):
    command = [sys.executable, "-c", _TRAIN_WITH_CPU_FLAGS, ",".join(sorted(cpu_flags)), *flags]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.mark.slow
def test_a_run_logs_and_saves_what_auto_chose_and_keeps_it_on_another_machine(tmp_path, multi30k_dir):
    corpus = multi30k_files(tmp_path / "data", multi30k_dir, {"train": 1000})
    run = tmp_path / "run"
    flags = ["--run-dir", str(run), "--preset", "tiny", *corpus, "--vocab-size", "500", "--max-length", "64",
             "--checkpoint-every", "2"]
    reason = "auto: this CPU computes bfloat16 natively (avx512_bf16): bf16 matmuls ran 1.80x as fast as float32"
    log = _train(AVX512_BF16_EPYC, *flags, "--train-steps", "2")
    assert f"Precision: bf16 (mixed_bfloat16): {reason}." in log
    train = json.loads((run / run_dir.CONFIG_FILE).read_text())["train"]
    assert (train["mixed_precision"], train["precision_reason"]) == ("bf16", reason)
    # Resumed where auto would pick float32: the run goes on in its own precision.
    log = _train(AVX2_ONLY, *flags, "--train-steps", "4")
    assert f"Precision: bf16 (mixed_bfloat16): {reason}." in log
    assert run_dir.checkpoint_step(run_dir.latest_checkpoint(run / run_dir.CHECKPOINT_DIR)) == 4
    assert json.loads((run / run_dir.CONFIG_FILE).read_text())["train"]["mixed_precision"] == "bf16"


_CHIEF_CHOICE = """
import sys
from keras_transformer import distribution
strategy = distribution.make_strategy()
index = distribution.worker_index(strategy) + 1  # Each worker would choose differently.
print("agreed", distribution.chief_choice(strategy, index, 4), flush=True)
"""


@pytest.mark.slow
def test_every_worker_takes_the_chiefs_choice():
    """Two local workers under MultiWorkerMirroredStrategy: worker 1 chose 2, the chief 1; both get 1."""
    processes = [
        subprocess.Popen([sys.executable, "-c", _CHIEF_CHOICE], cwd=ROOT, env={**os.environ, "TF_CONFIG": tf_config},
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for tf_config in local_tf_configs(2)
    ]
    try:
        outputs = [process.communicate(timeout=SUBPROCESS_TIMEOUT) for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, (stdout, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
        assert stdout.split() == ["agreed", "1"]
