"""translate.py reads its input as it arrives: answers a typed line at once, keeps order, never reads all."""

import io
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import tensorflow as tf

from keras_transformer import run_dir
from keras_transformer.cli import line_input
from keras_transformer.translator import Translator
from cli_modules import load_translate_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRANSLATE_PY = REPO / "translate.py"
# Loading TensorFlow and the run on 2 busy cores, then one translation.
ANSWER_TIMEOUT_SECONDS = 120


@pytest.fixture(scope="module")
def translator(tiny_translation_run):
    return Translator.from_run_dir(tiny_translation_run)


@pytest.fixture(scope="module")
def sources(multi30k_dir):
    from keras_transformer.corpora import load_multi30k

    return [source for source, _ in load_multi30k(multi30k_dir).validation[:50]]


def _translations(translator, sentences):
    return [text.decode() for text in translator.translate(tf.constant(sentences, tf.string))["translation"].numpy()]


def _lines_of(stream):
    """A queue receiving `stream`'s lines (bytes) from a reader thread, then `None` at its end."""
    lines = queue.Queue()

    def read():
        for line in iter(stream.readline, b""):
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _next_answer(lines, process, stderr_path):
    try:
        line = lines.get(timeout=ANSWER_TIMEOUT_SECONDS)
    except queue.Empty:
        pytest.fail(f"no translation within {ANSWER_TIMEOUT_SECONDS} s of writing a line; stderr:\n"
                    f"{stderr_path.read_text()[-2000:]}")
    assert line is not None, f"exited with {process.poll()}; stderr:\n{stderr_path.read_text()[-2000:]}"
    return line.decode().rstrip("\n")


@pytest.mark.slow
def test_a_line_written_to_stdin_is_translated_before_stdin_closes(tiny_translation_run, translator, sources, tmp_path):
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(TRANSLATE_PY), "--run-dir", str(tiny_translation_run)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=REPO,
        )
    try:
        answers = _lines_of(process.stdout)
        received = []
        for sentence in sources[:2]:
            process.stdin.write(sentence.encode() + b"\n")
            process.stdin.flush()
            received.append(_next_answer(answers, process, stderr_path))
        process.stdin.close()
        assert process.wait(timeout=ANSWER_TIMEOUT_SECONDS) == 0, stderr_path.read_text()[-2000:]
        assert answers.get(timeout=10) is None  # Nothing printed after the answers.
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    # Each was translated alone, as the one line that had arrived.
    assert received == [_translations(translator, [sentence])[0] for sentence in sources[:2]]


def test_input_and_output_files_keep_the_lines_and_their_order(tiny_translation_run, translator, sources, tmp_path,
                                                               capsys):
    lines = [("" if index % 7 == 3 else sentence) for index, sentence in enumerate(sources)]
    input_path, output_path = tmp_path / "input.en", tmp_path / "output.de"
    input_path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")

    exit_code = load_translate_cli().main(
        ["--run-dir", str(tiny_translation_run), "--input", str(input_path), "--output", str(output_path)]
    )

    assert exit_code == 0 and capsys.readouterr().out == ""
    written = output_path.read_text(encoding="utf-8").split("\n")
    assert written.pop() == ""  # The last line ends with "\n" too.
    assert written == _translations(translator, lines)
    assert [index for index, line in enumerate(written) if not line] == [i for i in range(50) if i % 7 == 3]


def test_translating_into_a_file_reports_progress_on_stderr(tiny_translation_run, sources, tmp_path, capsys,
                                                            monkeypatch):
    cli = load_translate_cli()
    monkeypatch.setattr(cli, "PROGRESS_SECONDS", 0.0)  # A line after every batch.
    input_path, output_path = tmp_path / "input.en", tmp_path / "output.de"
    input_path.write_text("".join(sentence + "\n" for sentence in sources[:5]), encoding="utf-8")
    run = ["--run-dir", str(tiny_translation_run), "--batch-size", "2", "--input", str(input_path)]

    assert cli.main([*run, "--output", str(output_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and len(output_path.read_text(encoding="utf-8").splitlines()) == 5
    reports = [line for line in captured.err.splitlines() if line.startswith(f"{cli.PROG}: ")]
    checkpoint = run_dir.checkpoint_path(tiny_translation_run)
    assert reports[0] == f"{cli.PROG}: translating with {checkpoint} (best)" and checkpoint.startswith(
        str(tiny_translation_run))
    rate = r"\(\d+\.\d sentences/s\)"
    counts = [re.fullmatch(rf"{cli.PROG}: (\d+) sentences translated {rate}", line) for line in reports[1:-1]]
    assert [found and found.group(1) for found in counts] == ["2", "4", "5"], captured.err[-2000:]
    end = rf"{cli.PROG}: translated 5 sentences in \d+\.\d s {rate} into {re.escape(str(output_path))}"
    assert re.fullmatch(end, reports[-1])

    # Into stdout redirected to a file (as capsys's is), the same lines.
    assert cli.main(run) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 5
    assert re.fullmatch(rf"{cli.PROG}: translated 5 sentences in \d+\.\d s {rate} into stdout",
                        captured.err.splitlines()[-1]), captured.err[-2000:]

    # Into a terminal, the translations themselves show the progress.
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    assert cli.main(run) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 5
    assert [line for line in captured.err.splitlines() if line.startswith(f"{cli.PROG}: ")] == reports[:1]


def test_sentences_typed_at_a_terminal_are_told_how_the_input_ends(tiny_translation_run, capsys, monkeypatch):
    cli = load_translate_cli()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"A dog.\n")))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)  # No progress lines.
    for terminal in (False, True):
        monkeypatch.setattr(sys.stdin, "isatty", lambda: terminal)
        sys.stdin.buffer.seek(0)
        assert cli.main(["--run-dir", str(tiny_translation_run)]) == 0
        captured = capsys.readouterr()
        assert len(captured.out.splitlines()) == 1
        told = [line for line in captured.err.splitlines() if line.startswith(f"{cli.PROG}: ")][1:]
        assert told == ([f"{cli.PROG}: translating the lines typed here; Ctrl-D ends."] if terminal else []), told


def test_lines_that_are_not_utf8_are_told_on_stderr(tiny_translation_run, translator, tmp_path, capsys):
    """A Latin-1 file translates (its malformed bytes as U+FFFD), and stderr says which line to convert first."""
    cli = load_translate_cli()
    lines = ["A man in a caf\xe9.", "A dog runs.", "Z\xfcrich at night.", "Two men."]
    input_path = tmp_path / "latin1.en"
    input_path.write_bytes("".join(line + "\n" for line in lines).encode("latin-1"))

    assert cli.main(["--run-dir", str(tiny_translation_run), "--input", str(input_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == _translations(translator, [line.encode("latin-1") for line in lines])
    told = [line for line in captured.err.splitlines() if "UTF-8" in line]
    assert told == [
        f"{cli.PROG}: line 1 is not UTF-8: its malformed bytes translate as U+FFFD "
        "(a Latin-1 file? `iconv -f LATIN1 -t UTF-8` converts it).",
        f"{cli.PROG}: 2 of the 4 lines were not UTF-8.",
    ], captured.err[-2000:]

    input_path.write_bytes("".join(line + "\n" for line in lines).encode("utf-8"))
    assert cli.main(["--run-dir", str(tiny_translation_run), "--input", str(input_path)]) == 0
    assert "UTF-8" not in capsys.readouterr().err


def test_the_first_sentence_that_is_not_utf8_is_told_as_it_arrives():
    told = []
    batches = line_input.reporting_invalid_utf8(
        iter([[b"ok", b"ok"], [b"ok", b"caf\xe9"], [b"\xff"]]), "sentence", told.append)
    assert next(batches) == [b"ok", b"ok"] and told == []
    assert next(batches) == [b"ok", b"caf\xe9"] and len(told) == 1 and told[0].startswith("sentence 4 is not UTF-8")
    assert list(batches) == [[b"\xff"]] and told[1:] == ["2 of the 5 sentences were not UTF-8."]


def test_a_batch_holds_the_lines_that_have_arrived():
    """A pipe's lines are batched as they come: no waiting for --batch-size lines or for the end."""
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as reader, os.fdopen(write_end, "wb", buffering=0) as writer:
        lines = line_input.LineReader(reader)
        batches = line_input.arriving_batches(lines, 32)
        writer.write(b"\xef\xbb\xbfA dog.\r\nTwo\rcats.\n")
        assert next(batches) == [b"A dog.", b"Two\rcats."]
        writer.write(b"\n")
        assert next(batches) == [b""]
        writer.write(b"A cat")
        assert not lines.line_ready()  # Not a line before its "\n", or the end.
        writer.write(b" sleeps.\nbad \xff")
        assert next(batches) == [b"A cat sleeps."]
        writer.close()
        assert list(batches) == [[b"bad \xff"]]


def test_only_the_first_lines_byte_order_mark_is_dropped():
    """An editor's mark starts a file, not a line: a later line's U+FEFF is passed on as the line holds it
    (stripping it from every line passed every test)."""
    stream = io.BytesIO(b"\xef\xbb\xbfA dog.\r\n\xef\xbb\xbfTwo cats.\n")
    assert list(line_input.LineReader(stream)) == [b"A dog.", b"\xef\xbb\xbfTwo cats."]


def test_batches_of_a_file_are_full():
    stream = io.BytesIO(b"".join(b"line %d\n" % index for index in range(70)))
    batches = list(line_input.arriving_batches(line_input.LineReader(stream), 32))
    assert [len(batch) for batch in batches] == [32, 32, 6]
    assert [line for batch in batches for line in batch] == [b"line %d" % index for index in range(70)]


def test_a_large_input_is_read_a_chunk_at_a_time():
    """The first batch is translated after one read, not after the whole input is in memory."""
    stream = io.BytesIO(b"A dog runs on the grass.\n" * 400_000)  # 10 MB
    first = next(line_input.arriving_batches(line_input.LineReader(stream), 32))
    assert first == [b"A dog runs on the grass."] * 32
    assert stream.tell() <= line_input.READ_CHUNK_BYTES


@pytest.mark.slow
def test_a_reader_that_leaves_early_ends_translate_py_quietly(tiny_translation_run, sources, tmp_path):
    """`translate.py ... | head -1`: the lines after the first have nowhere to go; no traceback."""
    input_path, stderr_path = tmp_path / "input.en", tmp_path / "stderr.txt"
    input_path.write_text("\n".join(sources[:20]) + "\n")
    with open(input_path, "rb") as stdin, open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(TRANSLATE_PY), "--run-dir", str(tiny_translation_run), "--batch-size", "1"],
            stdin=stdin, stdout=subprocess.PIPE, stderr=stderr, cwd=REPO,
        )
    try:
        assert process.stdout.readline().strip()
        process.stdout.close()  # As `head -1` does after its line.
        assert process.wait(timeout=ANSWER_TIMEOUT_SECONDS) == 1
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr = stderr_path.read_text()
    # Nor Python's "Exception ignored ... BrokenPipeError" when it flushes stdout at exit.
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr[-2000:]
