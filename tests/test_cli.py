"""Errors of the translate.py and `python -m export` command lines: one line each, no traceback."""

import importlib.util
from pathlib import Path

import pytest
import tensorflow as tf

from keras_transformer import run_dir
from keras_transformer.model import Transformer

REPO = Path(__file__).resolve().parents[1]


def load_translate_cli():
    spec = importlib.util.spec_from_file_location("translate_cli", REPO / "translate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def run(tmp_path):
    """A run directory with a config.json and a tiny model's checkpoint at step 5 (no vocabulary needed)."""
    model = Transformer.from_preset("tiny", vocab_size=50)
    model.build()
    run = tmp_path / "run"
    tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(run / run_dir.CHECKPOINT_DIR), 3).save(
        checkpoint_number=5
    )
    run_dir.write_config(run, {"model": run_dir.model_config(model)})
    return run


def _assert_translate_error(exit_code, stderr, *fragments):
    assert exit_code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("translate.py: error: "), stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0]


def test_translate_without_a_run_directory(tmp_path, capsys):
    exit_code = load_translate_cli().main(["--run-dir", str(tmp_path / "nowhere"), "A dog."])
    _assert_translate_error(exit_code, capsys.readouterr().err, f"{tmp_path / 'nowhere'} is not a run directory")


def test_translate_reads_its_input_before_loading_the_model(tmp_path, capsys, monkeypatch):
    cli = load_translate_cli()
    monkeypatch.setattr(cli, "load_translator", lambda args: pytest.fail("loaded the model first"))
    exit_code = cli.main(["--run-dir", str(tmp_path / "nowhere"), "--input", str(tmp_path / "missing.txt")])
    _assert_translate_error(
        exit_code, capsys.readouterr().err, f"cannot read --input {tmp_path / 'missing.txt'}: No such file"
    )


def test_translate_with_a_damaged_config(run, capsys):
    (run / run_dir.CONFIG_FILE).write_text('{"model": ')
    exit_code = load_translate_cli().main(["--run-dir", str(run), "A dog."])
    _assert_translate_error(exit_code, capsys.readouterr().err, "is damaged, not valid JSON")


def test_translate_with_a_checkpoint_that_does_not_exist(run, capsys):
    missing = str(run / run_dir.CHECKPOINT_DIR / "ckpt-7")
    exit_code = load_translate_cli().main(["--run-dir", str(run), "--checkpoint", missing, "A dog."])
    _assert_translate_error(exit_code, capsys.readouterr().err, f"Checkpoint {missing} does not exist")


def test_translate_with_a_checkpoint_of_another_architecture(run, capsys):
    config = run_dir.read_config(run)
    config["model"]["num_layers"] = 3
    run_dir.write_config(run, config)
    exit_code = load_translate_cli().main(["--run-dir", str(run), "A dog."])
    _assert_translate_error(exit_code, capsys.readouterr().err, "ckpt-5 does not fit the model")


def test_export_with_a_checkpoint_that_does_not_exist(run, tmp_path, capsys):
    from export.__main__ import main

    missing = str(run / run_dir.CHECKPOINT_DIR / "ckpt-7")
    exit_code = main(["--run-dir", str(run), "--out", str(tmp_path / "models" / "t"), "--checkpoint", missing])
    assert exit_code == 1
    assert capsys.readouterr().err.strip() == (
        f'export failed: Checkpoint {missing} does not exist (no {missing}.index); give "best", "averaged", '
        f'"latest" or a checkpoint prefix such as {run / run_dir.CHECKPOINT_DIR / "ckpt"}-STEP.'
    )
    assert not (tmp_path / "models").exists()
