"""Progress reports of a training run: progress lines, training summaries and time estimates.

Contract: `TrainingProgress` is told of every step `Trainer.fit` trains (its metrics and how
long it took) and reports on them; it decides nothing. It reads the learning-rate schedule
and the optimizer's count of updates, writes the training summaries to the summary writer
it is given and logs to the logger it is given (the trainer's: a run logs under one name).
It runs no collective and changes no variable, so every worker may call it alike (those
that are not the chief with a no-op summary writer). It does not import
`keras_transformer.trainer`, which imports it.

Timing: a step that traced a step function is left out of the speeds and the estimates,
not out of the loss and accuracy: it times tracing, not training. What cannot be told
(the speed of an interval made only of such steps) is reported as unknown ("-"), not as 0.
"""

from __future__ import annotations

import math
import time

import tensorflow as tf

# Timed steps (those that trace no step function) behind the first estimate of the run's length.
ESTIMATE_AFTER_STEPS = 10


def format_duration(seconds):
    """'1h02m', '3m05s' or '42s'."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{seconds:02d}s"
    return f"{seconds}s"


def describe_plan(config, start_step):
    """What `Trainer.fit` trains from `start_step` under `config`: '800 steps (1-800), or 60 minutes, or until ...'."""
    plan = f"{config.train_steps - start_step} steps ({start_step + 1}-{config.train_steps})"
    if config.max_minutes:
        plan += f", or {config.max_minutes:g} minutes"
    if config.patience:
        plan += f", or until {config.patience} validations in a row do not improve the validation BLEU"
    if config.cooldown:
        budget = "steps or minutes, whichever run out first" if config.max_minutes else "steps"
        plan += f"; the learning rate falls to zero over the last {config.cooldown:.0%} of the {budget}"
    return plan


def validation_time_left(config, step, validation_seconds):
    """Seconds of the validations still due after `step`, the final one included, at `validation_seconds` each.

    `validation_seconds` is the last validation's time: 0 until a validation has been timed
    (None), and on the workers that do not validate.
    """
    if validation_seconds is None:
        return 0.0
    every = config.eval_every
    due = max(0, (config.train_steps - 1) // every - step // every) if every else 0
    return (due + 1) * validation_seconds


class _Interval:
    """Sums of the step metrics since the last progress line.

    Steps that traced a step function are left out of the timing (`timed_*`), not
    out of the loss and accuracy.
    """

    def __init__(self):
        self.sums = {"loss_sum": 0.0, "correct": 0.0, "tokens": 0.0}
        self.timed_steps = 0
        self.timed_seconds = 0.0
        self.timed_tokens = 0.0

    def add(self, metrics, seconds, timed):
        for name in self.sums:
            self.sums[name] += metrics[name]
        if timed:
            self.timed_steps += 1
            self.timed_seconds += seconds
            self.timed_tokens += metrics["tokens"]


class TrainingProgress:
    """The progress report of one `Trainer.fit` call.

    Args:
        config: The run's `TrainingConfig` (read: `train_steps`, `max_minutes`, `eval_every`).
        schedule: The learning-rate schedule, called with the optimizer's count of updates.
        optimizer: The optimizer; only its `iterations` are read.
        writer: The summary writer of the training curves.
        started: `time.monotonic()` at the start of the call; the time budget counts from it.
        validation_time_left: `validation_time_left(step)`: seconds of the validations still
            due after `step` (see `validation_time_left`).
        validates: Whether this worker validates: its first estimate then says that the
            validations come on top.
        logger: Where the lines go.
    """

    def __init__(self, config, schedule, optimizer, writer, *, started, validation_time_left, validates, logger):
        self.config = config
        self.schedule = schedule
        self.optimizer = optimizer
        self.writer = writer
        self.started = started
        self.validation_time_left = validation_time_left
        self.validates = validates
        self.logger = logger
        self._interval = _Interval()
        self._timed_steps = 0
        self._timed_seconds = 0.0
        self._timed_tokens = 0.0

    @property
    def tokens_per_second(self):
        """Target tokens (non-pad, all replicas) per second of the timed steps so far; 0.0 before any."""
        return self._timed_tokens / self._timed_seconds if self._timed_seconds else 0.0

    def add(self, step, metrics, seconds, timed):
        """Counts `step`: its `metrics` sums, and its `seconds` if `timed` (it traced no step function).

        Logs the first estimate of the time left after `ESTIMATE_AFTER_STEPS` timed steps.
        """
        self._interval.add(metrics, seconds, timed)
        if timed:
            self._timed_seconds += seconds
            self._timed_tokens += metrics["tokens"]
            self._timed_steps += 1
            if self._timed_steps == ESTIMATE_AFTER_STEPS:
                self._log_estimate(step, self._timed_seconds / self._timed_steps)

    def log(self, step, grad_norm):
        """The progress line and training summaries of the steps up to `step`, which start a new interval."""
        # A new interval first: interrupted while logging, the run must not log these steps again.
        logged, self._interval = self._interval, _Interval()
        self._log_interval(step, logged, grad_norm)

    def log_rest(self, step):
        """A progress line for the steps since the last one, when the run stops between lines."""
        if self._interval.sums["tokens"]:
            self._log_interval(step, self._interval, None)

    def _log_interval(self, step, interval, grad_norm):
        """One progress line and the training summaries of `interval`.

        Loss and accuracy are token-weighted over the interval; the gradient norm is the
        one of the global gradient of the last step, None when it was not computed (an
        interval cut short by an interruption).
        """
        sums = interval.sums
        tokens = max(sums["tokens"], 1.0)
        loss = sums["loss_sum"] / tokens
        accuracy = sums["correct"] / tokens
        learning_rate = self._last_learning_rate()
        elapsed = time.monotonic() - self.started
        tokens_per_second, eta = self._speed(interval, step, elapsed)
        self.logger.info(
            "step %d/%d | loss %.3f | acc %.3f | lr %.2e | grad norm %s | %s tok/s | elapsed %s | ETA %s",
            step,
            self.config.train_steps,
            loss,
            accuracy,
            learning_rate,
            "-" if grad_norm is None else f"{grad_norm:.2f}",
            "-" if tokens_per_second is None else f"{tokens_per_second:,.0f}",
            format_duration(elapsed),
            "-" if eta is None else format_duration(eta),
        )
        with self.writer.as_default(step=step):
            tf.summary.scalar("loss", loss)
            tf.summary.scalar("accuracy", accuracy)
            tf.summary.scalar("learning_rate", learning_rate)
            if grad_norm is not None:
                tf.summary.scalar("grad_norm", grad_norm)
            if tokens_per_second is not None:  # A 0 would be a false dip in the curve.
                tf.summary.scalar("tokens_per_second", tokens_per_second)

    def _last_learning_rate(self):
        """The rate of the last update applied.

        From the optimizer's count of updates, not the trainer's `step`: with float16 loss
        scaling, a step whose gradients overflowed applies no update and the schedule does
        not advance.
        """
        return float(self.schedule(max(int(self.optimizer.iterations.numpy()) - 1, 0)))

    def _speed(self, interval, step, elapsed):
        """`(target tokens per second, seconds left)` of the interval; None for what it cannot tell.

        An interval made only of steps that traced a step function has no timing: its
        speed is unknown (not 0), and so is the time left, unless no step is left.
        """
        config = self.config
        steps_left = config.train_steps - step
        if not interval.timed_steps or not interval.timed_seconds:
            return None, (0.0 if steps_left == 0 else None)
        eta = steps_left * interval.timed_seconds / interval.timed_steps + self.validation_time_left(step)
        if config.max_minutes:
            eta = min(eta, max(0.0, config.max_minutes * 60 - elapsed))
        return interval.timed_tokens / interval.timed_seconds, eta

    def _log_estimate(self, step, seconds_per_step):
        """How long the steps left take, at the pace of the first timed steps."""
        config = self.config
        steps_left = config.train_steps - step
        seconds = steps_left * seconds_per_step
        message = (
            f"{seconds_per_step:.2f} s a step over the first {ESTIMATE_AFTER_STEPS} timed steps: the {steps_left} "
            f"steps left take about {format_duration(seconds)}"
        )
        if self.validates:
            message += ", plus the validations" if config.eval_every else ", plus the final validation"
        budget_left = math.inf
        if config.max_minutes:
            budget_left = max(0.0, config.max_minutes * 60 - (time.monotonic() - self.started))
        if seconds > budget_left:
            message += (
                f"; the {config.max_minutes:g}-minute budget stops the run near step "
                f"{step + int(budget_left / seconds_per_step)}"
            )
        self.logger.info("%s.", message)
