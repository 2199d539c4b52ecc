"""TrainingProgress against its arithmetic, recomputed here, on a clock the test moves.

No model and no trainer: the steps' metrics and timings are given, the schedule is a
plain function and the optimizer only its count of updates. How a real run's lines look
(the traced first step, the interval logged on a stop): test_trainer.py.
"""

import logging
import re
import types

import pytest
import tensorflow as tf

from keras_transformer import progress as progress_module
from keras_transformer import run_dir
from keras_transformer.progress import TrainingProgress, describe_plan, format_duration
from keras_transformer.trainer import TrainingConfig

LOGGER = "keras_transformer.test_progress"


class Clock:
    """`time.monotonic` of the progress module, moved by the test."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    return clock


def _progress(tmp_path, *, train_steps=10, max_minutes=None, validation_seconds=0.0, iterations=0, validates=False):
    def schedule(updates):
        return 1e-3 * (int(updates) + 1)  # Tells which count of updates it was called with.

    optimizer = types.SimpleNamespace(iterations=tf.Variable(iterations, dtype=tf.int64))
    progress = TrainingProgress(
        TrainingConfig(train_steps=train_steps, warmup_steps=20, max_minutes=max_minutes),
        schedule, optimizer, tf.summary.create_file_writer(str(tmp_path)), started=0.0,
        validation_time_left=lambda step: validation_seconds, validates=validates,
        logger=logging.getLogger(LOGGER),
    )
    return progress, optimizer


def _metrics(tokens, loss_sum=0.0, correct=0.0):
    return {"loss_sum": loss_sum, "correct": correct, "tokens": float(tokens)}


def _lines(caplog):
    return [record.getMessage() for record in caplog.records if record.name == LOGGER]


def _field(line, pattern):
    match = re.search(pattern, line)
    assert match, (pattern, line)
    return match.group(1)


def test_speed_eta_loss_and_rate_of_each_interval(tmp_path, clock, caplog):
    """Step 1 traced (untimed), steps 2-3 timed; then step 4 alone, timed, whose update overflowed (fp16)."""
    progress, optimizer = _progress(tmp_path, validation_seconds=4.0)
    steps = [  # (step, target tokens, seconds, timed, loss sum, correct tokens)
        (1, 100, 30.0, False, 400.0, 10.0),
        (2, 40, 2.0, True, 120.0, 8.0),
        (3, 60, 3.0, True, 150.0, 12.0),
    ]
    with caplog.at_level("INFO", logger=LOGGER):
        for step, tokens, seconds, timed, loss_sum, correct in steps:
            clock.now += seconds
            progress.add(step, _metrics(tokens, loss_sum, correct), seconds, timed)
        optimizer.iterations.assign(3)
        progress.log(3, grad_norm=1.5)
        clock.now += 1.0
        progress.add(4, _metrics(30), 1.0, True)  # A skipped update: the optimizer stays at 3 updates.
        progress.log(4, grad_norm=None)
    first, second = _lines(caplog)

    # Loss and accuracy: over every token of the interval, the traced step's too.
    assert float(_field(first, r"loss ([\d.]+)")) == pytest.approx(670.0 / 200, abs=5e-4)
    assert float(_field(first, r"acc ([\d.]+)")) == pytest.approx(30.0 / 200, abs=5e-4)
    # Speed: the timed steps' tokens over their seconds, the traced step left out.
    assert _field(first, r"\| ([\d,]+) tok/s") == f"{100 / 5.0:,.0f}"
    assert _field(second, r"\| ([\d,]+) tok/s") == f"{30 / 1.0:,.0f}"
    # ETA: the steps left at this interval's pace (not the run's), plus the validations still due.
    assert _field(first, r"ETA (\S+)$") == format_duration((10 - 3) * 5.0 / 2 + 4.0)
    assert _field(second, r"ETA (\S+)$") == format_duration((10 - 4) * 1.0 / 1 + 4.0)
    assert _field(first, r"elapsed (\S+) ") == format_duration(35.0)
    # The rate of the last update applied: update 3 (called with 2 updates before it), for both lines.
    assert _field(first, r"lr (\S+) ") == _field(second, r"lr (\S+) ") == f"{1e-3 * 3:.2e}"
    # The run's speed: every timed step so far.
    assert progress.tokens_per_second == pytest.approx((40 + 60 + 30) / (2.0 + 3.0 + 1.0))

    tf.summary.flush(progress.writer)
    scalars = run_dir.read_scalars(tmp_path)
    assert [(step, value) for step, _, value in scalars["tokens_per_second"]] == [
        (3, pytest.approx(20.0)), (4, pytest.approx(30.0))
    ]
    assert [(step, value) for step, _, value in scalars["learning_rate"]] == [
        (3, pytest.approx(3e-3)), (4, pytest.approx(3e-3))
    ]
    assert [step for step, _, _ in scalars["grad_norm"]] == [3]


def test_the_eta_stops_at_the_end_of_the_time_budget(tmp_path, clock, caplog):
    """50 s into a 1-minute budget, 8 steps of 5 s left: the run ends in 10 s, not 40 s."""
    progress, _ = _progress(tmp_path, max_minutes=1)
    clock.now = 50.0
    with caplog.at_level("INFO", logger=LOGGER):
        progress.add(2, _metrics(10), 5.0, True)
        progress.log(2, grad_norm=1.0)
        clock.now = 70.0  # Past the budget: nothing left.
        progress.add(3, _metrics(10), 5.0, True)
        progress.log(3, grad_norm=1.0)
    first, second = _lines(caplog)
    assert _field(first, r"ETA (\S+)$") == format_duration(60.0 - 50.0)
    assert _field(second, r"ETA (\S+)$") == format_duration(0.0)


def test_the_first_estimate_is_the_pace_of_the_first_timed_steps_and_where_the_budget_ends(
    tmp_path, clock, caplog
):
    """A traced step of 30 s, then 10 timed steps of 2 s: 89 steps left at 2 s; 10 s of the budget buy 5 steps."""
    progress, _ = _progress(tmp_path, train_steps=100, max_minutes=1, validates=True)
    with caplog.at_level("INFO", logger=LOGGER):
        clock.now += 30.0
        progress.add(1, _metrics(10), 30.0, False)
        for step in range(2, 12):
            clock.now += 2.0
            progress.add(step, _metrics(10), 2.0, True)
    (estimate,) = _lines(caplog)
    assert estimate == (
        f"2.00 s a step over the first 10 timed steps: the 89 steps left take about {format_duration(89 * 2.0)}, "
        f"plus the final validation; the 1-minute budget stops the run near step {11 + int((60 - 50) / 2.0)}."
    )


@pytest.mark.parametrize(
    "seconds, text", [(42.4, "42s"), (59.6, "1m00s"), (185, "3m05s"), (3600, "1h00m"), (3725, "1h02m")]
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_a_resumed_plan_counts_the_steps_left_and_names_every_limit():
    config = TrainingConfig(train_steps=800, warmup_steps=20, max_minutes=60, eval_every=100, patience=3,
                            cooldown=0.2)
    assert describe_plan(config, 300) == (
        "500 steps (301-800), or 60 minutes, or until 3 validations in a row do not improve the validation BLEU; "
        "the learning rate falls to zero over the last 20% of the steps or minutes, whichever run out first"
    )
    assert describe_plan(TrainingConfig(train_steps=800, warmup_steps=20, cooldown=0.2), 0) == (
        "800 steps (1-800); the learning rate falls to zero over the last 20% of the steps"
    )
