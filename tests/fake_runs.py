"""Helpers shared by the training tests: tiny trainers, fake run directories, stand-in translations.

A plain module (tests/ is on sys.path), not fixtures in conftest.py: import what you use.

* `run_command`: a command run from the repository root, output captured.
* `synthetic_pairs_dataset`, `tiny_trainer`, `training_losses`: a `tiny` Transformer trained
  on a copy task of random ids, and the training losses its run logged.
* `checkpointed_run`, `run_with_checkpoint`: a run directory (config.json and checkpoints)
  of an untrained tiny model, as training would leave it.
* `files_corpus`, `multi30k_files`: `--dataset files` directories for `train.py`.
* `PAIRS`, `REFERENCES`, `fake_translations`: Multi30k-like validation pairs, and
  translations that stand in for the checkpoints of a run, so that tests of what picks
  a checkpoint (averaging, the best checkpoint) decide which one "wins".
"""

import dataclasses
import os
import json
import socket
import subprocess
from pathlib import Path

import tensorflow as tf

from keras_transformer import distribution, evaluation, run_dir
from keras_transformer.model import Transformer
from keras_transformer.trainer import Trainer, TrainingConfig

ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT = 240


def run_command(command, env=None, timeout=SUBPROCESS_TIMEOUT):
    """`command` run in the repository root with `env` added to the environment; its output captured as text."""
    return subprocess.run(
        command, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


# --- Tiny training runs -------------------------------------------------------------------


def synthetic_pairs_dataset(input_context):
    """One epoch of four `((source, decoder_inputs), labels)` batches of a copy task on random ids."""
    ids = tf.random.stateless_uniform([4, 8, 10], seed=(1, 2), minval=4, maxval=50, dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices(((ids[:, :, :9], ids[:, :, :9]), ids[:, :, 1:]))


def tiny_trainer(run, train_steps=4):
    """A `Trainer` of a tiny model (vocabulary 50) on the CPU: a progress line every step, a checkpoint every 2."""
    config = TrainingConfig(train_steps=train_steps, warmup_steps=20, log_every=1, checkpoint_every=2)
    return Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
        run,
        config,
    )


def training_losses(run, tag="loss"):
    """Per-step training loss (or scalar `tag`) from the TensorBoard event files of `run` (log_every=1)."""
    losses = {}
    for path in sorted((run / run_dir.LOG_DIR / "train").glob("events.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag == tag:
                    losses[event.step] = float(tf.make_ndarray(value.tensor))
    return losses


# --- Run directories ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointedRun:
    """What `checkpointed_run` wrote: its checkpoints' paths, oldest first, and the best checkpoint's (or None)."""

    checkpoints: list
    best: str | None


def checkpointed_run(directory, steps=(10, 20), *, best_step=None, train=None, **model_config):
    """A run directory of an untrained tiny model (vocabulary 50) with checkpoints at `steps`.

    Its config.json holds the model's config, updated with `model_config` (which may then
    describe another architecture than the checkpoints'), and `train` if given. With
    `best_step`, `RUN/best` holds the checkpoint of that step with a validation BLEU of 12.5.
    """
    model = Transformer.from_preset("tiny", vocab_size=50)
    model.build()
    config = {"model": {**run_dir.model_config(model), **model_config}}
    if train is not None:
        config["train"] = train
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(directory / run_dir.CHECKPOINT_DIR), 3)
    paths = [manager.save(checkpoint_number=step) for step in steps]
    run_dir.write_config(directory, config)
    best = None
    if best_step is not None:
        checkpoint = tf.train.Checkpoint(model=model, **{run_dir.BEST_METRIC: tf.Variable(12.5, dtype=tf.float64)})
        best = checkpoint.write(str(directory / run_dir.BEST_DIR / f"ckpt-{best_step}"))
    return CheckpointedRun(paths, best)


def run_with_checkpoint(directory, step=5, **model_config):
    """A run directory holding a tiny model's checkpoint at `step`, and a config.json with `model_config`.

    Returns the checkpoint's path.
    """
    return checkpointed_run(directory, (step,), **model_config).checkpoints[-1]


# --- Stand-in translations ------------------------------------------------------------------

# Four words at least: BLEU is 0 for a corpus without 4-grams.
PAIRS = [
    ("A man in a red house.", "Ein Mann in einem roten Haus."),
    ("A dog runs on the grass.", "Ein Hund rennt auf dem Gras."),
    ("Two men play in the street.", "Zwei Männer spielen auf der Straße."),
    ("A girl jumps into the lake.", "Ein Mädchen springt in den See."),
]
REFERENCES = [target for _, target in PAIRS]


def validation_corpus(pairs=PAIRS, **splits):
    """A stand-in for a `ParallelCorpus` with `pairs` as its validation split, German targets, and `splits`."""
    return type("Corpus", (), {"validation": pairs, "target_lang": "de", **splits})()


def fake_translations(monkeypatch, winner, wins=REFERENCES, loses=None):
    """Translations stand in for the checkpoints of a run: checkpoint `winner` translates as `wins`.

    `run_dir.load_model(run, which)` returns `which` itself (a name such as "latest" or
    "averaged", or a checkpoint's path) and `run_dir.load_tokenizer` None; the fake
    `evaluation.translate` then answers `wins` for the checkpoint named `winner` or lying
    in a directory named `winner` (such as `run_dir.BEST_DIR`; an average under check counts as
    `run_dir.AVERAGED_DIR`), and `loses` for any other (by default "nichts" for every source):
    their first `len(sources)` lines, as the sources are the first pairs of the split. It takes
    the decoding settings in any form.
    """

    def translate(model, tokenizer, sources, *args, **kwargs):
        directory = Path(str(model)).parent.name
        directory = run_dir.AVERAGED_DIR if directory == run_dir.UNCHECKED_AVERAGE_DIR else directory
        if str(model) == winner or directory == winner:
            return list(wins)[: len(sources)]
        return list(loses)[: len(sources)] if loses is not None else ["nichts"] * len(sources)

    monkeypatch.setattr(run_dir, "load_model", lambda run, which="latest", *args, **kwargs: which)
    monkeypatch.setattr(run_dir, "load_tokenizer", lambda *args, **kwargs: None)
    monkeypatch.setattr(evaluation, "translate", translate)


# --- Corpora for train.py ---------------------------------------------------------------------


def files_corpus(directory, files):
    """`--dataset files` flags (en -> de) of a new `directory` holding `files`, {file name: bytes}."""
    directory.mkdir()
    for name, text in files.items():
        (directory / name).write_bytes(text)
    return ["--dataset", "files", "--data-dir", str(directory), "--source-lang", "en", "--target-lang", "de"]


def multi30k_files(directory, multi30k_dir, sizes):
    """`files_corpus` of the first `sizes[split]` Multi30k pairs of each split named ("train", "val", "test")."""
    from keras_transformer.corpora import load_multi30k

    corpus = load_multi30k(multi30k_dir)
    splits = {"train": corpus.train, "val": corpus.validation, "test": corpus.test}
    return files_corpus(directory, {
        f"{split}.{lang}": "".join(pair[side] + "\n" for pair in splits[split][:size]).encode("utf-8")
        for split, size in sizes.items()
        for side, lang in enumerate(("en", "de"))
    })


def local_tf_configs(count):
    """The TF_CONFIG (JSON) of each of `count` workers on 127.0.0.1, at ports free a moment ago; worker 0 first."""
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    workers = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in sockets]
    for sock in sockets:
        sock.close()
    return [
        json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
        for index in range(count)
    ]
