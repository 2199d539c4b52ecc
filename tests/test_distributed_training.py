"""Distributed training: replicas, workers, and float16 overflows across them.

Runs that need logical CPU devices or `MultiWorkerMirroredStrategy` (set up before
TensorFlow initializes its devices) happen in subprocesses: `training_worker.py` for the
`Trainer` alone, `train.py` for multi-worker runs of the command (stopped, killed, or
waiting for its peers). The rest runs in this process.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import training_worker  # tests/ is on sys.path: pytest puts it there for this file

from fake_runs import (
    ROOT, SUBPROCESS_TIMEOUT, local_tf_configs, multi30k_files, run_command, synthetic_pairs_dataset, tiny_trainer
)
from keras_transformer import distribution, run_dir

WORKER = ROOT / "tests" / "training_worker.py"

# Key biases get no gradient in exact arithmetic (softmax ignores a constant added to
# all of a query's logits), so their computed gradients are rounding noise, which Adam
# (epsilon 1e-9) turns into updates of the size of the learning rate. They are left out
# of the comparisons of weights trained in different ways.
ZERO_GRADIENT_WEIGHTS = "key_bias"
# Float rounding of batches split differently (an AVX2 CPU's kernels drifted 3.3e-5 on one weight).
WEIGHT_TOLERANCE = 1e-4


def _weights(npz, run):
    return {name.split("/", 1)[1]: npz[name] for name in npz.files if name.startswith(f"{run}/")}


def _assert_same_weights(actual, expected, initial):
    compared = [name for name in expected if ZERO_GRADIENT_WEIGHTS not in name]
    assert len(compared) > 50
    for name in compared:
        np.testing.assert_allclose(actual[name], expected[name], atol=WEIGHT_TOLERANCE, rtol=0, err_msg=name)
    # Training moved the weights far more than the tolerance.
    moved = max(np.abs(expected[name] - initial[name]).max() for name in compared)
    assert moved > 100 * WEIGHT_TOLERANCE


@pytest.mark.slow
def test_two_replicas_reach_the_weights_of_one(tmp_path):
    """Each global batch is split over 2 logical CPUs, or fed whole to one: same weights."""
    output = tmp_path / "weights.npz"
    result = run_command([sys.executable, str(WORKER), "replicas", str(output), str(tmp_path / "runs")])
    assert result.returncode == 0, result.stderr[-3000:]
    weights = np.load(output)
    _assert_same_weights(_weights(weights, "two"), _weights(weights, "one"), _weights(weights, "initial"))


@pytest.mark.slow
def test_each_replica_draws_its_own_dropout_mask(tmp_path):
    """Replicas share the seed generator's state: without the replica id in the seed, all draw one mask."""
    output = tmp_path / "masks.npz"
    result = run_command([sys.executable, str(WORKER), "dropout", str(output), "-"])
    assert result.returncode == 0, result.stderr[-3000:]
    masks = np.load(output)

    for step in ("step0", "step1"):
        first, second = masks[f"{step}/replica0"], masks[f"{step}/replica1"]
        assert 0.45 < first.mean() < 0.55 and 0.45 < second.mean() < 0.55  # rate 0.5 on 1,024 elements
        assert 0.4 < (first == second).mean() < 0.6  # independent masks agree on half the elements
    assert 0.4 < (masks["step0/replica0"] == masks["step1/replica0"]).mean() < 0.6


def _start(mode, output, run, tf_config=None):
    """A `training_worker.py` process in `mode` (a worker of `tf_config`, JSON, if given), stdout and stderr piped."""
    env = {**os.environ, **({"TF_CONFIG": tf_config} if tf_config else {})}
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(output), str(run)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _start_two_worker_processes(mode, directory, run):
    """Two `training_worker.py` processes in `mode` under MultiWorkerMirroredStrategy on 127.0.0.1.

    Worker i writes `directory/worker{i}.npz`.
    """
    return [
        _start(mode, directory / f"worker{index}.npz", run, tf_config)
        for index, tf_config in enumerate(local_tf_configs(2))
    ]


def _wait_for(processes, timeout=SUBPROCESS_TIMEOUT):
    """Waits for all `processes` (killing them all if one hangs) and asserts that each succeeded."""
    try:
        outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]


@pytest.mark.slow
def test_two_workers_train_in_lockstep(tmp_path):
    """Two processes under MultiWorkerMirroredStrategy on 127.0.0.1 end with the same weights, and with
    those of one process trained on the whole global batches (beyond float rounding)."""
    runs = tmp_path / "run"
    # The one-process reference trains meanwhile: this is mostly start-up and tracing time.
    reference = _start("one", tmp_path / "one.npz", tmp_path / "one")
    processes = [reference, *_start_two_worker_processes("worker", tmp_path, runs)]
    _wait_for(processes)
    one, chief, other = (np.load(tmp_path / name) for name in ("one.npz", "worker0.npz", "worker1.npz"))
    final, initial = _weights(chief, "final"), _weights(chief, "initial")
    for name, value in _weights(other, "final").items():
        np.testing.assert_array_equal(value, final[name], err_msg=name)
    for name, value in _weights(one, "initial").items():
        np.testing.assert_array_equal(value, initial[name], err_msg=name)
    _assert_same_weights(final, _weights(one, "final"), initial)
    # Only the chief writes into the run directory.
    assert [path.name for path in (runs / run_dir.CHECKPOINT_DIR).glob("*.index")] == ["ckpt-3.index"]


def _overflow_states(*npz_files):
    """`training_worker.py overflow` outputs as one `{step: {name: value}}` per replica (all workers')."""
    replicas = {}
    for index, npz in enumerate(npz_files):
        for key in npz.files:
            step, local, name = key.split("/")
            replicas.setdefault((index, local), {}).setdefault(int(step.removeprefix("step")), {})[name] = npz[key]
    return list(replicas.values())


def _step_weights(states, step):
    return [value for name, value in sorted(states[step].items()) if name.startswith("weight")]


def _assert_every_replica_skipped_the_overflow(replicas):
    """Replica 1 alone overflowed in step `OVERFLOW_STEP`: every replica skipped that step, and only it.

    Skipped: no weight changed (no NaN reached them through the gradient sum), the loss scale
    halved, the count of finite steps towards doubling it restarted, no update was counted.
    """
    assert len(replicas) == 2
    first = replicas[0]
    assert sorted(first) == list(range(training_worker.STEPS + 1))
    for states in replicas:
        for step in states:
            assert all(np.isfinite(weight).all() for weight in _step_weights(states, step)), step
            for name, value in states[step].items():
                np.testing.assert_array_equal(value, first[step][name], err_msg=f"step {step}: {name}")
    overflow = training_worker.OVERFLOW_STEP
    steps = range(1, training_worker.STEPS + 1)
    unchanged = [
        all(map(np.array_equal, _step_weights(first, step - 1), _step_weights(first, step))) for step in steps
    ]
    assert unchanged == [step == overflow for step in steps]
    initial_scale = float(first[0]["loss_scale"])
    for step, states in first.items():
        skipped = step >= overflow
        assert float(states["loss_scale"]) == initial_scale / (2 if skipped else 1), step
        assert int(states["growth_counter"]) == (step - overflow if skipped else step), step
        assert int(states["updates"]) == step - skipped, step


@pytest.mark.slow
def test_float16_overflow_on_one_replica_skips_the_step_on_every_replica(tmp_path):
    """Two replicas (logical CPUs), replica 1 overflows: Keras's LossScaleOptimizer took replica 0's
    verdict and applied the summed gradient, turning every weight into NaN."""
    _wait_for([_start("overflow", tmp_path / "states.npz", tmp_path / "run")])
    _assert_every_replica_skipped_the_overflow(_overflow_states(np.load(tmp_path / "states.npz")))


@pytest.mark.slow
def test_float16_overflow_on_one_worker_skips_the_step_on_every_worker(tmp_path):
    """Worker 1's replica overflows: each worker read its own first replica's verdict, and the one
    that applied the step waited in a gradient all-reduce the other never joined."""
    _wait_for(_start_two_worker_processes("overflow", tmp_path, tmp_path / "run"), timeout=120)
    npz_files = [np.load(tmp_path / f"worker{index}.npz") for index in range(2)]
    _assert_every_replica_skipped_the_overflow(_overflow_states(*npz_files))


def test_only_cpu_strategies_count_as_cpu_only():
    assert distribution.runs_on_cpus_only(distribution.make_strategy(["CPU:0"]))
    assert not distribution.runs_on_cpus_only(tf.distribute.OneDeviceStrategy("/gpu:0"))
    assert not distribution.runs_on_cpus_only(tf.distribute.MirroredStrategy(["/gpu:0", "/cpu:0"]))


_CPU_REPLICAS_SCRIPT = """
import os, sys
import tensorflow as tf
from keras_transformer import distribution
strategy = distribution.make_strategy(cpu_replicas=int(sys.argv[1]))
print(strategy.num_replicas_in_sync, tf.config.threading.get_intra_op_parallelism_threads(),
      tf.config.threading.get_inter_op_parallelism_threads(), len(os.sched_getaffinity(0)))
print(*sorted(tf.DeviceSpec.from_string(d).to_string() for d in strategy.extended.worker_devices))
"""


@pytest.mark.parametrize("replicas", [2, 3])
def test_cpu_replicas_split_the_cpu_and_share_out_its_cores(replicas):
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("--cpu-replicas applies only where there is no GPU")
    result = run_command([sys.executable, "-c", _CPU_REPLICAS_SCRIPT, str(replicas)])
    assert result.returncode == 0, result.stderr[-3000:]
    counts, devices = result.stdout.strip().splitlines()[-2:]
    got_replicas, intra, inter, cores = map(int, counts.split())
    assert (got_replicas, intra, inter) == (replicas, max(1, cores // replicas), max(cores, replicas))
    assert devices.split() == [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(replicas)]


def test_thread_pools_sized_by_the_environment_stay_as_they_are():
    result = run_command([sys.executable, "-c", _CPU_REPLICAS_SCRIPT, "2"],
                         env={"TF_NUM_INTRAOP_THREADS": "3", "TF_NUM_INTEROP_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    got_replicas, intra, inter, _ = map(int, result.stdout.strip().splitlines()[-2].split())
    assert (got_replicas, intra, inter) == (2, 0, 0)  # 0: not set through tf.config; TensorFlow reads the variables


def test_thread_pools_the_environment_leaves_to_tensorflow_are_shared_out():
    """TensorFlow takes a variable of 0 for its default size: the replicas' share applies as when it is unset."""
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("--cpu-replicas applies only where there is no GPU")
    result = run_command([sys.executable, "-c", _CPU_REPLICAS_SCRIPT, "2"],
                         env={"TF_NUM_INTRAOP_THREADS": "0", "TF_NUM_INTEROP_THREADS": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    got_replicas, intra, inter, cores = map(int, result.stdout.strip().splitlines()[-2].split())
    assert (got_replicas, intra, inter) == (2, max(1, cores // 2), max(cores, 2))


def test_devices_that_do_not_exist_are_refused():
    """This process never split its CPU: CPU:1 does not exist; nor does a GPU on a machine without one."""
    with pytest.raises(ValueError, match="Device CPU:1 does not exist: this process has 1 CPU device"):
        distribution.make_strategy(["CPU:1"])
    with pytest.raises(ValueError, match="Device CPU:0 is listed twice"):
        distribution.make_strategy(["CPU:0", "cpu:0"])
    if not tf.config.list_physical_devices("GPU"):
        with pytest.raises(ValueError, match="Device GPU:0 does not exist: TensorFlow sees no GPU"):
            distribution.make_strategy(["GPU:0"])


def test_a_worker_lost_in_a_step_names_the_steps_finished_before_it(tmp_path, monkeypatch):
    """A collective failing late in step 3 (its `assign_add` already run) is "after step 2", not after step 3."""
    trainer = tiny_trainer(tmp_path / "run", train_steps=6)
    real_train_step = trainer._train_step

    def failing_in_step_3(with_grad_norm):
        def step(iterator):
            metrics = real_train_step(with_grad_norm)(iterator)
            if int(trainer.step.numpy()) == 3:
                raise tf.errors.UnavailableError(None, None, "Collective ops is aborted by: task 1 is unhealthy")
            return metrics

        return step

    monkeypatch.setattr(trainer, "_train_step", failing_in_step_3)
    monkeypatch.setattr(distribution, "num_workers", lambda strategy: 2)
    with pytest.raises(distribution.WorkerLostError) as raised:
        trainer.fit(synthetic_pairs_dataset)
    assert int(trainer.step.numpy()) == 3
    message = str(raised.value)
    assert message.startswith("Another worker stopped without warning, after step 2 (TensorFlow: task 1 is unhealthy)")
    assert f"The latest checkpoint holds step 2 ({tmp_path / 'run' / 'checkpoints' / 'ckpt-2'})" in message


# --- Multi-worker runs of train.py ---------------------------------------------------


@pytest.fixture(scope="module")
def training_corpus(tmp_path_factory, multi30k_dir):
    """`--dataset files` flags of 2000 Multi30k training pairs: a start that tokenizes a corpus in a second."""
    return multi30k_files(tmp_path_factory.mktemp("corpus") / "data", multi30k_dir, {"train": 2000})


def _start_two_workers(run, *flags, env=None):
    """Two `train.py` workers of a `tiny` Multi30k run on 127.0.0.1 that train until stopped; stderr piped."""
    flags = ["--run-dir", str(run), "--preset", "tiny", "--vocab-size", "1000", "--train-steps", "100000",
             "--max-minutes", "0", "--log-every", "1", "--eval-every", "0", "--bleu-sentences", "0", *flags]
    processes = []
    for tf_config in local_tf_configs(2):
        processes.append(subprocess.Popen(
            [sys.executable, "train.py", *flags], cwd=ROOT,
            env={**os.environ, **(env or {}), "TF_CONFIG": tf_config},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        ))
    return processes


def _read_until(process, start):
    """The stderr lines of a training `process` up to the first one that starts with `start`."""
    import selectors

    lines = []
    selector = selectors.DefaultSelector()
    selector.register(process.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT
    while not any(line.startswith(start) for line in lines) and time.monotonic() < deadline:
        if selector.select(timeout=5) and (line := process.stderr.readline()):
            lines.append(line)
        assert process.poll() is None, "".join(lines)[-3000:]
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("killed", [0, 1], ids=["chief", "other"])
def test_killing_one_worker_checkpoints_and_stops_all_of_them_at_one_step(tmp_path, training_corpus, killed):
    """A worker stopping alone leaves the others failing in the next all-reduce: they must agree on the step.

    Also: the coordination service of MultiWorkerMirroredStrategy installs its own SIGTERM handler.
    """
    import signal

    run = tmp_path / "run"
    processes = _start_two_workers(run, *training_corpus, "--checkpoint-every", "100000")
    try:
        chief_lines = _read_until(processes[0], "step 3/")
        processes[killed].send_signal(signal.SIGTERM)
        codes = [process.wait(timeout=120) for process in processes]
    finally:
        for process in processes:
            process.kill()
    outputs = ["".join(chief_lines) + processes[0].stderr.read(), processes[1].stderr.read()]

    assert codes == [130, 130], (codes, *(output[-3000:] for output in outputs))
    stops = [re.search(r"Interrupted at step (\d+); saved (\S+)\.", output) for output in outputs]
    assert all(stops), outputs[killed][-3000:]
    step = stops[0].group(1)
    assert int(step) >= 3 and stops[1].group(1) == step  # the same step on both
    assert stops[0].group(2).endswith(f"ckpt-{step}")
    assert run_dir.checkpoint_step(tf.train.latest_checkpoint(str(run / "checkpoints"))) == int(step)
    assert not Path(stops[1].group(2)).parent.exists()  # the other worker's temporary checkpoints are gone


@pytest.mark.slow
@pytest.mark.parametrize("killed", [0, 1], ids=["chief", "other"])
def test_a_worker_killed_outright_stops_the_other_with_an_error_naming_the_checkpoint(
    tmp_path, training_corpus, killed
):
    """SIGKILL (or a crash) leaves no time to agree: the survivor must say so and exit, not hang or dump a traceback."""
    import signal

    run = tmp_path / "run"
    temporary = tmp_path / "tmp"  # where the non-chief worker keeps its checkpoints
    temporary.mkdir()
    processes = _start_two_workers(run, *training_corpus, "--checkpoint-every", "2",
                                   env={"TMPDIR": str(temporary)})
    survivor = processes[1 - killed]
    try:
        lines = _read_until(processes[0], "step 5/")
        processes[killed].send_signal(signal.SIGKILL)
        code = survivor.wait(timeout=120)
    finally:
        for process in processes:
            process.kill()
    output = ("".join(lines) if survivor is processes[0] else "") + survivor.stderr.read()

    assert code == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    error = re.search(r"train\.py: error: Another worker stopped without warning, after step (\d+) \(TensorFlow: "
                      r"(.+)\)\. Synchronous training cannot go on without it, so this worker stops too\. The latest "
                      r"checkpoint holds step (\d+) \((\S+)\): start every worker again with the same command", output)
    assert error, output[-3000:]
    last_step, cause, saved_step, saved_path = int(error.group(1)), error.group(2), int(error.group(3)), error.group(4)
    assert last_step >= 5 and 2 <= saved_step <= last_step and saved_step % 2 == 0
    if killed == 1:  # the chief survived and logged every step it finished: the error names the last of them
        assert last_step == int(re.findall(r"^step (\d+)/", output, re.MULTILINE)[-1]), output[-3000:]
    assert "Detected at node" not in cause and len(cause) <= 300
    assert run_dir.checkpoints(run / "checkpoints")[-1] == saved_path == str(run / "checkpoints" / f"ckpt-{saved_step}")
    if killed == 0:  # the survivor is the other worker: its temporary checkpoints are gone
        assert not list(temporary.glob("worker1-checkpoints-*"))


@pytest.mark.slow
def test_a_worker_killed_outright_during_set_up_stops_the_other_with_an_error(tmp_path, multi30k_dir):
    """Killed before the chief learned the vocabulary: the chief fails in a collective of the set-up, not of a step.

    The other worker waits for the chief's vocabulary in a barrier. Killed once the chief logged
    it, it may already have passed the barrier with the chief, which then fails in a step. So the
    chief is frozen (SIGSTOP) as soon as both are connected, seconds before it has learned the
    vocabulary; the other worker is killed; and the chief, let go, meets the barrier alone.
    """
    import signal

    processes = _start_two_workers(tmp_path / "run", "--data-dir", str(multi30k_dir))
    chief, other = processes
    try:
        lines = _read_until(chief, "All 2 workers of TF_CONFIG connected")
        chief.send_signal(signal.SIGSTOP)
        other.send_signal(signal.SIGKILL)
        other.wait(timeout=30)
        chief.send_signal(signal.SIGCONT)
        code = chief.wait(timeout=120)
    finally:
        for process in processes:
            process.kill()
    output = "".join(lines) + chief.stderr.read()

    assert code == 1, output[-3000:]
    assert "Traceback" not in output and "\nstep 1/" not in output, output[-3000:]
    assert re.search(r"^Learned a BPE vocabulary of 1000 tokens", output, re.MULTILINE), output[-3000:]
    assert re.search(r"train\.py: error: Another worker stopped without warning, while the workers were setting up "
                     r"\(TensorFlow: .+\)\. Synchronous training cannot go on without it, so this worker stops too\. "
                     r"Start every worker again with the same command\.", output), output[-3000:]


@pytest.mark.slow
def test_a_worker_whose_peers_never_start_gives_up_after_the_connect_timeout(tmp_path, multi30k_dir):
    """MultiWorkerMirroredStrategy() waits for every task in C++, holding the GIL: only faulthandler's timer ends it."""
    chief_config, _ = local_tf_configs(2)  # The other worker never starts.
    run = tmp_path / "run"
    result = run_command(
        [sys.executable, "train.py", "--run-dir", str(run), "--preset", "tiny", "--data-dir", str(multi30k_dir),
         "--connect-timeout-minutes", "0.1"],
        env={"TF_CONFIG": chief_config}, timeout=120,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert ("Waiting for all 2 workers of TF_CONFIG to start; after 0.1 minutes (--connect-timeout-minutes) "
            "this worker gives up with exit status 1") in result.stderr
    # faulthandler says where the worker waited.
    assert re.search(r"Timeout \(0:00:06\)!\n.*in make_strategy", result.stderr, re.DOTALL), result.stderr[-3000:]
    assert not (run / run_dir.CHECKPOINT_DIR).exists()


@pytest.mark.slow
def test_workers_that_connect_in_time_train_past_the_connect_timeout(tmp_path, multi30k_dir):
    """The timer that ends a worker whose peers never start is cancelled once they have all connected."""
    timeout_s = 15  # long enough for the second worker to start on a busy machine
    processes = _start_two_workers(
        tmp_path / "run", "--data-dir", str(multi30k_dir), "--connect-timeout-minutes", str(timeout_s / 60)
    )
    try:
        lines = _read_until(processes[0], "Waiting for all 2 workers")
        waiting_since = time.monotonic()
        lines += _read_until(processes[0], "All 2 workers of TF_CONFIG connected.")
        lines += _read_until(processes[0], "step 1/")
        # Past the timeout, a timer left running would have ended the worker.
        time.sleep(max(0.0, waiting_since + timeout_s + 5 - time.monotonic()))
        lines += _read_until(processes[0], "step ")
        assert all(process.poll() is None for process in processes), "".join(lines)[-3000:]
    finally:
        for process in processes:
            process.kill()
