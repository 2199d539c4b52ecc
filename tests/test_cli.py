"""Errors of the translate.py and `python -m export` command lines: one line each, no traceback."""

import io
import os
import subprocess
import sys
import threading

import pytest
import tensorflow as tf

from keras_transformer import run_dir
from keras_transformer.model import Transformer
from cli_modules import load_translate_cli  # noqa: E402


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
    _assert_translate_error(
        exit_code, capsys.readouterr().err, f"{tmp_path / 'nowhere'} is not a run directory: it does not exist."
    )


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


@pytest.mark.parametrize("version_directory", ["1", "holds-a-savedmodel"])
def test_export_refuses_a_version_directory_as_out(run, tmp_path, capsys, version_directory):
    """Else the export lands in models/t/1/1, which TF Serving cannot load."""
    from export.__main__ import main

    out = tmp_path / "models" / "t" / version_directory
    if not version_directory.isdigit():
        out.mkdir(parents=True)
        (out / "saved_model.pb").write_bytes(b"")
    exit_code = main(["--run-dir", str(run), "--out", str(out)])
    assert exit_code == 1
    assert capsys.readouterr().err.strip().endswith(
        f"give the model's directory, which the versions go in (--out {out.parent}, with --version N to choose "
        "the number)."
    )
    written = sorted(p.name for p in (tmp_path / "models").rglob("*"))
    assert written == (["holds-a-savedmodel", "saved_model.pb", "t"] if out.exists() else [])


def test_translate_without_a_vocabulary(run, capsys):
    exit_code = load_translate_cli().main(["--run-dir", str(run), "A dog."])
    _assert_translate_error(exit_code, capsys.readouterr().err, "has no tokenizer.model")


def test_translate_with_a_damaged_vocabulary(run, capsys):
    run_dir.tokenizer_path(run).write_bytes(b"\x0a\x05not a model")
    exit_code = load_translate_cli().main(["--run-dir", str(run), "A dog."])
    _assert_translate_error(exit_code, capsys.readouterr().err, "tokenizer.model is not a readable SentencePiece")


def test_translate_with_a_beam_over_the_translators_limit(run, multi30k_tokenizer, capsys):
    multi30k_tokenizer.save(run_dir.tokenizer_path(run))
    exit_code = load_translate_cli().main(["--run-dir", str(run), "--beam-size", "17", "A dog."])
    _assert_translate_error(exit_code, capsys.readouterr().err, "beam_size must be between 1 and 16, got 17")


def test_translate_with_an_unknown_early_stop_is_a_usage_error_that_lists_the_choices(capsys):
    with pytest.raises(SystemExit) as raised:
        load_translate_cli().parse_args(["--run-dir", "r", "--early-stopping", "never", "A dog."])
    error = capsys.readouterr().err
    assert raised.value.code == 2 and "argument --early-stopping: invalid choice: 'never'" in error
    assert "exact" in error and "current_length" in error


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--xla-max-batch", "8"], "--xla-max-batch needs --jit-compile."),
        (["--jit-compile", "--xla-max-batch", "0"], "--xla-max-batch must be at least 1."),
    ],
)
def test_translate_takes_xla_max_batch_with_jit_compile_only(capsys, flags, message):
    with pytest.raises(SystemExit) as raised:
        load_translate_cli().parse_args(["--run-dir", "r", *flags, "A dog."])
    assert raised.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, expected", [([], None), (["--xla-max-batch", "32"], 32)])
def test_translate_searches_batches_up_to_xla_max_batch_with_xla(run, multi30k_tokenizer, capsys, flags, expected):
    from keras_transformer.translator import DEFAULT_XLA_MAX_BATCH

    multi30k_tokenizer.save(run_dir.tokenizer_path(run))
    cli = load_translate_cli()
    translator = cli.run_translator(cli.parse_args(["--run-dir", str(run), "--jit-compile", *flags, "A dog."]))
    assert translator.jit_compile
    assert translator.xla_max_batch == (DEFAULT_XLA_MAX_BATCH if expected is None else expected)
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    assert f"searched at once (default {DEFAULT_XLA_MAX_BATCH})" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("flags", [[], ["--jit-compile"]])
def test_translate_says_that_xla_compiles_before_it_answers(run, multi30k_tokenizer, tmp_path, capsys, flags):
    multi30k_tokenizer.save(run_dir.tokenizer_path(run))
    empty = tmp_path / "empty.en"
    empty.write_text("")
    (tmp_path / "out").write_text("old translations\n")
    cli = load_translate_cli()
    assert cli.main(["--run-dir", str(run), *flags, "--input", str(empty), "--output", str(tmp_path / "out")]) == 0
    assert ("XLA compiles the search" in capsys.readouterr().err) == bool(flags)
    # No input translates to no lines: --output is emptied at the end (keeping it passed every test).
    assert (tmp_path / "out").read_text() == ""


@pytest.mark.slow
def test_translate_says_that_an_xla_exports_serving_signature_compiles_first(
    run, multi30k_tokenizer, tmp_path, capsys, caplog
):
    """Read from the export, as a SavedModel loads without the flags it was made with.

    And no word of the custom gradients the export leaves out on purpose, which each load warned of.
    """
    from keras_transformer.saved_model import save_translator
    from keras_transformer.translator import Translator

    multi30k_tokenizer.save(run_dir.tokenizer_path(run))
    empty = tmp_path / "empty.en"
    empty.write_text("")
    cli = load_translate_cli()
    for jit_compile in (False, True):
        export = tmp_path / f"export-{jit_compile}"
        save_translator(Translator.from_run_dir(run, jit_compile=jit_compile), export)
        for flags, notice in (([], jit_compile), (["--n-best"], False)):  # --n-best: the options signature.
            command = ["--saved-model", str(export), *flags, "--input", str(empty), "--output", str(tmp_path / "out")]
            assert cli.main(command) == 0
            assert ("XLA compiles the search" in capsys.readouterr().err) == notice, (jit_compile, flags)
    assert "custom gradients" not in caplog.text


def test_translate_with_a_run_traces_a_signature_when_it_first_calls_it(run, multi30k_tokenizer):
    """Loading traces nothing: a one-sentence translation would pay for both searches' graphs."""
    from keras_transformer.signatures import SIGNATURES

    multi30k_tokenizer.save(run_dir.tokenizer_path(run))
    cli = load_translate_cli()
    _, signatures = cli.load_translator(cli.parse_args(["--run-dir", str(run), "A dog."]))
    assert sorted(signatures) == sorted(SIGNATURES)
    assert [signatures[name].experimental_get_tracing_count() for name in SIGNATURES] == [0, 0]


def test_translate_refuses_an_early_stop_for_a_saved_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_translate_cli().parse_args(["--saved-model", "m", "--early-stopping", "exact", "A dog."])
    assert exit_info.value.code == 2
    assert "--early-stopping goes with --run-dir" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--beam-size", "0"], "--beam-size must be at least 1."),
        (["--alpha", "-0.5"], "--alpha must be 0 or more."),
        (["--alpha", "nan"], "--alpha must be a finite number, got nan."),
        (["--alpha", "inf"], "--alpha must be a finite number, got inf."),
        (["--max-length", "0"], "--max-length must be at least 1."),
        # int32 in the model: 2**32 + 1 would be read as 1, 2**31 as -2**31 ("unset").
        (["--max-length", "4294967297"], "--max-length must be at most 2,147,483,647, got 4,294,967,297."),
        (["--min-length", "2147483648"], "--min-length must be at most 2,147,483,647, got 2,147,483,648."),
        (["--beam-size", "4294967298", "--n-best"], "--beam-size must be at most"),
        (["--alpha", "1e6"], "--alpha must be at most 10, got 1e+06."),
    ],
)
def test_translate_options_out_of_range_are_usage_errors(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as raised:
        load_translate_cli().main(["--saved-model", str(tmp_path), *flags, "A dog."])
    assert raised.value.code == 2 and message in capsys.readouterr().err


def _sentences(cli, args):
    """The sentences translate.py would translate, as UTF-8 bytes."""
    return [sentence for batch in cli.input_batches(args, cli.open_input(args)) for sentence in batch]


def test_translate_passes_command_line_bytes_that_are_not_utf8_on_as_they_are():
    cli = load_translate_cli()
    sentence = os.fsdecode(b"caf\xe9 ok")  # how Python hands such an argument to sys.argv
    args = cli.parse_args(["--saved-model", "m", sentence])
    assert _sentences(cli, args) == [b"caf\xe9 ok"]


def test_translate_reads_input_lines_as_the_corpus_reader_does(tmp_path):
    """CRLF line ends and a byte order mark are not text; a stray "\\r" inside a line does not split it."""
    cli = load_translate_cli()
    path = tmp_path / "input.en"
    path.write_bytes(b"\xef\xbb\xbfA dog.\r\nTwo\rcats.\r\n\r\nbad \xff\n")
    args = cli.parse_args(["--saved-model", "m", "--input", str(path)])

    assert _sentences(cli, args) == [b"A dog.", b"Two\rcats.", b"", b"bad \xff"]


def test_translate_rejects_a_checkpoint_with_a_saved_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as raised:
        load_translate_cli().main(["--saved-model", str(tmp_path), "--checkpoint", "latest", "A dog."])
    assert raised.value.code == 2 and "--checkpoint goes with --run-dir" in capsys.readouterr().err


def test_translate_with_a_saved_model_directory_that_holds_none(tmp_path, capsys):
    cli = load_translate_cli()
    empty = tmp_path / "empty"
    empty.mkdir()
    exit_code = cli.main(["--saved-model", str(empty), "A dog."])
    _assert_translate_error(exit_code, capsys.readouterr().err, "holds neither a saved_model.pb nor numbered")

    (tmp_path / "models" / "3").mkdir(parents=True)  # a version directory being copied, say
    exit_code = cli.main(["--saved-model", str(tmp_path / "models"), "A dog."])
    _assert_translate_error(exit_code, capsys.readouterr().err, "the highest version in")


def test_translate_leaves_its_output_file_as_it_was_when_the_model_does_not_load(tmp_path, capsys):
    output = tmp_path / "translations.de"
    output.write_text("earlier translations\n")
    flags = ["--saved-model", str(tmp_path / "nowhere"), "--output", str(output)]
    exit_code = load_translate_cli().main([*flags, "A dog."])
    _assert_translate_error(exit_code, capsys.readouterr().err, "holds neither a saved_model.pb")
    assert output.read_text() == "earlier translations\n"


def test_translate_refuses_to_write_its_output_over_the_file_on_stdin(tmp_path, capsys, monkeypatch):
    cli = load_translate_cli()
    monkeypatch.setattr(cli, "load_translator", lambda args: pytest.fail("loaded the model first"))
    path = tmp_path / "sentences.en"
    path.write_text("A dog.\n")
    with open(path, "rb") as stdin:  # translate.py --output sentences.en < sentences.en
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(stdin))
        exit_code = cli.main(["--saved-model", "m", "--output", str(path)])
    message = f"cannot write --output {path}: it is the file on stdin"
    _assert_translate_error(exit_code, capsys.readouterr().err, message)
    assert path.read_text() == "A dog.\n"


def test_translate_with_a_damaged_saved_model(tmp_path, capsys):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "saved_model.pb").write_bytes(b"not a protobuf")
    exit_code = load_translate_cli().main(["--saved-model", str(tmp_path), "A dog."])
    _assert_translate_error(exit_code, capsys.readouterr().err, f"cannot load the SavedModel in {tmp_path / '1'}: ")


def test_ctrl_c_ends_translate_in_one_line_and_keeps_what_it_wrote(tmp_path, capsys, monkeypatch):
    cli = load_translate_cli()
    outputs = iter([{"translation": tf.constant([b"Ein Hund."])}, KeyboardInterrupt()])

    def translate(text):
        output = next(outputs)
        if isinstance(output, BaseException):
            raise output
        return output

    monkeypatch.setattr(cli, "load_translator", lambda args: (None, None))
    monkeypatch.setattr(cli, "translate_fn", lambda signatures, args: translate)
    output = tmp_path / "translations.de"
    exit_code = cli.main(["--run-dir", "r", "--batch-size", "1", "--output", str(output), "A dog.", "A cat."])
    assert exit_code == 130
    assert capsys.readouterr().err.splitlines()[-1] == "translate.py: interrupted"
    assert output.read_text() == "Ein Hund.\n"


def _fake_translator(cli, monkeypatch):
    """`translate.py` with a model that translates "A dog." and "A cat." (no TensorFlow model loaded)."""
    german = {b"A dog.": b"Ein Hund.", b"A cat.": b"Eine Katze."}
    monkeypatch.setattr(cli, "load_translator", lambda args: (None, None))
    monkeypatch.setattr(
        cli,
        "translate_fn",
        lambda signatures, args: lambda text: {"translation": tf.constant([german[t] for t in text.numpy()])},
    )


def test_translate_refuses_an_attention_path_it_cannot_write_before_loading_the_model(tmp_path, capsys, monkeypatch):
    cli = load_translate_cli()
    monkeypatch.setattr(cli, "load_translator", lambda args: pytest.fail("the model was loaded"))
    path = tmp_path / "missing" / "dog.png"
    exit_code = cli.main(["--run-dir", "r", "--attention", str(path), "A dog."])
    message = f"cannot write --attention {path}: {path.parent} is not a writable directory."
    _assert_translate_error(exit_code, capsys.readouterr().err, message)


def test_translate_writes_to_an_output_that_is_a_pipe(tmp_path, capsys, monkeypatch):
    """`--output >(gzip > f)` and the like: a pipe has nothing to empty (truncating it failed, and
    nothing was written)."""
    cli = load_translate_cli()
    _fake_translator(cli, monkeypatch)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    exit_code = cli.main(["--run-dir", "r", "--batch-size", "1", "--output", str(fifo), "A dog.", "A cat."])
    reader.join(timeout=60)
    assert exit_code == 0, capsys.readouterr().err
    assert received == ["Ein Hund.\nEine Katze.\n"]


def test_translate_writes_to_an_output_that_is_a_device(capsys, monkeypatch):
    cli = load_translate_cli()
    _fake_translator(cli, monkeypatch)
    assert cli.main(["--run-dir", "r", "--output", os.devnull, "A dog."]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--version", "-1"], "export failed: TF Serving loads versions numbered 0 or more, not -1."),
        (["--max-extra-length", "-100"], "export failed: max_extra_length must be 0 or more, got -100."),
    ],
)
def test_export_refuses_what_would_publish_a_model_that_cannot_serve(
    run, multi30k_tokenizer, tmp_path, capsys, flags, message
):
    from export.__main__ import main

    multi30k_tokenizer.save(run_dir.tokenizer_path(run))
    exit_code = main(["--run-dir", str(run), "--out", str(tmp_path / "models" / "t"), *flags])
    assert exit_code == 1 and capsys.readouterr().err.strip() == message
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--check-file", "val.en", "--check-lines", "-1"], "--check-lines must be 0 or more."),
        (["--check-lines", "5"], "--check-lines goes with --check-file."),
        (["--beam-size", "0"], "--beam-size must be at least 1."),
    ],
)
def test_export_flags_out_of_range_are_usage_errors(capsys, flags, message):
    from keras_transformer.cli import export

    with pytest.raises(SystemExit) as raised:
        export.parse_args(["--run-dir", "r", "--out", "o", *flags])
    assert raised.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("format_flags", [[], ["--format", "ctranslate2"]])
def test_export_paths_that_cannot_serve_are_usage_errors_naming_the_flag(tmp_path, capsys, format_flags):
    """Found before the model loads: an --out that is a file, an unreadable --check-file."""
    from keras_transformer.cli import export

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for flags, message in [
        (["--out", str(a_file)], f"--out {a_file} is a file: give the directory to export to."),
        (
            ["--out", str(tmp_path / "o"), "--check-file", str(tmp_path / "missing.en")],
            f"cannot read --check-file {tmp_path / 'missing.en'}: No such file or directory.",
        ),
    ]:
        with pytest.raises(SystemExit) as raised:
            export.parse_args(["--run-dir", "r", *format_flags, *flags])
        assert raised.value.code == 2 and message in capsys.readouterr().err


def test_export_checks_the_sentences_translate_py_would_read(tmp_path):
    """--check-file lines end at "\\n" only, as translate.py's: a stray "\\r" splits no sentence; CRLF and a BOM are
    not text."""
    from keras_transformer.cli import export

    path = tmp_path / "check.en"
    path.write_bytes(b"\xef\xbb\xbfA man\rrides.\r\nTwo dogs.\nA cat \xff.\nNot read.\n")
    assert export.read_check_sentences(path, 3) == ["A man\rrides.", "Two dogs.", "A cat \ufffd."]


def test_export_without_a_vocabulary(run, tmp_path, capsys):
    from export.__main__ import main

    exit_code = main(["--run-dir", str(run), "--out", str(tmp_path / "models" / "t")])
    assert exit_code == 1 and "has no tokenizer.model" in capsys.readouterr().err


def test_config_json_is_as_readable_as_the_runs_other_files(run):
    other = run / "other"
    other.write_text("")
    assert (run / run_dir.CONFIG_FILE).stat().st_mode == other.stat().st_mode


def test_a_run_file_that_cannot_be_written_whole_keeps_the_old_one(tmp_path):
    """Written on a full disk (a file size limit here), RUN/translations keeps its old lines, not half the new."""
    path = tmp_path / "translations" / "test.de"
    path.parent.mkdir()
    path.write_text("old\n")
    script = (
        "import resource, signal, sys\n"
        "from keras_transformer import evaluation\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))\n"
        "try:\n"
        "    evaluation.write_lines(sys.argv[1], ['Ein Hund rennt.'] * 5_000)\n"
        "except OSError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == f"Cannot write {path} (File too large).", result.stderr[-2000:]
    assert path.read_text() == "old\n" and [p.name for p in path.parent.iterdir()] == ["test.de"]


def test_translate_refuses_to_write_its_output_over_its_input(tmp_path, capsys, monkeypatch):
    cli = load_translate_cli()
    monkeypatch.setattr(cli, "load_translator", lambda args: pytest.fail("loaded the model first"))
    path = tmp_path / "sentences.en"
    path.write_text("A dog.\n")
    exit_code = cli.main(["--saved-model", "m", "--input", str(path), "--output", str(path)])
    _assert_translate_error(exit_code, capsys.readouterr().err, f"cannot write --output {path}: it is the --input file")
    assert path.read_text() == "A dog.\n"


def test_translate_reports_an_output_it_cannot_write_before_loading_the_model(tmp_path, capsys, monkeypatch):
    cli = load_translate_cli()
    monkeypatch.setattr(cli, "load_translator", lambda args: pytest.fail("loaded the model first"))
    missing = tmp_path / "missing" / "out.de"
    exit_code = cli.main(["--saved-model", "m", "--output", str(missing), "A dog."])
    _assert_translate_error(exit_code, capsys.readouterr().err, f"cannot write --output {missing}: No such file")


def test_translate_loads_the_model_before_it_waits_for_input(tmp_path, capsys, monkeypatch):
    cli = load_translate_cli()
    monkeypatch.setattr(cli, "input_batches", lambda *args: pytest.fail("read the input first"))
    exit_code = cli.main(["--saved-model", str(tmp_path / "nowhere")])
    _assert_translate_error(exit_code, capsys.readouterr().err, "holds neither a saved_model.pb")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--input", "sentences.en", "A dog."], "give sentences as arguments or --input, not both"),
        (["--scores", "--n-best", "A dog."], "argument --n-best: not allowed with argument --scores"),
    ],
)
def test_translate_refuses_flags_that_would_be_ignored(capsys, flags, message):
    with pytest.raises(SystemExit) as raised:
        load_translate_cli().parse_args(["--saved-model", "m", *flags])
    assert raised.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--saved-model", "m", "A dog."], "a SavedModel does not return its attention"),
        (["--run-dir", "r", "A dog.", "A cat."], "it draws one translation"),
        (["--run-dir", "r"], "it draws one translation"),
        (["--run-dir", "r", "--input", "sentences.en"], "it draws one translation"),
    ],
)
def test_translate_draws_attention_for_one_sentence_argument_of_a_run(capsys, flags, why):
    with pytest.raises(SystemExit) as raised:
        load_translate_cli().parse_args(["--attention", "a.png", *flags])
    assert raised.value.code == 2
    assert f"--attention goes with --run-dir and one sentence given as an argument ({why})." in capsys.readouterr().err


def _fresh(module_name):
    """A fresh copy of a command's module: its name in messages (`PROG`) is read from sys.argv on import."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"fresh_{module_name}", importlib.util.find_spec(module_name).origin)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_installed_commands_read_sys_argv_and_go_by_their_own_names(tmp_path, capsys, monkeypatch):
    """`kt-translate` and `kt-export` call `main()` without arguments."""
    monkeypatch.setattr("sys.argv", ["/venv/bin/kt-translate", "--saved-model", str(tmp_path / "nowhere"), "A dog."])
    exit_code = _fresh("keras_transformer.cli.translate").main()
    assert exit_code == 2 and capsys.readouterr().err.startswith("kt-translate: error: ")

    monkeypatch.setattr("sys.argv", ["/venv/bin/kt-export", "--run-dir", "r", "--out", "o", "--min-length", "-1"])
    with pytest.raises(SystemExit) as raised:
        _fresh("keras_transformer.cli.export").main()
    assert raised.value.code == 2
    assert capsys.readouterr().err.startswith("usage: kt-export ")


def test_export_cuts_sources_at_max_source_length_and_still_takes_the_old_flag(capsys):
    from keras_transformer.cli import export
    from keras_transformer.translator import DEFAULT_MAX_SOURCE_LENGTH

    required = ["--run-dir", "r", "--out", "o"]
    assert export.parse_args(required).max_source_length == DEFAULT_MAX_SOURCE_LENGTH
    assert export.parse_args([*required, "--max-source-length", "32"]).max_source_length == 32
    assert export.parse_args([*required, "--max-input-length", "64"]).max_source_length == 64  # old commands
    with pytest.raises(SystemExit):
        export.parse_args(["--help"])
    usage = capsys.readouterr().out
    assert usage.startswith("usage: python -m export ") and "--max-source-length" in usage
    assert "--max-input-length" not in usage


def test_export_decodes_with_the_runs_settings_and_the_flags_given(run):
    from keras_transformer.cli import export
    from keras_transformer.decoding import DecodingSettings

    config = run_dir.read_config(run)
    config["train"] = {"beam_size": 2, "alpha": 1.0}
    run_dir.write_config(run, config)
    required = ["--run-dir", str(run), "--out", "o"]
    assert export.decoding_settings(export.parse_args(required)) == DecodingSettings(beam_size=2, alpha=1.0)
    flags = ["--alpha", "0.2", "--max-extra-length", "10", "--min-length", "0", "--early-stopping", "current_length"]
    assert export.decoding_settings(export.parse_args([*required, *flags])) == DecodingSettings(
        beam_size=2, alpha=0.2, max_extra_length=10, min_length=0, early_stopping="current_length"
    )


def test_export_passes_each_flag_on_to_the_export(run, tmp_path, monkeypatch):
    """What `python -m export` asks of `saved_model.export_run` is what its flags say; --model-name (the name in
    the warmup requests) could be dropped without any test failing."""
    from keras_transformer import saved_model
    from keras_transformer.cli import export

    check_file = tmp_path / "check.en"
    check_file.write_bytes(b"A dog.\r\nTwo cats.\nA bird.\n")
    calls = []
    monkeypatch.setattr(saved_model, "export_run", lambda *args, **kwargs: calls.append((args, kwargs)))
    flags = ["--version", "3", "--checkpoint", "latest", "--model-name", "nmt", "--max-source-length", "32",
             "--jit-compile", "--xla-max-batch", "8", "--check-file", str(check_file), "--check-lines", "2"]
    assert export.main(["--run-dir", str(run), "--out", str(tmp_path / "models"), *flags]) == 0
    [(args, kwargs)] = calls
    assert args == (str(run), str(tmp_path / "models"))
    assert {name: kwargs[name] for name in kwargs if name != "decoding"} == {
        "version": 3, "which": "latest", "model_name": "nmt", "check_sentences": ["A dog.", "Two cats."],
        "max_source_length": 32, "jit_compile": True, "xla_max_batch": 8,
    }
    assert kwargs["decoding"] == run_dir.decoding_settings(run)


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, usage",
    [
        (["-m", "export", "--help"], "usage: python -m export "),
        (["-m", "export.client", "--help"], "usage: python -m export.client "),
        (["translate.py", "--help"], "usage: translate.py "),
    ],
)
def test_the_repositorys_commands_still_run_from_its_root(command, usage):
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(usage)
