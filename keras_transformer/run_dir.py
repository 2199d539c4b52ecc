"""The run directory: what training leaves behind and evaluation, translation and export read.

Layout:

    RUN/config.json          {"model": Transformer config, "data": {...}, "train": {...}}
    RUN/tokenizer.model      the shared subword vocabulary (SentencePiece proto)
    RUN/checkpoints/ckpt-N*  tf.train.Checkpoint(model, optimizer, step), the last K kept
    RUN/averaged/ckpt-1*     tf.train.Checkpoint(model) of the averaged last checkpoints
    RUN/logs/                TensorBoard event files
"""

import json
from pathlib import Path

import tensorflow as tf

from keras_transformer.model import Transformer

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"
CHECKPOINT_DIR = "checkpoints"
AVERAGED_DIR = "averaged"
LOG_DIR = "logs"

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
    "max_length",
    "layer_norm_epsilon",
    "pad_id",
)


class RunDirError(ValueError):
    """A run directory that is missing, incomplete or does not match what was asked."""


def model_config(model):
    """The part of `model.get_config()` that rebuilds the same architecture."""
    config = model.get_config()
    return {key: config[key] for key in MODEL_KEYS}


def write_config(run_dir, config):
    path = Path(run_dir) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def read_config(run_dir):
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise RunDirError(f"{run_dir} is not a run directory: {CONFIG_FILE} is missing.")
    return json.loads(path.read_text())


def build_model(run_dir, dtype=None):
    """A `Transformer` with the architecture of `run_dir`, built, with fresh weights."""
    kwargs = read_config(run_dir)["model"]
    if dtype is not None:
        kwargs = {**kwargs, "dtype": dtype}
    model = Transformer(**kwargs)
    model.build()
    return model


def checkpoint_path(run_dir, which="best"):
    """The checkpoint prefix for `which`: "latest", "averaged", "best" (averaged if present, else latest) or a path."""
    run_dir = Path(run_dir)
    if which in ("best", "averaged"):
        averaged = tf.train.latest_checkpoint(str(run_dir / AVERAGED_DIR))
        if averaged or which == "averaged":
            if not averaged:
                raise RunDirError(f"{run_dir} has no averaged checkpoint; average the checkpoints first.")
            return averaged
        which = "latest"
    if which == "latest":
        latest = tf.train.latest_checkpoint(str(run_dir / CHECKPOINT_DIR))
        if not latest:
            raise RunDirError(f"{run_dir} holds no checkpoint under {CHECKPOINT_DIR}/.")
        return latest
    return which


def load_model(run_dir, which="best", dtype=None):
    """The trained model of `run_dir` with the weights of checkpoint `which` (see `checkpoint_path`)."""
    model = build_model(run_dir, dtype=dtype)
    tf.train.Checkpoint(model=model).restore(checkpoint_path(run_dir, which)).expect_partial()
    return model


def tokenizer_path(run_dir):
    return Path(run_dir) / TOKENIZER_FILE
