"""The training loop: replica-count independence, multi-worker runs, resuming, bad flags.

Runs that need logical CPU devices or `MultiWorkerMirroredStrategy` (set up before
TensorFlow initializes its devices) and runs of `train.py` happen in subprocesses; the
rest runs in this process, without seeding TensorFlow globally (seeding drops its kernel
cache, and with it the SentencePiece resources of the session's tokenizer fixtures).
"""

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import training_worker  # tests/ is on sys.path: pytest puts it there for this file

from keras_transformer import data, distribution, run_dir
from keras_transformer.model import Transformer
from keras_transformer.schedule import TransformerSchedule
from keras_transformer.tokenizer import SubwordTokenizer
from keras_transformer.trainer import Trainer, TrainingConfig
from repo_scripts import import_train_script as _import_train_script  # noqa: E402

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


@pytest.mark.slow
def test_each_replica_draws_its_own_dropout_mask(tmp_path):
    """Replicas share the seed generator's state: without the replica id in the seed, all draw one mask."""
    output = tmp_path / "masks.npz"
    result = _run([sys.executable, str(WORKER), "dropout", str(output), "-"])
    assert result.returncode == 0, result.stderr[-3000:]
    masks = np.load(output)

    for step in ("step0", "step1"):
        first, second = masks[f"{step}/replica0"], masks[f"{step}/replica1"]
        assert 0.45 < first.mean() < 0.55 and 0.45 < second.mean() < 0.55  # rate 0.5 on 1,024 elements
        assert 0.4 < (first == second).mean() < 0.6  # independent masks agree on half the elements
    assert 0.4 < (masks["step0/replica0"] == masks["step1/replica0"]).mean() < 0.6


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def _start(mode, output, run, tf_config=None):
    """A `training_worker.py` process in `mode`, its output (stdout and stderr) piped."""
    env = {**os.environ, **({"TF_CONFIG": json.dumps(tf_config)} if tf_config else {})}
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(output), str(run)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _start_two_worker_processes(mode, directory, run):
    """Two `training_worker.py` processes in `mode` under MultiWorkerMirroredStrategy on 127.0.0.1.

    Worker i writes `directory/worker{i}.npz`.
    """
    workers = [f"127.0.0.1:{port}" for port in _free_ports(2)]
    return [
        _start(mode, directory / f"worker{index}.npz", run,
               {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
        for index in range(2)
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


# --- Resuming -------------------------------------------------------------------------

RESUME_STEPS = 6
STOP_STEP = 3


def _training_losses(run, tag="loss"):
    """Per-step training loss (or scalar `tag`) from the TensorBoard event files of `run` (log_every=1)."""
    losses = {}
    for path in sorted((run / run_dir.LOG_DIR / "train").glob("events.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag == tag:
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


def test_float16_steps_that_overflow_apply_no_update_and_the_logged_rate_follows_the_updates(tmp_path):
    """A loss scale far too high makes the first float16 steps overflow: the optimizer skips them
    (and halves the scale), so the schedule advances only with the updates applied, and so must
    the logged learning rate."""
    config = TrainingConfig(train_steps=8, warmup_steps=20, log_every=1, mixed_precision="fp16")
    trainer = Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
        tmp_path / "run",
        config,
    )
    trainer.optimizer.dynamic_scale.assign(2.0**22)  # overflows the first steps (4 of 8 here), not all
    assert trainer.fit(_synthetic_pairs_dataset).step == 8

    updates = int(trainer.optimizer.iterations)
    assert 0 < updates < 8, updates  # some steps skipped, some applied
    rates = _training_losses(tmp_path / "run", tag="learning_rate")
    schedule = TransformerSchedule(trainer.model.d_model, warmup_steps=20)
    assert rates[8] == pytest.approx(float(schedule(updates - 1)))
    assert rates[8] < float(schedule(7))  # the warm-up rate of step 8, which was not applied


def _label_smoothed_losses(labels, logits, eps):
    """Per-token `-sum_v q_v log softmax(logits)_v`, `q` being `1 - eps` on the label and `eps / (V - 1)` elsewhere."""
    vocab_size = logits.shape[-1]
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    targets = np.full(logits.shape, eps / (vocab_size - 1))
    np.put_along_axis(targets, labels[..., None], 1.0 - eps, axis=-1)
    return -(targets * log_probs).sum(-1)


def test_the_trainer_counts_and_scores_the_tokens_that_are_not_the_models_pad_id(tmp_path):
    """A model whose padding is id 7: its step counts and scores every other label, 0 included."""
    pad_id, vocab_size, eps = 7, 50, 0.1
    rng = np.random.default_rng(0)
    lengths = np.array([9, 6, 3, 7])
    real = np.arange(9) < lengths[:, None]
    labels = np.where(real, rng.integers(0, vocab_size, size=real.shape), pad_id)
    labels[real & (labels == pad_id)] = 0  # 0 is an ordinary token here
    labels[:, 0] = 0
    source = np.where(real, rng.integers(8, vocab_size, size=real.shape), pad_id)
    decoder_inputs = np.where(real, np.concatenate([np.full([4, 1], 2), labels[:, :-1]], axis=1), pad_id)
    batch = ((source.astype("int32"), decoder_inputs.astype("int32")), labels.astype("int32"))
    trainer = Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size, dropout_rate=0.0, pad_id=pad_id, dtype=dtype),
        tmp_path / "run",
        TrainingConfig(train_steps=1, warmup_steps=20, label_smoothing=eps),
    )
    logits = trainer.model(batch[0], training=False).numpy().astype("float64")  # the weights the step starts from

    stream = trainer._training_stream(lambda input_context: tf.data.Dataset.from_tensors(batch), 0)
    metrics = trainer._train_step(with_grad_norm=False)(iter(stream))

    label_logits = np.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    assert float(metrics["tokens"]) == real.sum() == 25
    expected_loss_sum = _label_smoothed_losses(labels, logits, eps)[real].sum()
    assert float(metrics["loss_sum"]) == pytest.approx(expected_loss_sum, rel=1e-5)
    assert float(metrics["correct"]) == (label_logits >= logits.max(-1))[real].sum()


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
    config = run_dir.read_config(tmp_path)
    run_dir.write_config(tmp_path, {**config, "train": {"average_last": 0}})  # Run again with --average-last 0.
    assert Path(run_dir.checkpoint_path(tmp_path, "best")).parent.name == run_dir.CHECKPOINT_DIR
    run_dir.write_config(tmp_path, config)
    manager.save(checkpoint_number=40)  # Training went on: the average is stale.
    assert Path(run_dir.checkpoint_path(tmp_path, "best")).name == "ckpt-40"


@pytest.mark.parametrize("better", ["averaged", "latest"])
def test_the_average_is_kept_only_if_it_translates_the_validation_set_better(tmp_path, monkeypatch, better):
    """train.py keeps RUN/averaged only when its validation BLEU is at least the latest's."""
    from keras_transformer import evaluation

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
    monkeypatch.setattr(run_dir, "load_tokenizer", lambda run: None)
    monkeypatch.setattr(
        evaluation,
        "translate",
        lambda model, tokenizer, sources, **kwargs: references if model == better else ["nichts"] * len(sources),
    )
    corpus = type("Corpus", (), {"validation": pairs, "target_lang": "de"})()
    settings = {"average_last": 2, "bleu_sentences": 3, "beam_size": 1, "alpha": 0.6, "max_length": 16}
    _import_train_script().average_if_better(tmp_path, corpus, settings)
    assert (tmp_path / run_dir.AVERAGED_DIR).exists() == (better == "averaged")


def test_translate_reports_each_batch_and_translates_as_without_a_callback(multi30k_tokenizer):
    from keras_transformer import evaluation

    model = Transformer.from_preset("tiny", vocab_size=multi30k_tokenizer.vocab_size)
    model.build()
    sources = ["a man", "two dogs run on the grass .", "a woman in a red coat", "children", "a boy jumps ."]
    reports = []
    options = dict(beam_size=2, batch_size=2)
    translations = evaluation.translate(
        model, multi30k_tokenizer, sources, on_batch=lambda done, total: reports.append((done, total)), **options
    )
    assert reports == [(2, 5), (4, 5), (5, 5)]  # batches of 2 over 5 sentences
    assert translations == evaluation.translate(model, multi30k_tokenizer, sources, **options)


def test_translation_progress_logs_at_most_every_so_many_seconds(monkeypatch, caplog):
    train = _import_train_script()
    clock = iter([100.0, 110.0, 131.0, 140.0, 170.0, 250.0])  # creation, then one reading per batch
    monkeypatch.setattr(train.time, "monotonic", lambda: next(clock))
    progress = train.translation_progress("test sentences", every_seconds=30)
    with caplog.at_level("INFO", logger="train"):
        for translated in (64, 128, 192, 256, 300):
            progress(translated, 300)
    # 30 s after the start, 30 s after that line; never for the last batch.
    assert [record.getMessage() for record in caplog.records] == [
        "  128/300 test sentences translated (31s)",
        "  256/300 test sentences translated (1m10s)",
    ]


# --- Bad flags ---------------------------------------------------------------------------


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


def test_average_last_beyond_the_kept_checkpoints_is_refused(tmp_path, capsys):
    """tiny keeps 3 checkpoints: averaging 5 would silently average 3."""
    flags = ["--run-dir", str(tmp_path / "run"), "--preset", "tiny", "--average-last", "5"]
    exit_code = _import_train_script().main(flags)
    _assert_one_line_error(exit_code, capsys.readouterr().err, "--average-last 5", "--keep-checkpoints is 3")
    assert not (tmp_path / "run").exists()


def test_a_language_the_corpus_lacks_fails_before_anything_is_written(tmp_path, capsys):
    exit_code = _import_train_script().main(["--run-dir", str(tmp_path / "run"), "--source-lang", "fr"])
    _assert_one_line_error(exit_code, capsys.readouterr().err, "--dataset multi30k translates between en and de")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text", ["{\"model\": {", "[1, 2]"], ids=["truncated", "not-an-object"])
def test_a_damaged_config_is_one_line(existing_run, capsys, text):
    (existing_run / run_dir.CONFIG_FILE).write_text(text)
    exit_code = _import_train_script().main(["--run-dir", str(existing_run)])
    _assert_one_line_error(exit_code, capsys.readouterr().err, str(existing_run / run_dir.CONFIG_FILE), "damaged")


@pytest.mark.parametrize("value", ["-1", str(2**32)])
def test_a_seed_out_of_numpys_range_is_a_usage_error(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as raised:
        _import_train_script().main(["--run-dir", str(tmp_path / "run"), "--seed", value])
    assert raised.value.code == 2
    assert f"argument --seed: must be an integer from 0 to {2**32 - 1}, got {value}" in capsys.readouterr().err


def test_help_gives_the_presets_defaults_and_the_papers_values():
    help_text = " ".join(_import_train_script().build_parser().format_help().split())
    assert "[the preset's: tiny 100, small 1600, medium 1000, base 4000, big 4000] The paper: 4000." in help_text
    assert "[the preset's: tiny 1, small 2, medium 1.5, base 1, big 1] The paper: 1." in help_text


def _start_two_workers(run, *flags, env=None):
    """Two `train.py` workers of a `tiny` Multi30k run on 127.0.0.1 that train until stopped; stderr piped."""
    workers = [f"127.0.0.1:{port}" for port in _free_ports(2)]
    flags = ["--run-dir", str(run), "--preset", "tiny", "--vocab-size", "1000", "--train-steps", "100000",
             "--max-minutes", "0", "--log-every", "1", "--eval-every", "0", "--bleu-sentences", "0", *flags]
    processes = []
    for index in range(2):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        processes.append(subprocess.Popen(
            [sys.executable, "train.py", *flags], cwd=ROOT,
            env={**os.environ, **(env or {}), "TF_CONFIG": json.dumps(tf_config)},
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
def test_killing_one_worker_checkpoints_and_stops_all_of_them_at_one_step(tmp_path, multi30k_dir, killed):
    """A worker stopping alone leaves the others failing in the next all-reduce: they must agree on the step.

    Also: the coordination service of MultiWorkerMirroredStrategy installs its own SIGTERM handler.
    """
    import signal

    run = tmp_path / "run"
    processes = _start_two_workers(run, "--data-dir", str(multi30k_dir), "--checkpoint-every", "100000")
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
def test_a_worker_killed_outright_stops_the_other_with_an_error_naming_the_checkpoint(tmp_path, multi30k_dir, killed):
    """SIGKILL (or a crash) leaves no time to agree: the survivor must say so and exit, not hang or dump a traceback."""
    import signal

    run = tmp_path / "run"
    temporary = tmp_path / "tmp"  # where the non-chief worker keeps its checkpoints
    temporary.mkdir()
    processes = _start_two_workers(run, "--data-dir", str(multi30k_dir), "--checkpoint-every", "2",
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
    assert re.search(r"^Learned a 1000-token BPE vocabulary", output, re.MULTILINE), output[-3000:]
    assert re.search(r"train\.py: error: Another worker stopped without warning, while the workers were setting up "
                     r"\(TensorFlow: .+\)\. Synchronous training cannot go on without it, so this worker stops too\. "
                     r"Start every worker again with the same command\.", output), output[-3000:]


@pytest.mark.slow
def test_a_worker_whose_peers_never_start_gives_up_after_the_connect_timeout(tmp_path, multi30k_dir):
    """MultiWorkerMirroredStrategy() waits for every task in C++, holding the GIL: only faulthandler's timer ends it."""
    workers = [f"127.0.0.1:{port}" for port in _free_ports(2)]
    tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": 0}}
    run = tmp_path / "run"
    result = _run(
        [sys.executable, "train.py", "--run-dir", str(run), "--preset", "tiny", "--data-dir", str(multi30k_dir),
         "--connect-timeout-minutes", "0.1"],
        env={"TF_CONFIG": json.dumps(tf_config)}, timeout=120,
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


def _interrupting_train(*flags):
    """`python -c` code: train.py with `flags`, interrupted (Ctrl-C) as its Trainer is created."""
    return [
        sys.executable, "-c",
        "import sys, train, keras_transformer.trainer as trainer\n"
        "def interrupt(*args, **kwargs):\n"
        "    raise KeyboardInterrupt\n"
        "trainer.Trainer = interrupt\n"
        f"sys.exit(train.main({list(flags)!r}))\n",
    ]


@pytest.mark.slow
def test_a_start_interrupted_after_the_vocabulary_is_resumed(tmp_path, multi30k_dir):
    """Ctrl-C right after the vocabulary is learned; the same command takes the run up again.

    Also a directory left so by earlier versions (a vocabulary without config.json).
    """
    run = tmp_path / "run"
    command = _interrupting_train("--run-dir", str(run), "--preset", "tiny", "--vocab-size", "1000",
                                  "--data-dir", str(multi30k_dir))
    first = _run(command)
    assert first.returncode == 130, first.stderr[-3000:]
    assert "run the same command to resume" in first.stderr
    assert (run / run_dir.CONFIG_FILE).is_file() and run_dir.tokenizer_path(run).is_file()
    assert run_dir.read_config(run)["data"]["vocab_size"] == 1000
    vocabulary = _snapshot(run)[run_dir.TOKENIZER_FILE]

    again = _run(command)
    assert again.returncode == 130, again.stderr[-3000:]
    assert _snapshot(run)[run_dir.TOKENIZER_FILE] == vocabulary  # Taken up, not learned again.
    # Its settings are pinned like those of any run.
    other = _run([sys.executable, "train.py", "--run-dir", str(run), "--seed", "1"])
    _assert_one_line_error(other.returncode, other.stderr, "trained with --seed 0, not 1")

    (run / run_dir.CONFIG_FILE).unlink()  # As earlier versions left it.
    legacy = _run(command)
    assert legacy.returncode == 130, legacy.stderr[-3000:]
    assert "an interrupted start" in legacy.stderr
    assert _snapshot(run)[run_dir.TOKENIZER_FILE] == vocabulary


# --- Run directories, devices, replicas, progress ---------------------------------------


def _run_with_checkpoint(directory, step=5, **model_config):
    """A run directory holding a tiny model's checkpoint at `step`, and a config.json with `model_config`."""
    model = Transformer.from_preset("tiny", vocab_size=50)
    model.build()
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(directory / run_dir.CHECKPOINT_DIR), 3)
    path = manager.save(checkpoint_number=step)
    run_dir.write_config(directory, {"model": {**run_dir.model_config(model), **model_config}})
    return path


@pytest.mark.parametrize("change", [{"num_layers": 3}, {"d_model": 64}], ids=["more-layers", "wider"])
def test_a_checkpoint_of_another_architecture_is_refused(tmp_path, change):
    """A 2-layer checkpoint under a 3-layer config.json used to load partly, layer 3 left random."""
    path = _run_with_checkpoint(tmp_path, **change)
    with pytest.raises(run_dir.RunDirError, match=f"Checkpoint {path} does not fit the model"):
        run_dir.load_model(tmp_path, "latest")
    with pytest.raises(run_dir.RunDirError, match=f"Checkpoint {path} does not fit the model"):
        run_dir.average_checkpoints(tmp_path, 2)
    assert not (tmp_path / run_dir.AVERAGED_DIR).exists()


def test_a_checkpoint_path_that_does_not_exist_is_a_clear_error(tmp_path):
    _run_with_checkpoint(tmp_path)
    missing = str(tmp_path / run_dir.CHECKPOINT_DIR / "ckpt-7")
    with pytest.raises(run_dir.RunDirError, match=f"Checkpoint {missing} does not exist"):
        run_dir.load_model(tmp_path, missing)
    assert run_dir.checkpoint_path(tmp_path, missing[:-1] + "5") == missing[:-1] + "5"


def test_a_damaged_checkpoint_is_a_clear_error(tmp_path):
    """A truncated file used to escape as a bare IndexError from TensorFlow's reader."""
    path = _run_with_checkpoint(tmp_path)
    with open(f"{path}.data-00000-of-00001", "r+b") as data_file:
        data_file.truncate(100)
    with pytest.raises(run_dir.RunDirError, match=f"Checkpoint {path} does not fit .* damaged file"):
        run_dir.load_model(tmp_path, "latest")


def _tiny_trainer(run, train_steps=4):
    config = TrainingConfig(train_steps=train_steps, warmup_steps=20, log_every=1, checkpoint_every=2)
    return Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
        run,
        config,
    )


def test_average_only_needs_no_data_directory(tmp_path):
    """A --dataset files run averages without --data-dir: averaging reads no data."""
    for step in (10, 20):
        _run_with_checkpoint(tmp_path, step=step)
    config = run_dir.read_config(tmp_path)
    config["data"] = {"corpus": "files", "source_lang": "en", "target_lang": "de", "vocab_size": 50}
    config["train"] = {"preset": "tiny"}
    run_dir.write_config(tmp_path, config)
    assert _import_train_script().main(["--run-dir", str(tmp_path), "--average-only", "--average-last", "2"]) == 0
    assert Path(run_dir.checkpoint_path(tmp_path, "averaged")).name == "ckpt-20"


def test_a_run_averaged_on_request_translates_with_the_average(tmp_path):
    """A `small` run saves --average-last 0; --average-only then makes the average its model, as asked."""
    for step in (10, 20):
        _run_with_checkpoint(tmp_path, step=step)
    config = run_dir.read_config(tmp_path)
    config["data"] = {"corpus": "files", "source_lang": "en", "target_lang": "de", "vocab_size": 50}
    config["train"] = {"preset": "tiny", "average_last": 0}
    run_dir.write_config(tmp_path, config)
    assert Path(run_dir.checkpoint_path(tmp_path, "best")).parent.name == run_dir.CHECKPOINT_DIR

    assert _import_train_script().main(["--run-dir", str(tmp_path), "--average-only", "--average-last", "2"]) == 0

    assert run_dir.checkpoint_path(tmp_path, "best") == run_dir.checkpoint_path(tmp_path, "averaged")
    assert run_dir.read_config(tmp_path)["model"] == config["model"]


def test_a_damaged_latest_checkpoint_stops_the_resume_and_the_one_before_can_take_over(tmp_path):
    """A damaged newest checkpoint is a clear error; once deleted, the run resumes from the one before.

    With `tf.train.latest_checkpoint`, deleting it (or a damaged `checkpoint` index)
    made the next run start over from step 0, over the checkpoints it had.
    """
    run = tmp_path / "run"
    _tiny_trainer(run).fit(_synthetic_pairs_dataset)
    directory = run / run_dir.CHECKPOINT_DIR
    newest, previous = directory / "ckpt-4", directory / "ckpt-2"
    with open(f"{newest}.data-00000-of-00001", "r+b") as data_file:
        data_file.truncate(100)
    with pytest.raises(run_dir.RunDirError) as raised:
        _tiny_trainer(run).restore()
    message = str(raised.value)
    assert message.startswith(f"Cannot resume the run. Checkpoint {newest} does not fit"), message
    assert message.endswith(f"If only this file is damaged, delete {newest}.* to resume from {previous}."), message

    for stale in directory.glob("ckpt-4.*"):
        stale.unlink()
    (directory / "checkpoint").write_text("damaged {")
    trainer = _tiny_trainer(run)
    assert trainer.restore() == 2
    expected = Transformer.from_preset("tiny", vocab_size=50)
    expected.build()
    tf.train.Checkpoint(model=expected).restore(str(previous)).expect_partial()
    for actual, wanted in zip(trainer.model.weights, expected.weights, strict=True):
        np.testing.assert_array_equal(actual.numpy(), wanted.numpy(), err_msg=actual.path)
    assert trainer.fit(_synthetic_pairs_dataset).start_step == 2


def test_a_damaged_only_checkpoint_says_how_to_start_over(tmp_path):
    run = tmp_path / "run"
    _tiny_trainer(run, train_steps=2).fit(_synthetic_pairs_dataset)
    (run / run_dir.CHECKPOINT_DIR / "ckpt-2.index").write_bytes(b"not an index")
    with pytest.raises(run_dir.RunDirError, match=f"To train the run from the start, delete {run / 'checkpoints'}\\.$"):
        _tiny_trainer(run).restore()


@pytest.mark.parametrize(
    "tf_config, message",
    [
        ("not json", "TF_CONFIG is not valid JSON"),
        ("[1, 2]", "TF_CONFIG must be a JSON object such as"),
        ('{"cluster": {"worker": "h:1,h:2"}, "task": {"type": "worker", "index": 0}}', "TF_CONFIG must be"),
    ],
    ids=["not-json", "not-an-object", "tasks-not-a-list"],
)
def test_a_malformed_tf_config_is_one_line(tmp_path, capsys, monkeypatch, tf_config, message):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    exit_code = _import_train_script().main(["--run-dir", str(tmp_path / "run"), "--preset", "tiny"])
    _assert_one_line_error(exit_code, capsys.readouterr().err, message)


def test_devices_that_do_not_exist_are_refused():
    """This process never split its CPU: CPU:1 does not exist; nor does a GPU on a machine without one."""
    with pytest.raises(ValueError, match="Device CPU:1 does not exist: this process has 1 CPU device"):
        distribution.make_strategy(["CPU:1"])
    with pytest.raises(ValueError, match="Device CPU:0 is listed twice"):
        distribution.make_strategy(["CPU:0", "cpu:0"])
    if not tf.config.list_physical_devices("GPU"):
        with pytest.raises(ValueError, match="Device GPU:0 does not exist: TensorFlow sees no GPU"):
            distribution.make_strategy(["GPU:0"])


@pytest.mark.parametrize("devices", ["", ",", " , "])
def test_devices_that_name_no_device_are_one_line(tmp_path, capsys, devices):
    exit_code = _import_train_script().main(["--run-dir", str(tmp_path / "run"), "--preset", "tiny",
                                             "--devices", devices])
    _assert_one_line_error(exit_code, capsys.readouterr().err, f"--devices {devices!r} names no device")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_missing_gpu_is_one_line_in_a_real_process(tmp_path):
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU")
    result = _run([sys.executable, "train.py", "--run-dir", str(tmp_path / "run"), "--devices", "GPU:0"])
    _assert_one_line_error(result.returncode, result.stderr, "--devices GPU:0: Device GPU:0 does not exist")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "saved, step, train_steps, replicas, expected",
    [
        (None, None, 200, 2, 2),  # A new run records its replicas.
        (1, 100, 200, 1, 1),  # Resumed on as many.
        (None, 100, 200, 2, 2),  # A run of an earlier version: from now on, on 2.
        (2, 200, 200, 1, 2),  # Evaluating a finished run works on any number, and keeps the record.
        (2, 100, 200, 1, "trained on 2 replica(s) up to step 100, and this command runs 1"),
    ],
    ids=["new", "same", "unrecorded", "finished", "other"],
)
def test_a_run_resumes_only_on_as_many_replicas(tmp_path, saved, step, train_steps, replicas, expected):
    train = _import_train_script()
    if step is not None:
        _run_with_checkpoint(tmp_path, step=step)
    settings = {"replicas": saved, "train_steps": train_steps}
    if isinstance(expected, int):
        assert train.check_replicas(tmp_path, settings, replicas) == expected
    else:
        with pytest.raises(train.SettingsError, match=re.escape(expected)):
            train.check_replicas(tmp_path, settings, replicas)


@pytest.mark.slow
def test_resuming_on_another_number_of_replicas_is_one_line_in_a_real_process(existing_run):
    """The run trained 100 of its 200 steps on 2 replicas; this command has 1 (the CPU)."""
    config = run_dir.read_config(existing_run)
    config["train"]["replicas"] = 2
    run_dir.write_config(existing_run, config)
    tf.train.CheckpointManager(
        tf.train.Checkpoint(model=run_dir.build_model(existing_run)), str(existing_run / run_dir.CHECKPOINT_DIR), 3
    ).save(checkpoint_number=100)
    before = _snapshot(existing_run)
    result = _run([sys.executable, "train.py", "--run-dir", str(existing_run)])
    _assert_one_line_error(result.returncode, result.stderr, "trained on 2 replica(s) up to step 100")
    assert _snapshot(existing_run) == before


@pytest.mark.slow
def test_a_finished_run_extended_by_epochs_checks_its_replicas(existing_run, multi30k_dir):
    """Finished at step 100 on 2 replicas; --epochs 1 means more steps, and this command has 1 replica."""
    config = run_dir.read_config(existing_run)
    config["train"].update(replicas=2, train_steps=100)
    run_dir.write_config(existing_run, config)
    tf.train.CheckpointManager(
        tf.train.Checkpoint(model=run_dir.build_model(existing_run)), str(existing_run / run_dir.CHECKPOINT_DIR), 3
    ).save(checkpoint_number=100)
    before = _snapshot(existing_run)
    result = _run([sys.executable, "train.py", "--run-dir", str(existing_run), "--data-dir", str(multi30k_dir),
                   "--epochs", "1"])
    _assert_one_line_error(result.returncode, result.stderr, "trained on 2 replica(s) up to step 100")
    assert _snapshot(existing_run) == before


def test_a_worker_lost_in_a_step_names_the_steps_finished_before_it(tmp_path, monkeypatch):
    """A collective failing late in step 3 (its `assign_add` already run) is "after step 2", not after step 3."""
    trainer = _tiny_trainer(tmp_path / "run", train_steps=6)
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
        trainer.fit(_synthetic_pairs_dataset)
    assert int(trainer.step.numpy()) == 3
    message = str(raised.value)
    assert message.startswith("Another worker stopped without warning, after step 2 (TensorFlow: task 1 is unhealthy)")
    assert f"The latest checkpoint holds step 2 ({tmp_path / 'run' / 'checkpoints' / 'ckpt-2'})" in message


def test_progress_lines_show_no_speed_for_steps_that_only_traced(tmp_path, caplog):
    """Step 1 traces the step function (untimed): its speed and ETA are unknown, not 0; step 2 is timed."""
    config = TrainingConfig(train_steps=3, warmup_steps=20, log_every=1)
    trainer = Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
        tmp_path / "run",
        config,
    )
    with caplog.at_level("INFO", logger="keras_transformer.trainer"):
        trainer.fit(_synthetic_pairs_dataset)
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("step ")]
    assert len(lines) == 3
    assert "| - tok/s |" in lines[0] and lines[0].endswith("| ETA -"), lines[0]
    assert re.search(r"\| [\d,]+ tok/s \|", lines[1]) and re.search(r"\| ETA \d+s$", lines[1]), lines[1]


def test_a_time_budget_ending_at_a_validation_does_not_validate_that_step_again(tmp_path):
    """Validation at step 1 (eval_every 1) spends the budget: the final validation must not repeat it."""
    validated = []
    trainer = Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
        tmp_path / "run",
        TrainingConfig(train_steps=10, warmup_steps=20, eval_every=1, max_minutes=1e-9),
        validate_fn=lambda model, step: validated.append(step) or {"loss": 1.0},
    )
    result = trainer.fit(_synthetic_pairs_dataset)
    assert result.stopped_early and result.step == 1
    assert validated == [1]


def _recording_trainer(run, validated, train_steps=4, eval_every=2, max_minutes=None, interrupt_at=None):
    """A tiny trainer whose validation records its step, or is interrupted at `interrupt_at`."""

    def validate(model, step):
        if step == interrupt_at:
            tf.summary.image("attention", np.zeros([1, 2, 2, 1]), step=step)  # Written before the metrics.
            raise KeyboardInterrupt
        validated.append(step)
        return {"loss": 1.0}

    return Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
        run,
        TrainingConfig(train_steps=train_steps, warmup_steps=20, eval_every=eval_every, max_minutes=max_minutes),
        validate_fn=validate,
    )


@pytest.mark.parametrize("interrupt_at", [2, 4], ids=["scheduled", "final"])
def test_a_validation_cut_off_is_redone_when_the_run_resumes(tmp_path, interrupt_at):
    """Interrupted in the validation of step 2 (eval_every 2) or of the last step, the resumed run validates it."""
    validated = []
    with pytest.raises(KeyboardInterrupt):
        _recording_trainer(tmp_path / "run", validated, interrupt_at=interrupt_at).fit(_synthetic_pairs_dataset)
    assert validated == [2, 4][: [2, 4].index(interrupt_at)]
    assert run_dir.validated_steps(tmp_path / "run") == set(validated)
    resumed = []
    result = _recording_trainer(tmp_path / "run", resumed).fit(_synthetic_pairs_dataset)
    assert result.start_step == interrupt_at and result.step == 4
    assert resumed == [2, 4][[2, 4].index(interrupt_at):]
    assert run_dir.validated_steps(tmp_path / "run") == {2, 4}


def test_a_run_resumed_at_a_validated_step_does_not_validate_it_again(tmp_path):
    """A time budget stops the run right after validating step 1; the resumed run validates from step 2 on."""
    validated = []
    result = _recording_trainer(tmp_path / "run", validated, eval_every=1, max_minutes=1e-9).fit(
        _synthetic_pairs_dataset
    )
    assert result.step == 1 and validated == [1]
    resumed = []
    _recording_trainer(tmp_path / "run", resumed, eval_every=1).fit(_synthetic_pairs_dataset)
    assert resumed == [2, 3, 4]


def test_validated_steps_reads_what_a_crash_left_before_a_cut_off_record(tmp_path):
    """Steps with metrics count, a step with images alone does not, and a record cut off by a crash ends the reading."""
    logs = tmp_path / run_dir.LOG_DIR / "validation"
    writer = tf.summary.create_file_writer(str(logs))
    with writer.as_default():
        for step in (10, 20):
            tf.summary.scalar("loss", 1.0, step=step)
        tf.summary.image("attention", np.zeros([1, 2, 2, 1]), step=30)
        tf.summary.scalar("loss", 1.0, step=40)
    writer.close()
    assert run_dir.validated_steps(tmp_path) == {10, 20, 40}
    (events,) = logs.glob("events.out.tfevents.*")
    events.write_bytes(events.read_bytes()[:-5])
    assert run_dir.validated_steps(tmp_path) == {10, 20}
    assert run_dir.validated_steps(tmp_path / "elsewhere") == set()


def test_steps_logged_again_after_a_crash_keep_their_newest_point(tmp_path):
    """Killed after step 16 with its last checkpoint at 10, a run logs steps 12-16 again when it resumes."""
    for steps, value in (((10, 12, 14, 16), 1.0), ((12, 14, 16, 18), 2.0)):  # the run, then the resumed run
        writer = tf.summary.create_file_writer(str(tmp_path))
        with writer.as_default():
            for step in steps:
                tf.summary.scalar("loss", value, step=step)
        writer.close()

    points = run_dir.read_scalars(tmp_path)["loss"]

    assert [(step, value) for step, _, value in points] == [(10, 1.0), (12, 2.0), (14, 2.0), (16, 2.0), (18, 2.0)]


def _logged(caplog):
    """The trainer's log messages, and its progress lines among them."""
    messages = [record.getMessage() for record in caplog.records]
    return messages, [message for message in messages if message.startswith("step ")]


def _interval_trainer(run):
    return Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
        run,
        TrainingConfig(train_steps=10, warmup_steps=20, log_every=10, max_minutes=60),
    )


def test_an_interruption_logs_the_steps_since_the_last_progress_line(tmp_path, caplog, monkeypatch):
    """Interrupted after step 3 of an interval of 10, the run logs steps 1-3 before it saves and stops."""
    trainer = _interval_trainer(tmp_path / "run")
    checks = iter(range(1, 11))

    def out_of_time(started):
        if next(checks) == 3:
            raise KeyboardInterrupt
        return False

    monkeypatch.setattr(trainer, "_out_of_time", out_of_time)
    with caplog.at_level("INFO", logger="keras_transformer.trainer"), pytest.raises(KeyboardInterrupt):
        trainer.fit(_synthetic_pairs_dataset)
    messages, progress = _logged(caplog)
    assert len(progress) == 1 and progress[0].startswith("step 3/10 | loss "), progress
    assert "| grad norm - |" in progress[0]
    assert any(message.startswith("Interrupted at step 3; saved ") for message in messages), messages


def test_a_time_budget_stop_logs_the_steps_since_the_last_progress_line(tmp_path, caplog, monkeypatch):
    trainer = _interval_trainer(tmp_path / "run")
    checks = iter(range(1, 11))
    monkeypatch.setattr(trainer, "_out_of_time", lambda started: next(checks) == 3)
    with caplog.at_level("INFO", logger="keras_transformer.trainer"):
        result = trainer.fit(_synthetic_pairs_dataset)
    _, progress = _logged(caplog)
    assert result.step == 3 and len(progress) == 1 and progress[0].startswith("step 3/10 | loss "), progress
    assert [step for step, _, _ in run_dir.read_scalars(tmp_path / "run" / run_dir.LOG_DIR / "train")["loss"]] == [3]


def test_an_interruption_as_a_step_returns_is_labelled_with_the_saved_step(tmp_path, caplog, monkeypatch):
    """Python raises KeyboardInterrupt once the step's TensorFlow call returns, before the loop counts the step."""
    trainer = _interval_trainer(tmp_path / "run")
    calls = iter(range(1, 11))

    def step_then_interrupt(with_grad_norm):
        step_fn = Trainer._train_step(trainer, with_grad_norm)

        def run(iterator):
            outputs = step_fn(iterator)
            if next(calls) == 3:
                raise KeyboardInterrupt
            return outputs

        return run

    monkeypatch.setattr(trainer, "_train_step", step_then_interrupt)
    with caplog.at_level("INFO", logger="keras_transformer.trainer"), pytest.raises(KeyboardInterrupt):
        trainer.fit(_synthetic_pairs_dataset)
    messages, progress = _logged(caplog)
    assert len(progress) == 1 and progress[0].startswith("step 3/10 | loss "), progress  # steps 1-2's metrics
    assert any(message.startswith("Interrupted at step 3; saved ") and message.endswith(
        "ckpt-3. Run the same command to resume.") for message in messages), messages


@pytest.mark.slow
def test_a_time_budget_stop_says_where_the_run_stands(tmp_path, multi30k_dir):
    """A run stopped by --max-minutes ends with its step and how to continue it."""
    from keras_transformer.corpora import load_multi30k

    corpus = load_multi30k(multi30k_dir)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for split, pairs in (("train", corpus.train[:3000]), ("val", corpus.validation[:4]), ("test", corpus.test[:4])):
        for side, lang in enumerate(("en", "de")):
            (data_dir / f"{split}.{lang}").write_text("".join(pair[side] + "\n" for pair in pairs))
    result = _run([
        sys.executable, "train.py", "--run-dir", str(tmp_path / "run"), "--preset", "tiny", "--dataset", "files",
        "--data-dir", str(data_dir), "--source-lang", "en", "--target-lang", "de", "--vocab-size", "1000",
        "--max-length", "64", "--max-minutes", "0.0001", "--bleu-sentences", "0", "--beam-size", "1",
    ])
    assert result.returncode == 0, result.stderr[-3000:]
    # Its one step traced the step function, so it was not timed: no speed rather than 0 tokens/s.
    assert re.search(r"^Trained steps 1-1 in \S+\.$", result.stderr, re.MULTILINE), result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"The time budget \(--max-minutes 0.0001\) stopped the run at step 1 of 200; run the same command again "
        r"to continue training from there\.", last
    ), last


def test_a_run_dir_that_is_a_file_is_one_line_before_any_work(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    result = _run([sys.executable, "train.py", "--run-dir", str(path), "--preset", "tiny"])
    _assert_one_line_error(result.returncode, result.stderr, f"--run-dir {path} is a file, not a directory.")
    assert path.read_text() == "mine"


@pytest.mark.slow
def test_a_vocabulary_too_small_for_the_text_is_one_line(tmp_path, multi30k_dir):
    run = tmp_path / "run"
    result = _run([sys.executable, "train.py", "--run-dir", str(run), "--preset", "tiny", "--vocab-size", "100",
                   "--data-dir", str(multi30k_dir)])
    _assert_one_line_error(result.returncode, result.stderr, "--vocab-size 100 is too small for the multi30k",
                           "or more")
    assert not run.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-length", "1"], "--max-length 1 leaves no room for a token and EOS"),
        (["--beam-size", "17"], "--beam-size is at most 16, got 17"),
    ],
    ids=["max-length", "beam-size"],
)
def test_settings_no_translator_could_use_fail_before_anything_is_written(tmp_path, capsys, flags, message):
    exit_code = _import_train_script().main(["--run-dir", str(tmp_path / "run"), "--preset", "tiny", *flags])
    _assert_one_line_error(exit_code, capsys.readouterr().err, message)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["inf", "nan", "0"])
def test_epochs_must_be_a_finite_positive_number(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as raised:
        _import_train_script().main(["--run-dir", str(tmp_path / "run"), "--epochs", value])
    assert raised.value.code == 2
    assert f"argument --epochs: must be a positive number, got {value}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("length_flags", [["--train-steps", "5"], ["--epochs", "1"]], ids=["steps", "epochs"])
def test_a_corpus_without_a_pair_short_enough_is_one_line(tmp_path, multi30k_dir, length_flags):
    """Every Multi30k sentence has more than 2 subword tokens, so --max-length 3 keeps no pair."""
    from keras_transformer.corpora import load_multi30k

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    pairs = load_multi30k(multi30k_dir).train[:300]
    for side, lang in enumerate(("en", "de")):
        (data_dir / f"train.{lang}").write_text("".join(pair[side] + "\n" for pair in pairs))
    run = tmp_path / "run"
    result = _run([
        sys.executable, "train.py", "--run-dir", str(run), "--preset", "tiny", "--dataset", "files",
        "--data-dir", str(data_dir), "--source-lang", "en", "--target-lang", "de", "--vocab-size", "400",
        "--max-length", "3", "--token-budget", "64", *length_flags,
    ])
    _assert_one_line_error(
        result.returncode, result.stderr, "No training pair is left", "longer than --max-length 3 allows (2 tokens)",
        f"delete {run} first",
    )


def _files_corpus(directory, files):
    directory.mkdir()
    for name, text in files.items():
        (directory / name).write_bytes(text)
    return ["--dataset", "files", "--data-dir", str(directory), "--source-lang", "en", "--target-lang", "de"]


def test_a_training_text_without_a_usable_line_is_one_line(tmp_path, capsys):
    """Every line empty or not UTF-8: SentencePiece has nothing to learn from (its message ends in "] ")."""
    flags = _files_corpus(tmp_path / "data", {"train.en": b"\n \n\xff\xfe\n", "train.de": b"\nzwei\ndrei\n"})
    exit_code = _import_train_script().main(["--run-dir", str(tmp_path / "run"), "--preset", "tiny", *flags])
    _assert_one_line_error(exit_code, capsys.readouterr().err, "training text has no sentence to learn a vocabulary")


def test_a_split_with_only_one_of_its_files_is_one_line(tmp_path, capsys):
    """val.en next to a misnamed German file: not a run without validation, but an error naming the file."""
    files = {"train.en": b"A dog.\n", "train.de": b"Ein Hund.\n", "val.en": b"A cat.\n", "valid.de": b"Eine Katze.\n"}
    flags = _files_corpus(tmp_path / "data", files)
    exit_code = _import_train_script().main(["--run-dir", str(tmp_path / "run"), "--preset", "tiny", *flags])
    _assert_one_line_error(exit_code, capsys.readouterr().err, "has val.en but not val.de")
    assert not (tmp_path / "run").exists()
