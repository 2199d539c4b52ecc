"""A training run's settings: where each comes from, how it is checked, and its config.json.

Every setting of a run is a field of `RunSettings`; its metadata says where config.json
keeps it (`data`, `train` or `model` section), whether it is pinned (it fixes the model,
the vocabulary or the data stream, so an existing run cannot change it), whether `null`
is a value, and how a value is checked. The `train.py` flags take their types from here,
so a flag and a `--config` key are checked alike.

A setting comes, in this order, from its flag, from the `--config` file, from the run
directory's saved config.json (when resuming), or from the defaults: the preset's
`Recipe` (`keras_transformer.recipes`), the corpus's entry (`keras_transformer.corpora`:
vocabulary size and length cap), then the field's default. `resolve` does that and every
check that needs no data, so that a bad command fails before anything is trained or written.

config.json is `{"data": {...}, "train": {...}, "model": {...}}`: `data` and `train` are
`RunSettings.to_config()`, `model` is `run_dir.model_config(model)` (the architecture, once
the model is built) with the model's settings (the dropouts, the attention's initialisation,
the norm order).
`saved_settings` reads it back, checked as a --config file is, so a run's config.json given
back as `--config` trains the same run.

A `--config` file is JSON or YAML (by its extension, .json, .yaml or .yml, else by its
text) with config.json's keys and layout, any of them left out. A value must be one its
flag takes; `null` stands for a flag left out where that means something (epochs,
max_minutes: no time budget, source_lang and target_lang: the corpus's). What a run
records rather than chooses is checked, never used: `train.replicas`, `train.workers` and the `model`
keys other than the model's settings, which the preset and the vocabulary
size determine. An unknown key or a wrong value is one `SettingsError` naming the file
and the key.
`mixed_precision: auto` (the default) is resolved when the run starts
(`keras_transformer.precision`) and saved as the choice, with its reason
(`train.precision_reason`); asked of a run that has one, it keeps it. A new run given a
precision by a --config file takes it, and its reason names the file.
"""

import argparse
import dataclasses
import difflib
import json
import logging
import math
from pathlib import Path

from keras_transformer import corpora, precision, run_dir
from keras_transformer.attention import ATTENTION_INITS
from keras_transformer.decoding_settings import MAX_ALPHA, MAX_BEAM_SIZE, DecodingSettings
from keras_transformer.recipes import DEFAULT_PRESET, RECIPES, get_recipe
from keras_transformer.trainer import TrainingConfig

logger = logging.getLogger(__name__)


class SettingsError(ValueError):
    """Settings that cannot be used together or with the run directory; the message names the flag or key."""


# The value checks of the flags (argparse types) and of --config values.


# Steps, budgets and lengths become TensorFlow int64 values; a larger one was a traceback mid-start.
INT64_MAX = 2**63 - 1


def positive_int(text):
    value = _int64(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text):
    value = _int64(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text}")
    return value


def _int64(text):
    value = int(text)
    if value > INT64_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {INT64_MAX} (a 64-bit integer), got {text}")
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


# faulthandler's timer, which ends a worker that waits too long, holds at most 2**63 ns.
_LONGEST_TIMEOUT_MINUTES = 10**8


def timeout_minutes(text):
    value = positive_float(text)
    if value > _LONGEST_TIMEOUT_MINUTES:
        raise argparse.ArgumentTypeError(f"must be at most {_LONGEST_TIMEOUT_MINUTES:.0e} minutes, got {text}")
    return value


def non_negative_float(text):
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive number, got {text}")
    return value


def length_penalty(text):
    value = float(text)
    if not 0 <= value <= MAX_ALPHA:
        raise argparse.ArgumentTypeError(f"must be from 0 to {MAX_ALPHA:g}, got {text}")
    return value


def probability(text):
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def fraction(text):
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


_INTEGER_CHECKS = (positive_int, non_negative_int, seed)
_NUMBER_CHECKS = (positive_float, non_negative_float, length_penalty, probability, fraction)


def _setting(check, *, section="train", key=None, pinned=False, nullable=False, recorded=False):
    """A `RunSettings` field: `check` is a check above, a tuple of choices, `bool` or `str`.

    A `recorded` setting has no flag: the run records it (how many replicas and workers it trains on),
    and a --config file's value is checked, not used.
    """
    metadata = dict(check=check, section=section, key=key, pinned=pinned, nullable=nullable, recorded=recorded)
    return dataclasses.field(default=None, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Every setting of a training run, each named as its `train.py` flag (see the flags' help)."""

    preset: str = _setting(tuple(RECIPES), pinned=True)
    dataset: str = _setting(tuple(corpora.CORPORA), section="data", key="corpus", pinned=True)
    source_lang: str = _setting(str, section="data", pinned=True, nullable=True)
    target_lang: str = _setting(str, section="data", pinned=True, nullable=True)
    vocab_size: int = _setting(positive_int, section="data", pinned=True)
    max_length: int = _setting(positive_int, section="data", pinned=True)
    long_sentences: str = _setting(("filter", "truncate"), section="data", pinned=True)
    token_budget: int = _setting(positive_int, section="data", pinned=True)
    seed: int = _setting(seed, pinned=True)
    dropout: float = _setting(probability, section="model", key="dropout_rate", pinned=True)
    attention_init: str = _setting(ATTENTION_INITS, section="model", pinned=True)
    attention_dropout: float = _setting(probability, section="model", key="attention_dropout_rate", pinned=True)
    activation_dropout: float = _setting(probability, section="model", key="activation_dropout_rate", pinned=True)
    norm_first: bool = _setting(bool, section="model", pinned=True)
    warmup_steps: int = _setting(positive_int, pinned=True)
    learning_rate_scale: float = _setting(positive_float, pinned=True)
    cooldown: float = _setting(fraction, pinned=True)
    label_smoothing: float = _setting(probability, pinned=True)
    mixed_precision: str = _setting(precision.CHOICES, pinned=True)
    jit_compile: bool = _setting(bool)
    cpu_replicas: int = _setting(positive_int)
    train_steps: int = _setting(positive_int)
    epochs: float = _setting(positive_float, nullable=True)
    max_minutes: float = _setting(non_negative_float, nullable=True)
    log_every: int = _setting(positive_int)
    checkpoint_every: int = _setting(positive_int)
    keep_checkpoints: int = _setting(positive_int)
    eval_every: int = _setting(non_negative_int)
    patience: int = _setting(non_negative_int)
    average_last: int = _setting(non_negative_int)
    bleu_sentences: int = _setting(non_negative_int)
    beam_size: int = _setting(positive_int)
    alpha: float = _setting(length_penalty)
    # The number of replicas the run trains on (see `check_replicas`).
    replicas: int = _setting(positive_int, nullable=True, recorded=True)
    # The number of workers (input pipelines, each reading its shard of the pairs) it trains on (see `check_workers`).
    workers: int = _setting(positive_int, nullable=True, recorded=True)
    # No flag: why the run computes in its `mixed_precision` (see `keras_transformer.precision`);
    # kept with the precision it explains, dropped when a flag asks for another.
    precision_reason: str = _setting(str, nullable=True)

    @property
    def recipe(self):
        return get_recipe(self.preset)

    @property
    def decoding(self) -> DecodingSettings:
        """How the run translates: the recipe's search with the run's beam size and length penalty."""
        return self.recipe.decoding.replace(beam_size=self.beam_size, alpha=self.alpha)

    def training_config(self) -> TrainingConfig:
        """The trainer's settings, each the run setting of its name."""
        return TrainingConfig(**{field.name: getattr(self, field.name) for field in dataclasses.fields(TrainingConfig)})

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def to_config(self):
        """config.json's `data` and `train` sections, and the `model` section's settings (dropouts, attention_init,
        norm_first)."""
        config = {"data": {}, "train": {}, "model": {}}
        for field in dataclasses.fields(self):
            section, key = location(field.name)
            config[section][key] = getattr(self, field.name)
        return config


SETTINGS = {field.name: field.metadata for field in dataclasses.fields(RunSettings)}
# Settings that earlier versions did not save, with the value those versions' runs had: a
# recipe's newer value would otherwise change such a run when it resumes, or is given back as --config.
SAVED_SINCE = {"cpu_replicas": 1, "attention_dropout": 0.0, "activation_dropout": 0.0, "norm_first": False}
PINNED = tuple(name for name, meta in SETTINGS.items() if meta["pinned"])
# Flags of one command, not settings of the run: no key of a config file.
PER_COMMAND = ("config", "data_dir", "devices", "connect_timeout_minutes", "run_dir", "average_only")


def location(name):
    """`(section, key)`: where config.json keeps setting `name`."""
    meta = SETTINGS[name]
    return meta["section"], meta["key"] or name


_SETTING_AT = {location(name): name for name in SETTINGS}


def flag_options(name):
    """`add_argument` keyword arguments that check flag `--name` as its config key is checked."""
    check = SETTINGS[name]["check"]
    if check is bool:
        return dict(action=argparse.BooleanOptionalAction)
    if isinstance(check, tuple):
        return dict(choices=check)
    return {} if check is str else dict(type=check)


def flag(name, value=True):
    """`--name`, or `--no-name` for a boolean setting's False."""
    return ("--" if value else "--no-") + name.replace("_", "-")


def config_key(name):
    """'train.max_minutes': where config.json keeps setting `name`."""
    return ".".join(location(name))


def defaults(preset, dataset):
    """The settings of a new run of `preset` on `dataset` given nothing else: recipe, then corpus, then general."""
    recipe, corpus = get_recipe(preset), corpora.get_corpus_entry(dataset)
    general = dict(
        preset=preset, dataset=dataset, source_lang=None, target_lang=None,
        vocab_size=corpus.vocab_size, max_length=corpus.max_length, long_sentences="filter",
        seed=0, dropout=recipe.model["dropout_rate"], attention_init=recipe.model.get("attention_init", "independent"),
        attention_dropout=recipe.model.get("attention_dropout_rate", 0.0),
        activation_dropout=recipe.model.get("activation_dropout_rate", 0.0),
        norm_first=recipe.model.get("norm_first", False),
        cooldown=0.0, label_smoothing=0.1, mixed_precision=precision.AUTO,
        jit_compile=False, cpu_replicas=1, epochs=None, patience=0, replicas=None, workers=None, precision_reason=None,
        beam_size=recipe.decoding.beam_size, alpha=recipe.decoding.alpha,
    )
    return {**general, **recipe.training}


def layered(*layers):
    """The `RunSettings` of `layers` of `{name: value}`, each over the ones before, over the defaults."""
    chosen = {}
    for layer in layers:
        chosen.update(layer)
        if "train_steps" in layer and "epochs" not in layer:
            chosen["epochs"] = None  # A length in steps replaces a length in epochs from below.
    preset, dataset = chosen.get("preset", DEFAULT_PRESET), chosen.get("dataset", corpora.DEFAULT_CORPUS)
    return RunSettings(**{**defaults(preset, dataset), **chosen, "preset": preset, "dataset": dataset})


def resolve(given, *, config_file=None, run=None, data_dir=None, average_only=False):
    """The run's settings: `given` (the flags), else the --config file, else the saved config.json, else defaults.

    Args:
        given: `{setting: value}` of the flags given (None values are left out).
        config_file: Path of a --config file, or None.
        run: The run directory, or None for `runs/DATASET-PRESET`.
        data_dir: The --data-dir flag (the `files` corpus needs it).
        average_only: The --average-only flag (it reads no data, and needs a run).

    Returns:
        `(RunSettings, run directory Path, saved config dict or None)`.

    Raises:
        SettingsError: For flags or a --config file in conflict with the run directory or
            with each other, and for a --config file that cannot be read or holds a
            wrong key or value.
    """
    explicit = {name: value for name, value in given.items() if value is not None and name in SETTINGS}
    from_file, model_keys = config_file_settings(config_file) if config_file is not None else ({}, {})
    if model_keys:  # The model's architecture: a run's config.json, which trains that run again, however old.
        from_file = _as_its_version_trained(from_file)
    file_reason = from_file.pop("precision_reason", None)  # Another run's: a new run's reason names it (below).
    requested = {**from_file, **explicit}
    dataset, preset = requested.get("dataset", corpora.DEFAULT_CORPUS), requested.get("preset", DEFAULT_PRESET)
    run = Path(run or Path("runs") / f"{dataset}-{preset}")
    if run.exists() and not run.is_dir():
        raise SettingsError(f"--run-dir {run} is a file, not a directory.")
    saved_config = run_dir.read_config(run) if (run / run_dir.CONFIG_FILE).is_file() else None
    if saved_config is None:
        _check_no_orphan_state(run)
    saved = {}
    if saved_config is not None:
        saved = _as_its_version_trained(saved_settings(saved_config, run / run_dir.CONFIG_FILE))
    _check_pinned(requested, saved, explicit, run, config_file)
    settings = layered(saved, from_file, explicit)
    if settings.mixed_precision == precision.AUTO and "mixed_precision" in saved:
        settings = settings.replace(  # `auto` keeps what the run chose.
            mixed_precision=saved["mixed_precision"], precision_reason=saved.get("precision_reason")
        )
    elif "mixed_precision" in explicit:
        settings = settings.replace(precision_reason=None)  # Chosen now, for the reason the run will log.
    elif from_file.get("mixed_precision", precision.AUTO) != precision.AUTO and "mixed_precision" not in saved:
        # Another run's reason (its CPU's bf16 speed, say) is not this machine's.
        reason = _precision_from_file(config_file, file_reason)
        settings = settings.replace(precision_reason=reason)
    if model_keys:  # Checked against the file's own settings: flags may change what they determine.
        _check_model_keys(model_keys, layered(saved, from_file), config_file)
    if settings.max_minutes == 0:
        settings = settings.replace(max_minutes=None)
    _check_lengths(settings)
    _check_corpus(settings, data_dir, average_only)
    _check_patience(settings)
    if settings.average_last > settings.keep_checkpoints:
        # An error rather than averaging fewer: the number averaged is part of the recipe,
        # and finding out after the training would be too late to keep more checkpoints.
        raise SettingsError(
            f"--average-last {settings.average_last} needs as many kept checkpoints, but "
            f"--keep-checkpoints is {settings.keep_checkpoints}: raise --keep-checkpoints or lower "
            "--average-last."
        )
    if average_only and saved_config is None:
        raise SettingsError(f"--average-only needs an existing run directory; {run} has no config.json.")
    if "train_steps" in requested and settings.epochs is None:
        check_not_shorter_than_trained(run, settings.train_steps)
    _check_vocabulary(run, settings.vocab_size)
    return settings, run, saved_config


def _as_its_version_trained(settings):
    """A run's `settings` from its config.json, with `SAVED_SINCE`'s value for each that its version did not save."""
    return {**SAVED_SINCE, **settings}


def _check_pinned(requested, saved, explicit, run, config_file):
    # A file's null language is the corpus's usual one, which a run saves as such.
    dataset = requested.get("dataset", saved.get("dataset", corpora.DEFAULT_CORPUS))
    usual = dict(zip(("source_lang", "target_lang"), corpora.get_corpus_entry(dataset).languages or ()))
    requested = {**requested, **{name: usual[name] for name in usual if name in requested and requested[name] is None}}
    for name in PINNED:
        if name == "mixed_precision" and precision.AUTO in (requested.get(name), saved.get(name)):
            continue  # `auto` takes the precision the run chose; a run saved before it chose takes any.
        if name in requested and name in saved and requested[name] != saved[name]:
            if isinstance(saved[name], bool):  # --norm-first or --no-norm-first.
                trained, asked = flag(name, saved[name]), flag(name, requested[name])
                asked_flag = asked
            else:
                trained, asked, asked_flag = f"{flag(name)} {saved[name]}", requested[name], flag(name)
            if name in explicit:
                given, advice = "", f"leave out {asked_flag}"
            else:
                given, advice = f" ({config_key(name)} of --config {config_file})", f"leave {config_key(name)} out"
            raise SettingsError(
                f"{run} was trained with {trained}, not {asked}{given}; use another "
                f"--run-dir, or {advice} to continue this run."
            )


def check_not_shorter_than_trained(run, train_steps, epochs=None):
    """Refuses a length below the steps trained, which config.json would keep though the run is longer.

    `epochs`: the --epochs that came to `train_steps` (counted once the data is read), if any.
    """
    latest = run_dir.latest_checkpoint(run / run_dir.CHECKPOINT_DIR)
    trained = run_dir.checkpoint_step(latest) if latest else 0
    if train_steps >= trained:
        return
    if epochs is not None:
        asked, advice = f"--epochs {epochs:g} ({train_steps:,} steps)", "give more epochs, or leave --epochs out"
    else:
        asked, advice = f"--train-steps {train_steps}", f"give {trained} or more, or leave --train-steps out"
    raise SettingsError(f"{run} has trained {trained} steps, more than {asked}: {advice} to evaluate it as it stands.")


def _check_lengths(settings):
    if settings.max_length < 2:
        raise SettingsError(f"--max-length {settings.max_length} leaves no room for a token and EOS; use 2 or more.")
    if settings.beam_size > MAX_BEAM_SIZE:
        # The run's translators (translate.py, export) use the saved beam size.
        raise SettingsError(f"--beam-size is at most {MAX_BEAM_SIZE}, got {settings.beam_size}.")
    if settings.token_budget < settings.max_length:
        raise SettingsError(
            f"--token-budget ({settings.token_budget}) must be at least --max-length "
            f"({settings.max_length}), or the longest pairs fit in no batch."
        )


def _check_corpus(settings, data_dir, average_only):
    """The corpus's needs (a directory, languages) and its direction, checked here: loading it takes a while."""
    entry = corpora.get_corpus_entry(settings.dataset)
    if entry.needs_data_dir and not data_dir and not average_only:  # Averaging reads no data.
        raise SettingsError(
            f"--dataset {entry.name} needs --data-dir DIR holding train.SRC and train.TGT (a run does not save it: "
            "give it again to resume)."
        )
    source, target = settings.source_lang, settings.target_lang
    if entry.languages is None:
        if not (source and target):
            raise SettingsError(f"--dataset {entry.name} needs --source-lang and --target-lang (the file suffixes).")
        return
    try:
        corpora.check_direction(entry.name, source, target)
    except ValueError:
        first, second = entry.languages
        raise SettingsError(
            f"--dataset {entry.name} translates between {first} and {second} (either way), not "
            f"--source-lang {source or first} --target-lang {target or second}."
        ) from None


def _check_patience(settings):
    """--patience counts validations with a BLEU: it needs --eval-every and --bleu-sentences."""
    patience = settings.patience
    if patience and not settings.eval_every:
        raise SettingsError(
            f"--patience {patience} counts validations, but --eval-every is 0 (one validation, at the end): "
            "give --eval-every N, or --patience 0."
        )
    if patience and not settings.bleu_sentences:
        raise SettingsError(
            f"--patience {patience} watches the validation BLEU, but --bleu-sentences is 0 (no BLEU): give "
            "--bleu-sentences N, or --patience 0."
        )


def saved_settings(config, path=run_dir.CONFIG_FILE):
    """The settings saved in a run's config.json `path`, `{name: value}`, checked as a --config file's are.

    Raises:
        SettingsError: Naming `path` and the key, for a value its flag would refuse (a file edited by hand).
    """
    settings = {}
    for (section, key), name in _SETTING_AT.items():
        values = config.get(section, {})
        if not isinstance(values, dict):
            raise SettingsError(f"{path}: {section} must be a mapping of keys to values, got {_shown(values)}.")
        if key in values:
            settings[name] = checked_value(values[key], name, f"{path}: {section}.{key}")
    return settings


def write_run_config(run, settings, model=None):
    """Writes RUN/config.json: the settings, and the architecture of `model` once it is built.

    Until then the `model` section holds only its settings (the dropouts, attention_init, norm_first): a
    run of known settings, no model yet (see `run_dir.saved_architecture`).
    """
    config = settings.to_config()
    if model is not None:
        config["model"] = {**run_dir.model_config(model), **config["model"]}
    run_dir.write_config(run, config)


def record_averaging(run, settings):
    """Saves `average_last` and the `keep_checkpoints` it needs in config.json, as any command saves its new values.

    Both: an --average-last above the saved --keep-checkpoints would make every later
    command on the run an error.
    """
    config = run_dir.read_config(run)
    train = config.setdefault("train", {})
    train.update(average_last=settings.average_last, keep_checkpoints=settings.keep_checkpoints)
    run_dir.write_config(run, config)


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
        the preset determines (see `_check_model_keys`). `train.replicas` and `train.workers`
        are checked and left out: they record what a run trained on.

    Raises:
        SettingsError: Naming the file and the key, for an unknown key or a wrong value.
    """
    where = f"--config {path}"
    settings, model_keys = {}, {}
    for section, values in read_config_file(path).items():
        if section not in ("data", "train", "model"):
            raise SettingsError(f"{where}: unknown section {section!r}; a run's config.json has data, train and model.")
        if not isinstance(values, dict):
            raise SettingsError(f"{where}: {section} must be a mapping of keys to values, got {_shown(values)}.")
        for key, value in values.items():
            if section == "model":
                key = run_dir.RENAMED_MODEL_KEYS.get(key, key)
            name = _SETTING_AT.get((section, key))
            label = f"{where}: {section}.{key}"
            if name is None and section == "model" and key in run_dir.MODEL_KEYS:
                model_keys[key] = value
            elif name is None:
                raise SettingsError(f"{where}: {_unknown_key(section, key)}")
            else:
                value = checked_value(value, name, label)
                if not SETTINGS[name]["recorded"]:
                    settings[name] = value
    return settings, model_keys


def _precision_from_file(config_file, file_reason):
    """Why a new run computes in the precision its --config file names (and why that file's run did)."""
    reason = f"--config {config_file}"
    return reason if file_reason is None else f"{reason} (whose run chose it: {file_reason})"


def _unknown_key(section, key):
    """The error for `section.key`, with the key meant if there is a close one."""
    message = f"unknown key {section}.{key}"
    if str(key).replace("-", "_") in PER_COMMAND:
        return f"{message}: {flag(str(key).replace('-', '_'))} is no setting of the run, give it on the command line."
    known = list(dict.fromkeys(
        [f"{place}.{name}" for place, name in _SETTING_AT] + [f"model.{name}" for name in run_dir.MODEL_KEYS]
    ))
    elsewhere = [place_key for place_key in known if place_key.split(".")[1] == key]  # A key in another section.
    if not elsewhere and key in SETTINGS:  # A setting's name where its key differs: dataset, dropout.
        elsewhere = [config_key(key)]
    close = elsewhere or difflib.get_close_matches(f"{section}.{key}", known, n=1, cutoff=0.75)
    if close:
        return f"{message}; did you mean {close[0]}?"
    keys = sorted(place_key.split(".")[1] for place_key in known if place_key.startswith(f"{section}."))
    return f"{message}; {section} takes {', '.join(keys)}."


def checked_value(value, name, label):
    """`value` of setting `name` checked as its flag checks its text; a SettingsError starting with `label` if wrong."""
    meta = SETTINGS[name]
    check = meta["check"]
    if value is None and meta["nullable"]:
        return None
    if check is bool:
        kind, fits = "true or false", isinstance(value, bool)
    elif isinstance(check, tuple):
        kind, fits = f"one of {', '.join(check)}", isinstance(value, str) and value in check
    elif check in _INTEGER_CHECKS:
        kind, fits = "an integer", isinstance(value, int) and not isinstance(value, bool)
    elif check in _NUMBER_CHECKS:
        kind, fits = "a number", isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        kind, fits = "a string", isinstance(value, str)
    if not fits:
        # YAML 1.1 reads yes, no, on and off as booleans: Norwegian's code, `no`, among them.
        quote = isinstance(value, bool) and (check is str or isinstance(check, tuple))
        hint = " (quote it: YAML reads yes, no, on and off as true or false)" if quote else ""
        raise SettingsError(f"{label} must be {kind}, got {_shown(value)}{hint}.")
    if check is bool or check is str or isinstance(check, tuple):
        return value
    try:
        return check(str(value))
    except argparse.ArgumentTypeError as error:
        raise SettingsError(f"{label} {error}.") from None


def _shown(value):
    """`value` as a config file writes it: "ten", 8, null, [1, 2]."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):  # YAML's dates, and the like.
        return repr(value)


def _check_model_keys(model_keys, settings, path):
    """The `model` keys of a --config file (but the settings') must be those of the model `settings` build.

    Those keys describe the model that the preset and the vocabulary size determine: a run's
    config.json holds them, and passes; another value, which would not be the model trained, fails.
    """
    from keras_transformer.model import Transformer

    # Without dropout, which no model key holds (it is a setting): a dropout layer's seed variable
    # would start TensorFlow's devices, and a strategy could no longer split the CPU (--cpu-replicas).
    built = run_dir.model_config(Transformer.from_preset(settings.preset, settings.vocab_size, dropout_rate=0.0))
    for key, value in model_keys.items():
        if value != built[key] or isinstance(value, bool) != isinstance(built[key], bool):
            raise SettingsError(
                f"--config {path}: model.{key} is {_shown(value)}, but the {settings.preset} preset with vocab_size "
                f"{settings.vocab_size} has {_shown(built[key])}: train.py trains the presets' "
                f"models (leave model.{key} out, or choose another train.preset)."
            )


def _check_no_orphan_state(run):
    """Refuses checkpoints, or files no run writes, in a directory without config.json; takes over a lone vocabulary.

    Runs write config.json before their vocabulary, but earlier versions wrote the
    vocabulary first: a start interrupted then left only tokenizer.model. Nothing was
    trained with it, so the run starts with it (its size is checked next).
    """
    # Hidden names are a run's partial files (`run_dir.write_config`) or the system's.
    others = sorted(p.name for p in run.glob("*") if p.name not in _RUN_NAMES and not p.name.startswith("."))
    if others:  # A mistyped --run-dir (the repository, a data directory) would get a run's files mixed in.
        listed = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise SettingsError(
            f"{run} is not empty ({listed}) and is not a run directory (no {run_dir.CONFIG_FILE}): give a new or "
            "empty --run-dir."
        )
    if (run / run_dir.CHECKPOINT_DIR).exists():
        raise SettingsError(
            f"{run} holds {run_dir.CHECKPOINT_DIR} but no {run_dir.CONFIG_FILE}; it is not a run of "
            "this script: use another --run-dir."
        )
    if run_dir.tokenizer_path(run).is_file():
        logger.warning("%s holds %s but no %s (an interrupted start): starting the run with that vocabulary.",
                       run, run_dir.TOKENIZER_FILE, run_dir.CONFIG_FILE)


# What a run writes in its directory (see `keras_transformer.run_dir`).
_RUN_NAMES = {
    run_dir.CONFIG_FILE, run_dir.TOKENIZER_FILE, run_dir.CHECKPOINT_DIR, run_dir.AVERAGED_DIR, run_dir.BEST_DIR,
    run_dir.LOG_DIR, run_dir.TRANSLATIONS_DIR,
}


def _check_vocabulary(run, vocab_size):
    """The saved vocabulary, if any, must have `vocab_size` ids (read without TensorFlow ops)."""
    import sentencepiece

    path = run_dir.tokenizer_path(run)
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


def check_replicas(run, settings, replicas):
    """The number of replicas to record in config.json, after checking that the run may use `replicas`.

    A run resumes where it stopped only on as many replicas as it trained on: the global
    batch and the data order depend on it (see `keras_transformer.trainer`). Evaluating a
    finished run works on any number, and keeps the recorded one.

    Raises:
        SettingsError: When training would continue on another number of replicas.
    """
    return _check_recorded_count(
        run, settings, settings.replicas, replicas, "replica", "as the global batch and the data order depend on it",
        "--devices and --cpu-replicas",
    )


def batch_warning(settings, replicas):
    """One line when `settings.cpu_replicas` did not make the run's replicas, which changes its batch; else None.

    --token-budget is per replica: a recipe that splits the CPU into N replicas (`medium`)
    trains on N × budget tokens a step, and on other devices (GPUs, --devices, TF_CONFIG)
    each replica still takes that budget.
    """
    chosen_for = settings.cpu_replicas
    if chosen_for == 1 or replicas == chosen_for:
        return None
    budget = settings.token_budget
    return (
        f"--cpu-replicas {chosen_for} does not apply on this run's devices (GPUs, --devices or TF_CONFIG): its "
        f"{replicas} replica(s) of --token-budget {budget} hold {replicas * budget:,} tokens a step, against the "
        f"{chosen_for * budget:,} of {chosen_for} CPU replicas; --token-budget {chosen_for * budget // replicas} "
        "keeps that batch."
    )


def check_workers(run, settings, workers):
    """The number of workers to record in config.json, after checking that the run may use `workers`.

    Each worker reads its own shard of the pairs (`keras_transformer.data`), so the data
    order depends on the number of workers even where the replicas are as many (2 workers
    of 1 replica, or 1 process of 2). As for replicas (`check_replicas`), a run resumes
    only on as many, and evaluating a finished run works on any number. A run of an
    earlier version recorded no workers, and may have trained on several: not checked.

    Raises:
        SettingsError: When training would continue on another number of workers.
    """
    return _check_recorded_count(
        run, settings, settings.workers, workers, "worker",
        "as each reads its own shard of the data and the data order depends on it", "TF_CONFIG",
    )


def _check_recorded_count(run, settings, saved, current, unit, reason, where):
    """`current` for a run that trains on, `saved` for a finished one; a resume on another number is refused."""
    step = _resumed_step(run, settings)
    if step is None:
        return saved
    if step and saved not in (None, current):  # None: recorded by no earlier command.
        raise SettingsError(
            f"{run} trained on {saved} {unit}(s) up to step {step}, and this command runs {current}: a run "
            f"resumes only on as many {unit}s, {reason}. Resume it on {saved} {unit}(s) (see {where}), or use "
            "another --run-dir."
        )
    return current


def _resumed_step(run, settings):
    """The step at which training resumes: 0 for a new run, None for a finished one."""
    step = run_dir.checkpoint_step(run_dir.latest_checkpoint(run / run_dir.CHECKPOINT_DIR))
    if step <= 0:
        return 0
    return None if step >= settings.train_steps else step
