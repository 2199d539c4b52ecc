"""The tiny run exported as a SavedModel, and calls of its signatures: shared by test_export.py and test_serving.py.

Both load it as a plugin (`pytest_plugins = ["export_fixtures"]`), so that its fixtures are
session-scoped; each export is made once per test run (`made_once`). The other names
are imported as usual.

* `sentences`: 16 Multi30k validation sources.
* `exported`, `served`: the tiny run exported (self-checked) and its reloaded signatures.
* `translator`: the in-process translator of the tiny run, which the exports must match.
* `served_beam_2`: an export by `python -m export` with its own beam size, length penalty and early stop.
* `translate`: the outputs of a signature (or translator function) as NumPy arrays.
* `LONG_TEXT`, `BAD_INPUTS`: inputs that a served model must survive.
"""

from pathlib import Path

import pytest
import tensorflow as tf
import tensorflow_text  # noqa: F401

from keras_transformer import saved_model
from keras_transformer.translator import Translator
from made_once import made_once

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "transformer"
# Beside the export's base directory, which holds its versions only.
_EXPORT_LOG = "export_log.txt"

LONG_TEXT = "word " * 2000  # 10000 characters, far more tokens than the input limit
BAD_INPUTS = [
    b"",
    b"   \t ",
    LONG_TEXT.encode(),
    b"A \xff\xfe dog \xc3\x28 runs.",  # invalid UTF-8
    "Ein 🐕 läuft. 你好世界 مرحبا ᚠᚢᚦ".encode(),
]


@pytest.fixture(scope="session")
def sentences(multi30k_dir):
    """16 Multi30k validation sources."""
    from keras_transformer.corpora import load_multi30k

    return [source for source, _ in load_multi30k(multi30k_dir).validation[:16]]


@pytest.fixture(scope="session")
def exported(tiny_translation_run, sentences, tmp_path_factory):
    """`(version directory, log lines)` of the tiny run exported under models/transformer."""

    def export(directory):
        lines = []
        saved_model.export_run(
            tiny_translation_run, directory / MODEL_NAME, check_sentences=sentences[:4], log=lines.append
        )
        (directory / _EXPORT_LOG).write_text("\n".join(lines))

    directory = made_once(tmp_path_factory, "exported", export)
    return directory / MODEL_NAME / "1", (directory / _EXPORT_LOG).read_text().splitlines()


@pytest.fixture(scope="session")
def translator(tiny_translation_run):
    return Translator.from_run_dir(tiny_translation_run)


@pytest.fixture(scope="session")
def served(exported):
    """The reloaded SavedModel's signatures."""
    return tf.saved_model.load(str(exported[0])).signatures


@pytest.fixture(scope="session")
def served_beam_2(tiny_translation_run, tmp_path_factory):
    """`(version directory, module, signatures)` of an export by `python -m export` with beam 2,
    alpha 1.0 and the "current_length" early stop (the repository's `python -m export` calls the same `main`)."""
    from export.__main__ import main

    def export(directory):
        flags = ["--beam-size", "2", "--alpha", "1.0", "--early-stopping", "current_length"]
        assert main(["--run-dir", str(tiny_translation_run), "--out", str(directory / MODEL_NAME), *flags]) == 0

    version_dir = made_once(tmp_path_factory, "served_beam_2", export) / MODEL_NAME / "1"
    module = tf.saved_model.load(str(version_dir))
    return version_dir, module, module.signatures


def translate(signature, texts, **options):
    inputs = {"text": tf.constant(texts, dtype=tf.string)}
    if options:
        inputs.update(
            beam_size=tf.constant(options["beam_size"]),
            alpha=tf.constant(options["alpha"], tf.float32),
            max_length=tf.constant(options["max_length"]),
            min_length=tf.constant(options.get("min_length", -1)),  # -1: the translator's own
        )
    return {name: value.numpy() for name, value in signature(**inputs).items()}
