"""One training run, start to end: corpus, vocabulary, model, training, averaging, final test.

`train(settings, run, ...)` is what `train.py` (`kt-train`) does once it has resolved the
settings (`keras_transformer.run_settings`): it builds the distribution strategy (all
local GPUs, the given devices, or the workers of a multi-worker `TF_CONFIG`), loads the
corpus, learns or loads the shared vocabulary (the chief learns it; every worker reads
it), builds the model (the preset's, or the architecture saved in config.json when
resuming), trains with `keras_transformer.trainer.Trainer` (validating on the chief),
then on the chief averages the last checkpoints if asked, makes the best translator of the
validation split among the average, the best checkpoint and the latest the run's model,
and translates the test split with the run's model (`run_dir.checkpoint_path(run, "best")`).

A finished run given again is evaluated again; an interrupted one resumes from its last
checkpoint with the same data order. `kill` (SIGTERM) stops training as Ctrl-C does,
with a checkpoint; in a multi-worker run, every worker stops after the same step.
"""

import faulthandler
import logging
import math
import os
import re
import shutil
import signal
import time
from pathlib import Path

import keras
import tensorflow as tf

from keras_transformer import corpora, data, distribution, evaluation, precision, run_dir
from keras_transformer.model import Transformer
from keras_transformer.run_settings import (
    INT64_MAX,
    SettingsError,
    batch_warning,
    check_not_shorter_than_trained,
    check_replicas,
    check_workers,
    record_averaging,
    write_run_config,
)
from keras_transformer.tokenizer import SubwordTokenizer, train_tokenizer
from keras_transformer.progress import format_duration
from keras_transformer.trainer import EmptyDatasetError, Trainer

logger = logging.getLogger(__name__)


def train(settings, run, saved_config=None, *, data_dir=None, devices=None, connect_timeout_minutes=15.0):
    """Trains (or resumes) and evaluates the run in directory `run`.

    Args:
        settings: The run's `RunSettings`, resolved and checked (`run_settings.resolve`).
        run: The run directory.
        saved_config: Its config.json as read before, or None for a new run.
        data_dir: Where the corpus is (see `corpora.load_corpus`).
        devices: Device names to replicate over, or None for the default strategy.
        connect_timeout_minutes: Multi-worker: how long to wait for every worker.

    Returns:
        The `trainer.TrainingResult`.

    Raises:
        SettingsError: For settings the data or the devices refuse.
    """
    try:
        strategy = make_strategy(devices, settings.cpu_replicas, connect_timeout_minutes)
    except ValueError as error:
        raise SettingsError(f"--devices {','.join(devices)}: {error}" if devices else str(error)) from None
    # A multi-worker strategy starts TensorFlow's coordination service, whose own SIGTERM
    # handler replaces ours: without this, `kill` neither checkpoints nor stops a worker.
    stop_on_sigterm()
    replicas, workers = strategy.num_replicas_in_sync, distribution.num_workers(strategy)
    if saved_config is None and (warning := batch_warning(settings, replicas)):
        logger.warning(warning)
    if settings.epochs is None:  # Else the length of the run, which the checks need, is not known yet.
        settings = settings.replace(replicas=check_replicas(run, settings, replicas))
        settings = settings.replace(workers=check_workers(run, settings, workers))
    tf.get_logger().setLevel("ERROR")
    # Seeding drops TensorFlow's kernel cache, which holds tokenizer resources: seed first.
    keras.utils.set_random_seed(settings.seed)
    corpus = load_corpus(settings, data_dir)
    settings = settings.replace(source_lang=corpus.source_lang, target_lang=corpus.target_lang)
    if settings.patience and not corpus.validation:
        raise SettingsError(
            f"--patience {settings.patience} watches the validation BLEU, but the {settings.dataset} corpus "
            "has no validation split."
        )
    is_chief = distribution.is_chief(strategy)
    tokenizer = prepare_tokenizer(run, corpus, settings, strategy)
    if is_chief and not isinstance(corpus.train, tf.data.Dataset):  # A TFDS stream would take a pass of its own.
        report_long_pairs(corpus.train, tokenizer, settings.max_length, settings.long_sentences)
    # After the vocabulary: its barrier is the set-up's first collective, the choice's the second.
    settings = choose_precision(settings, strategy)
    if settings.epochs is not None:
        settings = settings.replace(train_steps=steps_for_epochs(run, corpus, tokenizer, settings, replicas, workers))
        check_not_shorter_than_trained(run, settings.train_steps, settings.epochs)
        settings = settings.replace(replicas=check_replicas(run, settings, replicas))
        settings = settings.replace(workers=check_workers(run, settings, workers))

    def model_fn(dtype):
        architecture = None if saved_config is None else run_dir.saved_architecture(saved_config)
        if architecture is not None:  # None yet when the start was interrupted.
            return Transformer(**architecture, dtype=dtype)
        return Transformer.from_preset(
            settings.preset, tokenizer.vocab_size, dtype=dtype,
            dropout_rate=settings.dropout, attention_init=settings.attention_init,
            attention_dropout_rate=settings.attention_dropout, activation_dropout_rate=settings.activation_dropout,
            norm_first=settings.norm_first,
        )

    validator = None
    if is_chief and corpus.validation:
        validator = evaluation.Validator(
            corpus.validation, tokenizer, label_smoothing=settings.label_smoothing,
            bleu_sentences=settings.bleu_sentences, decoding=settings.decoding, token_budget=settings.token_budget,
            max_length=settings.max_length, target_lang=corpus.target_lang,
        )
    trainer = Trainer(strategy, model_fn, run, settings.training_config(), validate_fn=validator)
    if distribution.num_workers(strategy) > 1:
        # All workers must stop after the same step: a kill asks the trainer, which agrees
        # on it with the others (see Trainer.request_stop).
        signal.signal(signal.SIGTERM, lambda signum, frame: trainer.request_stop())
    if is_chief:
        write_run_config(run, settings, trainer.model)
        logger.info("Run directory: %s (TensorBoard: tensorboard --logdir %s)", run, run / run_dir.LOG_DIR)
    model_proto = tokenizer.model_proto

    def dataset_fn(input_context):
        # A tokenizer per input pipeline: its SentencePiece resource must live where the
        # distributed dataset runs.
        return data.make_training_dataset(
            corpus.train, SubwordTokenizer(model_proto), token_budget=settings.token_budget,
            max_length=settings.max_length, long_sentences=settings.long_sentences, seed=settings.seed,
            input_context=input_context,
        )

    try:
        result = trainer.fit(dataset_fn)
    except EmptyDatasetError:
        raise SettingsError(_no_training_pairs(run, settings)) from None
    stop_on_sigterm()  # Training is over: a kill stops the evaluation at once.
    if result.step > result.start_step:
        # Steps that traced (or compiled) their function are not timed: a run of those alone has no speed.
        speed = f"; {result.tokens_per_second:,.0f} target tokens/s" if result.tokens_per_second else ""
        logger.info("Trained steps %d-%d in %s%s.", result.start_step + 1, result.step,
                    format_duration(result.seconds), speed)
    if is_chief:
        if settings.average_last:
            average_if_better(run, corpus, settings)
        final_evaluation(run, corpus, settings)
    _log_early_stop(result, settings)  # Last: what to do next.
    return result


def _log_early_stop(result, settings):
    if result.stopped_early:
        # --train-steps and --epochs exclude each other: a length in epochs must give way.
        instead = " in place of --epochs" if settings.epochs is not None else ""
        logger.info("The time budget (--max-minutes %g) stopped the run at step %d of %d; run the same command "
                    "again to continue training from there, or add --train-steps %d%s to evaluate it as it stands "
                    "(with other decoding flags, say).", settings.max_minutes, result.step, settings.train_steps,
                    result.step, instead)
    if result.out_of_patience:
        logger.info("--patience %d stopped the run at step %d of %d; a larger --patience (or 0) continues its "
                    "training.", settings.patience, result.step, settings.train_steps)


def choose_precision(settings, strategy):
    """`settings` with `--mixed-precision auto` resolved for the devices of `strategy`, and why, logged.

    Every worker resolves it on its own devices, and all take the chief's choice: workers
    must compute alike (fp16's loss scaling is a collective of its own).
    """
    if settings.mixed_precision == precision.AUTO:
        chosen = precision.resolve(precision.AUTO, precision.local_devices(strategy), settings.jit_compile)
        names = list(precision.DTYPE_POLICIES)
        agreed = names[distribution.chief_choice(strategy, names.index(chosen.name), len(names))]
        reason = chosen.reason if agreed == chosen.name else f"{chosen.reason}; the chief chose {agreed}"
        settings = settings.replace(mixed_precision=agreed, precision_reason=reason)
    elif settings.precision_reason is None:
        settings = settings.replace(precision_reason=f"--mixed-precision {settings.mixed_precision}")
    logger.info("Precision: %s (%s): %s.", settings.mixed_precision, precision.DTYPE_POLICIES[settings.mixed_precision],
                settings.precision_reason)
    return settings


def make_strategy(devices, cpu_replicas, connect_timeout_minutes):
    """The strategy; with a multi-worker TF_CONFIG, waiting at most `connect_timeout_minutes` for the others."""
    workers = distribution.cluster_task_count()
    if workers < 2:
        return distribution.make_strategy(devices, cpu_replicas)
    logger.info("Waiting for all %d workers of TF_CONFIG to start; after %g minutes (--connect-timeout-minutes) "
                "this worker gives up with exit status 1 ...", workers, connect_timeout_minutes)
    # MultiWorkerMirroredStrategy() waits for the others in TensorFlow's C++ code, silently,
    # holding the GIL, its coordination service taking SIGTERM: no Python thread, signal
    # handler or exception gets through. faulthandler's timer is a C thread: it prints where
    # this worker waited (the "Timeout" traceback) and ends the process.
    faulthandler.dump_traceback_later(connect_timeout_minutes * 60, exit=True)
    try:
        strategy = distribution.make_strategy(devices)
    finally:
        faulthandler.cancel_dump_traceback_later()
    logger.info("All %d workers of TF_CONFIG connected.", workers)
    return strategy


def stop_on_sigterm():
    """`kill` (SIGTERM) stops training as Ctrl-C does: with a checkpoint."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def load_corpus(settings, data_dir):
    """The run's corpus, in its direction (see `corpora.CORPORA`)."""
    return corpora.load_corpus(
        settings.dataset, data_dir, source_lang=settings.source_lang, target_lang=settings.target_lang,
        seed=settings.seed,
    )


def prepare_tokenizer(run, corpus, settings, strategy):
    """The run's tokenizer: loaded, or learned on the training data and saved by the chief."""
    path = run_dir.tokenizer_path(run)
    if not path.is_file() and distribution.is_chief(strategy):
        started = time.monotonic()
        try:
            tokenizer = train_tokenizer(corpus.training_sentences(), settings.vocab_size, seed=settings.seed)
        except RuntimeError as error:  # SentencePiece's, for a vocabulary size the text cannot fill.
            raise SettingsError(_vocabulary_error(settings, error)) from None
        # config.json first: from here on, an interrupted start is a run of known settings,
        # which the same command resumes (and another command cannot take over).
        if not (run / run_dir.CONFIG_FILE).is_file():
            write_run_config(run, settings)
        partial = path.with_name(f".{path.name}.partial")
        tokenizer.save(partial)
        os.replace(partial, path)  # Atomically: never a truncated vocabulary.
        logger.info("Learned a BPE vocabulary of %d tokens in %.0fs: %s", tokenizer.vocab_size,
                    time.monotonic() - started, path)
    distribution.barrier(strategy)  # The other workers read the chief's file.
    return SubwordTokenizer.load(path)


def _vocabulary_error(settings, error):
    """A one-line message for SentencePiece's RuntimeError when learning the vocabulary."""
    text = str(error)
    needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", text)
    if needed:
        return (
            f"--vocab-size {settings.vocab_size} is too small for the {settings.dataset} training text: "
            f"its characters, byte pieces and reserved ids alone take {needed.group(1)} ids; give --vocab-size "
            f"{needed.group(1)} or more (8000 is usual)."
        )
    if "sentences_.empty()" in text:
        return (
            f"The {settings.dataset} training text has no sentence to learn a vocabulary from: every line is "
            "empty, not valid UTF-8, or longer than SentencePiece's limit of 4192 bytes."
        )
    detail = (text.split("] ", 1)[-1].strip() or text.strip() or type(error).__name__).splitlines()[0]
    return (
        f"Cannot learn a {settings.vocab_size}-token vocabulary on the {settings.dataset} training "
        f"text ({detail}); adjust --vocab-size."
    )


def report_long_pairs(pairs, tokenizer, max_length, long_sentences):
    """Logs how many training `pairs` are too long for `max_length`, and what becomes of them, if any are."""
    long = data.count_long_pairs(pairs, tokenizer, max_length)
    if not long:
        return
    what = f"{long:,} of {len(pairs):,} training pairs have a side over --max-length {max_length} tokens (EOS included)"
    if long_sentences == "truncate":
        logger.info("%s: they are cut to fit.", what)
    else:
        logger.warning("%s: they are left out (--long-sentences truncate cuts them to fit instead).", what)


def _no_training_pairs(run, settings):
    dropped = "an empty side" if settings.long_sentences == "truncate" else (
        f"an empty side or one longer than --max-length {settings.max_length} allows "
        f"({settings.max_length - 1} tokens)"
    )
    return (
        f"No training pair is left: every pair of the {settings.dataset} training data has {dropped}. "
        f"--max-length is saved with the run: to train with another, delete {run} first."
    )


def steps_for_epochs(run, corpus, tokenizer, settings, num_replicas, num_workers=1):
    """Steps of `settings.epochs` passes: per-replica batches of one epoch / replicas.

    The replicas and workers are those the run recorded, else `num_replicas` and
    `num_workers`: a finished run keeps its length on any number of devices, so evaluating
    it works there, and resuming it on another number is refused as such (`check_replicas`).
    With several workers, each pass is over its own shard, whose batches end short at more
    bucket edges: the batches of an epoch are those of every worker's shard.
    """
    num_replicas = settings.replicas or num_replicas
    num_workers = settings.workers or num_workers

    def batches(worker):
        context = tf.distribute.InputContext(num_workers, worker, num_replicas) if num_workers > 1 else None
        dataset = data.make_training_dataset(
            corpus.train, tokenizer, token_budget=settings.token_budget, max_length=settings.max_length,
            long_sentences=settings.long_sentences, seed=settings.seed, input_context=context,
        )
        return int(dataset.reduce(0, lambda count, _: count + 1))

    per_epoch = sum(batches(worker) for worker in range(num_workers))
    if not per_epoch:
        raise SettingsError(_no_training_pairs(run, settings))
    steps = settings.epochs * per_epoch / num_replicas
    if steps > INT64_MAX:  # The step counter is an int64, and a run saved with more could not resume.
        raise SettingsError(
            f"--epochs {settings.epochs:g} makes {steps:.3g} steps ({per_epoch:,} batches per epoch over "
            f"{num_replicas} replica(s)), more than a 64-bit step counter holds ({INT64_MAX})."
        )
    steps = max(1, math.ceil(steps))
    logger.info("%g epochs = %d steps (%d batches per epoch over %d replica(s)).", settings.epochs, steps,
                per_epoch, num_replicas)
    return steps


def average_only(run, settings):
    """Averages the last `settings.average_last` checkpoints of `run` into RUN/averaged, unchecked."""
    if not settings.average_last:
        raise SettingsError("--average-only needs --average-last N with N >= 1.")
    path, averaged = run_dir.average_checkpoints(run, settings.average_last, settings.checkpoint_every)
    logger.info("Averaged %d checkpoints (%s) into %s", len(averaged), ", ".join(Path(p).name for p in averaged), path)
    if (run / run_dir.CONFIG_FILE).is_file():
        # Saved as any command saves its new values: a run last given --average-last 0 (the
        # `small` preset's default) would otherwise keep translating with its latest checkpoint.
        record_averaging(run, settings)
    logger.info("translate.py and export now use the average (--checkpoint latest: the last checkpoint).")


def average_if_better(run, corpus, settings):
    """Averages the last checkpoints, and makes the best translator of the candidates the run's model.

    The paper averages the checkpoints of a long, converged run, where it smooths the
    noise of the last updates. Early in a short run, the older checkpoints are much worse
    than the latest and so is their mean. So the candidates are the average, the checkpoint
    of the best periodic validation BLEU in a run that keeps one (`run_dir.best_checkpoint`),
    and the latest checkpoint, each translating the whole validation split: not the first
    --bleu-sentences of the periodic check, as this choice is made once, and between
    checkpoints that close a subset's BLEU differs by its noise. The highest BLEU becomes the
    run's model (which the test, translate.py and export use), ties going to the earlier in
    that order. A latest checkpoint that beats a kept best one is written to RUN/averaged as
    the average of the last 1, since RUN/best would otherwise be the run's model. Without a
    validation BLEU (no validation split, or --bleu-sentences 0), the average is kept unchecked.
    The average waits in RUN/.averaged-unchecked until it wins: a check cut short (Ctrl-C)
    leaves the run's model as it was, and the run evaluated again checks it again.
    """
    shutil.rmtree(run / run_dir.UNCHECKED_AVERAGE_DIR, ignore_errors=True)
    averaged_path, averaged = run_dir.average_checkpoints(
        run, settings.average_last, settings.checkpoint_every, into=run_dir.UNCHECKED_AVERAGE_DIR
    )
    logger.info("Averaged the last %d checkpoints (%s).", len(averaged), ", ".join(Path(p).name for p in averaged))
    rivals = _rivals_of_the_average(run, averaged)
    pairs = list(corpus.validation or []) if settings.bleu_sentences else []
    if not rivals or not pairs:
        kept = run_dir.keep_unchecked_average(run)
        logger.info("The average is the run's model: %s.", _short_name(kept))
        return
    candidates = {"averaged": averaged_path, **rivals}
    scores = {label: _validation_scores(run, which, pairs, corpus.target_lang, settings)
              for label, which in candidates.items()}
    logger.info("Validation BLEU (%d sentences): %s.", len(pairs), ", ".join(
        f"{_candidate_name(label, candidates[label])} {score.bleu.score:.2f} (chrF {score.chrf.score:.2f})"
        for label, score in scores.items()))
    winner = max(scores, key=lambda label: scores[label].bleu.score)  # The first of equals; chrF is for information.
    if winner == "averaged":
        kept = run_dir.keep_unchecked_average(run)
        logger.info("The averaged checkpoint translates at least as well: it is the run's model, %s.",
                    _short_name(kept))
        return
    shutil.rmtree(run / run_dir.UNCHECKED_AVERAGE_DIR)
    shutil.rmtree(run / run_dir.AVERAGED_DIR, ignore_errors=True)  # An earlier check's: this check decides.
    if winner == "latest" and "best" in candidates:
        kept, _ = run_dir.average_checkpoints(run, 1, settings.checkpoint_every)
        logger.info("The latest checkpoint translates best: it is the run's model, as %s (the average of the "
                    "last 1).", _short_name(kept))
        return
    logger.info("Dropped the averaged checkpoint: the %s translates better, and is the run's model "
                "(train.py --run-dir %s --average-only --average-last N writes it again).",
                _candidate_name(winner, candidates[winner]), run)


def _rivals_of_the_average(run, averaged):
    """{"best": the best checkpoint, "latest": "latest"}: those of them that differ from the average and each other.

    `averaged` lists the checkpoints averaged, the latest last: an average of one is the latest.
    """
    rivals = {}
    best = run_dir.best_checkpoint(run)
    best_is_latest = bool(best) and run_dir.checkpoint_step(best[0]) == run_dir.checkpoint_step(averaged[-1])
    if best and not (best_is_latest and len(averaged) == 1):
        rivals["best"] = best[0]
    if len(averaged) >= 2 and not best_is_latest:
        rivals["latest"] = "latest"
    return rivals


def _candidate_name(label, which):
    """'averaged', 'best checkpoint (best/ckpt-N)' or 'latest': a candidate of `average_if_better` for messages."""
    return f"best checkpoint ({_short_name(which)})" if label == "best" else label


def _short_name(path):
    """'averaged/ckpt-N' or 'checkpoints/ckpt-N': which of the run's checkpoints."""
    return "/".join(Path(path).parts[-2:])


def _validation_scores(run, which, pairs, target_lang, settings):
    """BLEU and chrF of checkpoint `which` of the run on the validation `pairs`."""
    sources, references = (list(side) for side in zip(*pairs))
    translations = evaluation.translate(
        run_dir.load_model(run, which), run_dir.load_tokenizer(run), sources, decoding=settings.decoding,
        max_source_length=settings.max_length,
        on_batch=translation_progress(f"validation sentences ({_short_name(which)})"),
    )
    return evaluation.corpus_scores(translations, references, target_lang)


def final_evaluation(run, corpus, settings):
    """Test BLEU, chrF and translations of the run's model with beam search."""
    if not corpus.test:
        logger.info("The corpus has no test split; no test BLEU.")
        return
    which = run_dir.checkpoint_path(run, "best")
    name = _short_name(which)
    sources, references = (list(side) for side in zip(*corpus.test))
    started = time.monotonic()
    logger.info("Translating %d test sentences with %s (beam %d, alpha %g)...", len(sources), name,
                settings.beam_size, settings.alpha)
    translations = evaluation.translate(
        run_dir.load_model(run, which), run_dir.load_tokenizer(run), sources, decoding=settings.decoding,
        max_source_length=settings.max_length, on_batch=translation_progress("test sentences"),
    )
    scores = evaluation.corpus_scores(translations, references, corpus.target_lang)
    report = evaluation.output_report(translations, references, corpus.target_lang)
    output = run / run_dir.TRANSLATIONS_DIR / f"test.{corpus.target_lang}"
    evaluation.write_lines(output, translations)
    with tf.summary.create_file_writer(str(run / run_dir.LOG_DIR / "test")).as_default():
        for tag, value in {**scores.metrics(), "bleu_lowercase": report.lowercase_bleu}.items():
            tf.summary.scalar(tag, value, step=run_dir.checkpoint_step(which))
    logger.info("Test BLEU and chrF (%s, %d sentences, %.0fs):\n  %s\n  %s", name, len(sources),
                time.monotonic() - started, str(scores).replace("\n", "\n  "), report)
    logger.info("Translations: %s", output)
    for source, reference, translation in list(zip(sources, references, translations))[:3]:
        logger.info("  source:      %s\n  reference:   %s\n  translation: %s", source, reference, translation)


def translation_progress(what, every_seconds=30.0):
    """An `on_batch` callback for `evaluation.translate` that logs progress at most every `every_seconds`.

    A test set takes minutes on a CPU, and a large one (WMT14's, with `base`) much longer.
    """
    started = last = time.monotonic()

    def log(translated, total):
        nonlocal last
        now = time.monotonic()
        if translated < total and now - last >= every_seconds:
            last = now
            logger.info("  %d/%d %s translated (%s)", translated, total, what, format_duration(now - started))

    return log
