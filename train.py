"""Train a Transformer translation model with the recipe of "Attention Is All You Need".

    MULTI30K_DIR=../shared/data/multi30k python train.py      # small preset: 800 steps, ~10 min on 2 CPU cores
    python train.py --preset medium                            # best Multi30k BLEU in ~1 hour on CPU
    python train.py --preset base --dataset wmt14              # the paper's base model (GPUs)
    python train.py --run-dir RUN                              # resume RUN, or re-evaluate it if done
    python train.py --config RUN/config.json --run-dir NEW     # RUN's settings again, in NEW
    python train.py --eval-every 100 --patience 3              # stop once validation BLEU stops improving
    python train.py --run-dir RUN --average-last 5 --average-only

Every setting comes, in this order, from its flag, from the `--config` file, from the
run directory's saved `config.json` (when resuming), or from the preset's recipe
(`RECIPES`). Settings that fix the model, the vocabulary or the data stream (`PINNED`)
cannot change in an existing run directory: asking for another value, by flag or in the
file, is an error, reported before anything is trained or written. See
`python train.py --help` for every flag.

A `--config` file is JSON or YAML (by its extension, .json, .yaml or .yml, else by its
text) with the keys and the layout of a run's config.json, any of them left out: `data`
(corpus, source_lang, target_lang, vocab_size, max_length, long_sentences,
token_budget), `train` (preset and the other saved settings, each under its flag's name:
train_steps, max_minutes, patience, ...) and `model` (dropout_rate, the --dropout). So a
run's config.json given back trains the same run. A value must be one its flag takes;
`null` stands for a flag left out where that means something (epochs, max_minutes: no
time budget, source_lang and target_lang: the corpus's). Of train_steps and a non-null
epochs, epochs counts (the config.json of an --epochs run holds both). What a run
records rather than chooses is checked, never used as a setting: `train.replicas` (a run
resumes on as many replicas as it trained on, whatever the file says) and the `model`
keys other than dropout_rate, which the preset and the vocabulary size determine (any
other value is an error: train.py trains the presets' architectures). An unknown key or
a wrong value is one error naming the file and the key.

With --eval-every N, a run keeps the checkpoint of its best validation BLEU in RUN/best,
whatever checkpoints RUN/checkpoints rotates out; it is the run's model (the test,
translate.py, export) unless the average of --average-last translates the validation
sentences better. --patience stops the training once validation BLEU stops improving.
"""

import os
import platform

# Both before TensorFlow is imported. TensorFlow turns its oneDNN CPU kernels on by itself
# only on x86 CPUs with AVX-512 VNNI/BF16 or AMX, but training steps run faster with them
# on AVX2 CPUs too: a `small` step took 1,421 ms instead of 2,268 ms on a 2-core AMD EPYC
# (`bench/train_throughput.py`, 2026-11-25). TF_ENABLE_ONEDNN_OPTS=0 keeps TensorFlow's choice.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import argparse  # noqa: E402
import difflib  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

logger = logging.getLogger("train")

DATASETS = ("multi30k", "wmt14", "ted_pt_en", "files")
PRESET_NAMES = ("tiny", "small", "medium", "base", "big")

# Training recipes per preset: flags default to these. `max_minutes` None = no budget.
RECIPES = {
    # For smoke tests: trains in seconds, translates badly.
    "tiny": dict(
        train_steps=200, max_minutes=None, token_budget=1024, warmup_steps=100, learning_rate_scale=1.0,
        log_every=20, checkpoint_every=100, keep_checkpoints=3, eval_every=0, average_last=0, bleu_sentences=100,
    ),
    # The default: 800 steps, about 10 minutes in all on a 2-core AVX-512 CPU. A number of steps,
    # not a time budget, so that every machine trains the same model (up to float rounding).
    # Half the other presets' batch, for twice the updates. Warm-up 1600, not 800: after as
    # many tokens, the rate is 1/sqrt(2) of the one with 4,096-token batches (square-root
    # scaling for half the batch). After the same ~1.1M target tokens (about 9 minutes on a
    # 2-core AVX2 EPYC): validation loss 4.054 and test BLEU 21.4, against 4.554 and 10.5
    # with 4,096-token batches (README, *Results*).
    "small": dict(
        train_steps=800, max_minutes=None, token_budget=2048, warmup_steps=1600, learning_rate_scale=2.0,
        log_every=25, checkpoint_every=200, keep_checkpoints=5, eval_every=0, average_last=0, bleu_sentences=200,
    ),
    # Best Multi30k BLEU in about an hour of CPU training.
    "medium": dict(
        train_steps=20000, max_minutes=60.0, token_budget=4096, warmup_steps=1000, learning_rate_scale=1.5,
        log_every=50, checkpoint_every=100, keep_checkpoints=6, eval_every=400, average_last=5, bleu_sentences=300,
    ),
    # The paper: 100k steps of ~25k source + 25k target tokens (4096 padded tokens x 8 GPUs),
    # average of the last 5 checkpoints written every 10 minutes (~every 1500 steps here).
    "base": dict(
        train_steps=100_000, max_minutes=None, token_budget=4096, warmup_steps=4000, learning_rate_scale=1.0,
        log_every=100, checkpoint_every=1500, keep_checkpoints=20, eval_every=5000, average_last=5,
        bleu_sentences=500,
    ),
    # The paper: 300k steps, average of the last 20 checkpoints.
    "big": dict(
        train_steps=300_000, max_minutes=None, token_budget=4096, warmup_steps=4000, learning_rate_scale=1.0,
        log_every=100, checkpoint_every=1500, keep_checkpoints=20, eval_every=5000, average_last=20,
        bleu_sentences=500,
    ),
}

# Per dataset: vocabulary (shared BPE) and longest sequence.
DATASET_DEFAULTS = {
    "multi30k": dict(vocab_size=8000, max_length=128),
    "wmt14": dict(vocab_size=37000, max_length=256),  # The paper's ~37000 shared tokens.
    "ted_pt_en": dict(vocab_size=8000, max_length=256),
    "files": dict(vocab_size=8000, max_length=256),
}

GENERAL_DEFAULTS = dict(
    long_sentences="filter", seed=0, label_smoothing=0.1, beam_size=4, alpha=0.6, mixed_precision="none",
    jit_compile=False, patience=0,
)

# Settings that fix the model, the vocabulary or the data stream of a run: resuming
# with another value is an error.
PINNED = (
    "preset", "dataset", "source_lang", "target_lang", "vocab_size", "max_length", "long_sentences",
    "token_budget", "seed", "dropout", "warmup_steps", "learning_rate_scale", "label_smoothing", "mixed_precision",
)
# Where config.json keeps each setting; the rest go under "train".
_CONFIG_LOCATIONS = {
    "dataset": ("data", "corpus"),
    "source_lang": ("data", "source_lang"),
    "target_lang": ("data", "target_lang"),
    "vocab_size": ("data", "vocab_size"),
    "max_length": ("data", "max_length"),
    "long_sentences": ("data", "long_sentences"),
    "token_budget": ("data", "token_budget"),
    "dropout": ("model", "dropout_rate"),
}
# Settings saved in config.json; the others (paths, devices, --average-only) are per command.
# "replicas" is no flag: it is the number of replicas the run trains on (see `check_replicas`).
SAVED = (
    "preset", "dataset", "source_lang", "target_lang", "vocab_size", "max_length", "long_sentences",
    "token_budget", "seed", "dropout", "warmup_steps", "learning_rate_scale", "label_smoothing", "mixed_precision",
    "jit_compile",
    "train_steps", "epochs", "max_minutes", "log_every", "checkpoint_every", "keep_checkpoints", "eval_every",
    "patience", "average_last", "bleu_sentences", "beam_size", "alpha", "replicas",
)
# config.json's (section, key) -> the setting saved there.
_SETTING_AT = {_CONFIG_LOCATIONS.get(name, ("train", name)): name for name in SAVED}
# Settings that may be None, `null` in a --config file: a flag whose absence means something.
_NULLABLE = ("epochs", "max_minutes", "source_lang", "target_lang", "replicas")
# Flags of one command, not settings of the run: no key of a config file.
_PER_COMMAND = ("config", "data_dir", "devices", "connect_timeout_minutes", "run_dir", "average_only")


class SettingsError(ValueError):
    """Flags that cannot be used together or with the run directory."""


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text}")
    return value


def seed(text):
    value = int(text)
    if not 0 <= value < 2**32:  # NumPy's seeds, which Keras seeds, are 32-bit unsigned.
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {2**32 - 1}, got {text}")
    return value


def positive_float(text):
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text):
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive number, got {text}")
    return value


def probability(text):
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _recipe_values(name):
    """'tiny 100, small 800, ...': the default of setting `name` per preset, for help texts."""
    return ", ".join(f"{preset} {RECIPES[preset][name]:g}" for preset in PRESET_NAMES)


def build_parser():
    parser = argparse.ArgumentParser(
        description=(
            "Train a Transformer (Vaswani et al., 2017) for translation: Adam with the paper's "
            "warm-up schedule, label smoothing, token-budget batches, data-parallel over all local "
            "GPUs (or the workers of TF_CONFIG), checkpoints, TensorBoard (RUN/logs), validation "
            "BLEU, and a final test BLEU with beam search. Unset flags come from the run "
            "directory's config.json when resuming, else from the preset's recipe."
        ),
        epilog=(
            "Resume: run the same command again (or just --run-dir RUN); training continues "
            "from the last checkpoint with the same data order. A finished run is evaluated "
            "again. TensorBoard: tensorboard --logdir RUN/logs"
        ),
    )
    what = parser.add_argument_group("model and data")
    what.add_argument("--preset", choices=PRESET_NAMES, default=None,
                      help="Model size and training recipe: tiny (tests), small (default, ~10 min on a "
                           "2-core CPU), medium (best Multi30k BLEU in ~1 h of CPU), base/big (the paper's, "
                           "for GPUs and --dataset wmt14). [small]")
    what.add_argument("--dataset", choices=DATASETS, default=None,
                      help="Corpus: multi30k (EN-DE image captions), wmt14 (EN-DE, TFDS, the paper's), "
                           "ted_pt_en (TFDS), files (DIR/{train,val,test}.LANG text files in --data-dir). "
                           "[multi30k]")
    what.add_argument("--data-dir", default=None,
                      help="Multi30k directory (default: $MULTI30K_DIR, then ~/.keras/datasets/multi30k, "
                           "then download), TFDS data directory for wmt14/ted_pt_en, or the text-file "
                           "directory for --dataset files.")
    what.add_argument("--source-lang", default=None,
                      help="Source language code. [the corpus's usual: en; ted_pt_en: pt]")
    what.add_argument("--target-lang", default=None,
                      help="Target language code. [the corpus's usual: de; ted_pt_en: en]")
    what.add_argument("--vocab-size", type=positive_int, default=None,
                      help="Size of the shared BPE vocabulary learned on the training data. "
                           "[8000; wmt14: 37000]")
    what.add_argument("--max-length", type=positive_int, default=None,
                      help="Longest sequence in tokens; longer training pairs are dropped or cut "
                           "(--long-sentences). [multi30k: 128, other corpora: 256]")
    what.add_argument("--long-sentences", choices=("filter", "truncate"), default=None,
                      help="Training pairs with a side longer than --max-length: dropped (filter) or cut "
                           "to fit (truncate). [filter]")
    what.add_argument("--dropout", type=probability, default=None,
                      help="Dropout rate P_drop (residual and embedding dropout). [the preset's]")

    how = parser.add_argument_group("optimization")
    length = how.add_mutually_exclusive_group()
    length.add_argument("--train-steps", type=positive_int, default=None,
                        help="Total steps (global batches) of the run. [the recipe's]")
    length.add_argument("--epochs", type=positive_float, default=None,
                        help="Train this many passes over the training data instead of --train-steps.")
    how.add_argument("--max-minutes", type=non_negative_float, default=None,
                     help="Time budget of this command's training loop: when exceeded, training stops "
                          "cleanly after a checkpoint and goes on to the final evaluation. 0: no budget. "
                          "[medium: 60, else none]")
    how.add_argument("--token-budget", type=positive_int, default=None,
                     help="Padded tokens per batch and side, PER REPLICA (the global batch is this "
                          f"times the number of replicas). [the preset's: {_recipe_values('token_budget')}] "
                          "The paper's 25k = 8 GPUs x ~3k real.")
    how.add_argument("--warmup-steps", type=positive_int, default=None,
                     help="Linear warm-up steps of the learning rate, then inverse square-root decay. "
                          f"[the preset's: {_recipe_values('warmup_steps')}] The paper: 4000.")
    how.add_argument("--learning-rate-scale", type=positive_float, default=None,
                     help="Multiplier of the paper's rate d_model^-0.5 * min(step^-0.5, step * warmup^-1.5). "
                          f"[the preset's: {_recipe_values('learning_rate_scale')}] The paper: 1.")
    how.add_argument("--label-smoothing", type=probability, default=None, help="Label smoothing eps. [0.1]")
    how.add_argument("--seed", type=seed, default=None, help="Seed of weights, dropout and data order. [0]")
    how.add_argument("--mixed-precision", choices=("none", "bf16", "fp16"), default=None,
                     help="Compute in bfloat16 or float16 with float32 weights (fp16 adds loss scaling). "
                          "[none]")
    how.add_argument("--jit-compile", action=argparse.BooleanOptionalAction, default=None,
                     help="Compile the forward/backward pass with XLA (recompiles for every new batch "
                          "shape). [off]")
    how.add_argument("--devices", default=None,
                     help="Comma-separated devices to replicate over, e.g. GPU:0,GPU:1 (CPU:0,CPU:1 "
                          "splits the CPU, for testing). [all local GPUs, else the CPU; with a "
                          "multi-worker TF_CONFIG, MultiWorkerMirroredStrategy]")
    how.add_argument("--connect-timeout-minutes", type=positive_float, default=15.0,
                     help="Multi-worker: how long a worker waits for every worker of TF_CONFIG to "
                          "start; then it exits with status 1. [15]")

    run = parser.add_argument_group("run directory, logging and evaluation")
    run.add_argument("--run-dir", default=None, help="Where the run lives. [runs/DATASET-PRESET]")
    run.add_argument("--config", default=None, metavar="FILE",
                     help="Settings from a JSON or YAML file with the keys and layout of a run's config.json "
                          "(a run's config.json given back trains the same run): flags override it, it "
                          "overrides the run directory's saved settings and the recipe. Keys: see train.py's "
                          "docstring.")
    run.add_argument("--log-every", type=positive_int, default=None,
                     help="Steps between progress lines and TensorBoard training summaries.")
    run.add_argument("--checkpoint-every", type=positive_int, default=None,
                     help="Steps between checkpoints (one is also written at the end and on Ctrl-C).")
    run.add_argument("--keep-checkpoints", type=positive_int, default=None, help="Checkpoints to keep.")
    run.add_argument("--eval-every", type=non_negative_int, default=None,
                     help="Steps between validations (loss, perplexity, accuracy, BLEU on the first "
                          "--bleu-sentences validation sentences, attention images); 0: only at the end. "
                          "With N, the run keeps the checkpoint of its best validation BLEU in RUN/best.")
    run.add_argument("--patience", type=non_negative_int, default=None,
                     help="Stop training once N validations in a row (--eval-every) have not improved on the "
                          "best validation BLEU; the run's model is then its best checkpoint (or the average "
                          "of --average-last, if it translates better). 0: train all steps. [0]")
    run.add_argument("--bleu-sentences", type=non_negative_int, default=None,
                     help="Validation sentences translated for the validation BLEU (0: none).")
    run.add_argument("--average-last", type=non_negative_int, default=None,
                     help="Average the last N checkpoints into RUN/averaged for the final evaluation "
                          "(paper: 5 for base, 20 for big), kept only if its validation BLEU is at least that "
                          "of the last checkpoint, or of the best one in a run that keeps it (--eval-every N); "
                          "kept unchecked when there is no validation BLEU (--bleu-sentences 0). At most "
                          "--keep-checkpoints. 0: use the last checkpoint (or the best one). "
                          f"[the preset's: {_recipe_values('average_last')}]")
    run.add_argument("--average-only", action="store_true",
                     help="Only average the last --average-last checkpoints of --run-dir, then exit.")
    run.add_argument("--beam-size", type=positive_int, default=None, help="Beam size of the translations. [4]")
    run.add_argument("--alpha", type=non_negative_float, default=None, help="Length penalty alpha. [0.6]")
    return parser


def resolve_settings(args):
    """The run's settings: flags, else the --config file, else the saved config.json, else the recipe.

    Returns:
        `(settings dict, run directory Path, saved config dict or None)`.

    Raises:
        SettingsError: For flags or a --config file in conflict with the run directory or
            with each other, and for a --config file that cannot be read or holds a
            wrong key or value.
    """
    from keras_transformer import run_dir as run_dir_lib

    explicit = {name: value for name, value in vars(args).items() if value is not None and name in SAVED}
    from_file, model_keys = config_file_settings(args.config) if args.config is not None else ({}, {})
    requested = {**from_file, **explicit}
    dataset = requested.get("dataset", "multi30k")
    preset = requested.get("preset", "small")
    run = Path(args.run_dir or Path("runs") / f"{dataset}-{preset}")
    if run.exists() and not run.is_dir():
        raise SettingsError(f"--run-dir {run} is a file, not a directory.")
    saved_config = run_dir_lib.read_config(run) if (run / run_dir_lib.CONFIG_FILE).is_file() else None
    if saved_config is None:
        _check_no_orphan_state(run)
        saved = {}
    else:
        saved = _saved_settings(saved_config)
    for name in PINNED:
        if name in requested and name in saved and requested[name] != saved[name]:
            if name in explicit:
                given, advice = "", f"leave out --{_flag(name)}"
            else:
                given, advice = f" ({_config_key(name)} of --config {args.config})", f"leave {_config_key(name)} out"
            raise SettingsError(
                f"{run} was trained with --{_flag(name)} {saved[name]}, not {requested[name]}{given}; use another "
                f"--run-dir, or {advice} to continue this run."
            )
    settings = _layered(saved, from_file, explicit)
    dataset = settings["dataset"]
    if model_keys:  # Checked against the file's own settings: flags may change what they determine.
        _check_model_keys(model_keys, _layered(saved, from_file), args.config)
    if settings["max_minutes"] == 0:
        settings["max_minutes"] = None
    if settings["max_length"] < 2:
        raise SettingsError(f"--max-length {settings['max_length']} leaves no room for a token and EOS; use 2 or more.")
    _check_beam_size(settings["beam_size"])
    if settings["token_budget"] < settings["max_length"]:
        raise SettingsError(
            f"--token-budget ({settings['token_budget']}) must be at least --max-length "
            f"({settings['max_length']}), or the longest pairs fit in no batch."
        )
    if dataset == "files" and not args.data_dir and not args.average_only:  # Averaging reads no data.
        raise SettingsError(
            "--dataset files needs --data-dir DIR holding train.SRC and train.TGT (a run does not save it: "
            "give it again to resume)."
        )
    if dataset == "files" and not (settings["source_lang"] and settings["target_lang"]):
        raise SettingsError("--dataset files needs --source-lang and --target-lang (the file suffixes).")
    _check_direction(settings)
    _check_patience(settings)
    if settings["average_last"] > settings["keep_checkpoints"]:
        # An error rather than averaging fewer: the number averaged is part of the recipe,
        # and finding out after the training would be too late to keep more checkpoints.
        raise SettingsError(
            f"--average-last {settings['average_last']} needs as many kept checkpoints, but "
            f"--keep-checkpoints is {settings['keep_checkpoints']}: raise --keep-checkpoints or lower "
            "--average-last."
        )
    if args.average_only and saved_config is None:
        raise SettingsError(f"--average-only needs an existing run directory; {run} has no config.json.")
    _check_vocabulary(run, settings["vocab_size"])
    return settings, run, saved_config


def _layered(*layers):
    """The settings of `layers` of `{name: value}`, each over the ones before, over the recipe of their preset."""
    from keras_transformer.presets import get_preset

    chosen = {}
    for layer in layers:
        chosen.update(layer)
        if "train_steps" in layer and "epochs" not in layer:
            chosen["epochs"] = None  # A length in steps replaces a length in epochs from below.
    dataset, preset = chosen.get("dataset", "multi30k"), chosen.get("preset", "small")
    defaults = {
        **GENERAL_DEFAULTS,
        **DATASET_DEFAULTS[dataset],
        **RECIPES[preset],
        "dropout": get_preset(preset)["dropout_rate"],
        "epochs": None,
        "source_lang": None,
        "target_lang": None,
        "replicas": None,
    }
    return {**defaults, **chosen, "preset": preset, "dataset": dataset}


def _check_patience(settings):
    """--patience counts validations with a BLEU: it needs --eval-every and --bleu-sentences."""
    patience = settings["patience"]
    if patience and not settings["eval_every"]:
        raise SettingsError(
            f"--patience {patience} counts validations, but --eval-every is 0 (one validation, at the end): "
            "give --eval-every N, or --patience 0."
        )
    if patience and not settings["bleu_sentences"]:
        raise SettingsError(
            f"--patience {patience} watches the validation BLEU, but --bleu-sentences is 0 (no BLEU): give "
            "--bleu-sentences N, or --patience 0."
        )


def _flag(name):
    return name.replace("_", "-")


def _config_key(name):
    """'train.max_minutes': where config.json keeps setting `name`."""
    return ".".join(_CONFIG_LOCATIONS.get(name, ("train", name)))


def read_config_file(path):
    """The mapping of a --config file: JSON by the extension .json, YAML by .yaml or .yml, else by its text."""
    path = Path(path)
    where = f"--config {path}"
    if path.is_dir():
        raise SettingsError(f"{where} is a directory; give a file, such as {path / 'config.json'}.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SettingsError(f"{where}: cannot read it ({getattr(error, 'strerror', None) or error}).") from None
    suffix = path.suffix.lower()
    if suffix == ".json" or (suffix not in (".yaml", ".yml") and _is_json(text)):
        try:
            config = json.loads(text)
        except json.JSONDecodeError as error:
            raise SettingsError(f"{where}: not valid JSON ({error}).") from None
    else:
        config = _load_yaml(text, where)
    if config is None:  # An empty YAML file: no setting.
        return {}
    if not isinstance(config, dict):
        raise SettingsError(f"{where}: must hold a mapping of sections (data, train, model), got {_shown(config)}.")
    return config


def _is_json(text):
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _load_yaml(text, where):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        place = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(error, "problem", None) or " ".join(str(error).split())
        raise SettingsError(f"{where}: not valid YAML ({reason}{place}).") from None


def config_file_settings(path):
    """The settings of the --config file `path`, checked as their flags check them.

    Returns:
        `({setting: value}, {model key: value})`: the settings, and the `model` keys that
        the preset determines (see `_check_model_keys`). `train.replicas` is checked and
        left out: it records what a run trained on.

    Raises:
        SettingsError: Naming the file and the key, for an unknown key or a wrong value.
    """
    from keras_transformer.run_dir import MODEL_KEYS

    where = f"--config {path}"
    actions = {action.dest: action for action in build_parser()._actions}
    settings, model_keys = {}, {}
    for section, values in read_config_file(path).items():
        if section not in ("data", "train", "model"):
            raise SettingsError(f"{where}: unknown section {section!r}; a run's config.json has data, train and model.")
        if not isinstance(values, dict):
            raise SettingsError(f"{where}: {section} must be a mapping of keys to values, got {_shown(values)}.")
        for key, value in values.items():
            name = _SETTING_AT.get((section, key))
            label = f"{where}: {section}.{key}"
            if name is None and section == "model" and key in MODEL_KEYS:
                model_keys[key] = value
            elif name is None:
                raise SettingsError(f"{where}: {_unknown_key(section, key)}")
            elif name == "replicas":  # No flag: the count of replicas, as --train-steps counts steps.
                _checked_value(value, actions["train_steps"], label, nullable=True)
            else:
                settings[name] = _checked_value(value, actions[name], label, nullable=name in _NULLABLE)
    return settings, model_keys


def _unknown_key(section, key):
    """The error for `section.key`, with the key meant if there is a close one."""
    from keras_transformer.run_dir import MODEL_KEYS

    message = f"unknown key {section}.{key}"
    if str(key).replace("-", "_") in _PER_COMMAND:
        return f"{message}: --{_flag(str(key))} is no setting of the run, give it on the command line."
    known = [f"{place}.{name}" for place, name in _SETTING_AT] + [f"model.{name}" for name in MODEL_KEYS]
    elsewhere = [place_key for place_key in known if place_key.split(".")[1] == key]  # A key in another section.
    close = elsewhere or difflib.get_close_matches(f"{section}.{key}", known, n=1, cutoff=0.75)
    if close:
        return f"{message}; did you mean {close[0]}?"
    keys = sorted(place_key.split(".")[1] for place_key in known if place_key.startswith(f"{section}."))
    return f"{message}; {section} takes {', '.join(keys)}."


# The flags' value checks, by kind: what a --config value must be before that check.
_INTEGER_CHECKS = (positive_int, non_negative_int, seed)
_NUMBER_CHECKS = (positive_float, non_negative_float, probability)


def _checked_value(value, action, label, nullable):
    """`value` checked as the flag `action` checks its text; a SettingsError starting with `label` if wrong."""
    if value is None and nullable:
        return None
    if isinstance(action, argparse.BooleanOptionalAction):
        kind, fits = "true or false", isinstance(value, bool)
    elif action.choices:
        kind, fits = f"one of {', '.join(action.choices)}", isinstance(value, str) and value in action.choices
    elif action.type in _INTEGER_CHECKS:
        kind, fits = "an integer", isinstance(value, int) and not isinstance(value, bool)
    elif action.type in _NUMBER_CHECKS:
        kind, fits = "a number", isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        kind, fits = "a string", isinstance(value, str)
    if not fits:
        # YAML 1.1 reads yes, no, on and off as booleans: Norwegian's code, `no`, among them.
        quote = isinstance(value, bool) and (action.type is None or action.choices)
        hint = " (quote it: YAML reads yes, no, on and off as true or false)" if quote else ""
        raise SettingsError(f"{label} must be {kind}, got {_shown(value)}{hint}.")
    if action.type is None:
        return value
    try:
        return action.type(str(value))
    except argparse.ArgumentTypeError as error:
        raise SettingsError(f"{label} {error}.") from None


def _shown(value):
    """`value` as a config file writes it: "ten", 8, null, [1, 2]."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):  # YAML's dates, and the like.
        return repr(value)


def _check_model_keys(model_keys, settings, path):
    """The `model` keys of a --config file (but dropout_rate) must be those of the model `settings` build.

    Those keys describe the model that the preset and the vocabulary size determine: a run's
    config.json holds them, and passes; another value, which would not be the model trained, fails.
    """
    from keras_transformer import run_dir as run_dir_lib
    from keras_transformer.model import Transformer

    built = run_dir_lib.model_config(
        Transformer.from_preset(settings["preset"], settings["vocab_size"], dropout_rate=settings["dropout"])
    )
    for key, value in model_keys.items():
        if value != built[key] or isinstance(value, bool) != isinstance(built[key], bool):
            raise SettingsError(
                f"--config {path}: model.{key} is {_shown(value)}, but the {settings['preset']} preset with vocab_size "
                f"{settings['vocab_size']} has {_shown(built[key])}: train.py trains the presets' "
                f"models (leave model.{key} out, or choose another train.preset)."
            )


def _saved_settings(config):
    """The flat settings of a config.json written by this script."""
    settings = dict(config.get("train", {}))
    for name, (section, key) in _CONFIG_LOCATIONS.items():
        if key in config.get(section, {}):
            settings[name] = config[section][key]
    return {name: value for name, value in settings.items() if name in SAVED}


def _check_no_orphan_state(run):
    """Refuses a directory holding checkpoints without config.json; takes over a lone vocabulary.

    Runs of this script write config.json before their vocabulary, but earlier versions
    wrote the vocabulary first: a start interrupted then left only tokenizer.model.
    Nothing was trained with it, so the run starts with it (its size is checked next).
    """
    from keras_transformer import run_dir as run_dir_lib

    if (run / run_dir_lib.CHECKPOINT_DIR).exists():
        raise SettingsError(
            f"{run} holds {run_dir_lib.CHECKPOINT_DIR} but no {run_dir_lib.CONFIG_FILE}; it is not a run of "
            "this script: use another --run-dir."
        )
    if run_dir_lib.tokenizer_path(run).is_file():
        logger.warning("%s holds %s but no %s (an interrupted start): starting the run with that vocabulary.",
                       run, run_dir_lib.TOKENIZER_FILE, run_dir_lib.CONFIG_FILE)


def _check_beam_size(beam_size):
    from keras_transformer.translator import MAX_BEAM_SIZE

    if beam_size > MAX_BEAM_SIZE:
        # The run's translators (translate.py, export) use the saved beam size.
        raise SettingsError(f"--beam-size is at most {MAX_BEAM_SIZE}, got {beam_size}.")


def _check_direction(settings):
    """The languages must be those of the corpus (checked here: loading it takes a while)."""
    from keras_transformer import corpora

    if settings["dataset"] == "files":
        return
    source, target = settings["source_lang"], settings["target_lang"]
    try:
        corpora.check_direction(settings["dataset"], source, target)
    except ValueError:
        first, second = corpora.CORPUS_LANGUAGES[settings["dataset"]]
        raise SettingsError(
            f"--dataset {settings['dataset']} translates between {first} and {second} (either way), not "
            f"--source-lang {source or first} --target-lang {target or second}."
        ) from None


def _check_vocabulary(run, vocab_size):
    """The saved vocabulary, if any, must have `vocab_size` ids (read without TensorFlow ops)."""
    import sentencepiece

    from keras_transformer import run_dir as run_dir_lib

    path = run_dir_lib.tokenizer_path(run)
    if not path.is_file():
        return
    try:
        saved_size = sentencepiece.SentencePieceProcessor(model_file=str(path)).get_piece_size()
    except (OSError, RuntimeError) as error:
        raise SettingsError(f"{path} is not a readable SentencePiece model ({error}).") from None
    if saved_size != vocab_size:
        raise SettingsError(
            f"{path} has {saved_size} ids but --vocab-size is {vocab_size}; use another --run-dir, "
            "or leave out --vocab-size to continue this run."
        )


def run_config(settings, model_config=None):
    """The config.json of the run; without its "model" section until the model is built."""
    config = {"data": {}, "train": {}}
    if model_config is not None:
        config["model"] = model_config
    for name in SAVED:
        section, key = _CONFIG_LOCATIONS.get(name, ("train", name))
        if section != "model":
            config[section][key] = settings[name]
    return config


def check_replicas(run, settings, replicas):
    """The number of replicas to record in config.json, after checking that the run may use `replicas`.

    A run resumes where it stopped only on as many replicas as it trained on: the global
    batch and the data order depend on it (see `keras_transformer.trainer`). Evaluating a
    finished run works on any number, and keeps the recorded one.

    Raises:
        SettingsError: When training would continue on another number of replicas.
    """
    from keras_transformer import run_dir as run_dir_lib

    saved = settings["replicas"]
    step = run_dir_lib.checkpoint_step(run_dir_lib.latest_checkpoint(run / run_dir_lib.CHECKPOINT_DIR))
    if step <= 0:
        return replicas
    if step >= settings["train_steps"]:
        return saved
    if saved not in (None, replicas):
        raise SettingsError(
            f"{run} trained on {saved} replica(s) up to step {step}, and this command runs {replicas}: a run "
            f"resumes only on as many replicas, as the global batch and the data order depend on it. Resume it "
            f"on {saved} replica(s) (see --devices), or use another --run-dir."
        )
    return replicas


def load_corpus(settings, data_dir):
    from keras_transformer import corpora

    if settings["dataset"] == "files":
        directory = Path(data_dir)
        source, target = settings["source_lang"], settings["target_lang"]

        def split(stem):
            paths = (directory / f"{stem}.{source}", directory / f"{stem}.{target}")
            present = [path.is_file() for path in paths]
            if any(present) and not all(present):  # Likely a misnamed file: not a split to skip quietly.
                found, missing = paths if present[0] else paths[::-1]
                raise corpora.DatasetUnavailableError(f"{directory} has {found.name} but not {missing.name}.")
            return paths if all(present) else None

        if split("train") is None:
            raise corpora.DatasetUnavailableError(f"{directory} lacks train.{source} and train.{target}.")
        return corpora.load_text_corpus(
            split("train"), split("val"), split("test"), source_lang=source, target_lang=target, name="files"
        )
    return corpora.load_corpus(
        settings["dataset"], data_dir, source_lang=settings["source_lang"], target_lang=settings["target_lang"],
        seed=settings["seed"],
    )


def prepare_tokenizer(run, corpus, settings, strategy):
    """The run's tokenizer: loaded, or learned on the training data and saved by the chief."""
    from keras_transformer import distribution, run_dir as run_dir_lib
    from keras_transformer.tokenizer import SubwordTokenizer, train_tokenizer

    path = run_dir_lib.tokenizer_path(run)
    if not path.is_file() and distribution.is_chief(strategy):
        started = time.monotonic()
        try:
            tokenizer = train_tokenizer(corpus.training_sentences(), settings["vocab_size"], seed=settings["seed"])
        except RuntimeError as error:  # SentencePiece's, for a vocabulary size the text cannot fill.
            raise SettingsError(_vocabulary_error(settings, error)) from None
        # config.json first: from here on, an interrupted start is a run of known settings,
        # which the same command resumes (and another command cannot take over).
        if not (run / run_dir_lib.CONFIG_FILE).is_file():
            run_dir_lib.write_config(run, run_config(settings))
        partial = path.with_name(f".{path.name}.partial")
        tokenizer.save(partial)
        os.replace(partial, path)  # Atomically: never a truncated vocabulary.
        logger.info("Learned a %d-token BPE vocabulary in %.0fs: %s", tokenizer.vocab_size,
                    time.monotonic() - started, path)
    distribution.barrier(strategy)  # The other workers read the chief's file.
    return SubwordTokenizer.load(path)


def _vocabulary_error(settings, error):
    """A one-line message for SentencePiece's RuntimeError when learning the vocabulary."""
    import re

    text = str(error)
    needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", text)
    if needed:
        return (
            f"--vocab-size {settings['vocab_size']} is too small for the {settings['dataset']} training text: "
            f"its characters, byte pieces and reserved ids alone take {needed.group(1)} ids; give --vocab-size "
            f"{needed.group(1)} or more (8000 is usual)."
        )
    if "sentences_.empty()" in text:
        return (
            f"The {settings['dataset']} training text has no sentence to learn a vocabulary from: every line is "
            "empty, not valid UTF-8, or longer than SentencePiece's limit of 4192 bytes."
        )
    detail = (text.split("] ", 1)[-1].strip() or text.strip() or type(error).__name__).splitlines()[0]
    return (
        f"Cannot learn a {settings['vocab_size']}-token vocabulary on the {settings['dataset']} training "
        f"text ({detail}); adjust --vocab-size."
    )


def _no_training_pairs(run, settings):
    dropped = "an empty side" if settings["long_sentences"] == "truncate" else (
        f"an empty side or one longer than --max-length {settings['max_length']} allows "
        f"({settings['max_length'] - 1} tokens)"
    )
    return (
        f"No training pair is left: every pair of the {settings['dataset']} training data has {dropped}. "
        f"--max-length is saved with the run: to train with another, delete {run} first."
    )


def steps_for_epochs(run, corpus, tokenizer, settings, num_replicas):
    """Steps of `settings["epochs"]` passes: per-replica batches of one epoch / replicas."""
    from keras_transformer import data

    batches = data.make_training_dataset(
        corpus.train, tokenizer, token_budget=settings["token_budget"], max_length=settings["max_length"],
        long_sentences=settings["long_sentences"], seed=settings["seed"],
    )
    per_epoch = int(batches.reduce(0, lambda count, _: count + 1))
    if not per_epoch:
        raise SettingsError(_no_training_pairs(run, settings))
    steps = max(1, math.ceil(settings["epochs"] * per_epoch / num_replicas))
    logger.info("%g epochs = %d steps (%d batches per epoch over %d replica(s)).", settings["epochs"], steps,
                per_epoch, num_replicas)
    return steps


def average_only(run, settings):
    from keras_transformer import run_dir as run_dir_lib

    if not settings["average_last"]:
        raise SettingsError("--average-only needs --average-last N with N >= 1.")
    path, averaged = run_dir_lib.average_checkpoints(run, settings["average_last"])
    logger.info("Averaged %d checkpoints (%s) into %s", len(averaged), ", ".join(Path(p).name for p in averaged), path)
    if (run / run_dir_lib.CONFIG_FILE).is_file():
        # Saved as any command saves its new values: a run last given --average-last 0 (the
        # `small` preset's default) would otherwise keep translating with its latest checkpoint.
        config = run_dir_lib.read_config(run)
        config.setdefault("train", {})["average_last"] = settings["average_last"]
        run_dir_lib.write_config(run, config)
    logger.info("translate.py and export now use the average (--checkpoint latest: the last checkpoint).")
    return 0


def average_against_best(run, corpus, settings):
    """Averages the last checkpoints, and keeps the average only if it translates better than the best checkpoint.

    For a run that keeps the checkpoint of its best validation BLEU (`run_dir.best_checkpoint`):
    `average_if_better`, with that checkpoint in the place of the latest one. The run's model
    (`run_dir.checkpoint_path(run, "best")`, which the test, translate.py and export use) is
    then the better of the two on the first --bleu-sentences validation sentences; without
    validation sentences, the average, unchecked.
    """
    import shutil

    from keras_transformer import run_dir as run_dir_lib

    averaged_path, averaged = run_dir_lib.average_checkpoints(run, settings["average_last"])
    logger.info("Averaged the last %d checkpoints (%s) into %s", len(averaged),
                ", ".join(Path(p).name for p in averaged), averaged_path)
    best_path, _ = run_dir_lib.best_checkpoint(run)
    pairs = list(corpus.validation or [])[: settings["bleu_sentences"]]
    if not pairs:
        return
    averaged_bleu, best_bleu = (
        _validation_bleu(run, which, pairs, corpus.target_lang, settings) for which in (averaged_path, best_path)
    )
    best_name = "/".join(Path(best_path).parts[-2:])
    logger.info("Validation BLEU (%d sentences): averaged %.2f, best checkpoint (%s) %.2f.", len(pairs),
                averaged_bleu, best_name, best_bleu)
    if averaged_bleu < best_bleu:
        shutil.rmtree(run / run_dir_lib.AVERAGED_DIR)
        logger.info("Dropped the averaged checkpoint: %s translates better, and is the run's model.", best_name)
    else:
        logger.info("The averaged checkpoint translates at least as well: it is the run's model.")


def _validation_bleu(run, which, pairs, target_lang, settings):
    """BLEU of checkpoint `which` of the run on the validation `pairs`."""
    from keras_transformer import evaluation, run_dir as run_dir_lib

    sources, references = (list(side) for side in zip(*pairs))
    translations = evaluation.translate(
        run_dir_lib.load_model(run, which), run_dir_lib.load_tokenizer(run), sources, beam_size=settings["beam_size"],
        alpha=settings["alpha"], max_length=settings["max_length"],
        on_batch=translation_progress(f"validation sentences ({'/'.join(Path(which).parts[-2:])})"),
    )
    return evaluation.corpus_bleu(translations, references, target_lang).score


def average_if_better(run, corpus, settings):
    """Averages the last checkpoints, and keeps the average only if it translates better.

    The paper averages the checkpoints of a long, converged run, where it smooths the
    noise of the last updates. Early in a short run, the older checkpoints are much worse
    than the latest and so is their mean: the average is kept (as the run's "best"
    checkpoint, which translate.py and export use) only if its validation BLEU on the
    first --bleu-sentences sentences is at least the latest checkpoint's.
    """
    import shutil

    from keras_transformer import evaluation, run_dir as run_dir_lib

    path, averaged = run_dir_lib.average_checkpoints(run, settings["average_last"])
    logger.info("Averaged the last %d checkpoints (%s) into %s", len(averaged),
                ", ".join(Path(p).name for p in averaged), path)
    pairs = list(corpus.validation or [])[: settings["bleu_sentences"]]
    if len(averaged) < 2 or not pairs:
        return
    tokenizer = run_dir_lib.load_tokenizer(run)
    sources, references = (list(side) for side in zip(*pairs))
    scores = {}
    for which in ("averaged", "latest"):
        translations = evaluation.translate(
            run_dir_lib.load_model(run, which), tokenizer, sources, beam_size=settings["beam_size"],
            alpha=settings["alpha"], max_length=settings["max_length"],
            on_batch=translation_progress(f"validation sentences ({which} checkpoint)"),
        )
        scores[which] = evaluation.corpus_scores(translations, references, corpus.target_lang)
    averaged, latest = scores["averaged"], scores["latest"]
    logger.info("Validation BLEU (%d sentences): averaged %.2f, latest %.2f (chrF %.2f, %.2f).", len(pairs),
                averaged.bleu.score, latest.bleu.score, averaged.chrf.score, latest.chrf.score)
    if averaged.bleu.score < latest.bleu.score:  # BLEU decides; chrF is for information.
        shutil.rmtree(run / run_dir_lib.AVERAGED_DIR)
        logger.info("Dropped the averaged checkpoint: the latest one translates better "
                    "(python train.py --run-dir %s --average-only --average-last N writes it again).", run)


def final_evaluation(run, corpus, settings):
    """Averages the last checkpoints (if asked and better); test BLEU, chrF and translations with beam search."""
    import tensorflow as tf

    from keras_transformer import evaluation, run_dir as run_dir_lib

    if settings["average_last"]:
        average_if_better(run, corpus, settings)
    if not corpus.test:
        logger.info("The corpus has no test split; no test BLEU.")
        return
    which = run_dir_lib.checkpoint_path(run, "best")
    model = run_dir_lib.load_model(run, which)
    # "averaged/ckpt-N" or "checkpoints/ckpt-N": which of the two was kept matters.
    name = "/".join(Path(which).parts[-2:])
    tokenizer = run_dir_lib.load_tokenizer(run)
    sources, references = (list(side) for side in zip(*corpus.test))
    started = time.monotonic()
    logger.info("Translating %d test sentences with %s (beam %d, alpha %g)...", len(sources), name,
                settings["beam_size"], settings["alpha"])
    translations = evaluation.translate(
        model, tokenizer, sources, beam_size=settings["beam_size"], alpha=settings["alpha"],
        max_length=settings["max_length"], on_batch=translation_progress("test sentences"),
    )
    scores = evaluation.corpus_scores(translations, references, corpus.target_lang)
    output = run / run_dir_lib.TRANSLATIONS_DIR / f"test.{corpus.target_lang}"
    evaluation.write_lines(output, translations)
    with tf.summary.create_file_writer(str(run / run_dir_lib.LOG_DIR / "test")).as_default():
        for tag, value in scores.metrics().items():
            tf.summary.scalar(tag, value, step=run_dir_lib.checkpoint_step(which))
    logger.info("Test BLEU and chrF (%s, %d sentences, %.0fs):\n  %s", name, len(sources),
                time.monotonic() - started, str(scores).replace("\n", "\n  "))
    logger.info("Translations: %s", output)
    for source, reference, translation in list(zip(sources, references, translations))[:3]:
        logger.info("  source:      %s\n  reference:   %s\n  translation: %s", source, reference, translation)


def translation_progress(what, every_seconds=30.0):
    """An `on_batch` callback for `evaluation.translate` that logs progress at most every `every_seconds`.

    A test set takes minutes on a CPU (WMT14's 3003 sentences with `base`, much longer).
    """
    from keras_transformer.trainer import format_duration

    started = last = time.monotonic()

    def log(translated, total):
        nonlocal last
        now = time.monotonic()
        if translated < total and now - last >= every_seconds:
            last = now
            logger.info("  %d/%d %s translated (%s)", translated, total, what, format_duration(now - started))

    return log


def configure_process():
    """Progress lines on stderr, and a checkpoint on `kill` (SIGTERM) as on Ctrl-C."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("train", "keras_transformer"):
        logging.getLogger(name).setLevel(logging.INFO)
    handle_sigterm()


def handle_sigterm():
    """`kill` (SIGTERM) stops training as Ctrl-C does: with a checkpoint."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _make_strategy(devices, connect_timeout_minutes):
    """The strategy; with a multi-worker TF_CONFIG, waiting at most `connect_timeout_minutes` for the others."""
    from keras_transformer import distribution

    workers = distribution.cluster_task_count()
    if workers < 2:
        return distribution.make_strategy(devices)
    logger.info("Waiting for all %d workers of TF_CONFIG to start; after %g minutes (--connect-timeout-minutes) "
                "this worker gives up with exit status 1 ...", workers, connect_timeout_minutes)
    # MultiWorkerMirroredStrategy() waits for the others in TensorFlow's C++ code, silently (a lone
    # worker still waited after 10 minutes), holding the GIL, its coordination service taking
    # SIGTERM: no Python thread, signal handler or exception gets through. faulthandler's timer is
    # a C thread: it prints where this worker waited (the "Timeout" traceback) and ends the process.
    faulthandler.dump_traceback_later(connect_timeout_minutes * 60, exit=True)
    try:
        strategy = distribution.make_strategy(devices)
    finally:
        faulthandler.cancel_dump_traceback_later()
    logger.info("All %d workers of TF_CONFIG connected.", workers)
    return strategy


def train(args):
    """Checks the settings, then trains and evaluates; returns the exit code."""
    settings, run, saved_config = resolve_settings(args)
    configure_process()
    if args.average_only:
        return average_only(run, settings)

    from keras_transformer import distribution

    devices = None if args.devices is None else [name.strip() for name in args.devices.split(",") if name.strip()]
    if devices == []:
        raise SettingsError(f"--devices {args.devices!r} names no device; leave it out for the default.")
    try:
        strategy = _make_strategy(devices, args.connect_timeout_minutes)
    except ValueError as error:
        raise SettingsError(f"--devices {args.devices}: {error}" if devices else str(error)) from None
    # A multi-worker strategy starts TensorFlow's coordination service, whose own SIGTERM
    # handler replaces ours: without this, `kill` neither checkpoints nor stops a worker.
    handle_sigterm()
    if settings["epochs"] is None:  # Else the length of the run, which the check needs, is not known yet.
        settings["replicas"] = check_replicas(run, settings, strategy.num_replicas_in_sync)

    import keras
    import tensorflow as tf

    from keras_transformer import data, evaluation, run_dir as run_dir_lib
    from keras_transformer.model import Transformer
    from keras_transformer.tokenizer import SubwordTokenizer
    from keras_transformer.trainer import EmptyDatasetError, Trainer, TrainingConfig, format_duration

    tf.get_logger().setLevel("ERROR")
    # Seeding drops TensorFlow's kernel cache, which holds tokenizer resources: seed first.
    keras.utils.set_random_seed(settings["seed"])
    corpus = load_corpus(settings, args.data_dir)
    settings["source_lang"], settings["target_lang"] = corpus.source_lang, corpus.target_lang
    if settings["patience"] and not corpus.validation:
        raise SettingsError(
            f"--patience {settings['patience']} watches the validation BLEU, but the {settings['dataset']} corpus "
            "has no validation split."
        )
    is_chief = distribution.is_chief(strategy)
    tokenizer = prepare_tokenizer(run, corpus, settings, strategy)
    if settings["epochs"] is not None:
        settings["train_steps"] = steps_for_epochs(run, corpus, tokenizer, settings, strategy.num_replicas_in_sync)
        settings["replicas"] = check_replicas(run, settings, strategy.num_replicas_in_sync)

    def model_fn(dtype):
        if saved_config is not None and "model" in saved_config:  # Not yet when the start was interrupted.
            return Transformer(**saved_config["model"], dtype=dtype)
        return Transformer.from_preset(
            settings["preset"], tokenizer.vocab_size, dropout_rate=settings["dropout"], dtype=dtype
        )

    config = TrainingConfig(
        train_steps=settings["train_steps"],
        max_minutes=settings["max_minutes"],
        warmup_steps=settings["warmup_steps"],
        learning_rate_scale=settings["learning_rate_scale"],
        label_smoothing=settings["label_smoothing"],
        log_every=settings["log_every"],
        checkpoint_every=settings["checkpoint_every"],
        keep_checkpoints=settings["keep_checkpoints"],
        eval_every=settings["eval_every"],
        patience=settings["patience"],
        mixed_precision=settings["mixed_precision"],
        jit_compile=settings["jit_compile"],
    )
    validator = None
    if is_chief and corpus.validation:
        validator = evaluation.Validator(
            corpus.validation, tokenizer, label_smoothing=settings["label_smoothing"],
            bleu_sentences=settings["bleu_sentences"], beam_size=settings["beam_size"], alpha=settings["alpha"],
            token_budget=settings["token_budget"], max_length=settings["max_length"], target_lang=corpus.target_lang,
        )
    trainer = Trainer(strategy, model_fn, run, config, validate_fn=validator)
    if distribution.num_workers(strategy) > 1:
        # All workers must stop after the same step: a kill asks the trainer, which agrees
        # on it with the others (see Trainer.request_stop).
        signal.signal(signal.SIGTERM, lambda signum, frame: trainer.request_stop())
    if is_chief:
        run_dir_lib.write_config(run, run_config(settings, run_dir_lib.model_config(trainer.model)))
        logger.info("Run directory: %s (TensorBoard: tensorboard --logdir %s)", run, run / run_dir_lib.LOG_DIR)
    model_proto = tokenizer.model_proto

    def dataset_fn(input_context):
        # A tokenizer per input pipeline: its SentencePiece resource must live where the
        # distributed dataset runs.
        return data.make_training_dataset(
            corpus.train, SubwordTokenizer(model_proto), token_budget=settings["token_budget"],
            max_length=settings["max_length"], long_sentences=settings["long_sentences"], seed=settings["seed"],
            input_context=input_context,
        )

    try:
        result = trainer.fit(dataset_fn)
    except EmptyDatasetError:
        raise SettingsError(_no_training_pairs(run, settings)) from None
    handle_sigterm()  # Training is over: a kill stops the evaluation at once.
    if result.step > result.start_step:
        # Steps that traced (or compiled) their function are not timed: a run of those alone has no speed.
        speed = f"; {result.tokens_per_second:,.0f} target tokens/s" if result.tokens_per_second else ""
        logger.info("Trained steps %d-%d in %s%s.", result.start_step + 1, result.step,
                    format_duration(result.seconds), speed)
    if is_chief:
        if settings["average_last"] and run_dir_lib.best_checkpoint(run):
            average_against_best(run, corpus, settings)
            final_evaluation(run, corpus, {**settings, "average_last": 0})  # Averaged and chosen: only the test.
        else:
            final_evaluation(run, corpus, settings)
    if result.stopped_early:
        logger.info("The time budget (--max-minutes %g) stopped the run at step %d of %d; run the same command "
                    "again to continue training from there.", settings["max_minutes"], result.step,
                    settings["train_steps"])
    if result.out_of_patience:
        logger.info("--patience %d stopped the run at step %d of %d; a larger --patience (or 0) continues its "
                    "training.", settings["patience"], result.step, settings["train_steps"])
    return 0


def main(argv=None):
    """Runs the command line `argv`; returns the exit code (2 for bad flags or data, 1 for a lost worker)."""
    args = build_parser().parse_args(argv)
    from keras_transformer import distribution
    from keras_transformer.corpora import CorpusError, DatasetUnavailableError, MissingPackageError
    from keras_transformer.run_dir import RunDirError

    try:
        return train(args)
    except (SettingsError, RunDirError, DatasetUnavailableError, CorpusError, MissingPackageError) as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        return 2
    except distribution.PEER_FAILURES as error:  # Training itself raises WorkerLostError instead.
        if distribution.cluster_task_count() < 2:
            raise
        lost = distribution.worker_lost_error(
            error, "while the workers were setting up", "Start every worker again with the same command."
        )
        print(f"train.py: error: {lost}", file=sys.stderr)
        return 1
    except distribution.WorkerLostError as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("train.py: interrupted; run the same command to resume.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
