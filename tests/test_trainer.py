"""The training loop: the step, resuming, checkpoints, validations, progress lines.

Everything runs in this process, without seeding TensorFlow globally (seeding drops its
kernel cache, and with it the SentencePiece resources of the session's tokenizer
fixtures). Replicas and workers: test_distributed_training.py; mixed precision:
test_mixed_precision.py.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from fake_runs import synthetic_pairs_dataset, tiny_trainer, training_losses
from keras_transformer import data, distribution, run_dir
from keras_transformer.model import Transformer
from keras_transformer.tokenizer import SubwordTokenizer
from keras_transformer.trainer import Trainer, TrainingConfig


# --- Resuming -------------------------------------------------------------------------

RESUME_STEPS = 6
STOP_STEP = 3


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
    expected = training_losses(tmp_path / "uninterrupted")
    actual = training_losses(tmp_path / "interrupted")
    assert sorted(expected) == sorted(actual) == list(range(1, RESUME_STEPS + 1))
    for step in range(1, RESUME_STEPS + 1):
        assert actual[step] == pytest.approx(expected[step], rel=1e-5), step
    assert run_dir.checkpoint_step(tf.train.latest_checkpoint(str(tmp_path / "interrupted" / "checkpoints"))) == 6


def test_a_damaged_latest_checkpoint_stops_the_resume_and_the_one_before_can_take_over(tmp_path):
    """A damaged newest checkpoint is a clear error; once deleted, the run resumes from the one before.

    With `tf.train.latest_checkpoint`, deleting it (or a damaged `checkpoint` index)
    made the next run start over from step 0, over the checkpoints it had.
    """
    run = tmp_path / "run"
    tiny_trainer(run).fit(synthetic_pairs_dataset)
    directory = run / run_dir.CHECKPOINT_DIR
    newest, previous = directory / "ckpt-4", directory / "ckpt-2"
    with open(f"{newest}.data-00000-of-00001", "r+b") as data_file:
        data_file.truncate(100)
    with pytest.raises(run_dir.RunDirError) as raised:
        tiny_trainer(run).restore()
    message = str(raised.value)
    assert message.startswith(f"Cannot resume the run. Checkpoint {newest} does not fit"), message
    assert message.endswith(f"If only this file is damaged, delete {newest}.* to resume from {previous}."), message

    for stale in directory.glob("ckpt-4.*"):
        stale.unlink()
    (directory / "checkpoint").write_text("damaged {")
    trainer = tiny_trainer(run)
    assert trainer.restore() == 2
    expected = Transformer.from_preset("tiny", vocab_size=50)
    expected.build()
    tf.train.Checkpoint(model=expected).restore(str(previous)).expect_partial()
    for actual, wanted in zip(trainer.model.weights, expected.weights, strict=True):
        np.testing.assert_array_equal(actual.numpy(), wanted.numpy(), err_msg=actual.path)
    assert trainer.fit(synthetic_pairs_dataset).start_step == 2


def test_a_damaged_only_checkpoint_says_how_to_start_over(tmp_path):
    run = tmp_path / "run"
    tiny_trainer(run, train_steps=2).fit(synthetic_pairs_dataset)
    (run / run_dir.CHECKPOINT_DIR / "ckpt-2.index").write_bytes(b"not an index")
    with pytest.raises(run_dir.RunDirError, match=f"To train the run from the start, delete {run / 'checkpoints'}\\.$"):
        tiny_trainer(run).restore()


# --- The step ----------------------------------------------------------------------------


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


def test_a_fresh_run_trains_first_on_the_first_batch_of_its_stream(tmp_path):
    """Step 1's loss is the untrained model's loss on batch 0 of `dataset_fn`'s epoch, not on a later batch."""
    from keras_transformer.losses import label_smoothed_cross_entropy

    trainer = Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dropout_rate=0.0, dtype=dtype),
        tmp_path / "run",
        TrainingConfig(train_steps=1, warmup_steps=20, log_every=1),
    )
    losses = []
    for (source_ids, decoder_inputs), labels in synthetic_pairs_dataset(None).take(2):
        logits = trainer.model((source_ids, decoder_inputs), training=False)
        loss_sum, tokens = label_smoothed_cross_entropy(labels, logits, 0.1, pad_id=trainer.model.pad_id)
        losses.append(float(loss_sum / tokens))
    assert abs(losses[0] - losses[1]) > 1e-4 * losses[0]  # The batches tell apart.
    trainer.fit(synthetic_pairs_dataset)
    assert training_losses(tmp_path / "run")[1] == pytest.approx(losses[0], rel=1e-5)


# --- Validations -------------------------------------------------------------------------


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
    result = trainer.fit(synthetic_pairs_dataset)
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
        _recording_trainer(tmp_path / "run", validated, interrupt_at=interrupt_at).fit(synthetic_pairs_dataset)
    assert validated == [2, 4][: [2, 4].index(interrupt_at)]
    assert run_dir.validated_steps(tmp_path / "run") == set(validated)
    resumed = []
    result = _recording_trainer(tmp_path / "run", resumed).fit(synthetic_pairs_dataset)
    assert result.start_step == interrupt_at and result.step == 4
    assert resumed == [2, 4][[2, 4].index(interrupt_at):]
    assert run_dir.validated_steps(tmp_path / "run") == {2, 4}


def test_a_run_resumed_at_a_validated_step_does_not_validate_it_again(tmp_path):
    """A time budget stops the run right after validating step 1; the resumed run validates from step 2 on."""
    validated = []
    result = _recording_trainer(tmp_path / "run", validated, eval_every=1, max_minutes=1e-9).fit(
        synthetic_pairs_dataset
    )
    assert result.step == 1 and validated == [1]
    resumed = []
    _recording_trainer(tmp_path / "run", resumed, eval_every=1).fit(synthetic_pairs_dataset)
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


# --- Cooldown ------------------------------------------------------------------------


def _cooldown_trainer(run, cooldown, train_steps=4, max_minutes=None):
    return Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
        run,
        TrainingConfig(
            train_steps=train_steps, warmup_steps=20, log_every=1, cooldown=cooldown, max_minutes=max_minutes
        ),
    )


def test_a_cooldown_takes_the_rate_linearly_to_zero_over_the_last_steps(tmp_path):
    """Update k of 4 with a cooldown of half the steps: the paper's rate times min(1, (1 - (k - 1) / 4) / 0.5)."""
    _cooldown_trainer(tmp_path / "run", cooldown=0.5).fit(synthetic_pairs_dataset)
    logged = run_dir.read_scalars(tmp_path / "run" / run_dir.LOG_DIR / "train")["learning_rate"]
    d_model = Transformer.from_preset("tiny", vocab_size=50).d_model
    expected = [d_model**-0.5 * k * 20**-1.5 * min(1.0, (1 - (k - 1) / 4) / 0.5) for k in range(1, 5)]
    assert [step for step, _, _ in logged] == [1, 2, 3, 4]
    np.testing.assert_allclose([rate for _, _, rate in logged], expected, rtol=1e-5)


@pytest.mark.parametrize("cooldown", [0.5, 0.0], ids=["cooldown", "none"])
def test_the_updates_at_the_end_of_a_time_budget_barely_move_the_weights(tmp_path, monkeypatch, cooldown):
    """The clock at the end of the budget all along: the cooldown's rate (x 2e-7) leaves the weights as they were."""
    trainer = _cooldown_trainer(tmp_path / "run", cooldown, train_steps=3, max_minutes=60)
    monkeypatch.setattr(trainer, "_time_used", lambda started: 1.0 - 1e-7)
    initial = [variable.numpy() for variable in trainer.model.trainable_variables]
    assert trainer.fit(synthetic_pairs_dataset).step == 3
    variables = trainer.model.trainable_variables
    moved = max(np.abs(variable.numpy() - value).max() for variable, value in zip(variables, initial, strict=True))
    if cooldown:
        assert moved < 1e-8
    else:  # Adam moves a weight by about the rate (~1e-3) an update.
        assert moved > 1e-4


# --- Progress lines ----------------------------------------------------------------------


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
        trainer.fit(synthetic_pairs_dataset)
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("step ")]
    assert len(lines) == 3
    assert "| - tok/s |" in lines[0] and lines[0].endswith("| ETA -"), lines[0]
    assert re.search(r"\| [\d,]+ tok/s \|", lines[1]) and re.search(r"\| ETA \d+s$", lines[1]), lines[1]


def test_the_last_step_ends_a_progress_line_off_the_log_every_schedule(tmp_path, caplog):
    """3 steps, a line every 2: steps 1-2, then step 3 alone, with its gradient norm, in the log and the summaries."""
    trainer = Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
        tmp_path / "run",
        TrainingConfig(train_steps=3, warmup_steps=20, log_every=2),
    )
    with caplog.at_level("INFO", logger="keras_transformer.trainer"):
        trainer.fit(synthetic_pairs_dataset)
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/3", "step 3/3"], lines
    assert re.search(r"\| grad norm \d+\.\d\d \|", lines[1]), lines[1]
    scalars = run_dir.read_scalars(tmp_path / "run" / run_dir.LOG_DIR / "train")
    assert [step for step, _, _ in scalars["loss"]] == [step for step, _, _ in scalars["grad_norm"]] == [2, 3]


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
    checks = iter(range(11))  # 0: the check before the first step

    def time_used(started):
        if next(checks) == 3:
            raise KeyboardInterrupt
        return 0.0

    monkeypatch.setattr(trainer, "_time_used", time_used)
    with caplog.at_level("INFO", logger="keras_transformer.trainer"), pytest.raises(KeyboardInterrupt):
        trainer.fit(synthetic_pairs_dataset)
    messages, progress = _logged(caplog)
    assert len(progress) == 1 and progress[0].startswith("step 3/10 | loss "), progress
    assert "| grad norm - |" in progress[0]
    assert any(message.startswith("Interrupted at step 3; saved ") for message in messages), messages


def test_a_time_budget_stop_logs_the_steps_since_the_last_progress_line(tmp_path, caplog, monkeypatch):
    trainer = _interval_trainer(tmp_path / "run")
    checks = iter(range(11))  # 0: the check before the first step
    monkeypatch.setattr(trainer, "_time_used", lambda started: float(next(checks) == 3))
    with caplog.at_level("INFO", logger="keras_transformer.trainer"):
        result = trainer.fit(synthetic_pairs_dataset)
    _, progress = _logged(caplog)
    assert result.step == 3 and len(progress) == 1 and progress[0].startswith("step 3/10 | loss "), progress
    assert [step for step, _, _ in run_dir.read_scalars(tmp_path / "run" / run_dir.LOG_DIR / "train")["loss"]] == [3]


def test_a_time_budget_running_out_with_the_last_step_is_no_early_stop(tmp_path, monkeypatch):
    """The budget spent after step 2 of 2: the run is complete, and train.py must not advise running it on."""
    trainer = _cooldown_trainer(tmp_path / "run", 0.0, train_steps=2, max_minutes=60)
    checks = iter(range(3))  # 0: the check before the first step
    monkeypatch.setattr(trainer, "_time_used", lambda started: float(next(checks) == 2))
    result = trainer.fit(synthetic_pairs_dataset)
    assert (result.step, result.stopped_early) == (2, False)


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
        trainer.fit(synthetic_pairs_dataset)
    messages, progress = _logged(caplog)
    assert len(progress) == 1 and progress[0].startswith("step 3/10 | loss "), progress  # steps 1-2's metrics
    assert any(message.startswith("Interrupted at step 3; saved ") and message.endswith(
        "ckpt-3.") for message in messages), messages
