"""The everyday workflow of train.py: config files, a step-based default, validation-driven training.

Runs of `train.py` happen in subprocesses (it seeds TensorFlow globally, which drops the
SentencePiece resources of the session's tokenizer fixtures); settings are resolved and
the `Trainer` runs in this process.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import distribution, run_dir, run_settings, training_run
from keras_transformer.best_checkpoint import BestCheckpoint
from keras_transformer.cli import train as train_cli
from keras_transformer.model import Transformer
from keras_transformer.recipes import RECIPES
from keras_transformer.trainer import Trainer, TrainingConfig
from fake_runs import (  # noqa: E402
    PAIRS, checkpointed_run, fake_translations, local_tf_configs, multi30k_files, validation_corpus,
)

ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT = 240


def _resolve(*flags):
    return train_cli.resolve_settings(train_cli.build_parser().parse_args(list(flags)))[0]


def _one_line_error(exit_code, stderr):
    assert exit_code == 2
    assert "Traceback" not in stderr, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: "), stderr[-2000:]
    return last


def _write(path, config):
    """Writes `config` as JSON or YAML, by `path`'s extension."""
    import yaml

    path.write_text(yaml.safe_dump(config) if path.suffix in (".yaml", ".yml") else json.dumps(config))
    return path


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory, multi30k_dir):
    """`--dataset files` flags of 2000 Multi30k training pairs and 4 validation and test pairs."""
    sizes = {"train": 2000, "val": 4, "test": 4}
    return multi30k_files(tmp_path_factory.mktemp("corpus") / "data", multi30k_dir, sizes)


@pytest.fixture(scope="module")
def training_corpus(tmp_path_factory, multi30k_dir):
    """`--dataset files` flags of 2000 Multi30k training pairs alone: a run of it neither validates nor tests."""
    return multi30k_files(tmp_path_factory.mktemp("corpus") / "data", multi30k_dir, {"train": 2000})


def _train(*flags, python=None):
    """train.py with `flags` in a subprocess (or `python`, code that ends by calling train.main(FLAGS))."""
    command = [sys.executable, "train.py", *flags] if python is None else [
        sys.executable, "-c", python.replace("FLAGS", repr(list(flags)))
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


# --- Config files --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_runs_config_json_given_back_trains_the_same_run(tmp_path, training_corpus):
    """--config RUN/config.json --run-dir NEW: NEW's config.json is RUN's, model and replicas included."""
    run, new = tmp_path / "run", tmp_path / "new"
    _train("--run-dir", str(run), "--preset", "tiny", *training_corpus, "--vocab-size", "1000", "--max-length", "64",
           "--train-steps", "3", "--seed", "3", "--warmup-steps", "50", "--label-smoothing", "0.2", "--alpha", "0.8",
           "--beam-size", "1", "--bleu-sentences", "0", "--dropout", "0.15", "--attention-init", "tied",
           "--max-minutes", "30", "--cpu-replicas", "2")
    given_back = run_dir.read_config(run)
    # The data directory is no setting of a run: each command gives it.
    data_dir = training_corpus[training_corpus.index("--data-dir") + 1]
    config = run / run_dir.CONFIG_FILE
    _train("--config", str(config), "--run-dir", str(new), "--data-dir", data_dir)
    taken = run_dir.read_config(new)
    # The precision is the file's, and so says the reason (this machine did not choose it).
    reason = given_back["train"].pop("precision_reason")
    assert taken["train"].pop("precision_reason") == f"--config {config} (whose run chose it: {reason})"
    assert taken == given_back
    assert given_back["train"]["seed"] == 3 and given_back["model"]["dropout_rate"] == 0.15
    assert given_back["model"]["attention_init"] == "tied"
    if not tf.config.list_physical_devices("GPU"):  # Checking the file's model must leave the CPU to split.
        assert given_back["train"]["cpu_replicas"] == 2 and taken["train"]["replicas"] == 2


def test_cpu_replicas_that_the_devices_overrule_are_named_with_the_budget_that_keeps_the_batch(
    tmp_path, training_corpus
):
    """`medium` splits the CPU into 2 replicas of 2,048 tokens; on 1 device (a GPU, --devices) a step would halve."""
    stderr = _train("--run-dir", str(tmp_path / "run"), "--preset", "tiny", *training_corpus, "--vocab-size", "1000",
                    "--train-steps", "2", "--bleu-sentences", "0", "--cpu-replicas", "2", "--devices", "CPU:0")
    budget = RECIPES["tiny"].training["token_budget"]
    assert run_dir.read_config(tmp_path / "run")["train"]["replicas"] == 1
    warning = (f"--cpu-replicas 2 does not apply on this run's devices (GPUs, --devices or TF_CONFIG): its 1 "
               f"replica(s) of --token-budget {budget} hold {budget:,} tokens a step, against the {2 * budget:,} of "
               f"2 CPU replicas; --token-budget {2 * budget} keeps that batch.")
    assert warning in stderr
    two_replicas = run_settings.layered({"preset": "tiny", "cpu_replicas": 2})
    assert run_settings.batch_warning(two_replicas, 2) is None  # Both replicas of its batch: nothing to say.


def _saved_run(directory, **train_settings):
    """A run directory as a `tiny` run's start leaves it: its config.json, nothing trained."""
    settings = _resolve("--preset", "tiny", "--run-dir", str(directory / "elsewhere"))
    run_settings.write_run_config(directory, settings.replace(source_lang="en", target_lang="de", **train_settings))
    return directory


def test_flags_override_the_file_which_overrides_the_run_and_the_recipe(tmp_path):
    run = _saved_run(tmp_path / "run", train_steps=200, log_every=5, eval_every=10)
    config = _write(tmp_path / "exp.yaml", {"train": {"train_steps": 50, "log_every": 7, "alpha": 1.0}})

    settings = _resolve("--run-dir", str(run), "--config", str(config), "--log-every", "9")

    assert settings.log_every == 9  # flag over file
    assert settings.train_steps == 50 and settings.alpha == 1.0  # file over the run and the recipe
    assert settings.eval_every == 10  # the run over the recipe (tiny: 0)
    assert settings.keep_checkpoints == 3 and settings.preset == "tiny"  # the recipe of the run's preset


def test_a_recipes_vocabulary_size_is_over_the_corpus_and_under_the_flag(tmp_path):
    from keras_transformer.corpora import CORPORA

    def vocab_size(*flags):
        return _resolve("--run-dir", str(tmp_path / "run"), *flags).vocab_size

    assert "vocab_size" not in RECIPES["base"].training
    assert vocab_size("--preset", "base") == CORPORA["multi30k"].vocab_size
    medium = RECIPES["medium"].training["vocab_size"]
    assert vocab_size("--preset", "medium") == medium != CORPORA["multi30k"].vocab_size
    assert vocab_size("--preset", "medium", "--vocab-size", "6000") == 6000


def test_a_file_chooses_the_preset_and_with_it_the_recipe_and_run_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = _write(tmp_path / "exp.json", {"train": {"preset": "tiny"}})
    settings, run, _ = train_cli.resolve_settings(train_cli.build_parser().parse_args(["--config", str(config)]))
    assert settings.train_steps == RECIPES["tiny"].training["train_steps"]
    assert run == Path("runs") / "multi30k-tiny"


def test_a_flag_over_the_files_preset_chooses_the_recipe_and_run_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = _write(tmp_path / "exp.json", {"train": {"preset": "tiny"}})
    args = train_cli.build_parser().parse_args(["--config", str(config), "--preset", "medium"])
    settings, run, _ = train_cli.resolve_settings(args)
    assert settings.preset == "medium" and settings.train_steps == RECIPES["medium"].training["train_steps"]
    assert run == Path("runs") / "multi30k-medium"


def test_a_precision_flag_given_to_a_run_drops_the_reason_its_start_logged(tmp_path):
    """The run computes in bf16 now because the flag says so, not for what `auto` measured at its start."""
    run = _saved_run(tmp_path / "run", mixed_precision="bf16", precision_reason="auto: this machine's bf16 speed")
    settings = _resolve("--run-dir", str(run), "--mixed-precision", "bf16")
    assert (settings.mixed_precision, settings.precision_reason) == ("bf16", None)


def test_steps_in_a_file_replace_the_runs_epochs(tmp_path):
    run = _saved_run(tmp_path / "run", epochs=2.0, train_steps=600)
    assert _resolve("--run-dir", str(run)).epochs == 2.0
    config = _write(tmp_path / "exp.yaml", {"train": {"train_steps": 50}})
    settings = _resolve("--run-dir", str(run), "--config", str(config))
    assert settings.epochs is None and settings.train_steps == 50


def test_a_pinned_setting_of_a_file_is_refused_by_the_run(tmp_path, capsys):
    run = _saved_run(tmp_path / "run")
    config = _write(tmp_path / "exp.yaml", {"train": {"seed": 1}})
    before = (run / run_dir.CONFIG_FILE).read_text()
    exit_code = train_cli.main(["--run-dir", str(run), "--config", str(config)])
    line = _one_line_error(exit_code, capsys.readouterr().err)
    assert f"{run} was trained with --seed 0, not 1 (train.seed of --config {config})" in line
    assert "leave train.seed out to continue this run" in line
    assert (run / run_dir.CONFIG_FILE).read_text() == before


@pytest.mark.parametrize("direction, refused", [(("en", "de"), False), (("de", "en"), True)], ids=["usual", "reversed"])
def test_null_languages_of_a_file_are_the_corpus_usual_ones_for_a_run(tmp_path, capsys, direction, refused):
    """null: the corpus's (en → de for Multi30k), which a run trained in that direction saved as en and de."""
    run = _saved_run(tmp_path / "run")
    config = run_dir.read_config(run)
    config["data"]["source_lang"], config["data"]["target_lang"] = direction
    run_dir.write_config(run, config)
    config = _write(tmp_path / "exp.yaml", {"data": {"source_lang": None, "target_lang": None}})
    exit_code = train_cli.main(["--run-dir", str(run), "--config", str(config), "--average-only"])
    line = _one_line_error(exit_code, capsys.readouterr().err)
    if refused:
        assert f"{run} was trained with --source-lang de, not en (data.source_lang of --config {config})" in line
    else:  # Past the settings: --average-only finds no checkpoint to average.
        assert line == "train.py: error: --average-only needs --average-last N with N >= 1.", line


def test_a_files_precision_reason_is_not_a_resumed_runs(tmp_path):
    """A run resumed with another run's config.json keeps why it computes in its precision."""
    run = _saved_run(tmp_path / "run", mixed_precision="bf16", precision_reason="auto: this machine's bf16 speed")
    train = {"mixed_precision": "bf16", "precision_reason": "auto: another machine's bf16 speed"}
    other = _write(tmp_path / "other.json", {"train": train})
    settings = _resolve("--run-dir", str(run), "--config", str(other))
    assert (settings.mixed_precision, settings.precision_reason) == ("bf16", "auto: this machine's bf16 speed")


@pytest.mark.parametrize("saved", ["bf16", "none"])
def test_auto_given_to_a_run_keeps_the_precision_it_chose(tmp_path, saved):
    """--mixed-precision auto (or a file's auto) resumes a run in the precision its start chose, for its reason."""
    reason = f"auto: this machine's choice, {saved}"
    run = _saved_run(tmp_path / "run", mixed_precision=saved, precision_reason=reason)
    config = _write(tmp_path / "auto.json", {"train": {"mixed_precision": "auto"}})
    for flags in (["--mixed-precision", "auto"], ["--config", str(config)]):
        settings = _resolve("--run-dir", str(run), *flags)
        assert (settings.mixed_precision, settings.precision_reason) == (saved, reason), flags


def test_a_start_interrupted_before_its_model_keeps_its_dropout_and_attention_init(tmp_path, capsys):
    """config.json as a start interrupted after its vocabulary leaves it: no architecture yet, every setting."""
    run = tmp_path / "run"
    settings = _resolve("--preset", "tiny", "--run-dir", str(run), "--dropout", "0.3", "--attention-init", "tied")
    run_settings.write_run_config(run, settings.replace(source_lang="en", target_lang="de"))
    resumed = _resolve("--run-dir", str(run))
    assert (resumed.dropout, resumed.attention_init) == (0.3, "tied")
    line = _one_line_error(train_cli.main(["--run-dir", str(run), "--dropout", "0.5"]), capsys.readouterr().err)
    assert f"{run} was trained with --dropout 0.3, not 0.5" in line
    with pytest.raises(run_dir.RunDirError, match="holds no trained model yet"):
        run_dir.build_model(run)


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("data", "corpus", "wmt15", 'data.corpus must be one of multi30k, wmt14, ted_pt_en, files, got "wmt15".'),
        ("train", "preset", "huge", 'train.preset must be one of tiny, small, medium, base, big, got "huge".'),
        ("train", "train_steps", "500", 'train.train_steps must be an integer, got "500".'),
        ("train", "eval_every", -1, "train.eval_every must be 0 or a positive integer, got -1."),
        ("train", "alpha", 50, "train.alpha must be from 0 to 10, got 50."),
    ],
    ids=["corpus", "preset", "string", "negative", "alpha"],
)
def test_a_wrong_value_in_a_runs_config_json_is_one_error_naming_it(tmp_path, capsys, section, key, value, message):
    """A config.json edited by hand is checked as a --config file is, before anything is written."""
    run = _saved_run(tmp_path / "run")
    config = run_dir.read_config(run)
    config[section][key] = value
    run_dir.write_config(run, config)
    before = (run / run_dir.CONFIG_FILE).read_text()
    line = _one_line_error(train_cli.main(["--run-dir", str(run)]), capsys.readouterr().err)
    assert line == f"train.py: error: {run / run_dir.CONFIG_FILE}: {message}", line
    assert (run / run_dir.CONFIG_FILE).read_text() == before


@pytest.mark.parametrize(
    "config, message",
    [
        ({"train": {"max_minutes": "ten"}}, 'train.max_minutes must be a number, got "ten".'),
        ({"train": {"max_minute": 10}}, "unknown key train.max_minute; did you mean train.max_minutes?"),
        ({"train": {"vocab_size": 1000}}, "unknown key train.vocab_size; did you mean data.vocab_size?"),
        ({"train": {"warmup_steps": 0}}, "train.warmup_steps must be a positive integer, got 0."),
        ({"train": {"train_steps": 2.5}}, "train.train_steps must be an integer, got 2.5."),
        ({"train": {"seed": None}}, "train.seed must be an integer, got null."),
        ({"train": {"jit_compile": "yes"}}, 'train.jit_compile must be true or false, got "yes".'),
        ({"train": {"replicas": "two"}}, 'train.replicas must be an integer, got "two".'),
        ({"data": {"corpus": "wmt15"}}, 'data.corpus must be one of multi30k, wmt14, ted_pt_en, files, got "wmt15".'),
        ({"data": {"source_lang": False}}, "data.source_lang must be a string, got false (quote it: YAML reads"),
        ({"data": {"data_dir": "/data"}}, "unknown key data.data_dir: --data-dir is no setting of the run"),
        ({"data": {"dataset": "wmt14"}}, "unknown key data.dataset; did you mean data.corpus?"),
        ({"train": {"dropout": 0.2}}, "unknown key train.dropout; did you mean model.dropout_rate?"),
        (
            {"model": {"dtype": "float32"}},
            "model takes activation_dropout_rate, attention_dropout_rate, attention_init, d_ff, d_model, dropout_rate",
        ),
        ({"model": {"dropout_rate": 1.5}}, "model.dropout_rate must be in [0, 1), got 1.5."),
        ({"model": {"attention_init": "orthogonal"}},
         'model.attention_init must be one of independent, tied, mimetic, got "orthogonal".'),
        ({"train": {"cooldown": 1.5}}, "train.cooldown must be in [0, 1], got 1.5."),
        ({"model": {"d_model": 512}}, "model.d_model is 512, but the small preset with vocab_size 4000 has 128"),
        ({"optimizer": {}}, "unknown section 'optimizer'"),
        ({"train": [1, 2]}, "train must be a mapping of keys to values, got [1, 2]."),
    ],
    ids=["type", "typo", "section", "range", "integer", "null", "boolean", "replicas", "choice", "yaml-no",
         "per-command", "flag-name", "flag-name-elsewhere", "model-keys", "probability", "attention-init", "fraction",
         "derived", "unknown-section", "not-a-mapping"],
)
def test_a_wrong_key_or_value_in_a_file_is_one_error_naming_it(tmp_path, capsys, config, message):
    path = _write(tmp_path / "exp.yaml", config)
    exit_code = train_cli.main(["--run-dir", str(tmp_path / "run"), "--config", str(path)])
    line = _one_line_error(exit_code, capsys.readouterr().err)
    assert line.startswith(f"train.py: error: --config {path}: ") and message in line, line
    assert not (tmp_path / "run").exists()


def test_the_model_keys_a_preset_determines_pass_with_the_files_own_settings(tmp_path):
    """A tiny run's model section passes, even with a flag that changes what the section describes."""
    model = Transformer.from_preset("tiny", vocab_size=1000, dropout_rate=0.2)
    config = {"train": {"preset": "tiny"}, "data": {"vocab_size": 1000}, "model": run_dir.model_config(model)}
    path = _write(tmp_path / "exp.json", config)
    settings = _resolve("--run-dir", str(tmp_path / "run"), "--config", str(path), "--vocab-size", "2000")
    assert (settings.vocab_size, settings.dropout) == (2000, 0.2)


@pytest.mark.parametrize("name", ["exp.yaml", "exp.yml", "exp.json", "exp.cfg", "json-text.cfg"])
def test_yaml_and_json_files_load_alike(tmp_path, name):
    config = {"data": {"token_budget": 4096, "long_sentences": "truncate"},
              "train": {"preset": "tiny", "max_minutes": None, "learning_rate_scale": 1.5, "jit_compile": True}}
    path = tmp_path / name
    if name == "exp.cfg":  # YAML, told by its text
        path.write_text("data:\n  token_budget: 4096\n  long_sentences: truncate\ntrain:\n  preset: tiny\n"
                        "  max_minutes: null\n  learning_rate_scale: 1.5\n  jit_compile: true\n")
    elif name == "json-text.cfg":
        path.write_text(json.dumps(config))
    else:
        _write(path, config)
    settings = _resolve("--run-dir", str(tmp_path / "run"), "--config", str(path))
    assert (settings.token_budget, settings.long_sentences, settings.max_minutes) == (4096, "truncate", None)
    assert (settings.learning_rate_scale, settings.jit_compile, settings.preset) == (1.5, True, "tiny")


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("exp.yaml", "train:\n  seed: [1\n", "not valid YAML ("),
        ("exp.json", '{"train": {"seed": 1,}}', "not valid JSON ("),
        ("exp.yaml", "- 1\n- 2\n", "must hold a mapping of sections (data, train, model), got [1, 2]."),
    ],
    ids=["yaml", "json", "list"],
)
def test_a_file_that_is_no_settings_mapping_is_one_error(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    exit_code = train_cli.main(["--run-dir", str(tmp_path / "run"), "--config", str(path)])
    line = _one_line_error(exit_code, capsys.readouterr().err)
    assert f"--config {path}: {message}" in line, line


def test_a_missing_file_or_a_directory_is_one_error(tmp_path, capsys):
    line = _one_line_error(train_cli.main(["--config", str(tmp_path / "nope.yaml")]), capsys.readouterr().err)
    assert f"--config {tmp_path / 'nope.yaml'}: cannot read it (No such file or directory)." in line
    line = _one_line_error(train_cli.main(["--config", str(tmp_path)]), capsys.readouterr().err)
    assert f"--config {tmp_path} is a directory; give a file, such as {tmp_path / 'config.json'}." in line


def test_a_cooldown_may_last_the_whole_run():
    """--cooldown 1 is the linear decay from the first step (a fraction, unlike a dropout rate)."""
    assert _resolve("--run-dir", "unused", "--cooldown", "1").cooldown == 1.0


# --- A step-based default ----------------------------------------------------------------------


def test_the_default_recipe_stops_after_its_steps_not_on_time():
    default = RECIPES["small"].training
    assert default["max_minutes"] is None and default["train_steps"] > 0
    settings = _resolve("--run-dir", "unused")
    assert (settings.preset, settings.train_steps, settings.max_minutes) == ("small", default["train_steps"], None)
    assert _resolve("--run-dir", "unused", "--max-minutes", "5").max_minutes == 5.0


def test_max_minutes_0_lifts_a_recipes_time_budget():
    """--max-minutes 0 is no budget (its help says so): medium's 56 minutes are lifted, and the trainer has none."""
    assert RECIPES["medium"].training["max_minutes"] > 0
    settings = _resolve("--run-dir", "unused", "--preset", "medium", "--max-minutes", "0")
    assert settings.max_minutes is None
    # `auto` is resolved when a run starts.
    assert settings.replace(mixed_precision="none").training_config().max_minutes is None


@pytest.mark.parametrize("preset", sorted(RECIPES))
def test_a_preset_is_its_recipe_for_the_model_the_flags_the_trainer_and_the_search(preset):
    """--preset NAME takes everything from RECIPES[NAME]: the parser's choices, the run's settings, the model."""
    recipe = RECIPES[preset]
    parser = train_cli.build_parser()
    (choice,) = [action for action in parser._actions if action.dest == "preset"]
    assert tuple(choice.choices) == tuple(RECIPES)
    assert f"{preset} ({recipe.summary})" in " ".join(parser.format_help().split())
    settings = _resolve("--run-dir", "unused", "--preset", preset)
    config = settings.replace(mixed_precision="none").training_config()  # `auto` is resolved when a run starts.
    for name, value in recipe.training.items():
        assert getattr(settings, name) == value
        if hasattr(config, name):
            assert getattr(config, name) == value
    assert settings.decoding == recipe.decoding and settings.dropout == recipe.model["dropout_rate"]
    model = Transformer.from_preset(preset, vocab_size=settings.vocab_size)
    assert {key: getattr(model, key) for key in recipe.model} == dict(recipe.model)
    assert settings.attention_init == model.attention_init


def _synthetic_pairs_dataset(input_context):
    """One epoch of four `((source, decoder_inputs), labels)` batches of a copy task on random ids."""
    ids = tf.random.stateless_uniform([4, 8, 10], seed=(1, 2), minval=4, maxval=50, dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices(((ids[:, :, :9], ids[:, :, :9]), ids[:, :, 1:]))


def _trainer(run, validate_fn=None, **config):
    # log_every 1: every step computes the gradient norm, so one step function is traced, not two.
    config = {"train_steps": 10, "warmup_steps": 20, "log_every": 1, **config}
    return Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
        run,
        TrainingConfig(**config),
        validate_fn=validate_fn,
    )


def test_a_run_says_how_many_training_pairs_are_too_long_and_what_becomes_of_them(
    multi30k_dir, multi30k_tokenizer, caplog
):
    from keras_transformer.corpora import load_multi30k

    pairs = load_multi30k(multi30k_dir).train[:500]
    long = sum(
        max(len(multi30k_tokenizer.tokenize(side).numpy()) for side in pair) > 11 for pair in pairs
    )
    assert 0 < long < len(pairs)
    with caplog.at_level("INFO", logger="keras_transformer.training_run"):
        for long_sentences in ("filter", "truncate"):
            training_run.report_long_pairs(pairs, multi30k_tokenizer, 12, long_sentences)
        training_run.report_long_pairs(pairs, multi30k_tokenizer, 256, "filter")  # none: nothing said
    what = f"{long} of 500 training pairs have a side over --max-length 12 tokens (EOS included)"
    assert [(record.levelname, record.getMessage()) for record in caplog.records] == [
        ("WARNING", f"{what}: they are left out (--long-sentences truncate cuts them to fit instead)."),
        ("INFO", f"{what}: they are cut to fit."),
    ]


def test_a_run_logs_its_plan_and_an_estimate_after_its_first_timed_steps(tmp_path, caplog):
    """Step 1 traces the step function; steps 2-11 are timed, then the estimate of the 3 steps left."""
    trainer = _trainer(tmp_path / "run", train_steps=14)
    with caplog.at_level("INFO", logger="keras_transformer.trainer"):
        trainer.fit(_synthetic_pairs_dataset)
    messages = [record.getMessage() for record in caplog.records]
    assert re.fullmatch(r"Training Transformer \([\d,]+ parameters\) on 1 replica: 14 steps \(1-14\)\.",
                        messages[0]), messages[0]
    estimates = [message for message in messages if "timed steps" in message]
    assert len(estimates) == 1 and re.fullmatch(
        r"\d+\.\d\d s a step over the first 10 timed steps: the 3 steps left take about \d+s\.", estimates[0]
    ), estimates


def test_the_eta_counts_the_validations_still_due(tmp_path):
    trainer = _trainer(tmp_path / "run", train_steps=20, eval_every=5)
    assert trainer._validation_time_left(7) == 0.0  # no validation timed yet
    trainer._validation_seconds = 2.0
    assert trainer._validation_time_left(7) == 3 * 2.0  # steps 10 and 15, and the final one at 20
    assert trainer._validation_time_left(20) == 2.0  # the final one, still to come


# --- Validation-driven training ----------------------------------------------------------------


def _bleu_validator(bleu_by_step, weights=None):
    """A validate_fn returning the BLEU of `bleu_by_step[step]`, recording the model's weights by step."""

    def validate(model, step):
        if weights is not None:
            weights[step] = [variable.numpy() for variable in model.trainable_variables]
        return {"loss": 1.0, "bleu": bleu_by_step[step]}

    return validate


def test_patience_stops_the_run_and_the_best_checkpoint_outlives_the_rotation(tmp_path, caplog):
    """BLEU 10, 12, 11, 11 at steps 1-4 with patience 2: training stops at step 4, "best" is step 2."""
    run = tmp_path / "run"
    weights = {}
    trainer = _trainer(run, _bleu_validator({1: 10.0, 2: 12.0, 3: 11.0, 4: 11.0, 5: 11.0}, weights), eval_every=1,
                       patience=2, checkpoint_every=1, keep_checkpoints=1)
    run_dir.write_config(run, {"model": run_dir.model_config(trainer.model)})
    with caplog.at_level("INFO", logger="keras_transformer.trainer"):
        result = trainer.fit(_synthetic_pairs_dataset)

    assert (result.step, result.out_of_patience, result.stopped_early) == (4, True, False)
    assert sorted(weights) == [1, 2, 3, 4]
    assert [Path(path).name for path in run_dir.checkpoints(run / run_dir.CHECKPOINT_DIR)] == ["ckpt-4"]
    best = run_dir.checkpoint_path(run, "best")
    assert best == str(run / run_dir.BEST_DIR / "ckpt-2")
    assert run_dir.best_checkpoint(run) == (best, 12.0)
    for loaded, saved in zip(run_dir.load_model(run, "best").trainable_variables, weights[2]):
        np.testing.assert_array_equal(loaded.numpy(), saved)
    assert run_dir.checkpoint_path(run, "latest").endswith("ckpt-4")
    messages = [record.getMessage() for record in caplog.records]
    assert "Stopping at step 4 of 10: validation BLEU has not improved for 2 validations (patience); the best, " \
           "12.00, is step 2's." in messages, messages


def _best_record(tmp_path, patience):
    """A `BestCheckpoint` that decides, validating every step; `record` alone saves nothing."""
    import logging

    return BestCheckpoint(tf.Module(), tmp_path, tmp_path / run_dir.BEST_DIR, decides=True, eval_every=1,
                          patience=patience, logger=logging.getLogger("keras_transformer.trainer"))


def test_a_bleu_equal_to_the_best_is_no_improvement(tmp_path):
    """"Strictly higher": a tie keeps the older best and counts against patience."""
    best = _best_record(tmp_path, patience=2)
    assert best.record(1, {"bleu": 12.0})
    assert not best.record(2, {"bleu": 12.0}) and not best.out_of_patience()
    assert not best.record(3, {"bleu": 12.0}) and best.out_of_patience()
    assert "the best, 12.00, is step 1's" in best.no_improvement()


def test_the_best_step_validated_again_is_no_setback(tmp_path):
    """A run interrupted after validating its best step validates it again on resuming: the same BLEU, not a
    validation without improvement."""
    best = _best_record(tmp_path, patience=1)
    assert best.record(1, {"bleu": 12.0})
    assert not best.record(1, {"bleu": 12.0}) and not best.out_of_patience()
    assert not best.record(2, {"bleu": 11.0}) and best.out_of_patience()


def test_patience_counts_on_across_a_resume(tmp_path):
    """Resumed after step 3 (BLEU 10, 12, 11), the run stops at step 4; run again, it has nothing to do."""
    run = tmp_path / "run"
    bleu = {1: 10.0, 2: 12.0, 3: 11.0, 4: 11.0, 5: 11.0}
    first = _trainer(run, _bleu_validator(bleu), train_steps=3, eval_every=1, patience=2).fit(_synthetic_pairs_dataset)
    assert (first.step, first.out_of_patience) == (3, False)

    validated = {}
    resumed = _trainer(run, _bleu_validator(bleu, validated), eval_every=1, patience=2).fit(_synthetic_pairs_dataset)
    assert (resumed.start_step, resumed.step, resumed.out_of_patience) == (3, 4, True)
    assert sorted(validated) == [4]

    again = _trainer(run, _bleu_validator(bleu, validated), eval_every=1, patience=2).fit(_synthetic_pairs_dataset)
    assert (again.start_step, again.step, again.out_of_patience) == (4, 4, True)
    assert sorted(validated) == [4]
    assert run_dir.best_checkpoint(run) == (str(run / run_dir.BEST_DIR / "ckpt-2"), 12.0)


def test_patience_counts_only_the_scheduled_validations_across_a_stop_off_the_schedule(tmp_path, caplog):
    """Stopped at step 3 (validated there, off the every-2 schedule), then run to step 8: patience ends it at 6.

    A run that had not stopped validates steps 2, 4 and 6, and the second BLEU without
    improvement (step 6) ends it, not the extra validation of step 3 with the one of step 4.
    """
    run = tmp_path / "run"
    bleu = {2: 12.0, 3: 11.0, 4: 11.0, 6: 11.0, 8: 11.0}
    with caplog.at_level("INFO", logger="keras_transformer.trainer"):
        first = _trainer(run, _bleu_validator(bleu), train_steps=3, eval_every=2, patience=2).fit(
            _synthetic_pairs_dataset
        )
    assert (first.step, first.out_of_patience) == (3, False)
    assert "step 3 is off the schedule of every 2 steps: not counted" in caplog.text

    validated = {}
    resumed = _trainer(run, _bleu_validator(bleu, validated), train_steps=8, eval_every=2, patience=2)
    result = resumed.fit(_synthetic_pairs_dataset)
    assert sorted(validated) == [4, 6]
    assert (result.step, result.out_of_patience) == (6, True)
    assert run_dir.best_checkpoint(run) == (str(run / run_dir.BEST_DIR / "ckpt-2"), 12.0)


def test_a_run_interrupted_while_saving_a_new_best_validates_that_step_again(tmp_path, monkeypatch):
    """Ctrl-C in the save of step 2's best BLEU: the resumed run validates step 2 again and keeps its weights."""
    run = tmp_path / "run"
    bleu = {1: 10.0, 2: 12.0, 3: 11.0, 4: 11.0}
    save = BestCheckpoint.save

    def interrupted_at_step_2(self, step):
        if step == 2:
            raise KeyboardInterrupt
        save(self, step)

    monkeypatch.setattr(BestCheckpoint, "save", interrupted_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        _trainer(run, _bleu_validator(bleu), train_steps=4, eval_every=1, patience=2).fit(_synthetic_pairs_dataset)
    assert run_dir.best_checkpoint(run) == (str(run / run_dir.BEST_DIR / "ckpt-1"), 10.0)
    monkeypatch.setattr(BestCheckpoint, "save", save)

    validated = {}
    trainer = _trainer(run, _bleu_validator(bleu, validated), eval_every=1, patience=2)
    run_dir.write_config(run, {"model": run_dir.model_config(trainer.model)})
    resumed = trainer.fit(_synthetic_pairs_dataset)
    assert sorted(validated) == [2, 3, 4]
    assert (resumed.step, resumed.out_of_patience) == (4, True)  # Steps 3 and 4 did not beat step 2.
    assert run_dir.best_checkpoint(run) == (str(run / run_dir.BEST_DIR / "ckpt-2"), 12.0)
    for loaded, saved in zip(run_dir.load_model(run, "best").trainable_variables, validated[2]):
        np.testing.assert_array_equal(loaded.numpy(), saved)


def test_a_run_without_periodic_validation_keeps_no_best_checkpoint(tmp_path):
    """eval_every 0: only the final validation, and "best" keeps its meaning: averaged, else latest."""
    run = tmp_path / "run"
    _trainer(run, _bleu_validator({4: 20.0}), train_steps=4).fit(_synthetic_pairs_dataset)
    assert not (run / run_dir.BEST_DIR).exists()
    assert run_dir.checkpoint_path(run, "best") == run_dir.checkpoint_path(run, "latest")


def test_the_final_validation_can_be_the_best(tmp_path):
    run = tmp_path / "run"
    _trainer(run, _bleu_validator({2: 10.0, 3: 15.0}), train_steps=3, eval_every=2).fit(_synthetic_pairs_dataset)
    assert run_dir.best_checkpoint(run) == (str(run / run_dir.BEST_DIR / "ckpt-3"), 15.0)


def test_a_worker_follows_the_chiefs_decisions_in_the_same_collectives(tmp_path, monkeypatch):
    """Two workers simulated in turn: the other worker's `any_worker` calls return what the chief decided.

    Both make the same calls in the same order (else the all-reduces would not pair up), and
    the other worker saves the best checkpoint and stops at the chief's step, without
    writing to the run directory.
    """
    calls = []

    def chief_any_worker(strategy, flag):
        calls.append(bool(flag))
        return bool(flag)

    monkeypatch.setattr(distribution, "any_worker", chief_any_worker)
    bleu = {1: 10.0, 2: 12.0, 3: 11.0, 4: 11.0, 5: 11.0}
    chief = _trainer(tmp_path / "run", _bleu_validator(bleu), eval_every=1, patience=2).fit(_synthetic_pairs_dataset)
    assert chief.step == 4 and any(calls)

    decisions = iter(calls)
    others = []

    def worker_any_worker(strategy, flag):
        assert not flag  # The other worker decides nothing itself.
        others.append(flag)
        return next(decisions)

    monkeypatch.setattr(distribution, "any_worker", worker_any_worker)
    monkeypatch.setattr(distribution, "is_chief", lambda strategy: False)
    worker = _trainer(tmp_path / "worker-run", None, eval_every=1, patience=2)
    saved = []
    monkeypatch.setattr(worker._best.manager, "save", lambda checkpoint_number: saved.append(checkpoint_number))
    result = worker.fit(_synthetic_pairs_dataset)
    assert (result.step, result.out_of_patience) == (4, True)
    assert len(others) == len(calls)
    assert saved == [1, 2]  # the chief's new bests
    assert not (tmp_path / "worker-run").exists()


def test_patience_needs_a_validation_function_on_the_chief(tmp_path):
    with pytest.raises(ValueError, match="patience .2. needs a validate_fn on the chief"):
        _trainer(tmp_path / "run", None, eval_every=1, patience=2)
    with pytest.raises(ValueError, match="patience .2. counts validations: it needs eval_every > 0"):
        TrainingConfig(train_steps=10, patience=2)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--patience", "2"], "--patience 2 counts validations, but --eval-every is 0 (one validation, at the end): "
                              "give --eval-every N, or --patience 0."),
        (["--patience", "2", "--eval-every", "10", "--bleu-sentences", "0"],
         "--patience 2 watches the validation BLEU, but --bleu-sentences is 0"),
    ],
    ids=["no-eval-every", "no-bleu"],
)
def test_patience_without_validation_bleu_is_one_error(tmp_path, capsys, flags, message):
    exit_code = train_cli.main(["--run-dir", str(tmp_path / "run"), "--preset", "tiny", *flags])
    assert message in _one_line_error(exit_code, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def _run_with_best(directory, best_step=10, steps=(10, 20)):
    """A run directory with checkpoints at `steps` and the best checkpoint at `best_step`."""
    return checkpointed_run(directory, steps, best_step=best_step, train={"average_last": 2}).best


def test_best_means_a_current_average_else_the_best_checkpoint(tmp_path):
    best = _run_with_best(tmp_path)
    assert run_dir.checkpoint_path(tmp_path, "best") == best
    averaged, _ = run_dir.average_checkpoints(tmp_path, 2)
    assert run_dir.checkpoint_path(tmp_path, "best") == averaged
    config = run_dir.read_config(tmp_path)
    run_dir.write_config(tmp_path, {**config, "train": {"average_last": 0}})  # Run again with --average-last 0.
    assert run_dir.checkpoint_path(tmp_path, "best") == best
    run_dir.write_config(tmp_path, config)
    tf.train.Checkpoint(model=run_dir.build_model(tmp_path)).write(str(tmp_path / run_dir.CHECKPOINT_DIR / "ckpt-30"))
    assert run_dir.checkpoint_path(tmp_path, "best") == best  # Training went on past the average.


@pytest.mark.parametrize("better", [run_dir.AVERAGED_DIR, run_dir.BEST_DIR])
def test_the_final_evaluation_keeps_the_average_only_if_it_beats_the_best_checkpoint(tmp_path, monkeypatch, better):
    best = _run_with_best(tmp_path, best_step=100, steps=(100, 200))  # tiny's checkpoints: every 100 steps
    # Translations stand in for the two checkpoints: the `better` one translates perfectly.
    fake_translations(monkeypatch, winner=better)
    settings = run_settings.layered(
        {"preset": "tiny", "average_last": 2, "bleu_sentences": len(PAIRS), "beam_size": 1, "alpha": 0.6,
         "max_length": 16}
    )
    training_run.average_if_better(tmp_path, validation_corpus(), settings)
    expected = run_dir.checkpoint_path(tmp_path, "averaged") if better == run_dir.AVERAGED_DIR else best
    assert (tmp_path / run_dir.AVERAGED_DIR).exists() == (better == run_dir.AVERAGED_DIR)
    assert run_dir.checkpoint_path(tmp_path, "best") == expected


def test_a_latest_checkpoint_that_beats_the_best_and_the_average_is_the_runs_model(tmp_path, monkeypatch, caplog):
    """Of the average of steps 200 and 300, the best checkpoint (100) and the latest (300), the latest translates
    best: RUN/averaged then holds the latest's weights, and RUN/best stays."""
    best = checkpointed_run(tmp_path, (100, 200), best_step=100, train={"average_last": 2}).best
    newer = run_dir.build_model(tmp_path)  # Other weights for step 300, so the average differs from the latest.
    for variable in newer.trainable_variables:
        variable.assign(tf.ones_like(variable))
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=newer), str(tmp_path / run_dir.CHECKPOINT_DIR), 3)
    latest = manager.save(checkpoint_number=300)
    fake_translations(monkeypatch, winner="latest")
    caplog.set_level("INFO", logger="keras_transformer")
    settings = run_settings.layered(
        {"preset": "tiny", "average_last": 2, "bleu_sentences": len(PAIRS), "beam_size": 1, "alpha": 0.6,
         "max_length": 16}
    )

    training_run.average_if_better(tmp_path, validation_corpus(), settings)

    model = run_dir.checkpoint_path(tmp_path, "best")
    assert model == str(tmp_path / run_dir.AVERAGED_DIR / "ckpt-300")
    weights = [name for name, _ in tf.train.list_variables(latest) if name.startswith("model/")]
    assert weights
    written, expected = tf.train.load_checkpoint(model), tf.train.load_checkpoint(latest)
    for name in weights:
        np.testing.assert_array_equal(written.get_tensor(name), expected.get_tensor(name), err_msg=name)
    assert run_dir.best_checkpoint(tmp_path)[0] == best  # RUN/best is kept as it was.
    assert "averaged 0.00 (chrF" in caplog.text and "best checkpoint (best/ckpt-100) 0.00" in caplog.text


def test_an_average_of_one_that_is_the_best_checkpoint_is_not_translated_twice(tmp_path, monkeypatch):
    """--average-last 1 where the best checkpoint is the latest: the one candidate is kept without a check."""
    checkpointed_run(tmp_path, (100, 200), best_step=200, train={"average_last": 1})
    fake_translations(monkeypatch, winner=run_dir.BEST_DIR)
    translated = []
    real_scores = training_run._validation_scores
    monkeypatch.setattr(training_run, "_validation_scores",
                        lambda run, which, *args: translated.append(which) or real_scores(run, which, *args))
    settings = run_settings.layered(
        {"preset": "tiny", "average_last": 1, "bleu_sentences": len(PAIRS), "beam_size": 1, "alpha": 0.6,
         "max_length": 16}
    )

    training_run.average_if_better(tmp_path, validation_corpus(), settings)

    assert translated == []
    assert run_dir.checkpoint_path(tmp_path, "best") == run_dir.checkpoint_path(tmp_path, "averaged")


def test_a_check_cut_short_leaves_the_runs_model_as_it_was_and_the_next_one_checks_again(tmp_path, monkeypatch):
    """Ctrl-C while the candidates translate: the average, not yet compared, must not become the run's model."""
    best = _run_with_best(tmp_path, best_step=100, steps=(100, 200))
    fake_translations(monkeypatch, winner=run_dir.AVERAGED_DIR)
    real_scores = training_run._validation_scores

    def interrupted_after_the_average(run, which, *args):
        if Path(which).parent.name == run_dir.BEST_DIR:
            raise KeyboardInterrupt
        return real_scores(run, which, *args)

    monkeypatch.setattr(training_run, "_validation_scores", interrupted_after_the_average)
    settings = run_settings.layered(
        {"preset": "tiny", "average_last": 2, "bleu_sentences": len(PAIRS), "beam_size": 1, "alpha": 0.6,
         "max_length": 16}
    )
    with pytest.raises(KeyboardInterrupt):
        training_run.average_if_better(tmp_path, validation_corpus(), settings)
    assert run_dir.checkpoint_path(tmp_path, "best") == best
    assert not (tmp_path / run_dir.AVERAGED_DIR).exists()

    monkeypatch.setattr(training_run, "_validation_scores", real_scores)
    training_run.average_if_better(tmp_path, validation_corpus(), settings)  # train.py given the run again.
    assert run_dir.checkpoint_path(tmp_path, "best") == str(tmp_path / run_dir.AVERAGED_DIR / "ckpt-200")
    assert not (tmp_path / run_dir.UNCHECKED_AVERAGE_DIR).exists()


_FAKE_VALIDATION = """
import sys, train
from keras_transformer import evaluation
BLEU = {2: 10.0, 4: 12.0, 6: 11.0, 8: 11.0}
class Validator:
    def __init__(self, *args, **kwargs):
        pass
    def __call__(self, model, step):
        return {"loss": 1.0, "bleu": BLEU.get(step, 0.0)}
evaluation.Validator = Validator
sys.exit(train.main(FLAGS))
"""


@pytest.mark.slow
def test_train_py_stops_on_patience_and_tests_the_best_checkpoint(tmp_path, small_corpus):
    """Validation BLEU 10, 12, 11, 11 every 2 steps, --patience 2: stops at step 8, tests step 4's checkpoint."""
    run = tmp_path / "run"
    flags = ["--run-dir", str(run), "--preset", "tiny", *small_corpus, "--vocab-size", "1000", "--max-length", "64",
             "--train-steps", "20", "--eval-every", "2", "--checkpoint-every", "2", "--keep-checkpoints", "2",
             "--patience", "2", "--beam-size", "1", "--bleu-sentences", "4"]
    log = _train(*flags, python=_FAKE_VALIDATION)
    assert "Stopping at step 8 of 20: validation BLEU has not improved for 2 validations" in log, log[-3000:]
    assert re.search(r"^Translating 4 test sentences with best/ckpt-4 ", log, re.MULTILINE), log[-3000:]
    assert "--patience 2 stopped the run at step 8 of 20" in log.strip().splitlines()[-1]
    assert [Path(p).name for p in run_dir.checkpoints(run / run_dir.CHECKPOINT_DIR)] == ["ckpt-6", "ckpt-8"]
    assert run_dir.read_config(run)["train"]["patience"] == 2

    again = _train(*flags, python=_FAKE_VALIDATION)
    assert "Stopped at step 8 of 20: validation BLEU has not improved for 2 validations" in again, again[-3000:]
    assert re.search(r"^Translating 4 test sentences with best/ckpt-4 ", again, re.MULTILINE), again[-3000:]
    assert run_dir.best_checkpoint(run) == (str(run / run_dir.BEST_DIR / "ckpt-4"), 12.0)


@pytest.mark.slow
def test_two_workers_stop_together_on_the_chiefs_patience(tmp_path, small_corpus):
    """Only the chief validates; the other worker saves the best checkpoint and stops with it, at step 8."""
    run = tmp_path / "run"
    flags = ["--run-dir", str(run), "--preset", "tiny", *small_corpus, "--vocab-size", "1000", "--max-length", "64",
             "--train-steps", "20", "--eval-every", "2", "--checkpoint-every", "2", "--patience", "2",
             "--beam-size", "1", "--bleu-sentences", "4"]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _FAKE_VALIDATION.replace("FLAGS", repr(flags))], cwd=ROOT,
            env={**os.environ, "TF_CONFIG": tf_config}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for tf_config in local_tf_configs(2)
    ]
    try:
        logs = [process.communicate(timeout=SUBPROCESS_TIMEOUT)[1] for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, log in zip(processes, logs):
        assert process.returncode == 0, log[-3000:]
        assert "Stopping at step 8 of 20: validation BLEU has not improved for 2 validations" in log, log[-3000:]
    assert "the best, 12.00, is step 4's" in logs[0]
    assert run_dir.best_checkpoint(run) == (str(run / run_dir.BEST_DIR / "ckpt-4"), 12.0)
