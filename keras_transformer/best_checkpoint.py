"""Validation-driven training: the checkpoint of a run's best validation BLEU, and patience.

A run that validates every `eval_every` steps keeps the weights of its best validation BLEU
so far in `RUN/best` (`run_dir.best_checkpoint`), out of reach of the rotation of
`RUN/checkpoints`; with `patience` N, it stops once N validations in a row have not
improved on that BLEU. Patience counts the validations of the schedule (steps that are
multiples of `eval_every`) only: the one a run makes where it stops (the time budget, the
last step) is no setback, as a run that had gone on would not have made it. The record
survives a resume: the best checkpoint holds its BLEU, and the validations since it are
read from the validation logs.

Contract: `BestCheckpoint` decides on the worker that validates (the chief), from the
metrics of its validations, and runs no collective. Making the other workers follow is
the caller's job (`Trainer` all-reduces each decision): `save` must then run on every
worker alike, as `tf.distribute` requires of any save; the others save to a temporary
directory. It logs to the logger it is given (the trainer's: a run logs under one name)
and does not import `keras_transformer.trainer`, which imports it.
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from keras_transformer.run_dir import (
    BEST_METRIC,
    CHECKPOINT_NAME,
    LOG_DIR,
    best_checkpoint,
    checkpoint_step,
    read_scalars,
)


@dataclasses.dataclass
class _BestSoFar:
    """The chief's record of the best validation BLEU: its step and the validations since.

    A fresh record (`step` -1) takes the first BLEU as its best.
    """

    step: int = -1
    bleu: float = -math.inf
    validations_since: int = 0

    def update(self, step, bleu, counts):
        """Records the BLEU of `step`; returns whether it is a new best (strictly higher).

        A validation that is no better counts against patience only if `counts`.
        """
        if bleu > self.bleu:
            self.step, self.bleu, self.validations_since = step, bleu, 0
            return True
        if counts and step > self.step:  # The best step itself, validated again after a crash, is no setback.
            self.validations_since += 1
        return False


class BestCheckpoint:
    """The best validation BLEU of a run, its checkpoint, and the validations without improvement since.

    Args:
        model: The model whose weights are kept.
        run_dir: The run directory, read by `resume` (`RUN/best` and the validation logs).
        directory: Where `save` writes: `RUN/best` on the chief, a temporary directory on the
            other workers.
        decides: Whether this worker decides: the chief, when it validates.
        eval_every: Steps between validations (`TrainingConfig.eval_every`).
        patience: `TrainingConfig.patience`; 0 never runs out.
        logger: Where the lines go.
    """

    def __init__(self, model, run_dir, directory, *, decides, eval_every, patience, logger):
        self.run_dir = run_dir
        self.decides = decides
        self.eval_every = eval_every
        self.patience = patience
        self.logger = logger
        # The best weights with their BLEU, atomically in one checkpoint of `manager`.
        self._bleu = tf.Variable(-math.inf, dtype=tf.float64, trainable=False, name=BEST_METRIC)
        self.manager = tf.train.CheckpointManager(
            tf.train.Checkpoint(model=model, **{BEST_METRIC: self._bleu}),
            str(directory),
            max_to_keep=1,
            checkpoint_name=CHECKPOINT_NAME,
        )
        self._best = _BestSoFar()

    def resume(self, start_step):
        """Takes up the record at `start_step`: the BLEU of RUN/best, and the validations logged after it."""
        found = best_checkpoint(self.run_dir) if self.decides else None
        if found is None:
            self._best = _BestSoFar()
            return
        path, bleu = found
        self._best = _BestSoFar(checkpoint_step(path), bleu)
        logged = read_scalars(self.run_dir / LOG_DIR / "validation").get(BEST_METRIC, [])
        # Up to `start_step` only: validations of steps past the checkpoint resumed from are redone.
        self._best.validations_since = sum(
            1 for step, _, _ in logged if self._best.step < step <= start_step and self._scheduled(step)
        )

    def record(self, step, metrics):
        """Records the validation BLEU of `step`; returns whether it is a new best.

        `metrics` is None where nothing was validated. Only the deciding worker keeps a record,
        and only in a run that validates every `eval_every` steps, or did before.
        """
        if metrics is None or not (self.decides and (self.eval_every > 0 or self._best.step >= 0)):
            return False
        if BEST_METRIC not in metrics:
            if self.patience:
                self.logger.warning("The validation at step %d gave no %s: patience cannot count it.", step,
                                    BEST_METRIC)
            return False
        best = self._best
        scheduled = self._scheduled(step)
        if best.update(step, metrics[BEST_METRIC], counts=scheduled):
            return True
        self.logger.info(
            "Validation BLEU %.2f at step %d: no better than %.2f at step %d "
            "(%d validation(s) without improvement%s%s).",
            metrics[BEST_METRIC], step, best.bleu, best.step, best.validations_since,
            f", patience {self.patience}" if self.patience else "",
            "" if scheduled else f"; step {step} is off the schedule of every {self.eval_every} steps: not counted",
        )
        return False

    def _scheduled(self, step):
        """Whether `step`'s validation is one of the schedule's, which patience counts."""
        return self.eval_every > 0 and step % self.eval_every == 0

    def save(self, step):
        """Saves the model as the best checkpoint of `step`, with its BLEU; to be called on every worker alike."""
        self._bleu.assign(self._best.bleu)  # The chief's BLEU; the other workers' copies are thrown away.
        path = self.manager.save(checkpoint_number=step)
        if self.decides:
            self.logger.info("Best validation BLEU so far, %.2f at step %d: saved %s.", self._best.bleu, step, path)

    def out_of_patience(self):
        """Whether `patience` validations in a row have not improved on the best BLEU (known where it decides)."""
        return bool(self.patience) and self._best.validations_since >= self.patience

    def no_improvement(self):
        """Why patience stopped the run, for the log."""
        why = f"validation BLEU has not improved for {self.patience} validations (patience)"
        if self.decides:
            why += f"; the best, {self._best.bleu:.2f}, is step {self._best.step}'s"
        return why
