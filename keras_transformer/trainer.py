"""The training loop: synchronous data parallelism, resumable checkpoints, TensorBoard.

One loop serves every `tf.distribute.Strategy` (see `keras_transformer.distribution`):

* Batches are per replica, from `strategy.distribute_datasets_from_function`; one step
  consumes one batch on every replica (the global batch).
* The loss of a replica is its sum of token losses divided by the number of real tokens
  of the GLOBAL batch (all-reduced), so the gradients the optimizer sums over replicas
  are those of the global mean: the result does not depend on how the global batch is
  split over replicas, beyond float rounding. Padding is the model's `pad_id`.
* float16 (dynamic loss scaling): a step is skipped, and the loss scale halved, when the
  gradients of ANY replica of any worker overflowed; all of them decide on one
  all-reduced flag (`schedule.AgreedLossScaleOptimizer`), so they skip or apply together.
  A skipped step advances `step` but not `optimizer.iterations` nor the schedule.
* With `jit_compile`, XLA compiles the forward and backward pass; the all-reduces and
  the optimizer update stay outside the compiled function, where every strategy
  supports them. Every new batch shape compiles anew, so XLA pays off only with few
  distinct shapes.
* The step counter is a variable updated inside the step function, atomically with the
  weights; the checkpoint holds it with the model, the optimizer state and the dropout
  seed states.

Resuming, and where the data stands: the training stream is the dataset returned by
`dataset_fn`, repeated forever; it is deterministic for a given seed (the shuffle is
seeded and every epoch reshuffles deterministically). A run restored at step `s` skips
the first `s * replicas_per_worker` batches of its worker's stream, so it sees exactly
the batches an uninterrupted run would have seen, and only the steps after the last
checkpoint are redone. Skipping re-runs only the cheap part of the pipeline (shuffling,
bucketing, padding of cached token ids), not the model: little next to the steps it
skips (see docs/performance.md). This holds as long as the seed, the data flags and the
numbers of replicas and of workers (each reads its shard of the pairs) are unchanged; we
chose it over checkpointing the tf.data iterator, whose state includes the whole shuffle
buffer (large on a big corpus, and in every checkpoint) and which not every pipeline op
supports.

Validation-driven training (`keras_transformer.best_checkpoint`): a run that validates
every `eval_every` steps keeps the checkpoint of its best validation BLEU in `RUN/best`
and, with `patience`, stops once that BLEU no longer improves. Only the chief validates;
it decides, and every worker follows through an all-reduce (see `_agreed`): all save the
best checkpoint and all stop together.

Progress lines, training summaries and time estimates: `keras_transformer.progress`.

Multi-worker: every worker runs the same loop; only the chief writes checkpoints under
`RUN/checkpoints`, summaries and logs (the others write their checkpoints to a temporary
directory, as `tf.distribute` requires all workers to save), and the workers agree on
stopping early with an all-reduce, so that none waits forever for the others. A worker
that dies without warning makes the others' next all-reduce fail: they raise
`distribution.WorkerLostError` and save nothing (the run resumes from its latest checkpoint).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import keras
import tensorflow as tf

from keras_transformer import distribution
from keras_transformer.best_checkpoint import BestCheckpoint
from keras_transformer.losses import label_smoothed_cross_entropy, sum_over_replicas, token_accuracy
from keras_transformer.precision import DTYPE_POLICIES
from keras_transformer.progress import TrainingProgress, describe_plan, validation_time_left
from keras_transformer.run_dir import (
    BEST_DIR,
    CHECKPOINT_DIR,
    CHECKPOINT_NAME,
    LOG_DIR,
    RunDirError,
    check_checkpointable,
    checkpoint_step,
    checkpoints,
    restore_checkpoint,
    validated_steps,
)
from keras_transformer.schedule import DEFAULT_WARMUP_STEPS, TransformerSchedule, make_optimizer

logger = logging.getLogger(__name__)

# Checkpoint keys that only a loss-scaled (float16) optimizer writes.
LOSS_SCALE_PREFIX = "optimizer/dynamic_scale/"


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """How long and how to train; everything but the model and the data.

    Attributes:
        train_steps: Total number of steps (global batches) of the run, resumed or not.
        max_minutes: Wall-clock budget of this invocation's training loop (validation
            included); when exceeded, training stops cleanly after a checkpoint. None:
            no budget.
        warmup_steps: Warm-up of the learning-rate schedule.
        learning_rate_scale: Multiplier of the paper's learning rate.
        cooldown: Fraction of the run's budget, at its end, over which the learning
            rate falls linearly to zero: of `train_steps`, or of `max_minutes` when
            that runs out first (see `TransformerSchedule`); 0: no cooldown.
        label_smoothing: `eps` of the label-smoothed loss.
        log_every: Steps between progress lines and training summaries.
        checkpoint_every: Steps between checkpoints (one is also written at the end).
        keep_checkpoints: How many of the latest checkpoints to keep.
        eval_every: Steps between validations; 0 validates only at the end. With
            `eval_every`, the run keeps the checkpoint of its best validation BLEU.
        patience: Stop when this many validations in a row have not improved on the
            best validation BLEU; 0 trains all `train_steps`. Needs `eval_every`.
        mixed_precision: "none", "bf16" or "fp16" (see `DTYPE_POLICIES`).
        jit_compile: Compile the forward and backward pass with XLA.
    """

    train_steps: int
    max_minutes: float | None = None
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    learning_rate_scale: float = 1.0
    cooldown: float = 0.0
    label_smoothing: float = 0.1
    log_every: int = 100
    checkpoint_every: int = 1000
    keep_checkpoints: int = 5
    eval_every: int = 0
    patience: int = 0
    mixed_precision: str = "none"
    jit_compile: bool = False

    def __post_init__(self):
        positive = ("train_steps", "warmup_steps", "log_every", "checkpoint_every", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}.")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"max_minutes must be positive, got {self.max_minutes!r}.")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be 0 (never) or positive, got {self.eval_every!r}.")
        if self.patience < 0:
            raise ValueError(f"patience must be 0 (off) or positive, got {self.patience!r}.")
        if self.patience and not self.eval_every:
            raise ValueError(f"patience ({self.patience}) counts validations: it needs eval_every > 0.")
        if not 0.0 <= self.cooldown <= 1.0:
            raise ValueError(f"cooldown must be in [0, 1], got {self.cooldown!r}.")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing!r}.")
        if self.mixed_precision not in DTYPE_POLICIES:
            raise ValueError(f"mixed_precision must be one of {list(DTYPE_POLICIES)}, got {self.mixed_precision!r}.")


class EmptyDatasetError(ValueError):
    """The training dataset of a worker gave no batch at all."""


@dataclasses.dataclass(frozen=True)
class TrainingResult:
    """What a call of `Trainer.fit` did.

    Attributes:
        start_step: The step training resumed from (0 for a fresh run).
        step: The step reached and checkpointed.
        stopped_early: Whether the time budget ended training before `train_steps`.
        seconds: Wall time of the training loop.
        tokens_per_second: Target tokens (non-pad, all replicas) per second of training steps.
        out_of_patience: Whether `patience` validations without improvement ended
            training (in this call or an earlier one) before `train_steps`.
    """

    start_step: int
    step: int
    stopped_early: bool
    seconds: float
    tokens_per_second: float
    out_of_patience: bool = False


class Trainer:
    """Trains a model under a distribution strategy with the paper's recipe.

    Seed the run first (`keras.utils.set_random_seed`) for reproducible weights and
    dropout. Seeding drops TensorFlow's kernel cache, where a `SubwordTokenizer` keeps its
    resource: make tokenizers after seeding, and inside `dataset_fn`.

    Args:
        strategy: From `keras_transformer.distribution.make_strategy`.
        model_fn: Called with a Keras dtype policy name ("float32", "mixed_bfloat16", ...)
            inside `strategy.scope()`; returns a `Transformer` (built or not).
        run_dir: The run directory; checkpoints go to `RUN/checkpoints`, summaries to
            `RUN/logs/{train,validation}`.
        config: A `TrainingConfig`.
        validate_fn: Optional `validate_fn(model, step) -> {name: float}`, called on the
            chief every `eval_every` steps and at the end, with the validation summary
            writer as default writer (it may write its own summaries, e.g. images,
            before the returned metrics are written). A run that stopped during a due
            validation (interrupted or killed) validates that step again on resume.
            Its "bleu" (`run_dir.BEST_METRIC`) picks the best checkpoint and drives
            `patience`; the other workers pass None.
    """

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        model_fn: Callable[[str], keras.Model],
        run_dir,
        config: TrainingConfig,
        validate_fn: Callable[[keras.Model, int], dict] | None = None,
    ):
        self.strategy = strategy
        self.config = config
        self.run_dir = Path(run_dir)
        self.validate_fn = validate_fn
        self.is_chief = distribution.is_chief(strategy)
        if config.patience and self.is_chief and validate_fn is None:
            raise ValueError(f"patience ({config.patience}) needs a validate_fn on the chief, whose BLEU it watches.")
        if config.mixed_precision == "fp16":
            distribution.prepare_for_float16(strategy)
        with strategy.scope():
            self.model = model_fn(DTYPE_POLICIES[config.mixed_precision])
            if not self.model.built:
                self.model.build()
            check_checkpointable(self.model)
            self.schedule = TransformerSchedule(
                self.model.d_model, config.warmup_steps, config.learning_rate_scale, config.cooldown
            )
            self.optimizer = make_optimizer(self.schedule, loss_scaling=config.mixed_precision == "fp16")
            self.optimizer.build(self.model.trainable_variables)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        # Keras does not checkpoint the dropout seed states with the model; saving them
        # makes a resumed run draw the same dropout masks as an uninterrupted one.
        self.checkpoint = tf.train.Checkpoint(
            model=self.model,
            optimizer=self.optimizer,
            step=self.step,
            random_state=list(self.model.non_trainable_variables),
        )
        self._checkpoint_dir = self.run_dir / CHECKPOINT_DIR
        self._save_dir = (
            self._checkpoint_dir
            if self.is_chief
            else Path(tempfile.mkdtemp(prefix=f"worker{distribution.worker_index(strategy)}-checkpoints-"))
        )
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, str(self._save_dir), max_to_keep=config.keep_checkpoints, checkpoint_name=CHECKPOINT_NAME
        )
        # The other workers save their best checkpoints to their temporary directory, as for `manager`.
        self._best = BestCheckpoint(
            self.model, self.run_dir, self.run_dir / BEST_DIR if self.is_chief else self._save_dir / BEST_DIR,
            decides=self.is_chief and validate_fn is not None, eval_every=config.eval_every, patience=config.patience,
            logger=logger,
        )
        self._validation_seconds = None
        self._gradients = self._make_gradients_fn()
        self._train_steps = {}
        self._saved_step = None
        self._stop_requested = False

    def request_stop(self):
        """Asks `fit` to checkpoint and stop after the current step, on every worker alike.

        For a SIGTERM handler of a multi-worker run: a worker that stopped on its own
        would leave the others waiting in the next all-reduce, which then fails. `fit`
        agrees on the request with the other workers after each step, and all of them
        stop after the same step, as on KeyboardInterrupt (which `fit` re-raises).
        """
        self._stop_requested = True

    def restore(self):
        """Restores the latest checkpoint of `RUN/checkpoints`, if any.

        Returns:
            The step to continue from (0 when there is no checkpoint).

        Raises:
            RunDirError: When the latest checkpoint cannot be restored.
        """
        found = checkpoints(self._checkpoint_dir)
        if found:
            try:
                restore_checkpoint(self.checkpoint, found[-1], partial=False)
            except RunDirError as error:
                self._raise_if_saved_in_another_precision(found[-1])
                if len(found) > 1:
                    advice = f"If only this file is damaged, delete {found[-1]}.* to resume from {found[-2]}."
                else:
                    advice = f"To train the run from the start, delete {self._checkpoint_dir}."
                raise RunDirError(f"Cannot resume the run. {str(error).rstrip('.')}. {advice}") from None
            self._saved_step = int(self.step.numpy())
            logger.info("Restored step %d from %s.", self._saved_step, found[-1])
        return int(self.step.numpy())

    def _raise_if_saved_in_another_precision(self, path):
        """A one-line error when `path` was saved with float16's loss scaling and this run has none, or the reverse.

        The optimizers differ then (a `LossScaleOptimizer` wraps float16's), so the
        restore fails on an optimizer variable, which reads as another architecture.
        """
        try:
            saved_fp16 = any(name.startswith(LOSS_SCALE_PREFIX) for name, _ in tf.train.list_variables(path))
        except Exception:  # A damaged file: the caller's message says so.
            return
        if saved_fp16 != (self.config.mixed_precision == "fp16"):
            trained = "mixed_precision='fp16'" if saved_fp16 else "mixed_precision 'none' or 'bf16'"
            raise RunDirError(
                f"Cannot resume the run. Checkpoint {path} was saved with {trained}, and this run has "
                f"mixed_precision={self.config.mixed_precision!r}: resume it in the precision it was trained in."
            )

    def save(self):
        """Writes a checkpoint numbered by the current step; returns its path.

        Raises:
            OSError: If it cannot be written (a full disk): one line, saying where the run resumes.
        """
        step = int(self.step.numpy())
        prefix = self._save_dir / f"{CHECKPOINT_NAME}-{step}"
        try:
            path = self.manager.save(checkpoint_number=step)
        except tf.errors.OpError as error:
            shutil.rmtree(f"{prefix}_temp", ignore_errors=True)  # What TensorFlow had written of it.
            found = checkpoints(self._save_dir)
            resume = f"the same command resumes from {found[-1]}" if found else "the same command starts it again"
            # "{{function_node ...}} PATH; File too large [Op:SaveV2]": what the system said.
            reason = re.sub(r"\s*\[Op:\w+\]$", "", error.message.strip().splitlines()[0].rsplit("; ", 1)[-1])
            raise OSError(f"Cannot write checkpoint {prefix} ({reason}); {resume}.") from None
        self._saved_step = step
        return path

    def fit(self, dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset]) -> TrainingResult:
        """Trains from the latest checkpoint up to `config.train_steps` (or the time budget, or `patience`).

        Args:
            dataset_fn: `dataset_fn(input_context)` returns ONE epoch of per-replica
                batches `((source_ids, decoder_inputs), labels)` for this worker, padded
                with the model's `pad_id`, e.g.
                `keras_transformer.data.make_training_dataset(..., input_context=...)`.
                It must be deterministic for a given seed (see the module docstring).

        Returns:
            A `TrainingResult`. On KeyboardInterrupt, a checkpoint is written and the
            exception re-raised.

        Raises:
            EmptyDatasetError: When `dataset_fn`'s epoch has no batch.
            RunDirError: When the latest checkpoint cannot be restored.
            distribution.WorkerLostError: When another worker of a multi-worker run died (killed
                without a SIGTERM, crashed, lost its machine): nothing is saved, the
                run resumes from its latest checkpoint.
        """
        config = self.config
        start_step = self.restore()
        self._best.resume(start_step)
        started = time.monotonic()
        writers = self._summary_writers()
        if self._agreed(self._validation_cut_off(start_step)):
            logger.info("The validation at step %d was cut off; validating it again.", start_step)
            self._evaluate(start_step, writers["validation"])
        if start_step >= config.train_steps:
            logger.info("Already trained %d of %d steps; nothing to do.", start_step, config.train_steps)
            self._cleanup_worker_checkpoints()
            return TrainingResult(start_step, start_step, False, 0.0, 0.0)
        if self._agreed(self._best.out_of_patience()):
            logger.info("Stopped at step %d of %d: %s; nothing to do.", start_step, config.train_steps,
                        self._best.no_improvement())
            self._cleanup_worker_checkpoints()
            return TrainingResult(start_step, start_step, False, 0.0, 0.0, out_of_patience=True)
        logger.info("Training %s (%s parameters) on %s: %s.", type(self.model).__name__,
                    f"{self.model.count_params():,}", _replicas(self.strategy.num_replicas_in_sync),
                    describe_plan(config, start_step))
        iterator = iter(self._training_stream(dataset_fn, start_step))
        step = start_step
        progress = TrainingProgress(
            config, self.schedule, self.optimizer, writers["train"], started=started, logger=logger,
            validation_time_left=self._validation_time_left, validates=self.validate_fn is not None and self.is_chief,
        )
        stopped_early = out_of_patience = False
        time_used = self._time_used(started)
        try:
            while step < config.train_steps:
                self._set_budget_used(step, time_used)
                with_grad_norm = (step + 1) % config.log_every == 0 or step + 1 == config.train_steps
                tracing = with_grad_norm not in self._train_steps
                step_started = time.monotonic()
                try:
                    metrics = self._train_step(with_grad_norm)(iterator)
                except tf.errors.OutOfRangeError:
                    # The stream repeats its epoch forever: it ends only if the epoch is empty.
                    raise EmptyDatasetError(
                        "The training dataset gave no batch: dataset_fn returned an empty epoch (every pair "
                        "filtered out, or no pair in this worker's shard)."
                    ) from None
                metrics = {name: float(value) for name, value in metrics.items()}
                step_seconds = time.monotonic() - step_started
                step += 1
                progress.add(step, metrics, step_seconds, timed=not tracing)
                if with_grad_norm:
                    progress.log(step, metrics["grad_norm"])
                if step % config.checkpoint_every == 0:
                    self.save()
                out_of_patience = self._validation_due(step) and self._evaluate(step, writers["validation"])
                if self._stop_agreed():
                    raise KeyboardInterrupt
                if out_of_patience:
                    progress.log_rest(step)
                    logger.info("Stopping at step %d of %d: %s.", step, config.train_steps, self._best.no_improvement())
                    break
                time_used = self._time_used(started)
                if time_used >= 1.0:
                    stopped_early = step < config.train_steps
                    progress.log_rest(step)
                    logger.info("Time budget of %g minutes reached at step %d.", config.max_minutes, step)
                    break
        except distribution.PEER_FAILURES as error:
            if distribution.num_workers(self.strategy) == 1:
                raise
            # Not saved here: the failed step may have updated some weights (those whose
            # all-reduce finished before the other worker died) and not others.
            self._cleanup_worker_checkpoints()
            # `step`, not `self.step`: the failed step may have run its `assign_add` already.
            raise self._worker_lost(error, step) from None
        except KeyboardInterrupt:
            # Python raises it once the step's TensorFlow call returns, often before `step += 1`
            # ran: that step's metrics are lost, but the model and `self.step` have taken it.
            step = int(self.step.numpy())
            progress.log_rest(step)
            path = self.save()
            logger.info("Interrupted at step %d; saved %s.", step, path)  # The command says how to resume.
            self._cleanup_worker_checkpoints()
            raise
        finally:
            for writer in writers.values():
                writer.flush()
        if self._saved_step != step:
            self.save()
        if not self._validation_due(step):  # Else the loop validated this step (the time budget or patience ended it).
            self._evaluate(step, writers["validation"])
        self._cleanup_worker_checkpoints()
        seconds = time.monotonic() - started
        return TrainingResult(
            start_step, step, stopped_early, seconds, progress.tokens_per_second, out_of_patience
        )

    def _training_stream(self, dataset_fn, start_step):
        """The distributed, endless stream of batches, positioned at `start_step`."""

        def stream(input_context):
            batches_per_step = input_context.num_replicas_in_sync // input_context.num_input_pipelines
            return dataset_fn(input_context).repeat().skip(start_step * batches_per_step)

        return self.strategy.distribute_datasets_from_function(stream)

    def _train_step(self, with_grad_norm):
        """The step function (traced once per value of `with_grad_norm`).

        Computing the norm of the global gradient takes one more all-reduce of all
        gradients (the optimizer all-reduces its own copy), so it is done only on the
        steps that are logged.
        """
        if with_grad_norm not in self._train_steps:
            self._train_steps[with_grad_norm] = self._make_train_step(with_grad_norm)
        return self._train_steps[with_grad_norm]

    def _make_train_step(self, with_grad_norm):
        model, optimizer, strategy = self.model, self.optimizer, self.strategy
        variables = model.trainable_variables
        gradients = self._gradients
        pad_id = model.pad_id

        def replica_step(batch):
            (source_ids, decoder_inputs), labels = batch
            tokens = tf.reduce_sum(tf.cast(tf.not_equal(labels, pad_id), tf.float32))
            global_tokens = tf.maximum(sum_over_replicas(tokens), 1.0)
            grads, loss_sum, correct = gradients(source_ids, decoder_inputs, labels, global_tokens)
            metrics = {"loss_sum": loss_sum, "correct": correct, "tokens": tokens}
            if with_grad_norm:
                loss_scale = tf.cast(optimizer.scale_loss(tf.constant(1.0)), tf.float32)
                metrics["grad_norm"] = tf.linalg.global_norm(sum_over_replicas(grads)) / loss_scale
            optimizer.apply(grads, variables)
            return metrics

        # Without AutoGraph (no Python control flow on tensors here or in the model): converting
        # the model's code slowed every run's start by seconds.
        @tf.function(autograph=False)
        def train_step(iterator):
            per_replica = strategy.run(replica_step, args=(next(iterator),))
            self.step.assign_add(1)
            # Every replica holds the same global gradient norm; the rest are sums.
            return {
                name: strategy.reduce(
                    tf.distribute.ReduceOp.MEAN if name == "grad_norm" else tf.distribute.ReduceOp.SUM,
                    value,
                    axis=None,
                )
                for name, value in per_replica.items()
            }

        return train_step

    def _make_gradients_fn(self):
        """Forward and backward pass of one replica: (gradients, loss sum, correct tokens)."""
        model, optimizer = self.model, self.optimizer
        variables = model.trainable_variables
        label_smoothing = self.config.label_smoothing
        pad_id = model.pad_id

        @tf.function(jit_compile=self.config.jit_compile, autograph=False)  # See train_step's.
        def gradients(source_ids, decoder_inputs, labels, global_tokens):
            with tf.GradientTape() as tape:
                logits = model((source_ids, decoder_inputs), training=True)
                loss_sum, _ = label_smoothed_cross_entropy(labels, logits, label_smoothing, pad_id=pad_id)
                scaled_loss = optimizer.scale_loss(loss_sum / global_tokens)
            grads = tape.gradient(scaled_loss, variables)
            correct, _ = token_accuracy(labels, logits, pad_id=pad_id)
            return grads, loss_sum, correct

        return gradients

    def _validation_time_left(self, step):
        """Seconds of the validations still due after `step`, the final one included, at the last one's pace."""
        return validation_time_left(self.config, step, self._validation_seconds)

    def _validation_due(self, step):
        """Whether the training loop validates after `step` (the last step is validated after the loop)."""
        config = self.config
        return bool(config.eval_every) and step % config.eval_every == 0 and step < config.train_steps

    def _validation_cut_off(self, step):
        """Whether the run stopped at `step` before writing the validation it was due there.

        An interruption or a crash during a validation leaves the checkpoint of its step
        but none of its metrics; the resumed run starts at that step.
        """
        if self.validate_fn is None or not self.is_chief or step == 0:
            return False
        due = self._validation_due(step) or step >= self.config.train_steps
        return due and step not in validated_steps(self.run_dir)

    def _evaluate(self, step, writer):
        """Validates `step` and keeps the best checkpoint; returns whether patience ran out, agreed by all workers.

        Every worker calls it: the chief decides, the others follow (see `_agreed`). The
        metrics are written last, once a new best is saved: a step counts as validated
        (`validated_steps`) only then, so a run interrupted in between validates it again
        when it resumes instead of losing its best weights.
        """
        metrics = self._validate(step, writer)
        if self._agreed(self._best.record(step, metrics)):
            self._best.save(step)
        self._write_metrics(step, writer, metrics)
        return self._agreed(self._best.out_of_patience())

    def _validate(self, step, writer):
        """Runs `validate_fn` on the chief (its images go to `writer`) and logs its metrics; returns them.

        Returns None on the other workers, and without a `validate_fn`.
        """
        if self.validate_fn is None or not self.is_chief:
            return None
        started = time.monotonic()
        with writer.as_default(step=step):
            metrics = self.validate_fn(self.model, step)
        self._validation_seconds = time.monotonic() - started
        logger.info("validation at step %d | %s", step, " | ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
        return metrics

    @staticmethod
    def _write_metrics(step, writer, metrics):
        """Writes the validation metrics of `step` as summaries (none where nothing was validated)."""
        if metrics is None:
            return
        with writer.as_default(step=step):
            for name, value in metrics.items():
                tf.summary.scalar(name, value)
        writer.flush()

    def _summary_writers(self):
        if not self.is_chief:
            return {"train": tf.summary.create_noop_writer(), "validation": tf.summary.create_noop_writer()}
        logs = self.run_dir / LOG_DIR
        return {
            "train": tf.summary.create_file_writer(str(logs / "train")),
            "validation": tf.summary.create_file_writer(str(logs / "validation")),
        }

    def _stop_agreed(self):
        """Whether any worker was asked to stop (`request_stop`), agreed by all workers."""
        return self._agreed(self._stop_requested)

    def _agreed(self, flag):
        """`flag` of any worker, on every worker: a collective all of them must call (none with one worker).

        The chief's decisions (validation) reach the others so: their own flag is False.
        """
        return distribution.any_worker(self.strategy, flag)

    def _time_used(self, started):
        """The fraction of the time budget spent (1: all of it; 0 without one), agreed by all workers.

        The workers' mean: every one stops after the same step, and with a cooldown every
        one applies the same learning rate.
        """
        if not self.config.max_minutes:
            return 0.0
        seconds = time.monotonic() - started
        return distribution.mean_over_workers(self.strategy, seconds / (self.config.max_minutes * 60))

    def _set_budget_used(self, step, time_used):
        """Tells the schedule's cooldown how much of the run's budget `step` steps and `time_used` used."""
        if self.schedule.budget_used is not None:
            self.schedule.budget_used.assign(max(step / self.config.train_steps, time_used))

    def _worker_lost(self, error, completed_steps):
        """The `WorkerLostError` for `error`, after `completed_steps`, naming the checkpoint the run resumes from."""
        # Read from the chief's directory, not from `_saved_step`: a chief killed while saving
        # leaves its newest checkpoint unwritten although this worker saved its own.
        found = checkpoints(self._checkpoint_dir)
        if found:
            resume = (
                f"The latest checkpoint holds step {checkpoint_step(found[-1])} ({found[-1]}): start every worker "
                "again with the same command to resume from there (--checkpoint-every bounds the steps lost)."
            )
        else:
            resume = "No checkpoint was written yet: the same command on every worker trains the run from the start."
        when = f"after step {completed_steps}" if completed_steps else "in the first step"
        return distribution.worker_lost_error(error, when, resume)

    def _cleanup_worker_checkpoints(self):
        if not self.is_chief:
            shutil.rmtree(self._save_dir, ignore_errors=True)


def _replicas(count):
    return f"{count} replica{'' if count == 1 else 's'}"
