"""The training loop: replica-count independence, multi-worker runs, resuming, bad flags.

Runs that need logical CPU devices or `MultiWorkerMirroredStrategy` (set up before
TensorFlow initializes its devices) and runs of `train.py` happen in subprocesses; the
rest runs in this process, without seeding TensorFlow globally (seeding drops its kernel
cache, and with it the SentencePiece resources of the session's tokenizer fixtures).
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import data, distribution, run_dir
from keras_transformer.model import Transformer
from keras_transformer.tokenizer import SubwordTokenizer
from keras_transformer.trainer import Trainer, TrainingConfig

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "training_worker.py"
SUBPROCESS_TIMEOUT = 240

# Key biases get no gradient in exact arithmetic (softmax ignores a constant added to
# all of a query's logits), so their computed gradients are rounding noise, which Adam
# (epsilon 1e-9) turns into updates of the size of the learning rate. They are left out
# of the comparisons of weights trained in different ways.
ZERO_GRADIENT_WEIGHTS = "key_bias"
WEIGHT_TOLERANCE = 2e-5


def _run(command, env=None, timeout=SUBPROCESS_TIMEOUT):
    return subprocess.run(
        command, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


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
    result = _run([sys.executable, str(WORKER), "replicas", str(output), str(tmp_path / "runs")])
    assert result.returncode == 0, result.stderr[-3000:]
    weights = np.load(output)
    _assert_same_weights(_weights(weights, "two"), _weights(weights, "one"), _weights(weights, "initial"))


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


@pytest.mark.slow
def test_two_workers_train_in_lockstep(tmp_path):
    """Two processes under MultiWorkerMirroredStrategy on 127.0.0.1 end with the same weights."""
    workers = [f"127.0.0.1:{port}" for port in _free_ports(2)]
    runs = tmp_path / "run"
    processes = []
    for index in range(2):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        processes.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), "worker", str(tmp_path / f"worker{index}.npz"), str(runs)],
                cwd=ROOT,
                env={**os.environ, "TF_CONFIG": json.dumps(tf_config)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [process.communicate(timeout=SUBPROCESS_TIMEOUT)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    chief, other = (np.load(tmp_path / f"worker{index}.npz") for index in range(2))
    final, initial = _weights(chief, "final"), _weights(chief, "initial")
    for name, value in _weights(other, "final").items():
        np.testing.assert_array_equal(value, final[name], err_msg=name)
    assert max(np.abs(final[name] - initial[name]).max() for name in final) > 100 * WEIGHT_TOLERANCE
    # Only the chief writes into the run directory.
    assert [path.name for path in (runs / run_dir.CHECKPOINT_DIR).glob("*.index")] == ["ckpt-3.index"]


# --- Resuming -------------------------------------------------------------------------

RESUME_STEPS = 6
STOP_STEP = 3


def _training_losses(run):
    """Per-step training loss from the TensorBoard event files of `run` (log_every=1)."""
    losses = {}
    for path in sorted((run / run_dir.LOG_DIR / "train").glob("events.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag == "loss":
                    losses[event.step] = float(tf.make_ndarray(value.tensor))
    return losses


def _fit(run, pairs, model_proto, initial_values, train_steps):
    def model_fn(dtype):
        model = Transformer.from_preset("tiny", vocab_size=4000, dtype=dtype)  # dropout 0.1
        model.build()
        for variable, value in zip(model.variables, initial_values):
            variable.assign(value)
        return model

    def dataset_fn(input_context):
        return data.make_training_dataset(
            pairs, SubwordTokenizer(model_proto), token_budget=512, max_length=32, seed=7,
            input_context=input_context,
        )

    config = TrainingConfig(train_steps=train_steps, warmup_steps=20, log_every=1, checkpoint_every=STOP_STEP)
    trainer = Trainer(distribution.make_strategy(["CPU:0"]), model_fn, run, config)
    return trainer, trainer.fit(dataset_fn)


def test_interrupted_run_resumes_where_it_stopped(tmp_path, multi30k_dir, multi30k_tokenizer):
    """Stopped after a checkpoint and restarted, a run continues with the losses of an uninterrupted one.

    Dropout is on: its seed states are in the checkpoint too. The data (shuffled, bucketed
    Multi30k) continues at the next unseen batch.
    """
    from keras_transformer.corpora import load_multi30k

    pairs = load_multi30k(multi30k_dir).train[:600]
    assert multi30k_tokenizer.vocab_size == 4000
    reference = Transformer.from_preset("tiny", vocab_size=4000)
    reference.build()
    initial_values = [variable.numpy() for variable in reference.variables]
    proto = multi30k_tokenizer.model_proto

    _, uninterrupted = _fit(tmp_path / "uninterrupted", pairs, proto, initial_values, RESUME_STEPS)
    _, first = _fit(tmp_path / "interrupted", pairs, proto, initial_values, STOP_STEP)
    resumed_trainer, resumed = _fit(tmp_path / "interrupted", pairs, proto, initial_values, RESUME_STEPS)

    assert (uninterrupted.start_step, first.step, resumed.start_step, resumed.step) == (0, 3, 3, 6)
    assert int(resumed_trainer.optimizer.iterations.numpy()) == RESUME_STEPS
    expected = _training_losses(tmp_path / "uninterrupted")
    actual = _training_losses(tmp_path / "interrupted")
    assert sorted(expected) == sorted(actual) == list(range(1, RESUME_STEPS + 1))
    for step in range(1, RESUME_STEPS + 1):
        assert actual[step] == pytest.approx(expected[step], rel=1e-5), step
    assert run_dir.checkpoint_step(tf.train.latest_checkpoint(str(tmp_path / "interrupted" / "checkpoints"))) == 6


@pytest.fixture
def grappler_remapping():
    """Restores Grappler's process-wide remapper setting after the test."""
    before = tf.config.optimizer.get_experimental_options().get("remapping", True)
    yield
    tf.config.optimizer.set_experimental_options({"remapping": before})


def _synthetic_pairs_dataset(input_context):
    """One epoch of four `((source, decoder_inputs), labels)` batches of a copy task on random ids."""
    ids = tf.random.stateless_uniform([4, 8, 10], seed=(1, 2), minval=4, maxval=50, dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices(((ids[:, :, :9], ids[:, :, :9]), ids[:, :, 1:]))


@pytest.mark.parametrize("mixed_precision, fused", [("fp16", False), ("bf16", True), ("none", True)])
def test_float16_on_a_cpu_trains_without_the_matmul_bias_fusion(
    tmp_path, grappler_remapping, caplog, mixed_precision, fused
):
    """fp16 on CPUs turns Grappler's remapper off (TF 2.21 fuses float16 MatMul+BiasAdd into a
    reference kernel, ~1000x slower), with a warning, and trains; other precisions keep it."""
    tf.config.optimizer.set_experimental_options({"remapping": True})
    config = TrainingConfig(train_steps=2, warmup_steps=20, log_every=1, mixed_precision=mixed_precision)
    with caplog.at_level("WARNING", logger="keras_transformer.distribution"):
        trainer = Trainer(
            distribution.make_strategy(["CPU:0"]),
            lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
            tmp_path / "run",
            config,
        )
    assert tf.config.optimizer.get_experimental_options()["remapping"] is fused
    assert ("MatMul+BiasAdd fusion is turned off" in caplog.text) is not fused
    assert trainer.fit(_synthetic_pairs_dataset).step == 2
    losses = _training_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2] and all(np.isfinite(list(losses.values())))


def test_only_cpu_strategies_count_as_cpu_only():
    assert distribution.runs_on_cpus_only(distribution.make_strategy(["CPU:0"]))
    assert not distribution.runs_on_cpus_only(tf.distribute.OneDeviceStrategy("/gpu:0"))
    assert not distribution.runs_on_cpus_only(tf.distribute.MirroredStrategy(["/gpu:0", "/cpu:0"]))


def test_averaging_the_last_checkpoints(tmp_path):
    """`average_checkpoints` writes the mean of the kept checkpoints' weights."""
    model = Transformer.from_preset("tiny", vocab_size=50)
    model.build()
    run_dir.write_config(tmp_path, {"model": run_dir.model_config(model)})
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(tmp_path / "checkpoints"), 3)
    for step in (10, 20, 30):
        for variable in model.trainable_variables:
            variable.assign(np.full(variable.shape, step, "float32"))
        manager.save(checkpoint_number=step)
    path, averaged = run_dir.average_checkpoints(tmp_path, 2)
    assert Path(path).name == "ckpt-30" and [Path(p).name for p in averaged] == ["ckpt-20", "ckpt-30"]
    loaded = run_dir.load_model(tmp_path, "best")
    for variable in loaded.trainable_variables:
        np.testing.assert_allclose(variable.numpy(), 25.0, err_msg=variable.path)
    assert run_dir.checkpoint_path(tmp_path, "best") == path
    manager.save(checkpoint_number=40)  # Training went on: the average is stale.
    assert Path(run_dir.checkpoint_path(tmp_path, "best")).name == "ckpt-40"


@pytest.mark.parametrize("better", ["averaged", "latest"])
def test_the_average_is_kept_only_if_it_translates_the_validation_set_better(tmp_path, monkeypatch, better):
    """train.py keeps RUN/averaged only when its validation BLEU is at least the latest's."""
    from keras_transformer import evaluation, tokenizer as tokenizer_lib

    model = Transformer.from_preset("tiny", vocab_size=50)
    model.build()
    run_dir.write_config(tmp_path, {"model": run_dir.model_config(model)})
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(tmp_path / "checkpoints"), 3)
    for step in (10, 20):
        manager.save(checkpoint_number=step)
    # Four words at least: BLEU is 0 for a corpus without 4-grams.
    pairs = [
        ("a man in a red house", "ein Mann in einem roten Haus"),
        ("a dog runs on the grass", "ein Hund rennt auf dem Gras"),
        ("two men play in the street", "zwei Männer spielen auf der Straße"),
    ]
    references = [target for _, target in pairs]
    # Translations stand in for the two checkpoints: the `better` one translates perfectly.
    monkeypatch.setattr(run_dir, "load_model", lambda run, which: which)
    monkeypatch.setattr(tokenizer_lib.SubwordTokenizer, "load", lambda path: None)
    monkeypatch.setattr(
        evaluation,
        "translate",
        lambda model, tokenizer, sources, **kwargs: references if model == better else ["nichts"] * len(sources),
    )
    corpus = type("Corpus", (), {"validation": pairs, "target_lang": "de"})()
    settings = {"average_last": 2, "bleu_sentences": 3, "beam_size": 1, "alpha": 0.6, "max_length": 16}
    _import_train_script().average_if_better(tmp_path, corpus, settings)
    assert (tmp_path / run_dir.AVERAGED_DIR).exists() == (better == "averaged")


# --- Bad flags ---------------------------------------------------------------------------


def _import_train_script():
    sys.path.insert(0, str(ROOT))
    try:
        import train
    finally:
        sys.path.remove(str(ROOT))
    return train


def _snapshot(directory):
    return {
        str(path.relative_to(directory)): (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.fixture
def existing_run(tmp_path, multi30k_tokenizer):
    """A run directory as `train.py --preset tiny` leaves it: config.json, tokenizer, a checkpoint."""
    train = _import_train_script()
    run = tmp_path / "run"
    model = Transformer.from_preset("tiny", vocab_size=multi30k_tokenizer.vocab_size)
    model.build()
    settings = {
        **{name: None for name in train.SAVED},
        **train.GENERAL_DEFAULTS,
        **train.DATASET_DEFAULTS["multi30k"],
        **train.RECIPES["tiny"],
        "preset": "tiny",
        "dataset": "multi30k",
        "source_lang": "en",
        "target_lang": "de",
        "vocab_size": multi30k_tokenizer.vocab_size,
        "dropout": model.dropout_rate,
    }
    run_dir.write_config(run, train.run_config(settings, run_dir.model_config(model)))
    multi30k_tokenizer.save(run_dir.tokenizer_path(run))
    tf.train.Checkpoint(model=model).write(str(run / run_dir.CHECKPOINT_DIR / "ckpt-100"))
    return run


def _assert_one_line_error(exit_code, stderr, *fragments):
    assert exit_code == 2
    assert "Traceback" not in stderr, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("train.py: error:"), stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[-1]


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--preset", "small"], ["trained with --preset tiny, not small"]),
        (["--vocab-size", "1000"], ["trained with --vocab-size 4000, not 1000"]),
        (["--token-budget", "2048"], ["trained with --token-budget 1024, not 2048"]),
        (["--dataset", "wmt14"], ["trained with --dataset multi30k, not wmt14"]),
    ],
    ids=["preset", "vocabulary", "token-budget", "dataset"],
)
def test_flags_conflicting_with_the_run_fail_before_anything_is_written(existing_run, capsys, flags, fragments):
    before = _snapshot(existing_run)
    exit_code = _import_train_script().main(["--run-dir", str(existing_run), *flags])
    _assert_one_line_error(exit_code, capsys.readouterr().err, *fragments)
    assert _snapshot(existing_run) == before


def test_a_vocabulary_that_does_not_match_the_config_is_refused(existing_run, capsys):
    config = run_dir.read_config(existing_run)
    config["data"]["vocab_size"] = 8000
    run_dir.write_config(existing_run, config)
    before = _snapshot(existing_run)
    exit_code = _import_train_script().main(["--run-dir", str(existing_run)])
    _assert_one_line_error(exit_code, capsys.readouterr().err, "has 4000 ids but --vocab-size is 8000")
    assert _snapshot(existing_run) == before


def test_checkpoints_without_config_are_not_taken_over(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    exit_code = _import_train_script().main(["--run-dir", str(tmp_path), "--preset", "tiny"])
    _assert_one_line_error(exit_code, capsys.readouterr().err, "no config.json")
    assert [path.name for path in tmp_path.iterdir()] == ["checkpoints"]


@pytest.mark.slow
def test_missing_data_is_one_line_in_a_real_process(existing_run):
    before = _snapshot(existing_run)
    result = _run([sys.executable, "train.py", "--run-dir", str(existing_run), "--data-dir", "/nonexistent/multi30k"])
    _assert_one_line_error(result.returncode, result.stderr, "Multi30k directory /nonexistent/multi30k", "lacks")
    assert _snapshot(existing_run) == before


def test_unknown_preset_is_a_usage_error(tmp_path):
    result = _run([sys.executable, "train.py", "--preset", "huge", "--run-dir", str(tmp_path / "run")])
    assert result.returncode == 2 and "invalid choice: 'huge'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
