"""The run directory: what training leaves behind and evaluation, translation and export read.

Layout:

    RUN/config.json          {"model": Transformer config, "data": {...}, "train": {...}}
    RUN/tokenizer.model      the shared subword vocabulary (SentencePiece proto)
    RUN/checkpoints/ckpt-N*  tf.train.Checkpoint(model, optimizer, step, random_state: the dropout seeds)
                             after step N, the last K kept
    RUN/averaged/ckpt-N*     tf.train.Checkpoint(model): the mean of the last checkpoints up to step N
    RUN/.averaged-unchecked/ a new average while the final check compares it (moved to RUN/averaged if it wins)
    RUN/best/ckpt-N*         tf.train.Checkpoint(model, bleu): the weights of step N, whose validation BLEU
                             (`bleu`) is the best of the run so far; written by runs that validate every
                             --eval-every steps, and not deleted with the old checkpoints of RUN/checkpoints
    RUN/logs/                TensorBoard event files (train/, validation/, test/)
    RUN/translations/        final translations of the test split, one line per sentence

Checkpoint averaging (section 6.1: the mean of the last 5 checkpoints for base models,
20 for big ones) smooths the noise of the last updates; `average_checkpoints` writes it.

The run's model, `checkpoint_path(run_dir, "best")` (what the final test, translate.py and
the export use): the averaged checkpoint while it is current (see `checkpoint_path`; the
final check writes the latest there, as an average of 1, when the latest beats the best), else
the checkpoint of the best validation BLEU when the run has one, else the latest.
"""

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import tensorflow as tf
from tensorflow.core.util import event_pb2

from keras_transformer import error_text
from keras_transformer.model import Transformer
from keras_transformer.tokenizer import SubwordTokenizer

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"
CHECKPOINT_DIR = "checkpoints"
AVERAGED_DIR = "averaged"
# Hidden, as a run's partial files are: an interrupted check must not leave its average as the run's model.
UNCHECKED_AVERAGE_DIR = ".averaged-unchecked"
BEST_DIR = "best"
LOG_DIR = "logs"
TRANSLATIONS_DIR = "translations"
CHECKPOINT_NAME = "ckpt"
# The validation metric a run keeps its best checkpoint by (higher is better): a key of
# the validation metrics, and the name of the value in RUN/best's checkpoint.
BEST_METRIC = "bleu"

# The Transformer arguments kept in config.json["model"].
MODEL_KEYS = (
    "vocab_size",
    "num_layers",
    "d_model",
    "num_heads",
    "d_ff",
    "dropout_rate",
    "norm_first",
    "learned_positions",
    "max_positions",
    "layer_norm_epsilon",
    "pad_id",
)
# Model keys of config.json files written before a rename, and their names now.
RENAMED_MODEL_KEYS = {"max_length": "max_positions"}


class RunDirError(ValueError):
    """A run directory that is missing, incomplete or does not match what was asked."""


def model_config(model):
    """The part of `model.get_config()` that rebuilds the same architecture."""
    config = model.get_config()
    return {key: config[key] for key in MODEL_KEYS}


def write_config(run_dir, config):
    """Writes `RUN/config.json` atomically (`write_text_atomically`)."""
    write_text_atomically(Path(run_dir) / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_text_atomically(path, text):
    """Writes `text` to `path` (UTF-8), creating its directory: an interruption or a full disk leaves the old
    file or the new one, never half of one.

    Raises:
        OSError: If it cannot be written, naming `path` and the system's reason.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp, whose files only their owner can read: made like the run's other
    # files, so that others who can read the checkpoints can load the run.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}")
    try:
        with open(temporary, "x", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):  # A read-only file system made none; its error is the one to see.
            temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):  # A failed write names no file.
            raise OSError(f"Cannot write {path} ({error.strerror or error}).") from None
        raise


def read_config(run_dir):
    """The dict of `RUN/config.json`.

    Raises:
        RunDirError: When the file is missing or is not a JSON object.
    """
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        missing = "it does not exist" if not Path(run_dir).exists() else f"{CONFIG_FILE} is missing"
        raise RunDirError(f"{run_dir} is not a run directory: {missing}.")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RunDirError(f"{path} is damaged, not valid JSON ({error}).") from None
    if not isinstance(config, dict):
        raise RunDirError(f"{path} is damaged: it holds a JSON {type(config).__name__}, not an object.")
    return config


def check_checkpointable(model):
    """Raises RunDirError unless `tf.train.Checkpoint(model=model)` reaches every weight.

    Keras 3 does not expose layers held in Python lists to TensorFlow checkpoints; their
    weights would silently be left out of checkpoints and left random on restore.
    """
    reachable = {id(trackable) for trackable in tf.train.TrackableView(model).descendants()}
    missing = [weight.path for weight in model.weights if id(weight) not in reachable]
    if missing:
        raise RunDirError(
            f"tf.train.Checkpoint(model=...) would leave out {len(missing)} of {len(model.weights)} weights of "
            f"this {type(model).__name__} (e.g. {missing[0]}): Keras does not track layers kept in Python "
            "lists for TensorFlow checkpoints; assign each such layer to an attribute as well."
        )


def saved_architecture(config):
    """The `Transformer` arguments of config.json's model section, or None if it holds no architecture yet.

    A run writes its settings first (the model section then holds only the dropouts,
    attention_init and norm_first; earlier versions wrote fewer), the architecture once the model is built.
    """
    model = config.get("model")
    return model if isinstance(model, dict) and "d_model" in model else None


def build_model(run_dir, dtype=None):
    """A `Transformer` with the architecture of `run_dir`, built, with fresh weights."""
    kwargs = saved_architecture(read_config(run_dir))
    if kwargs is None:
        raise RunDirError(f"{run_dir} holds no trained model yet: its {CONFIG_FILE} has no architecture.")
    if dtype is not None:
        kwargs = {**kwargs, "dtype": dtype}
    model = Transformer(**kwargs)
    model.build()
    check_checkpointable(model)
    return model


def checkpoint_path(run_dir, which="best"):
    """The checkpoint prefix for `which`.

    Args:
        run_dir: The run directory.
        which: "latest"; "averaged"; "best": the run's model, which is the averaged
            checkpoint unless a later checkpoint was written after it (training went
            on) or the run was last told not to average (`--average-last 0`); else
            the checkpoint of the best validation BLEU, in a run that keeps one
            (`best_checkpoint`); else the latest. Or a checkpoint path, returned as
            it is.

    Raises:
        RunDirError: When the asked checkpoint does not exist.
    """
    run_dir = Path(run_dir)
    if which not in ("best", "averaged", "latest"):
        if not tf.io.gfile.exists(f"{which}.index"):
            raise RunDirError(
                f"Checkpoint {which} does not exist (no {which}.index); give \"best\", \"averaged\", "
                f"\"latest\" or a checkpoint prefix such as {run_dir / CHECKPOINT_DIR / CHECKPOINT_NAME}-STEP."
            )
        return which
    averaged = latest_checkpoint(run_dir / AVERAGED_DIR)
    latest = latest_checkpoint(run_dir / CHECKPOINT_DIR)
    if which == "averaged" and not averaged:
        raise RunDirError(f"{run_dir} has no averaged checkpoint; average the checkpoints first.")
    if which == "averaged" or (
        which == "best" and averaged and checkpoint_step(averaged) >= checkpoint_step(latest) and _uses_average(run_dir)
    ):
        return averaged
    best = latest_checkpoint(run_dir / BEST_DIR)
    if which == "best" and best:
        return best
    if not latest:
        raise RunDirError(f"{run_dir} holds no checkpoint under {CHECKPOINT_DIR}/.")
    return latest


def checkpoint_label(run_dir, which="best"):
    """`checkpoint_path(run_dir, which)` for messages, with the name it was asked by ("best" is one of three)."""
    path = checkpoint_path(run_dir, which)
    return path if path == which else f"{path} ({which})"


def _uses_average(run_dir):
    """Whether the run's final model may be its average: not when config.json says `average_last` 0."""
    if not (run_dir / CONFIG_FILE).is_file():
        return True
    return read_config(run_dir).get("train", {}).get("average_last") != 0


def checkpoints(directory):
    """The prefixes of the complete checkpoints `ckpt-N` in `directory`, oldest (smallest N) first.

    Read from the files rather than from the `checkpoint` index that
    `tf.train.latest_checkpoint` reads: that index names the newest checkpoint even when
    its files are gone, and is then taken for "no checkpoint", so deleting a damaged newest
    checkpoint (or a damaged index) would make training start over instead of resuming from
    the checkpoint before. TensorFlow writes a checkpoint's `.index` file after its data.
    """
    steps = [
        int(match.group(1))
        for name in tf.io.gfile.glob(str(Path(directory) / f"{CHECKPOINT_NAME}-*.index"))
        if (match := re.fullmatch(rf"{CHECKPOINT_NAME}-(\d+)\.index", Path(name).name))
    ]
    return [str(Path(directory) / f"{CHECKPOINT_NAME}-{step}") for step in sorted(steps)]


def latest_checkpoint(directory):
    """The newest complete checkpoint of `directory` (see `checkpoints`), or None."""
    found = checkpoints(directory)
    return found[-1] if found else None


def best_checkpoint(run_dir):
    """`(prefix, validation BLEU)` of the run's best checkpoint under `RUN/best`, or None if it has none.

    Raises:
        RunDirError: When the checkpoint does not hold its BLEU (a damaged file).
    """
    path = latest_checkpoint(Path(run_dir) / BEST_DIR)
    if path is None:
        return None
    try:
        return path, float(tf.train.load_checkpoint(path).get_tensor(f"{BEST_METRIC}/.ATTRIBUTES/VARIABLE_VALUE"))
    except Exception as error:  # As in `restore_checkpoint`: anything, for a damaged file.
        raise RunDirError(
            f"Checkpoint {path} does not hold its validation {BEST_METRIC} (a damaged file): "
            f"{error_text.summary(error)}"
        ) from None


def checkpoint_step(path):
    """The step N of a checkpoint prefix ".../ckpt-N" (-1 for None)."""
    if path is None:
        return -1
    match = re.search(r"-(\d+)$", str(path))
    if not match:
        raise RunDirError(f"{path} is not a checkpoint prefix ending in -STEP.")
    return int(match.group(1))


def average_checkpoints(run_dir, last_n, every=1, into=AVERAGED_DIR):
    """Writes the mean of the weights of the last `last_n` checkpoints to `RUN/averaged/` (or `RUN/into/`).

    Every weight of the model is trainable and averaged. The checkpoint holds the model
    only: no optimizer state, step or dropout seed states (a training checkpoint keeps
    those under `random_state`, which `tf.train.Checkpoint(model=...)` does not reach).
    The averaged checkpoint is numbered by the newest step. Before
    the newest, only checkpoints of the schedule count: one saved between two of them (an
    interruption the run resumed from) would weigh their stretch of training twice.

    Args:
        run_dir: The run directory.
        last_n: How many checkpoints to average, the newest and those of the schedule before
            it (fewer if fewer are kept).
        every: The run's steps between checkpoints (`--checkpoint-every`): the schedule.
        into: The directory of the run to write it to: `AVERAGED_DIR` makes it the run's model;
            `UNCHECKED_AVERAGE_DIR` holds it until `keep_unchecked_average`.

    Returns:
        `(path of the averaged checkpoint, paths of the checkpoints averaged)`.

    Raises:
        RunDirError: When the run has no checkpoint, or `last_n < 1`.
    """
    if last_n < 1:
        raise RunDirError(f"Cannot average the last {last_n} checkpoints; give a positive number.")
    found = checkpoints(Path(run_dir) / CHECKPOINT_DIR)
    if not found:
        raise RunDirError(f"{run_dir} holds no checkpoint under {CHECKPOINT_DIR}/ to average.")
    *older, newest = found
    scheduled = [path for path in older if checkpoint_step(path) % every == 0]
    chosen = scheduled[max(0, len(scheduled) - (last_n - 1)):] + [newest]
    model = build_model(run_dir)
    checkpoint = tf.train.Checkpoint(model=model)
    totals = None
    for path in chosen:
        restore_checkpoint(checkpoint, path)
        values = [variable.numpy().astype("float64") for variable in model.trainable_variables]
        totals = values if totals is None else [total + value for total, value in zip(totals, values)]
    for variable, total in zip(model.trainable_variables, totals):
        variable.assign((total / len(chosen)).astype(variable.dtype))
    manager = tf.train.CheckpointManager(
        checkpoint, str(Path(run_dir) / into), max_to_keep=1, checkpoint_name=CHECKPOINT_NAME
    )
    return manager.save(checkpoint_number=checkpoint_step(chosen[-1])), chosen


def keep_unchecked_average(run_dir):
    """Moves the average of `UNCHECKED_AVERAGE_DIR` to RUN/averaged, replacing any there; returns its new prefix."""
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir / AVERAGED_DIR, ignore_errors=True)
    os.replace(run_dir / UNCHECKED_AVERAGE_DIR, run_dir / AVERAGED_DIR)  # Its `checkpoint` index holds relative paths.
    return latest_checkpoint(run_dir / AVERAGED_DIR)


def load_model(run_dir, which="best", dtype=None):
    """The trained model of `run_dir` with the weights of checkpoint `which` (see `checkpoint_path`)."""
    model = build_model(run_dir, dtype=dtype)
    restore_checkpoint(tf.train.Checkpoint(model=model), checkpoint_path(run_dir, which))
    return model


def restore_checkpoint(checkpoint, path, partial=True):
    """Restores `checkpoint` from `path`, which must hold every variable `checkpoint` holds.

    A variable missing from the file, as when config.json describes another
    architecture, would otherwise stay random silently.

    Args:
        checkpoint: A `tf.train.Checkpoint`.
        path: A checkpoint prefix.
        partial: Whether values of the file that `checkpoint` does not hold are expected
            (a training checkpoint holds the optimizer too, which translating does not
            need), rather than warned about.

    Raises:
        RunDirError: When the checkpoint cannot be read or does not fit.
    """
    try:
        status = checkpoint.restore(path)
        if partial:
            status.expect_partial()
        status.assert_existing_objects_matched()
    except Exception as error:  # TensorFlow raises anything from IndexError to DataLossError on a damaged file.
        raise RunDirError(
            f"Checkpoint {path} does not fit the model of {CONFIG_FILE} (another architecture, or a damaged "
            f"file): {error_text.summary(error)}"
        ) from None


def read_scalars(event_dir):
    """`{tag: [(step, wall_time, value), ...]}` of the scalar summaries under `event_dir`, by step.

    Other summaries (the attention images) are skipped; a record cut off by a crash ends
    the reading of its file, and the records before it count. A step logged twice (a run
    that crashed after its last checkpoint logs those steps again when it resumes) keeps
    its newest point.
    """
    newest = {}  # {tag: {step: point}}
    for path in sorted(Path(event_dir).glob("events.out.tfevents.*")):
        try:
            for record in tf.data.TFRecordDataset(str(path)):
                event = event_pb2.Event.FromString(record.numpy())
                for value in event.summary.value:
                    if value.metadata.plugin_data.plugin_name == "scalars":
                        point = (int(event.step), float(event.wall_time), float(tf.make_ndarray(value.tensor)))
                        points = newest.setdefault(value.tag, {})
                        if point[0] not in points or point[1] >= points[point[0]][1]:
                            points[point[0]] = point
        except tf.errors.DataLossError:
            pass
    return {tag: sorted(points.values()) for tag, points in newest.items()}


def validated_steps(run_dir):
    """The steps whose validation metrics `RUN/logs/validation` holds.

    A validation writes its images first and its metrics last, so a step with images
    alone is one whose validation was cut off.
    """
    scalars = read_scalars(Path(run_dir) / LOG_DIR / "validation")
    return {step for points in scalars.values() for step, _, _ in points}


def decoding_settings(run_dir):
    """The `DecodingSettings` the run translates with (those of its validation and test BLEU).

    Returns:
        The decoding settings of the run's recipe (`train.preset`; the defaults for an
        unknown one), with the beam size and length penalty saved in config.json's
        "train" section (what `RunSettings.decoding` gives the run itself).

    Raises:
        RunDirError: When config.json is missing or damaged.
        ValueError: For a saved setting out of range.
    """
    from keras_transformer.decoding_settings import DecodingSettings  # Standard library only.
    from keras_transformer.recipes import RECIPES

    train = read_config(run_dir).get("train", {})
    recipe = RECIPES.get(train.get("preset"))
    decoding = recipe.decoding if recipe else DecodingSettings()
    return decoding.replace(beam_size=train.get("beam_size"), alpha=train.get("alpha"))


def tokenizer_path(run_dir):
    return Path(run_dir) / TOKENIZER_FILE


def load_tokenizer(run_dir):
    """The run's `SubwordTokenizer`.

    Raises:
        RunDirError: If `RUN/tokenizer.model` is missing or not a SentencePiece model.
    """
    path = tokenizer_path(run_dir)
    if not path.is_file():
        raise RunDirError(f"{run_dir} has no {TOKENIZER_FILE}: it is not a run directory, or training did not get "
                          "as far as the vocabulary.")
    try:
        return SubwordTokenizer.load(path)
    except (RuntimeError, ValueError, tf.errors.OpError) as error:
        raise RunDirError(
            f"{path} is not a readable SentencePiece model of this project: {error_text.summary(error)}"
        ) from None
