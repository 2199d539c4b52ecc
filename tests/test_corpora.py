"""Tests of parallel corpus loading (keras_transformer.corpora)."""

import functools
import gzip
import http.server
import re
import socket
import threading
import time

import pytest
import tensorflow as tf

from keras_transformer import corpora
from keras_transformer.corpora import (
    CorpusError,
    DatasetUnavailableError,
    find_multi30k_dir,
    load_corpus,
    load_multi30k,
    load_text_corpus,
    read_parallel_files,
)

_TINY_MULTI30K = {
    "train": (["A dog.", "Two cats."], ["Ein Hund.", "Zwei Katzen."]),
    "val": (["A bird."], ["Ein Vogel."]),
    "test_2016_flickr": (["A horse."], ["Ein Pferd."]),
}


def _write_tiny_multi30k(directory, compress=False):
    """Writes `_TINY_MULTI30K` as Multi30k-named files (gzipped with `.gz` if asked)."""
    directory.mkdir(parents=True, exist_ok=True)
    for stem, (english, german) in _TINY_MULTI30K.items():
        for lang, lines in (("en", english), ("de", german)):
            data = "".join(line + "\n" for line in lines).encode("utf-8")
            if compress:
                (directory / f"{stem}.{lang}.gz").write_bytes(gzip.compress(data))
            else:
                (directory / f"{stem}.{lang}").write_bytes(data)
    return directory


@pytest.fixture
def no_multi30k_env(monkeypatch):
    monkeypatch.delenv(corpora.MULTI30K_ENV, raising=False)


def test_multi30k_splits_match_the_files(multi30k_dir):
    corpus = load_multi30k(multi30k_dir)

    sizes = (len(corpus.train), len(corpus.validation), len(corpus.test))
    assert sizes == (29000, 1014, 1000)
    assert (corpus.source_lang, corpus.target_lang) == ("en", "de")
    english = (multi30k_dir / "test_2016_flickr.en").read_text(encoding="utf-8").splitlines()
    german = (multi30k_dir / "test_2016_flickr.de").read_text(encoding="utf-8").splitlines()
    assert corpus.test == [(en.strip(), de.strip()) for en, de in zip(english, german)]


def test_multi30k_direction_can_be_reversed(multi30k_dir):
    forward = load_multi30k(multi30k_dir)
    backward = load_multi30k(multi30k_dir, source_lang="de", target_lang="en")

    assert backward.validation == [(de, en) for en, de in forward.validation]


def test_training_sentences_alternate_source_and_target(tmp_path):
    corpus = load_multi30k(_write_tiny_multi30k(tmp_path))

    assert list(corpus.training_sentences()) == ["A dog.", "Ein Hund.", "Two cats.", "Zwei Katzen."]


def test_env_variable_is_used_and_explicit_dir_wins(tmp_path, monkeypatch):
    from_env = _write_tiny_multi30k(tmp_path / "env")
    explicit = _write_tiny_multi30k(tmp_path / "explicit")
    monkeypatch.setenv(corpora.MULTI30K_ENV, str(from_env))

    assert find_multi30k_dir() == from_env
    assert find_multi30k_dir(explicit) == explicit


def test_explicit_dir_without_files_names_what_is_missing(tmp_path, no_multi30k_env):
    with pytest.raises(DatasetUnavailableError, match=r"lacks train\.en.*--data-dir"):
        load_multi30k(tmp_path)


def test_a_directory_from_the_environment_is_said_to_come_from_there(tmp_path, monkeypatch):
    monkeypatch.setenv(corpora.MULTI30K_ENV, str(tmp_path))
    with pytest.raises(DatasetUnavailableError, match=rf"^Multi30k directory {tmp_path} \(from MULTI30K_DIR\) lacks"):
        find_multi30k_dir()
    with pytest.raises(DatasetUnavailableError, match=rf"^Multi30k directory {tmp_path} lacks"):
        find_multi30k_dir(tmp_path)  # given by the caller, who knows where from


def test_keras_cache_copy_is_used(tmp_path, no_multi30k_env, monkeypatch):
    _write_tiny_multi30k(tmp_path / "datasets" / "multi30k")
    monkeypatch.setattr(corpora, "MULTI30K_URL", "http://127.0.0.1:9")  # Must not be used.

    corpus = load_multi30k(cache_dir=tmp_path)

    assert corpus.validation == [("A bird.", "Ein Vogel.")]


def test_failed_download_raises_one_clear_error_quickly(tmp_path, no_multi30k_env, monkeypatch):
    monkeypatch.setattr(corpora, "MULTI30K_URL", "http://127.0.0.1:9")  # Nothing listens.
    start = time.monotonic()

    with pytest.raises(DatasetUnavailableError) as raised:
        load_multi30k(cache_dir=tmp_path / "empty_cache")

    assert time.monotonic() - start < 10
    message = str(raised.value)
    assert "--data-dir" in message and "MULTI30K_DIR" in message
    assert "raw.githubusercontent.com/multi30k/dataset" in message
    assert raised.value.__suppress_context__  # No urllib traceback chained.


def test_download_fetches_and_unpacks_into_keras_cache(tmp_path, no_multi30k_env, monkeypatch):
    served = _write_tiny_multi30k(tmp_path / "server", compress=True)
    handler = functools.partial(_QuietHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(corpora, "MULTI30K_URL", f"http://127.0.0.1:{server.server_port}")
    try:
        corpus = load_multi30k(cache_dir=tmp_path / "cache")
    finally:
        server.shutdown()
        server.server_close()

    cached = tmp_path / "cache" / "datasets" / "multi30k"
    assert sorted(path.name for path in cached.iterdir()) == sorted(
        f"{stem}.{lang}" for stem in _TINY_MULTI30K for lang in ("en", "de")
    )
    assert corpus.train == [("A dog.", "Ein Hund."), ("Two cats.", "Zwei Katzen.")]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.mark.parametrize("name", ["wmt14", "ted_pt_en"])
def test_missing_tfds_data_raises_clear_error(name, tmp_path):
    start = time.monotonic()

    with pytest.raises(DatasetUnavailableError, match="--data-dir") as raised:
        load_corpus(name, tmp_path / "no_tfds_data", download=False)

    assert time.monotonic() - start < 30
    assert str(tmp_path / "no_tfds_data") in str(raised.value)


def test_tfds_corpus_maps_examples_to_pairs_in_the_asked_direction(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")

    with tfds.testing.mock_data(num_examples=4):  # Random text, no files, no network.
        forward = load_corpus("wmt14", tmp_path, download=False)
        backward = load_corpus("wmt14", tmp_path, source_lang="de", target_lang="en", download=False)

    assert (forward.source_lang, forward.target_lang) == ("en", "de")
    assert len(forward.validation) == len(forward.test) == 4
    assert all(isinstance(text, str) for pair in forward.validation for text in pair)
    assert backward.validation == [(target, source) for source, target in forward.validation]
    sentences = list(forward.training_sentences())
    assert len(sentences) == 8 and all(isinstance(text, str) for text in sentences)


def test_unknown_corpus_or_direction_is_rejected(multi30k_dir):
    with pytest.raises(ValueError, match="Unknown corpus"):
        load_corpus("europarl")
    with pytest.raises(ValueError, match="translates between"):
        load_multi30k(multi30k_dir, source_lang="en", target_lang="fr")


def test_misaligned_files_name_both_files_and_counts(tmp_path):
    source = tmp_path / "train.src"
    target = tmp_path / "train.tgt"
    source.write_text("one\ntwo\nthree\n", encoding="utf-8")
    target.write_text("eins\nzwei\n", encoding="utf-8")

    with pytest.raises(CorpusError) as raised:
        read_parallel_files(source, target)

    message = str(raised.value)
    assert str(source) in message and str(target) in message
    assert "3 lines" in message and "has 2" in message


def test_empty_and_invalid_lines_skip_their_pair_with_one_warning_line(tmp_path, caplog):
    source = tmp_path / "s.txt"
    target = tmp_path / "t.txt"
    source.write_bytes(b"one\n\nthree\nf\xffour\nfive\n   \nseven")
    target.write_bytes(b"eins\nzwei\ndr\xc3ei\nvier\n\nsechs\r\nsieben\r\n")

    with caplog.at_level("WARNING", logger="keras_transformer.corpora"):
        pairs = read_parallel_files(source, target)

    assert pairs == [("one", "eins"), ("seven", "sieben")]
    assert [record.getMessage() for record in caplog.records] == [
        f"Skipped 5 of 7 pairs of {source} / {target}: 3 with an empty side, 2 not valid UTF-8 (first: line 2)."]


def test_a_test_split_keeps_every_line_so_that_translations_stay_aligned(tmp_path, caplog):
    """An empty or malformed line of test.en / test.de keeps its pair; train drops such pairs."""
    lines = {"en": b"A dog.\n\nA caf\xe9.\nTwo cats.\n", "de": b"Ein Hund.\nLeer.\nEin Caf\xc3\xa9.\n\n"}
    for stem in ("train", "test"):
        for lang, text in lines.items():
            (tmp_path / f"{stem}.{lang}").write_bytes(text)
    with caplog.at_level("WARNING", logger="keras_transformer.corpora"):
        corpus = load_corpus("files", tmp_path, source_lang="en", target_lang="de")
    assert corpus.test == [("A dog.", "Ein Hund."), ("", "Leer."), ("A caf\ufffd.", "Ein Café."), ("Two cats.", "")]
    assert corpus.train == [("A dog.", "Ein Hund.")]
    assert len(caplog.records) == 1 and "train.en" in caplog.records[0].getMessage()


def test_multi30k_keeps_every_test_line_and_skips_a_validation_pair_with_an_empty_side(tmp_path):
    """As the files corpus does: the test translations are scored line by line against test_2016_flickr.
    Each line is stripped, in either split."""
    directory = _write_tiny_multi30k(tmp_path)
    for stem in ("val", "test_2016_flickr"):
        (directory / f"{stem}.en").write_bytes(b"A bird.\n\n A horse.\t\n")
        (directory / f"{stem}.de").write_bytes(b"Ein Vogel.\nLeer.\nEin Pferd.\n")

    corpus = load_multi30k(directory)

    assert corpus.test == [("A bird.", "Ein Vogel."), ("", "Leer."), ("A horse.", "Ein Pferd.")]
    assert corpus.validation == [("A bird.", "Ein Vogel."), ("A horse.", "Ein Pferd.")]


def test_a_byte_order_mark_is_not_part_of_the_first_sentence(tmp_path):
    source, target = tmp_path / "s.txt", tmp_path / "t.txt"
    source.write_bytes("\ufeffHello world.\nBye.\n".encode("utf-8"))
    target.write_bytes("\ufeffHallo Welt.\r\nTschüss.\r\n".encode("utf-8"))
    assert read_parallel_files(source, target) == [("Hello world.", "Hallo Welt."), ("Bye.", "Tschüss.")]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_a_utf16_or_utf32_file_is_an_error_not_nul_riddled_pairs(tmp_path, encoding):
    """Read as UTF-8, some of its lines decode: they became pairs of "\\x00A\\x00 \\x00d\\x00o\\x00g..."."""
    source, target = tmp_path / "s.txt", tmp_path / "t.txt"
    source.write_text("A dog.\nTwo cats.\n", encoding=encoding)  # With its byte order mark.
    target.write_text("Ein Hund.\nZwei Katzen.\n", encoding="utf-8")
    name = encoding.upper()
    with pytest.raises(CorpusError, match=re.escape(f"{source} is {name} text") + f".*iconv -f {name} -t UTF-8"):
        read_parallel_files(source, target, keep_every_line=True)


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le"])
def test_a_utf16_or_utf32_file_without_a_byte_order_mark_is_an_error_too(tmp_path, encoding):
    """`iconv -t UTF-16LE` writes no mark; both sides so converted have equal line counts and gave NUL-riddled pairs."""
    source, target = tmp_path / "s.txt", tmp_path / "t.txt"
    source.write_text("A dog.\nTwo cats.\n", encoding=encoding)
    target.write_text("Ein Hund.\nZwei Katzen.\n", encoding=encoding)
    with pytest.raises(CorpusError, match=re.escape(f"{source} has NUL bytes around its first line break")):
        read_parallel_files(source, target)


def test_a_tfds_corpus_learns_its_vocabulary_from_text_cleaned_as_tokenization_cleans_it():
    """Raw, a tab or line break took a vocabulary id that no tokenized text uses, and invalid UTF-8 raised."""
    from keras_transformer.corpora import ParallelCorpus

    train = tf.data.Dataset.from_tensor_slices(
        ([b"\tA dog\nruns. ", b"A \xff cat."], [b"Ein Hund\trennt.\r", "\u00a0Eine Katze.".encode()])
    )
    corpus = ParallelCorpus("wmt14", "en", "de", train, [], [])
    assert list(corpus.training_sentences()) == ["A dog runs.", "Ein Hund rennt.", "A \ufffd cat.", "Eine Katze."]


def test_clean_files_load_without_warning(tmp_path, caplog):
    paths = {}
    for split, lines in (("train", ("a b", "c d")), ("dev", ("e f",))):
        for side, text in (("src", "\n".join(lines)), ("tgt", "\n".join(lines).upper())):
            paths[split, side] = tmp_path / f"{split}.{side}"
            paths[split, side].write_text(text, encoding="utf-8")

    with caplog.at_level("WARNING", logger="keras_transformer.corpora"):
        corpus = load_text_corpus(
            (paths["train", "src"], paths["train", "tgt"]),
            validation=(paths["dev", "src"], paths["dev", "tgt"]),
            source_lang="xx",
            target_lang="yy",
        )

    assert corpus.train == [("a b", "A B"), ("c d", "C D")]
    assert corpus.validation == [("e f", "E F")]
    assert corpus.test == []
    assert (corpus.source_lang, corpus.target_lang) == ("xx", "yy")
    assert not caplog.records


@pytest.mark.parametrize("name", ["wmt14", "ted_pt_en"])
def test_a_package_tfds_lacks_is_named_not_taken_for_missing_data(name, tmp_path, monkeypatch):
    """Some TFDS builders import optional packages (e.g. importlib_resources) only when loading."""
    tfds = pytest.importorskip("tensorflow_datasets")

    def builder(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'importlib_resources'", name="importlib_resources")

    monkeypatch.setattr(tfds, "builder", builder)
    with pytest.raises(ImportError, match="pip install importlib_resources") as raised:
        load_corpus(name, tmp_path, download=False)

    assert isinstance(raised.value, corpora.MissingPackageError)
    assert raised.value.name == "importlib_resources"
    assert "tfds build" not in str(raised.value)


def test_the_direction_is_checked_without_loading():
    assert corpora.check_direction("ted_pt_en") == ("pt", "en")
    assert corpora.check_direction("multi30k", "de", "en") == ("de", "en")
    with pytest.raises(ValueError, match="translates between 'en' and 'de'"):
        corpora.check_direction("multi30k", "fr")
    assert corpora.check_direction("files", "fr", "en") == ("fr", "en")
    with pytest.raises(ValueError, match="needs source_lang and target_lang"):
        corpora.check_direction("files", "fr")


def test_the_files_corpus_is_a_corpus_of_the_registry(tmp_path):
    """load_corpus("files") reads DIR/{train,val,test}.LANG, as read_parallel_files reads each pair of files."""
    for stem, (english, german) in _TINY_MULTI30K.items():
        stem = "test" if stem.startswith("test") else stem
        (tmp_path / f"{stem}.en").write_text("".join(line + "\n" for line in english))
        (tmp_path / f"{stem}.de").write_text("".join(line + "\n" for line in german))
    corpus = load_corpus("files", tmp_path, source_lang="de", target_lang="en")
    assert (corpus.name, corpus.source_lang, corpus.target_lang) == ("files", "de", "en")
    assert corpus.train == read_parallel_files(tmp_path / "train.de", tmp_path / "train.en")
    assert corpus.validation == [("Ein Vogel.", "A bird.")] and corpus.test == [("Ein Pferd.", "A horse.")]
    (tmp_path / "val.en").unlink()
    with pytest.raises(DatasetUnavailableError, match="has val.de but not val.en"):
        load_corpus("files", tmp_path, source_lang="de", target_lang="en")
    with pytest.raises(ValueError, match="needs data_dir"):
        load_corpus("files", source_lang="de", target_lang="en")


def test_train_py_takes_its_corpora_and_their_defaults_from_the_registry():
    from keras_transformer.cli import train as train_cli
    from keras_transformer.run_settings import layered

    parser = train_cli.build_parser()
    (dataset,) = [action for action in parser._actions if action.dest == "dataset"]
    assert tuple(dataset.choices) == tuple(corpora.CORPORA)
    help_text = " ".join(parser.format_help().split())
    for entry in corpora.CORPORA.values():
        assert f"{entry.name} ({entry.summary})" in help_text
        settings = layered({"dataset": entry.name, "preset": "base"})  # A preset that sets no vocabulary size.
        assert (settings.vocab_size, settings.max_length) == (entry.vocab_size, entry.max_length)


_READ_TFDS_TRAIN = """
import hashlib, sys
from keras_transformer import corpora, tfds_corpora
tfds_corpora.WMT14_TFDS_NAME = "tiny_pairs/en_de"  # A local stand-in, sharded as TFDS shards WMT14.
corpus = corpora.load_corpus("wmt14", sys.argv[1], download=False, seed=5)
epochs = [b"|".join(source for source, _ in corpus.train.as_numpy_iterator()) for _ in range(2)]
in_order = b"|".join(b"s %d" % i for i in range(2000))
print(epochs[0] == in_order, hashlib.sha256(epochs[0]).hexdigest(), hashlib.sha256(epochs[1]).hexdigest(),
      len(epochs[0].split(b"|")))
"""


@pytest.mark.slow
def test_tfds_training_pairs_come_in_the_same_order_in_every_process_and_iteration(tmp_path):
    """Without a shuffle seed, TFDS interleaves its shuffled files in any order: resume and sharding need one order.

    The same one on every iteration too: the chief reads the training split once more (to
    learn the vocabulary) than the other workers and a resumed run before training.
    """
    import subprocess
    import sys

    tfds = pytest.importorskip("tensorflow_datasets")
    sentences = tf.data.Dataset.from_tensor_slices({"en": [f"s {i}" for i in range(2000)], "de": ["x"] * 2000})
    builder = tfds.dataset_builders.TfDataBuilder(
        name="tiny_pairs", config="en_de", version="1.0.0", data_dir=str(tmp_path),
        split_datasets={"train": sentences, "validation": sentences.take(8), "test": sentences.take(8)},
        features=tfds.features.FeaturesDict({"en": tfds.features.Text(), "de": tfds.features.Text()}),
    )
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=4))
    command = [sys.executable, "-c", _READ_TFDS_TRAIN, str(tmp_path)]
    outputs = [subprocess.run(command, capture_output=True, text=True, check=True).stdout for _ in range(2)]
    runs = {tuple(output.split()[-4:]) for output in outputs}
    assert len(runs) == 1, runs
    ((in_order, first_read, second_read, pairs),) = runs
    # Every pair, the files shuffled, the same order on every read (the data pipeline reshuffles each epoch).
    assert pairs == "2000" and in_order == "False" and first_read == second_read


class _UnpreparedBuilder:
    """A TFDS builder whose data is not prepared and whose download fails once started."""

    def __init__(self, urls):
        self.url_infos = dict.fromkeys(urls)
        self.downloads = 0

    def is_prepared(self):
        return False

    def download_and_prepare(self):
        self.downloads += 1
        raise ConnectionError("the download itself failed")


def test_a_tfds_download_is_announced_before_it_starts(tmp_path, monkeypatch, caplog):
    """Preparing WMT14 takes hours: say what is going on before TFDS goes quiet."""
    tfds = pytest.importorskip("tensorflow_datasets")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)  # Answers 404: reachable.
    threading.Thread(target=server.serve_forever, daemon=True).start()
    builder = _UnpreparedBuilder([f"http://127.0.0.1:{server.server_port}/training-parallel.tgz"])
    monkeypatch.setattr(tfds, "builder", lambda name, data_dir=None: builder)
    try:
        with caplog.at_level("INFO", logger="keras_transformer.tfds_corpora"), pytest.raises(
            DatasetUnavailableError, match="the download itself failed"
        ):
            load_corpus("wmt14", tmp_path)
    finally:
        server.shutdown()
        server.server_close()

    assert builder.downloads == 1
    assert f"wmt14_translate/de-en is not prepared in {tmp_path}; downloading" in caplog.text


def test_an_unreachable_tfds_download_host_fails_at_once(tmp_path, monkeypatch, caplog):
    """Offline, TFDS itself retries for about 3.5 minutes and leaves partial downloads behind."""
    tfds = pytest.importorskip("tensorflow_datasets")
    with socket.socket() as unused:  # A port nothing listens on once closed.
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    builder = _UnpreparedBuilder(["ftp://ftp.example/skipped.tgz", f"http://127.0.0.1:{port}/news.tgz"])
    monkeypatch.setattr(tfds, "builder", lambda name, data_dir=None: builder)
    start = time.monotonic()

    with caplog.at_level("INFO", logger="keras_transformer.tfds_corpora"), pytest.raises(
        DatasetUnavailableError, match=f"needs 127.0.0.1:{port}, which cannot be reached"
    ) as raised:
        load_corpus("ted_pt_en", tmp_path)

    assert time.monotonic() - start < 10
    assert builder.downloads == 0 and "downloading" not in caplog.text
    assert "tfds build ted_hrlr_translate/pt_to_en --data_dir DIR" in str(raised.value)
