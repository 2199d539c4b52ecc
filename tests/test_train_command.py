"""The train.py command: flags and their errors, run directories it takes over, what it keeps.

These tests call the command in this process (`keras_transformer.cli.train.main`), or
run `python train.py` in a subprocess, and the library functions a run is made of
(`keras_transformer.training_run`).
"""

import dataclasses
import hashlib
import json
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from fake_runs import (
    PAIRS,
    REFERENCES,
    checkpointed_run,
    fake_translations,
    files_corpus,
    multi30k_files,
    run_command,
    run_with_checkpoint,
    validation_corpus,
)
from keras_transformer import run_dir, run_settings, training_run
from keras_transformer.cli import train as train_cli
from keras_transformer.decoding_settings import DecodingSettings
from keras_transformer.model import Transformer
from keras_transformer.trainer import TrainingResult


# --- Checkpoint averaging and translation progress ---------------------------------------


@pytest.mark.parametrize("better", ["averaged", "latest"])
def test_the_average_is_kept_only_if_it_translates_the_validation_set_better(tmp_path, monkeypatch, better):
    """train.py keeps RUN/averaged only when its validation BLEU is at least the latest's."""
    checkpointed_run(tmp_path, (100, 200))  # tiny's checkpoints: every 100 steps
    # Translations stand in for the two checkpoints: the `better` one translates perfectly.
    fake_translations(monkeypatch, winner=better)
    settings = run_settings.layered(
        {"preset": "tiny", "average_last": 2, "bleu_sentences": len(PAIRS), "beam_size": 1, "alpha": 0.6,
         "max_length": 16}
    )
    training_run.average_if_better(tmp_path, validation_corpus(), settings)
    assert (tmp_path / run_dir.AVERAGED_DIR).exists() == (better == "averaged")


def test_an_average_that_translates_as_well_as_the_latest_is_kept(tmp_path, monkeypatch):
    """"At least as well": on a tie (both translate alike), the average stays the run's model."""
    checkpointed_run(tmp_path, (100, 200))  # tiny's checkpoints: every 100 steps
    fake_translations(monkeypatch, winner="neither")  # Both checkpoints translate "nichts".
    settings = run_settings.layered(
        {"preset": "tiny", "average_last": 2, "bleu_sentences": len(PAIRS), "beam_size": 1, "alpha": 0.6,
         "max_length": 16}
    )
    training_run.average_if_better(tmp_path, validation_corpus(), settings)
    assert run_dir.checkpoint_path(tmp_path, "best") == run_dir.checkpoint_path(tmp_path, "averaged")


def test_the_average_is_chosen_on_the_whole_validation_split_not_the_periodic_checks_sentences(
    tmp_path, monkeypatch, caplog
):
    """The latest translates the first --bleu-sentences pair right and the average the other three: the
    average is kept, as every validation pair counts."""
    checkpointed_run(tmp_path, (100, 200))  # tiny's checkpoints: every 100 steps
    wrong = ["nichts"] * len(REFERENCES)
    fake_translations(monkeypatch, winner=run_dir.AVERAGED_DIR, wins=wrong[:1] + REFERENCES[1:],
                      loses=REFERENCES[:1] + wrong[1:])
    caplog.set_level("INFO", logger="keras_transformer")
    settings = run_settings.layered(
        {"preset": "tiny", "average_last": 2, "bleu_sentences": 1, "beam_size": 1, "alpha": 0.6, "max_length": 16}
    )

    training_run.average_if_better(tmp_path, validation_corpus(), settings)

    assert run_dir.checkpoint_path(tmp_path, "best") == run_dir.checkpoint_path(tmp_path, "averaged")
    assert any(f"Validation BLEU ({len(PAIRS)} sentences)" in record.getMessage() for record in caplog.records)


def test_average_only_needs_no_data_directory(tmp_path):
    """A --dataset files run averages without --data-dir: averaging reads no data."""
    for step in (100, 200):  # tiny's checkpoints: every 100 steps
        run_with_checkpoint(tmp_path, step=step)
    config = run_dir.read_config(tmp_path)
    config["data"] = {"corpus": "files", "source_lang": "en", "target_lang": "de", "vocab_size": 50}
    config["train"] = {"preset": "tiny"}
    run_dir.write_config(tmp_path, config)
    assert train_cli.main(["--run-dir", str(tmp_path), "--average-only", "--average-last", "2"]) == 0
    assert Path(run_dir.checkpoint_path(tmp_path, "averaged")).name == "ckpt-200"


def test_a_run_averaged_on_request_translates_with_the_average(tmp_path):
    """A `small` run saves --average-last 0; --average-only then makes the average its model, as asked."""
    for step in (100, 200):  # tiny's checkpoints: every 100 steps
        run_with_checkpoint(tmp_path, step=step)
    config = run_dir.read_config(tmp_path)
    config["data"] = {"corpus": "files", "source_lang": "en", "target_lang": "de", "vocab_size": 50}
    config["train"] = {"preset": "tiny", "average_last": 0}
    run_dir.write_config(tmp_path, config)
    assert Path(run_dir.checkpoint_path(tmp_path, "best")).parent.name == run_dir.CHECKPOINT_DIR

    assert train_cli.main(["--run-dir", str(tmp_path), "--average-only", "--average-last", "2"]) == 0

    assert run_dir.checkpoint_path(tmp_path, "best") == run_dir.checkpoint_path(tmp_path, "averaged")
    assert run_dir.read_config(tmp_path)["model"] == config["model"]


def test_averaging_more_checkpoints_than_a_run_kept_saves_both_flags(tmp_path):
    """`--average-only --average-last 4 --keep-checkpoints 4` on a run that kept 3: later commands still resolve."""
    for step in (100, 200, 300, 400):  # tiny's checkpoints: every 100 steps; it keeps 3
        run_with_checkpoint(tmp_path, step=step)
    config = run_dir.read_config(tmp_path)
    config["data"] = {"corpus": "files", "source_lang": "en", "target_lang": "de", "vocab_size": 50}
    config["train"] = {"preset": "tiny"}
    run_dir.write_config(tmp_path, config)
    assert train_cli.main(
        ["--run-dir", str(tmp_path), "--average-only", "--average-last", "4", "--keep-checkpoints", "4"]) == 0
    assert {key: run_dir.read_config(tmp_path)["train"][key] for key in ("average_last", "keep_checkpoints")} == {
        "average_last": 4, "keep_checkpoints": 4}
    data = tmp_path / "data"
    files_corpus(data, {"train.en": b"A dog.\n", "train.de": b"Ein Hund.\n"})
    settings, _, _ = run_settings.resolve({}, run=tmp_path, data_dir=data)  # `train.py --run-dir RUN --data-dir D`
    assert (settings.average_last, settings.keep_checkpoints) == (4, 4)


def test_translate_reports_each_batch_and_translates_as_without_a_callback(multi30k_tokenizer):
    from keras_transformer import evaluation

    model = Transformer.from_preset("tiny", vocab_size=multi30k_tokenizer.vocab_size)
    model.build()
    sources = ["a man", "two dogs run on the grass .", "a woman in a red coat", "children", "a boy jumps ."]
    reports = []
    options = dict(decoding=DecodingSettings(beam_size=2), batch_size=2)
    translations = evaluation.translate(
        model, multi30k_tokenizer, sources, on_batch=lambda done, total: reports.append((done, total)), **options
    )
    assert reports == [(2, 5), (4, 5), (5, 5)]  # batches of 2 over 5 sentences
    assert translations == evaluation.translate(model, multi30k_tokenizer, sources, **options)

    # Empty and blank sources translate to "" in their places (a test file's lines stay aligned).
    reports.clear()
    with_blanks = ["", *sources[:2], "  ", *sources[2:]]
    expected = ["", *translations[:2], "", *translations[2:]]
    assert evaluation.translate(
        model, multi30k_tokenizer, with_blanks, on_batch=lambda done, total: reports.append((done, total)), **options
    ) == expected
    assert reports == [(4, 7), (6, 7), (7, 7)]
    assert evaluation.translate(model, multi30k_tokenizer, ["", " "], **options) == ["", ""]


def test_translation_progress_logs_at_most_every_so_many_seconds(monkeypatch, caplog):
    clock = iter([100.0, 110.0, 131.0, 140.0, 170.0, 250.0])  # creation, then one reading per batch
    monkeypatch.setattr(training_run.time, "monotonic", lambda: next(clock))
    progress = training_run.translation_progress("test sentences", every_seconds=30)
    with caplog.at_level("INFO", logger="keras_transformer.training_run"):
        for translated in (64, 128, 192, 256, 300):
            progress(translated, 300)
    # 30 s after the start, 30 s after that line; never for the last batch.
    assert [record.getMessage() for record in caplog.records] == [
        "  128/300 test sentences translated (31s)",
        "  256/300 test sentences translated (1m10s)",
    ]


# --- Bad flags ---------------------------------------------------------------------------


def _snapshot(directory):
    return {
        str(path.relative_to(directory)): (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.fixture
def existing_run(tmp_path, multi30k_tokenizer):
    """A run directory as `train.py --preset tiny` leaves it: config.json, tokenizer, a checkpoint."""
    run = tmp_path / "run"
    model = Transformer.from_preset("tiny", vocab_size=multi30k_tokenizer.vocab_size)
    model.build()
    settings = run_settings.layered({
        "preset": "tiny",
        "dataset": "multi30k",
        "source_lang": "en",
        "target_lang": "de",
        "vocab_size": multi30k_tokenizer.vocab_size,
        "dropout": model.dropout_rate,
    })
    run_settings.write_run_config(run, settings, model)
    multi30k_tokenizer.save(run_dir.tokenizer_path(run))
    tf.train.Checkpoint(model=model).write(str(run / run_dir.CHECKPOINT_DIR / "ckpt-100"))
    return run


def _assert_one_line_error(exit_code, stderr, *fragments):
    assert exit_code == 2
    assert "Traceback" not in stderr, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("train.py: error:"), stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[-1]


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--preset", "small"], ["trained with --preset tiny, not small"]),
        (["--vocab-size", "1000"], ["trained with --vocab-size 4000, not 1000"]),
        (["--token-budget", "2048"], ["trained with --token-budget 1024, not 2048"]),
        (["--dataset", "wmt14"], ["trained with --dataset multi30k, not wmt14"]),
    ],
    ids=["preset", "vocabulary", "token-budget", "dataset"],
)
def test_flags_conflicting_with_the_run_fail_before_anything_is_written(existing_run, capsys, flags, fragments):
    before = _snapshot(existing_run)
    exit_code = train_cli.main(["--run-dir", str(existing_run), *flags])
    _assert_one_line_error(exit_code, capsys.readouterr().err, *fragments)
    assert _snapshot(existing_run) == before


def test_fewer_steps_than_the_run_trained_are_refused_before_anything_is_written(existing_run, capsys):
    """Else config.json would say 50 of a run that trained 100 (its checkpoint), and --config it would differ."""
    before = _snapshot(existing_run)
    exit_code = train_cli.main(["--run-dir", str(existing_run), "--train-steps", "50"])
    _assert_one_line_error(exit_code, capsys.readouterr().err, "has trained 100 steps, more than --train-steps 50")
    assert _snapshot(existing_run) == before


def test_as_many_steps_as_the_run_trained_are_its_length(existing_run):
    """What a time-budget stop advises (--train-steps STEP, to evaluate the run as it stands) is not refused."""
    args = train_cli.build_parser().parse_args(["--run-dir", str(existing_run), "--train-steps", "100"])
    settings, _, _ = train_cli.resolve_settings(args)
    assert (settings.train_steps, settings.epochs) == (100, None)


def test_fewer_epochs_than_the_run_trained_are_refused_before_anything_is_written(existing_run, multi30k_dir,
                                                                                  capsys):
    """--epochs counts its steps once the data is read: a length under the 100 trained is refused as --train-steps."""
    before = _snapshot(existing_run)
    exit_code = train_cli.main(["--run-dir", str(existing_run), "--epochs", "0.01", "--data-dir", str(multi30k_dir)])
    _assert_one_line_error(exit_code, capsys.readouterr().err, "has trained 100 steps, more than --epochs 0.01 (")
    assert _snapshot(existing_run) == before


def _file_size_limit(limit_bytes):
    """A child process's `preexec_fn`: writes past `limit_bytes` fail (EFBIG) as on a full disk."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # Else the write kills the process instead of failing.
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return limit


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_leaves_no_part_of_it(tmp_path, multi30k_dir):
    """As on a full disk: the checkpoint's data file fails; the run's small files were written."""
    corpus = multi30k_files(tmp_path / "data", multi30k_dir, {"train": 300, "test": 4})
    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "train.py", "--run-dir", str(run), "--preset", "tiny", *corpus, "--vocab-size", "400",
         "--train-steps", "2", "--bleu-sentences", "0", "--beam-size", "1"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=240,
        preexec_fn=_file_size_limit(100_000),
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"train.py: error: Cannot write checkpoint {run / 'checkpoints' / 'ckpt-2'} (File too large); "
        "the same command starts it again.")
    assert list((run / "checkpoints").iterdir()) == []


def test_a_vocabulary_that_does_not_match_the_config_is_refused(existing_run, capsys):
    config = run_dir.read_config(existing_run)
    config["data"]["vocab_size"] = 8000
    run_dir.write_config(existing_run, config)
    before = _snapshot(existing_run)
    exit_code = train_cli.main(["--run-dir", str(existing_run)])
    _assert_one_line_error(exit_code, capsys.readouterr().err, "has 4000 ids but --vocab-size is 8000")
    assert _snapshot(existing_run) == before


def test_a_directory_of_other_files_is_not_made_a_run(tmp_path, capsys):
    """A mistyped --run-dir (the repository, a data directory) would get checkpoints and logs mixed in."""
    (tmp_path / "notes.txt").write_text("mine")
    before = _snapshot(tmp_path)
    exit_code = train_cli.main(["--run-dir", str(tmp_path), "--preset", "tiny"])
    _assert_one_line_error(exit_code, capsys.readouterr().err, f"{tmp_path} is not empty (notes.txt) and is not a run")
    assert _snapshot(tmp_path) == before


def test_checkpoints_without_config_are_not_taken_over(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    exit_code = train_cli.main(["--run-dir", str(tmp_path), "--preset", "tiny"])
    _assert_one_line_error(exit_code, capsys.readouterr().err, "no config.json")
    assert [path.name for path in tmp_path.iterdir()] == ["checkpoints"]


@pytest.mark.slow
def test_missing_data_is_one_line_in_a_real_process(existing_run):
    before = _snapshot(existing_run)
    result = run_command(
        [sys.executable, "train.py", "--run-dir", str(existing_run), "--data-dir", "/nonexistent/multi30k"]
    )
    _assert_one_line_error(result.returncode, result.stderr, "Multi30k directory /nonexistent/multi30k", "lacks")
    assert _snapshot(existing_run) == before


def test_unknown_preset_is_a_usage_error(tmp_path):
    result = run_command([sys.executable, "train.py", "--preset", "huge", "--run-dir", str(tmp_path / "run")])
    assert result.returncode == 2 and "invalid choice: 'huge'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_average_last_beyond_the_kept_checkpoints_is_refused(tmp_path, capsys):
    """tiny keeps 3 checkpoints: averaging 5 would silently average 3."""
    flags = ["--run-dir", str(tmp_path / "run"), "--preset", "tiny", "--average-last", "5"]
    exit_code = train_cli.main(flags)
    _assert_one_line_error(exit_code, capsys.readouterr().err, "--average-last 5", "--keep-checkpoints is 3")
    assert not (tmp_path / "run").exists()


def test_a_language_the_corpus_lacks_fails_before_anything_is_written(tmp_path, capsys):
    exit_code = train_cli.main(["--run-dir", str(tmp_path / "run"), "--source-lang", "fr"])
    _assert_one_line_error(exit_code, capsys.readouterr().err, "--dataset multi30k translates between en and de")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text", ["{\"model\": {", "[1, 2]"], ids=["truncated", "not-an-object"])
def test_a_damaged_config_is_one_line(existing_run, capsys, text):
    (existing_run / run_dir.CONFIG_FILE).write_text(text)
    exit_code = train_cli.main(["--run-dir", str(existing_run)])
    _assert_one_line_error(exit_code, capsys.readouterr().err, str(existing_run / run_dir.CONFIG_FILE), "damaged")


@pytest.mark.parametrize("value", ["-1", str(2**32)])
def test_a_seed_out_of_numpys_range_is_a_usage_error(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as raised:
        train_cli.main(["--run-dir", str(tmp_path / "run"), "--seed", value])
    assert raised.value.code == 2
    assert f"argument --seed: must be an integer from 0 to {2**32 - 1}, got {value}" in capsys.readouterr().err


def test_help_gives_the_presets_defaults_and_the_papers_values():
    help_text = " ".join(train_cli.build_parser().format_help().split())
    assert "[the preset's: tiny 100, small 1000, medium 2000, base 4000, big 4000] The paper: 4000." in help_text
    assert "[the preset's: tiny 1, small 1.75, medium 1.75, base 1, big 1] The paper: 1." in help_text


@pytest.mark.parametrize(
    "tf_config, message",
    [
        ("not json", "TF_CONFIG is not valid JSON"),
        ("[1, 2]", "TF_CONFIG must be a JSON object such as"),
        ('{"cluster": {"worker": "h:1,h:2"}, "task": {"type": "worker", "index": 0}}', "TF_CONFIG must be"),
    ],
    ids=["not-json", "not-an-object", "tasks-not-a-list"],
)
def test_a_malformed_tf_config_is_one_line(tmp_path, capsys, monkeypatch, tf_config, message):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    exit_code = train_cli.main(["--run-dir", str(tmp_path / "run"), "--preset", "tiny"])
    _assert_one_line_error(exit_code, capsys.readouterr().err, message)


@pytest.mark.parametrize("devices", ["", ",", " , "])
def test_devices_that_name_no_device_are_one_line(tmp_path, capsys, devices):
    exit_code = train_cli.main(["--run-dir", str(tmp_path / "run"), "--preset", "tiny", "--devices", devices])
    _assert_one_line_error(exit_code, capsys.readouterr().err, f"--devices {devices!r} names no device")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_missing_gpu_is_one_line_in_a_real_process(tmp_path):
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU")
    result = run_command([sys.executable, "train.py", "--run-dir", str(tmp_path / "run"), "--devices", "GPU:0"])
    _assert_one_line_error(result.returncode, result.stderr, "--devices GPU:0: Device GPU:0 does not exist")
    assert not (tmp_path / "run").exists()


def test_a_run_dir_that_is_a_file_is_one_line_before_any_work(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    result = run_command([sys.executable, "train.py", "--run-dir", str(path), "--preset", "tiny"])
    _assert_one_line_error(result.returncode, result.stderr, f"--run-dir {path} is a file, not a directory.")
    assert path.read_text() == "mine"


@pytest.mark.slow
def test_a_vocabulary_too_small_for_the_text_is_one_line(tmp_path, multi30k_dir):
    run = tmp_path / "run"
    result = run_command([sys.executable, "train.py", "--run-dir", str(run), "--preset", "tiny", "--vocab-size", "100",
                          "--data-dir", str(multi30k_dir)])
    _assert_one_line_error(result.returncode, result.stderr, "--vocab-size 100 is too small for the multi30k",
                           "or more")
    assert not run.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-length", "1"], "--max-length 1 leaves no room for a token and EOS"),
        (["--beam-size", "17"], "--beam-size is at most 16, got 17"),
    ],
    ids=["max-length", "beam-size"],
)
def test_settings_no_translator_could_use_fail_before_anything_is_written(tmp_path, capsys, flags, message):
    exit_code = train_cli.main(["--run-dir", str(tmp_path / "run"), "--preset", "tiny", *flags])
    _assert_one_line_error(exit_code, capsys.readouterr().err, message)
    assert not (tmp_path / "run").exists()


# Past 10, ((5 + length) / 6) ** alpha overflows float32 and every score is -0: the best would be arbitrary.
_OUT_OF_RANGE_NUMBERS = [
    *(("--alpha", value, "must be from 0 to 10") for value in ("-1", "11", "1e6", "nan")),
    *(("--epochs", value, "must be a positive number") for value in ("inf", "nan", "0")),
    *((flag, str(2**63), "must be at most 9223372036854775807 (a 64-bit integer)")
      for flag in ("--token-budget", "--train-steps", "--eval-every")),
    # faulthandler's timer overflowed past 2**63 ns: an OverflowError once the workers were awaited.
    *(("--connect-timeout-minutes", value, "must be at most 1e+08 minutes") for value in ("1e9", "1e300")),
]


@pytest.mark.parametrize("flag, value, message", _OUT_OF_RANGE_NUMBERS)
def test_numbers_out_of_range_are_usage_errors_before_anything_is_written(tmp_path, capsys, flag, value, message):
    with pytest.raises(SystemExit) as raised:
        train_cli.main(["--run-dir", str(tmp_path / "run"), flag, value])
    assert raised.value.code == 2
    assert f"argument {flag}: {message}, got {value}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("length_flags", [["--train-steps", "5"], ["--epochs", "1"]], ids=["steps", "epochs"])
def test_a_corpus_without_a_pair_short_enough_is_one_line(tmp_path, multi30k_dir, length_flags):
    """Every Multi30k sentence has more than 2 subword tokens, so --max-length 3 keeps no pair."""
    corpus = multi30k_files(tmp_path / "data", multi30k_dir, {"train": 300})
    run = tmp_path / "run"
    result = run_command([
        sys.executable, "train.py", "--run-dir", str(run), "--preset", "tiny", *corpus, "--vocab-size", "400",
        "--max-length", "3", "--token-budget", "64", *length_flags,
    ])
    _assert_one_line_error(
        result.returncode, result.stderr, "No training pair is left", "longer than --max-length 3 allows (2 tokens)",
        f"delete {run} first",
    )


def test_a_training_text_without_a_usable_line_is_one_line(tmp_path, capsys):
    """Every line empty or not UTF-8: SentencePiece has nothing to learn from (its message ends in "] ")."""
    flags = files_corpus(tmp_path / "data", {"train.en": b"\n \n\xff\xfe\n", "train.de": b"\nzwei\ndrei\n"})
    exit_code = train_cli.main(["--run-dir", str(tmp_path / "run"), "--preset", "tiny", *flags])
    _assert_one_line_error(exit_code, capsys.readouterr().err, "training text has no sentence to learn a vocabulary")


def test_a_split_with_only_one_of_its_files_is_one_line(tmp_path, capsys):
    """val.en next to a misnamed German file: not a run without validation, but an error naming the file."""
    files = {"train.en": b"A dog.\n", "train.de": b"Ein Hund.\n", "val.en": b"A cat.\n", "valid.de": b"Eine Katze.\n"}
    flags = files_corpus(tmp_path / "data", files)
    exit_code = train_cli.main(["--run-dir", str(tmp_path / "run"), "--preset", "tiny", *flags])
    _assert_one_line_error(exit_code, capsys.readouterr().err, "has val.en but not val.de")
    assert not (tmp_path / "run").exists()


# --- Interrupted, stopped and resumed runs -----------------------------------------------


def _interrupting_train(*flags):
    """`python -c` code: train.py with `flags`, interrupted (Ctrl-C) as its Trainer is created."""
    return [
        sys.executable, "-c",
        "import sys, train, keras_transformer.trainer as trainer\n"
        "def interrupt(*args, **kwargs):\n"
        "    raise KeyboardInterrupt\n"
        "trainer.Trainer = interrupt\n"
        f"sys.exit(train.main({list(flags)!r}))\n",
    ]


@pytest.mark.slow
def test_a_start_interrupted_after_the_vocabulary_is_resumed(tmp_path, multi30k_dir):
    """Ctrl-C right after the vocabulary is learned; the same command takes the run up again.

    Also a directory left so by earlier versions (a vocabulary without config.json).
    """
    run = tmp_path / "run"
    command = _interrupting_train("--run-dir", str(run), "--preset", "tiny", "--vocab-size", "1000",
                                  "--data-dir", str(multi30k_dir))
    first = run_command(command)
    assert first.returncode == 130, first.stderr[-3000:]
    assert "run the same command to resume" in first.stderr
    assert (run / run_dir.CONFIG_FILE).is_file() and run_dir.tokenizer_path(run).is_file()
    assert run_dir.read_config(run)["data"]["vocab_size"] == 1000
    vocabulary = _snapshot(run)[run_dir.TOKENIZER_FILE]

    again = run_command(command)
    assert again.returncode == 130, again.stderr[-3000:]
    assert _snapshot(run)[run_dir.TOKENIZER_FILE] == vocabulary  # Taken up, not learned again.
    # Its settings are pinned like those of any run.
    other = run_command([sys.executable, "train.py", "--run-dir", str(run), "--seed", "1"])
    _assert_one_line_error(other.returncode, other.stderr, "trained with --seed 0, not 1")

    (run / run_dir.CONFIG_FILE).unlink()  # As earlier versions left it.
    legacy = run_command(command)
    assert legacy.returncode == 130, legacy.stderr[-3000:]
    assert "an interrupted start" in legacy.stderr
    assert _snapshot(run)[run_dir.TOKENIZER_FILE] == vocabulary


@pytest.mark.parametrize("start", ["new", "stopped", "interrupted"])
def test_a_run_draws_its_weights_as_its_settings_say(tmp_path, multi30k_dir, multi30k_tokenizer, monkeypatch, start):
    """A new run, one stopped before its first checkpoint (config.json holds the model, no checkpoint its
    weights), and one interrupted before it built its model (config.json and the vocabulary alone) build their
    model with the run's attention initialisation, dropouts and norm order, not the layers' or the preset's
    defaults."""
    run = tmp_path / "run"
    command = ["--run-dir", str(run), "--data-dir", str(multi30k_dir)]
    if start == "new":
        command += ["--preset", "tiny", "--vocab-size", "1000", "--dropout", "0.25", "--attention-init", "mimetic",
                    "--attention-dropout", "0.1", "--activation-dropout", "0.2", "--norm-first"]
    else:  # `train.py --run-dir RUN` resumes it: its settings are the run's.
        settings = run_settings.layered({
            "preset": "tiny", "dataset": "multi30k", "source_lang": "en", "target_lang": "de",
            "vocab_size": multi30k_tokenizer.vocab_size, "dropout": 0.25, "attention_init": "mimetic",
            "attention_dropout": 0.1, "activation_dropout": 0.2, "norm_first": True,
        })
        model = Transformer.from_preset(
            "tiny", multi30k_tokenizer.vocab_size, dropout_rate=0.25, attention_init="mimetic",
            attention_dropout_rate=0.1, activation_dropout_rate=0.2, norm_first=True,
        )
        model.build()
        run_settings.write_run_config(run, settings, model if start == "stopped" else None)
        multi30k_tokenizer.save(run_dir.tokenizer_path(run))
    built = []

    def trainer_stopped_at_once(strategy, model_fn, *args, **kwargs):
        built.append(model_fn("float32"))
        raise KeyboardInterrupt

    monkeypatch.setattr(training_run, "Trainer", trainer_stopped_at_once)
    assert train_cli.main(command) == 130
    (model,) = built
    blocks = model.encoder.blocks + model.decoder.blocks
    assert model.dropout_rate == 0.25
    assert {block.self_attention.attention_init for block in blocks} == {"mimetic"}
    assert {block.feed_forward.dropout.rate for block in blocks} == {0.2}
    assert {block.self_attention.dropout.rate for block in blocks} == {0.1}
    assert {block.norm_first for block in blocks} == {True} and model.encoder.final_norm is not None


@pytest.mark.slow
def test_a_time_budget_stop_says_where_the_run_stands_and_its_advice_works(tmp_path, multi30k_dir):
    """A run stopped by --max-minutes ends with its step and how to continue it, or only evaluate it.

    A run in --epochs: the advice to evaluate it must swap its length for --train-steps (argparse
    refuses both), and the run then takes the new length. The message of a run in steps is
    `test_a_time_budget_stop_logs_the_step_and_the_flags_to_go_on`'s.
    """
    # No validation split: what the stop says does not depend on one, and the run skips the final validation.
    corpus = multi30k_files(tmp_path / "data", multi30k_dir, {"train": 3000, "test": 4})
    command = [
        sys.executable, "train.py", "--run-dir", str(tmp_path / "run"), "--preset", "tiny", *corpus,
        "--vocab-size", "1000",
        "--max-length", "64", "--max-minutes", "0.0001", "--bleu-sentences", "0", "--beam-size", "1",
    ]
    result = run_command([*command, "--epochs", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    # Its one step traced the step function, so it was not timed: no speed rather than 0 tokens/s.
    assert re.search(r"^Trained steps 1-1 in \S+\.$", result.stderr, re.MULTILINE), result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"The time budget \(--max-minutes 0.0001\) stopped the run at step 1 of \d+; run the same command again "
        r"to continue training from there, or add --train-steps 1 in place of --epochs to evaluate it as it stands "
        r"\(with other decoding flags, say\)\.", last
    ), last

    evaluated = run_command([*command, "--train-steps", "1", "--beam-size", "2"])  # As the last line says.
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "Already trained 1 of 1 steps; nothing to do." in evaluated.stderr, evaluated.stderr[-3000:]
    assert "Translating 4 test sentences with checkpoints/ckpt-1 (beam 2, alpha 0.6)" in evaluated.stderr


@pytest.mark.parametrize("length, instead", [({}, ""), ({"epochs": 1}, " in place of --epochs")],
                         ids=["steps", "epochs"])
def test_a_time_budget_stop_logs_the_step_and_the_flags_to_go_on(caplog, length, instead):
    settings = run_settings.layered({"preset": "tiny", "max_minutes": 0.5, "train_steps": 200, **length})
    stopped = TrainingResult(start_step=0, step=37, stopped_early=True, seconds=30.0, tokens_per_second=0.0)
    with caplog.at_level("INFO", logger="keras_transformer.training_run"):
        training_run._log_early_stop(stopped, settings)
        training_run._log_early_stop(dataclasses.replace(stopped, step=200, stopped_early=False), settings)
    assert [record.getMessage() for record in caplog.records] == [
        "The time budget (--max-minutes 0.5) stopped the run at step 37 of 200; run the same command again to "
        f"continue training from there, or add --train-steps 37{instead} to evaluate it as it stands (with other "
        "decoding flags, say)."
    ]


@pytest.mark.parametrize(
    "saved, step, train_steps, replicas, expected",
    [
        (None, None, 200, 2, 2),  # A new run records its replicas.
        (1, 100, 200, 1, 1),  # Resumed on as many.
        (None, 100, 200, 2, 2),  # A run of an earlier version: from now on, on 2.
        (2, 200, 200, 1, 2),  # Evaluating a finished run works on any number, and keeps the record.
        (2, 100, 200, 1, "trained on 2 replica(s) up to step 100, and this command runs 1"),
    ],
    ids=["new", "same", "unrecorded", "finished", "other"],
)
def test_a_run_resumes_only_on_as_many_replicas(tmp_path, saved, step, train_steps, replicas, expected):
    if step is not None:
        run_with_checkpoint(tmp_path, step=step)
    settings = run_settings.layered({"preset": "tiny", "replicas": saved, "train_steps": train_steps})
    if isinstance(expected, int):
        assert run_settings.check_replicas(tmp_path, settings, replicas) == expected
    else:
        with pytest.raises(run_settings.SettingsError, match=re.escape(expected)):
            run_settings.check_replicas(tmp_path, settings, replicas)


@pytest.mark.parametrize(
    "saved, step, train_steps, workers, expected",
    [
        (None, None, 200, 2, 2),  # A new run records its workers.
        (2, 100, 200, 2, 2),  # Resumed on as many.
        (None, 100, 200, 1, 1),  # A run of an earlier version (maybe of several workers): from now on, on 1.
        (2, 200, 200, 1, 2),  # Evaluating a finished run works on any number, and keeps the record.
        (2, 100, 200, 1, "trained on 2 worker(s) up to step 100, and this command runs 1"),
        (1, 100, 200, 2, "trained on 1 worker(s) up to step 100, and this command runs 2"),
    ],
    ids=["new", "same", "unrecorded", "finished", "fewer", "more"],
)
def test_a_run_resumes_only_on_as_many_workers(tmp_path, saved, step, train_steps, workers, expected):
    """Each worker reads its shard of the pairs: 2 workers of 1 replica each are not 1 process of 2 replicas."""
    if step is not None:
        run_with_checkpoint(tmp_path, step=step)
    settings = run_settings.layered({"preset": "tiny", "replicas": 2, "workers": saved, "train_steps": train_steps})
    if isinstance(expected, int):
        assert run_settings.check_workers(tmp_path, settings, workers) == expected
        assert run_settings.check_replicas(tmp_path, settings, 2) == 2  # Only the workers differ.
    else:
        with pytest.raises(run_settings.SettingsError, match=re.escape(expected) + r".*\(see TF_CONFIG\)"):
            run_settings.check_workers(tmp_path, settings, workers)


@pytest.mark.slow
def test_resuming_on_another_number_of_replicas_is_one_line_in_a_real_process(existing_run):
    """The run trained 100 of its 200 steps on 2 replicas; this command has 1 (the CPU)."""
    config = run_dir.read_config(existing_run)
    config["train"]["replicas"] = 2
    run_dir.write_config(existing_run, config)
    tf.train.CheckpointManager(
        tf.train.Checkpoint(model=run_dir.build_model(existing_run)), str(existing_run / run_dir.CHECKPOINT_DIR), 3
    ).save(checkpoint_number=100)
    before = _snapshot(existing_run)
    result = run_command([sys.executable, "train.py", "--run-dir", str(existing_run)])
    _assert_one_line_error(result.returncode, result.stderr, "trained on 2 replica(s) up to step 100")
    assert _snapshot(existing_run) == before


@pytest.mark.slow
def test_cpu_replicas_split_the_cpu_and_a_resume_on_another_number_is_one_line(existing_run):
    """The run trained 100 of its 200 steps on 1 replica; --cpu-replicas 2 makes this command's strategy 2."""
    config = run_dir.read_config(existing_run)
    config["train"]["replicas"] = 1
    run_dir.write_config(existing_run, config)
    before = _snapshot(existing_run)
    result = run_command([sys.executable, "train.py", "--run-dir", str(existing_run), "--cpu-replicas", "2"])
    _assert_one_line_error(
        result.returncode, result.stderr, "trained on 1 replica(s) up to step 100, and this command runs 2",
        "--cpu-replicas",
    )
    assert _snapshot(existing_run) == before


def test_a_run_of_an_earlier_version_keeps_its_one_cpu_replica(tmp_path):
    """A config.json without cpu_replicas was written by code that trained on one CPU replica, whatever its preset."""
    old = run_settings.layered({"preset": "medium"}).to_config()
    del old["train"]["cpu_replicas"]
    run_dir.write_config(tmp_path / "old", old)
    resumed, _, _ = run_settings.resolve({}, run=tmp_path / "old")
    new, _, _ = run_settings.resolve({"preset": "medium"}, run=tmp_path / "new")
    assert (resumed.cpu_replicas, new.cpu_replicas) == (1, 2)


def test_a_config_json_of_an_earlier_version_given_back_keeps_its_one_cpu_replica(tmp_path):
    """--config OLD/config.json --run-dir NEW trains OLD's run again: one replica, not the recipe's two of its budget.

    A file holding the model's architecture is a run's config.json; a user's file without it takes the recipe's.
    """
    settings = run_settings.layered({"preset": "medium", "token_budget": 4096})  # medium's batch then
    built = Transformer.from_preset("medium", vocab_size=settings.vocab_size, dropout_rate=0.0)
    run_settings.write_run_config(tmp_path / "old", settings, built)
    old = run_dir.read_config(tmp_path / "old")
    del old["train"]["cpu_replicas"]
    run_dir.write_config(tmp_path / "old", old)
    user_file = tmp_path / "medium.json"
    user_file.write_text(json.dumps({"train": {"preset": "medium"}}))

    given_back, _, _ = run_settings.resolve({}, config_file=tmp_path / "old" / run_dir.CONFIG_FILE, run=tmp_path / "a")
    users, _, _ = run_settings.resolve({}, config_file=user_file, run=tmp_path / "b")
    assert (given_back.cpu_replicas, given_back.token_budget) == (1, 4096)
    assert users.cpu_replicas == 2


def test_attention_and_activation_dropout_are_pinned_and_a_run_of_an_earlier_version_had_none(tmp_path):
    """The flags reach config.json's model section; a resume keeps them, and refuses others naming the flag.

    A config.json without them was written by code whose models had neither dropout, whatever the recipe says now.
    """
    given = {"preset": "tiny", "attention_dropout": 0.1, "activation_dropout": 0.2}
    settings, run, _ = run_settings.resolve(given, run=tmp_path / "run")
    run_settings.write_run_config(run, settings)
    assert {k: run_dir.read_config(run)["model"][k] for k in ("attention_dropout_rate", "activation_dropout_rate")} \
        == {"attention_dropout_rate": 0.1, "activation_dropout_rate": 0.2}
    resumed, _, _ = run_settings.resolve({}, run=run)
    assert (resumed.attention_dropout, resumed.activation_dropout) == (0.1, 0.2)
    with pytest.raises(run_settings.SettingsError, match=r"trained with --activation-dropout 0.2, not 0.3"):
        run_settings.resolve({"activation_dropout": 0.3}, run=run)

    old = run_settings.layered({"preset": "medium"}).to_config()
    old["model"] = {"dropout_rate": 0.2, "attention_init": "mimetic"}
    run_dir.write_config(tmp_path / "old", old)
    resumed, _, _ = run_settings.resolve({}, run=tmp_path / "old")
    assert (resumed.attention_dropout, resumed.activation_dropout) == (0.0, 0.0)
    with pytest.raises(run_settings.SettingsError, match=r"trained with --attention-dropout 0.0, not 0.1"):
        run_settings.resolve({"attention_dropout": 0.1}, run=tmp_path / "old")


def test_the_norm_order_is_pinned_and_a_run_of_an_earlier_version_was_post_ln(tmp_path):
    """--norm-first reaches config.json's model section; a resume keeps it, and refuses the other order naming
    both flags. A start saved before norm_first was a setting (a model section of its dropout and attention_init
    alone) built the presets' post-LN model."""
    settings, run, _ = run_settings.resolve({"preset": "tiny", "norm_first": True}, run=tmp_path / "run")
    run_settings.write_run_config(run, settings)
    assert run_dir.read_config(run)["model"]["norm_first"] is True
    resumed, _, _ = run_settings.resolve({}, run=run)
    assert resumed.norm_first is True
    with pytest.raises(run_settings.SettingsError,
                       match=r"trained with --norm-first, not --no-norm-first; .*leave out --no-norm-first"):
        run_settings.resolve({"norm_first": False}, run=run)

    old = run_settings.layered({"preset": "medium"}).to_config()
    old["model"] = {"dropout_rate": 0.2, "attention_init": "mimetic"}
    run_dir.write_config(tmp_path / "old", old)
    assert run_settings.resolve({}, run=tmp_path / "old")[0].norm_first is False
    with pytest.raises(run_settings.SettingsError, match=r"trained with --no-norm-first, not --norm-first"):
        run_settings.resolve({"norm_first": True}, run=tmp_path / "old")


@pytest.mark.slow
def test_a_run_of_two_workers_resumed_on_two_replicas_is_one_line_in_a_real_process(existing_run):
    """The run trained 100 of its 200 steps on 2 workers of 1 replica; this command has 2 replicas, 1 worker."""
    config = run_dir.read_config(existing_run)
    config["train"].update(replicas=2, workers=2)
    run_dir.write_config(existing_run, config)
    tf.train.CheckpointManager(
        tf.train.Checkpoint(model=run_dir.build_model(existing_run)), str(existing_run / run_dir.CHECKPOINT_DIR), 3
    ).save(checkpoint_number=100)
    before = _snapshot(existing_run)
    result = run_command([sys.executable, "train.py", "--run-dir", str(existing_run), "--devices", "CPU:0,CPU:1"])
    _assert_one_line_error(result.returncode, result.stderr, "trained on 2 worker(s) up to step 100", "TF_CONFIG")
    assert _snapshot(existing_run) == before


def test_an_epochs_run_keeps_its_length_on_another_number_of_replicas(tmp_path, multi30k_dir, multi30k_tokenizer):
    """Trained on 2 replicas, its epochs are counted in steps of 2 replicas' batches, also where 1 runs."""
    from types import SimpleNamespace

    from keras_transformer.corpora import load_multi30k

    corpus = SimpleNamespace(train=load_multi30k(multi30k_dir).train[:500])
    settings = run_settings.layered({"preset": "tiny", "epochs": 1, "vocab_size": multi30k_tokenizer.vocab_size})
    on_two = training_run.steps_for_epochs(tmp_path, corpus, multi30k_tokenizer, settings, 2)
    on_one = training_run.steps_for_epochs(tmp_path, corpus, multi30k_tokenizer, settings, 1)
    assert on_one > on_two
    recorded = settings.replace(replicas=2)
    assert training_run.steps_for_epochs(tmp_path, corpus, multi30k_tokenizer, recorded, 1) == on_two


def test_a_part_of_an_epoch_is_one_more_step(tmp_path, multi30k_dir, multi30k_tokenizer):
    """--epochs that end inside a step take that step: epochs worth 2.5 batches (on 1 replica) are 3 steps, not 2."""
    from types import SimpleNamespace

    from keras_transformer import data
    from keras_transformer.corpora import load_multi30k

    corpus = SimpleNamespace(train=load_multi30k(multi30k_dir).train[:500])
    settings = run_settings.layered({"preset": "tiny", "vocab_size": multi30k_tokenizer.vocab_size})
    batches = int(
        data.make_training_dataset(
            corpus.train, multi30k_tokenizer, token_budget=settings.token_budget, max_length=settings.max_length,
            seed=settings.seed,
        ).reduce(0, lambda count, _: count + 1)
    )
    half = batches // 2
    epochs = (half + 0.5) / batches  # half and a half batches
    steps = training_run.steps_for_epochs(tmp_path, corpus, multi30k_tokenizer, settings.replace(epochs=epochs), 1)
    assert steps == half + 1


def test_an_epoch_on_two_workers_is_a_pass_over_each_workers_shard(tmp_path, multi30k_dir, multi30k_tokenizer):
    """Counted as the batches of the whole corpus, it was fewer steps than either shard has batches."""
    from types import SimpleNamespace

    from keras_transformer import data
    from keras_transformer.corpora import load_multi30k

    corpus = SimpleNamespace(train=load_multi30k(multi30k_dir).train[:2000])
    settings = run_settings.layered({"preset": "tiny", "epochs": 1, "vocab_size": multi30k_tokenizer.vocab_size})
    shard_batches = [
        int(
            data.make_training_dataset(
                corpus.train, multi30k_tokenizer, token_budget=settings.token_budget, max_length=settings.max_length,
                seed=settings.seed, input_context=tf.distribute.InputContext(2, worker, 2),
            ).reduce(0, lambda count, _: count + 1)
        )
        for worker in (0, 1)
    ]
    steps = training_run.steps_for_epochs(tmp_path, corpus, multi30k_tokenizer, settings, 2, 2)
    assert min(shard_batches) <= steps <= max(shard_batches), (steps, shard_batches)


@pytest.mark.parametrize("epochs", [1e300, 1e308])
def test_more_epochs_than_a_64_bit_step_counter_holds_are_refused(tmp_path, multi30k_dir, multi30k_tokenizer, epochs):
    """They made a run of 10**302 steps whose saved config.json could never be resumed (or an OverflowError)."""
    from types import SimpleNamespace

    from keras_transformer.corpora import load_multi30k

    corpus = SimpleNamespace(train=load_multi30k(multi30k_dir).train[:200])
    settings = run_settings.layered({"preset": "tiny", "epochs": epochs, "vocab_size": multi30k_tokenizer.vocab_size})
    with pytest.raises(run_settings.SettingsError, match=r"--epochs 1e\+30\d makes .* steps .*64-bit step counter"):
        training_run.steps_for_epochs(tmp_path, corpus, multi30k_tokenizer, settings, 1)


@pytest.mark.slow
def test_a_finished_run_extended_by_epochs_checks_its_replicas(existing_run, multi30k_dir):
    """Finished at step 100 on 2 replicas; --epochs 1 means more steps, and this command has 1 replica."""
    config = run_dir.read_config(existing_run)
    config["train"].update(replicas=2, train_steps=100)
    run_dir.write_config(existing_run, config)
    tf.train.CheckpointManager(
        tf.train.Checkpoint(model=run_dir.build_model(existing_run)), str(existing_run / run_dir.CHECKPOINT_DIR), 3
    ).save(checkpoint_number=100)
    before = _snapshot(existing_run)
    result = run_command([sys.executable, "train.py", "--run-dir", str(existing_run), "--data-dir", str(multi30k_dir),
                          "--epochs", "1"])
    _assert_one_line_error(result.returncode, result.stderr, "trained on 2 replica(s) up to step 100")
    assert _snapshot(existing_run) == before
