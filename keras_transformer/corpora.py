"""Parallel corpora as (source sentence, target sentence) pairs.

Every loader returns a `ParallelCorpus`: the language codes plus `train`, `validation` and
`test` splits of `(source, target)` str pairs. Evaluation splits are always Python lists,
so translations can be matched to references in order. The training split is a list too,
except for TFDS corpora (WMT14 has 4.5M pairs), where it stays a streaming
`tf.data.Dataset` of `(source, target)` string tensors that `keras_transformer.data`
consumes directly; `ParallelCorpus.training_sentences()` streams either kind to the
tokenizer trainer.

Sources:

* Multi30k EN-DE (task 1, raw text): `load_multi30k`. The directory is taken from, in
  order: the `data_dir` argument (the CLI's `--data-dir`), the `MULTI30K_DIR` environment
  variable, the Keras cache (`$KERAS_HOME/datasets/multi30k`, default `~/.keras`), and
  finally a download of the gzipped files from the dataset's GitHub repository into
  that cache.
* WMT14 EN-DE (the paper's data) and TED pt->en through TensorFlow Datasets:
  `keras_transformer.tfds_corpora`.
* Any line-aligned pair of text files: `read_parallel_files`, `load_text_corpus`, and
  `load_text_files` for a directory of `{train,val,test}.LANG` files.

`CORPORA` is the registry: one `CorpusEntry` per corpus (its loader, languages, the
vocabulary size and length cap it is trained with, a line of help), from which
`load_corpus` and `train.py --dataset` take everything. A new corpus is one entry there.

Text files are read as bytes and decoded line by line, so one bad line costs one pair,
never the alignment: a pair whose source or target line is empty or not valid UTF-8 is
skipped, and the number skipped is logged in one warning per file pair. A test split
keeps every line (malformed bytes as U+FFFD), so that a run's translations of it stay
line-aligned with its files; an empty source translates to an empty line. Files with
different line counts, or in UTF-16 or UTF-32 (told by their byte order mark, or by NUL
bytes beside their first line break), raise `CorpusError`. A corpus that cannot be found or downloaded
raises `DatasetUnavailableError`, whose message says where to get it and how to pass a
local copy; a Python package that TFDS needs and lacks raises `MissingPackageError` (an
`ImportError`) naming the package to install.
"""

from __future__ import annotations

import codecs
import dataclasses
import gzip
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Iterator, Sequence

import keras
import tensorflow as tf

from keras_transformer.tokenizer import clean_text

logger = logging.getLogger(__name__)

Pair = tuple[str, str]

MULTI30K_ENV = "MULTI30K_DIR"
MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"
MULTI30K_SPLITS = {"train": "train", "validation": "val", "test": "test_2016_flickr"}
MULTI30K_LANGUAGES = ("en", "de")

_MULTI30K_HELP = (
    f"Download train, val and test_2016_flickr .en.gz and .de.gz from {MULTI30K_URL}/, "
    "gunzip them into one directory, and pass it with --data-dir DIR or the "
    f"{MULTI30K_ENV} environment variable."
)


class DatasetUnavailableError(RuntimeError):
    """A corpus is neither available locally nor downloadable."""


class CorpusError(ValueError):
    """Parallel text files that cannot be paired line by line."""


class MissingPackageError(ImportError):
    """A Python package that loading a corpus needs is not installed."""


@dataclasses.dataclass(frozen=True)
class ParallelCorpus:
    """Sentence pairs of one language pair, split for training and evaluation.

    Attributes:
        name: Corpus name, e.g. "multi30k".
        source_lang: Source language code, e.g. "en".
        target_lang: Target language code, e.g. "de".
        train: `(source, target)` pairs; a list, or for TFDS corpora a `tf.data.Dataset`
            of `(source, target)` scalar string tensors.
        validation: `(source, target)` pairs, in corpus order.
        test: `(source, target)` pairs, in corpus order.
    """

    name: str
    source_lang: str
    target_lang: str
    train: Sequence[Pair] | tf.data.Dataset
    validation: list[Pair]
    test: list[Pair]

    def training_sentences(self) -> Iterator[str]:
        """Yields the source and then the target sentence of every training pair.

        This is the input for learning the shared vocabulary.
        """
        if isinstance(self.train, tf.data.Dataset):
            # Cleaned as tokenization cleans them (text files are as they are read): a tab or
            # line break would otherwise take vocabulary ids that no tokenized text uses.
            cleaned = self.train.map(lambda source, target: (clean_text(source), clean_text(target)))
            for source, target in cleaned.as_numpy_iterator():
                yield source.decode("utf-8", errors="replace")
                yield target.decode("utf-8", errors="replace")
        else:
            for source, target in self.train:
                yield source
                yield target


def load_multi30k(
    data_dir: str | os.PathLike | None = None,
    *,
    source_lang: str = "en",
    target_lang: str = "de",
    cache_dir: str | os.PathLike | None = None,
) -> ParallelCorpus:
    """Loads Multi30k task 1 (29000 train, 1014 validation, 1000 test_2016_flickr pairs).

    Args:
        data_dir: Directory holding `train.en`, `train.de`, `val.*`, `test_2016_flickr.*`.
            When None, see `find_multi30k_dir` for where the files are looked for.
        source_lang: "en" or "de".
        target_lang: The other one.
        cache_dir: Keras cache root (default `$KERAS_HOME` or `~/.keras`).

    Returns:
        The corpus, all splits as lists of pairs.

    Raises:
        DatasetUnavailableError: When the files are missing and cannot be downloaded.
    """
    check_languages("Multi30k", MULTI30K_LANGUAGES, source_lang, target_lang)
    directory = find_multi30k_dir(data_dir, cache_dir=cache_dir)
    splits = {
        split: read_parallel_files(
            directory / f"{stem}.{source_lang}", directory / f"{stem}.{target_lang}", keep_every_line=split == "test"
        )
        for split, stem in MULTI30K_SPLITS.items()
    }
    return ParallelCorpus("multi30k", source_lang, target_lang, **splits)


def find_multi30k_dir(
    data_dir: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """Finds (or downloads) the Multi30k text directory.

    Order: `data_dir`, then `$MULTI30K_DIR`, then `<cache_dir>/datasets/multi30k`, then a
    download from `MULTI30K_URL` into that cache directory.

    Args:
        data_dir: Explicit directory (the CLI's `--data-dir`); must hold all files.
        cache_dir: Keras cache root (default `$KERAS_HOME` or `~/.keras`).

    Returns:
        The directory holding all six Multi30k files.

    Raises:
        DatasetUnavailableError: When an explicit directory lacks files, or the download
            fails.
    """
    if data_dir:
        return _complete_multi30k_dir(Path(data_dir))
    if os.environ.get(MULTI30K_ENV):
        return _complete_multi30k_dir(Path(os.environ[MULTI30K_ENV]), origin=MULTI30K_ENV)
    cache = Path(cache_dir or os.environ.get("KERAS_HOME") or Path.home() / ".keras")
    cached = cache / "datasets" / "multi30k"
    if _missing_multi30k_files(cached):
        return _download_multi30k(cache)
    return cached


def _complete_multi30k_dir(directory: Path, origin: str | None = None) -> Path:
    """Returns `directory`, or raises DatasetUnavailableError naming its missing files (and where it came from)."""
    missing = _missing_multi30k_files(directory)
    if missing:
        raise DatasetUnavailableError(
            f"Multi30k directory {directory}{f' (from {origin})' if origin else ''} lacks {', '.join(missing)}. "
            + _MULTI30K_HELP
        )
    return directory


def _multi30k_file_names() -> list[str]:
    return [f"{stem}.{lang}" for stem in MULTI30K_SPLITS.values() for lang in MULTI30K_LANGUAGES]


def _missing_multi30k_files(directory: Path) -> list[str]:
    return [name for name in _multi30k_file_names() if not (directory / name).is_file()]


def _download_multi30k(cache: Path) -> Path:
    """Downloads the missing gzipped files with Keras's cache and decompresses them."""
    directory = cache / "datasets" / "multi30k"
    # Keras silently caches in /tmp/.keras when `cache` does not exist yet.
    directory.mkdir(parents=True, exist_ok=True)
    for name in _missing_multi30k_files(directory):
        url = f"{MULTI30K_URL}/{name}.gz"
        try:
            archive = Path(
                keras.utils.get_file(
                    fname=f"{name}.gz",
                    origin=url,
                    cache_dir=os.fspath(cache),
                    cache_subdir=os.path.join("datasets", "multi30k"),
                )
            )
        except Exception as error:  # Keras raises a bare Exception for URL failures.
            raise DatasetUnavailableError(
                f"Multi30k is not available locally and downloading {url} failed ({error}). "
                + _MULTI30K_HELP
            ) from None
        directory = archive.parent  # Keras falls back to /tmp/.keras if cache is read-only.
        _gunzip(archive, directory / name)
    return directory


def _gunzip(archive: Path, destination: Path) -> None:
    """Decompresses `archive` to `destination` atomically and deletes the archive."""
    partial = destination.with_name(destination.name + ".partial")
    with gzip.open(archive, "rb") as compressed, open(partial, "wb") as plain:
        shutil.copyfileobj(compressed, plain)
    partial.replace(destination)
    archive.unlink()


def load_text_corpus(
    train: tuple[str | os.PathLike, str | os.PathLike],
    validation: tuple[str | os.PathLike, str | os.PathLike] | None = None,
    test: tuple[str | os.PathLike, str | os.PathLike] | None = None,
    *,
    source_lang: str = "src",
    target_lang: str = "tgt",
    name: str = "text",
) -> ParallelCorpus:
    """Loads a corpus from line-aligned `(source file, target file)` path pairs.

    Args:
        train: Paths of the training source and target files.
        validation: Paths of the validation files; no validation pairs when None.
        test: Paths of the test files; no test pairs when None.
        source_lang: Source language code.
        target_lang: Target language code.
        name: Corpus name.

    Returns:
        The corpus, all splits as lists of pairs held in memory.

    Raises:
        CorpusError: When two files of a split have different line counts.
    """

    def read(paths, **options):
        return read_parallel_files(*paths, **options) if paths else []

    # Every test line: the run's translations of it must stay line-aligned with its files.
    test_pairs = read(test, keep_every_line=True)
    return ParallelCorpus(name, source_lang, target_lang, read(train), read(validation), test_pairs)


def read_parallel_files(
    source_path: str | os.PathLike, target_path: str | os.PathLike, *, keep_every_line: bool = False
) -> list[Pair]:
    """Reads line-aligned source and target files into `(source, target)` pairs.

    Lines are stripped of surrounding whitespace. A pair is skipped when either line is
    empty or not valid UTF-8; one warning per call reports how many were skipped, and
    the first of their line numbers.

    Args:
        source_path: File with one source sentence per line (any `tf.io.gfile` path).
        target_path: File with the aligned target sentences.
        keep_every_line: Keep those pairs too, malformed bytes read as U+FFFD (a test
            set, whose translations are scored line by line against its files).

    Returns:
        The kept pairs, in file order.

    Raises:
        CorpusError: When the files have different numbers of lines, or one is UTF-16
            or UTF-32 text.
    """
    source_lines = _read_lines(source_path)
    target_lines = _read_lines(target_path)
    if len(source_lines) != len(target_lines):
        raise CorpusError(
            f"Parallel files are not line-aligned: {source_path} has {len(source_lines)} "
            f"lines but {target_path} has {len(target_lines)}."
        )
    if keep_every_line:
        return [
            (source_line.decode("utf-8", "replace").strip(), target_line.decode("utf-8", "replace").strip())
            for source_line, target_line in zip(source_lines, target_lines)
        ]
    pairs = []
    empty, invalid = [], []  # Line numbers, from 1.
    for number, (source_line, target_line) in enumerate(zip(source_lines, target_lines), start=1):
        try:
            pair = (source_line.decode("utf-8").strip(), target_line.decode("utf-8").strip())
        except UnicodeDecodeError:
            invalid.append(number)
            continue
        if not (pair[0] and pair[1]):
            empty.append(number)
            continue
        pairs.append(pair)
    if empty or invalid:
        # A log line, not a warning: Python prints those on two lines, the second the warning's code.
        logger.warning(
            "Skipped %d of %d pairs of %s / %s: %d with an empty side, %d not valid UTF-8 (first: line %d).",
            len(empty) + len(invalid), len(source_lines), source_path, target_path, len(empty), len(invalid),
            min(empty + invalid),
        )
    return pairs


# Byte order marks of the encodings Windows tools write as "Unicode"; UTF-32's first: it begins with UTF-16's.
_OTHER_ENCODINGS = (
    (codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"),
)


def _read_lines(path: str | os.PathLike) -> list[bytes]:
    """Splits a file on "\\n" only (dropping a "\\r" before it), keeping it undecoded.

    A UTF-8 byte order mark at the start, which some editors write, is not text: left
    in, it would begin the first sentence, source and reference alike. A UTF-16 or
    UTF-32 one raises CorpusError, and so do NUL bytes beside the first line break (such
    text without a mark): read as UTF-8, such a file is not skipped line by line but gives
    NUL-riddled pairs wherever a line happens to decode.
    """
    with tf.io.gfile.GFile(os.fspath(path), "rb") as text_file:
        text = text_file.read()
    for mark, encoding in _OTHER_ENCODINGS:
        if text.startswith(mark):
            raise CorpusError(
                f"{path} is {encoding} text (it starts with a {encoding} byte order mark); corpus files must be "
                f"UTF-8: convert it, e.g. iconv -f {encoding} -t UTF-8 FILE > FILE.utf8."
            )
    # Without a mark (iconv -t UTF-16LE writes none), its line breaks give it away: "\n" is
    # "\n\x00" or "\x00\n" in UTF-16, whatever the script, and a NUL never borders one in a UTF-8 corpus.
    first_break = text.find(b"\n")
    if first_break >= 0 and b"\x00" in text[max(first_break - 1, 0) : first_break + 2]:
        raise CorpusError(
            f"{path} has NUL bytes around its first line break: UTF-16 or UTF-32 text without a byte order "
            "mark; corpus files must be UTF-8: convert it, e.g. iconv -f UTF-16LE -t UTF-8 FILE > FILE.utf8."
        )
    lines = text.removeprefix(codecs.BOM_UTF8).split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


def check_languages(
    corpus: str, languages: tuple[str, str], source_lang: str, target_lang: str
) -> None:
    """Raises a ValueError unless `source_lang` and `target_lang` are the two `languages` of `corpus`."""
    if {source_lang, target_lang} != set(languages):
        raise ValueError(
            f"{corpus} translates between {languages[0]!r} and {languages[1]!r}; got "
            f"source_lang={source_lang!r}, target_lang={target_lang!r}."
        )


def load_text_files(
    data_dir: str | os.PathLike,
    *,
    source_lang: str,
    target_lang: str,
) -> ParallelCorpus:
    """Loads the `files` corpus: `DIR/{train,val,test}.{source_lang,target_lang}` text files.

    The validation and test splits are optional (a split with neither file is empty).

    Raises:
        DatasetUnavailableError: When the training files are missing, or a split has one
            of its two files only (likely a misnamed file, not a split to skip quietly).
        CorpusError: When two files of a split have different line counts.
    """
    directory = Path(data_dir)

    def split(stem):
        paths = (directory / f"{stem}.{source_lang}", directory / f"{stem}.{target_lang}")
        present = [path.is_file() for path in paths]
        if any(present) and not all(present):
            found, missing = paths if present[0] else paths[::-1]
            raise DatasetUnavailableError(f"{directory} has {found.name} but not {missing.name}.")
        return paths if all(present) else None

    if split("train") is None:
        raise DatasetUnavailableError(f"{directory} lacks train.{source_lang} and train.{target_lang}.")
    return load_text_corpus(
        split("train"), split("val"), split("test"), source_lang=source_lang, target_lang=target_lang, name="files"
    )


def _load_tfds_corpus(loader_name):
    """A registry loader calling `tfds_corpora.<loader_name>`, imported when used (TFDS is slow to import)."""

    def load(data_dir, *, source_lang, target_lang, download, seed):
        from keras_transformer import tfds_corpora

        loader = getattr(tfds_corpora, loader_name)
        return loader(data_dir, source_lang=source_lang, target_lang=target_lang, download=download, seed=seed)

    return load


def _load_multi30k(data_dir, *, source_lang, target_lang, download, seed):
    del download, seed  # Multi30k is small: downloaded whenever no copy is found; read in file order.
    return load_multi30k(data_dir, source_lang=source_lang, target_lang=target_lang)


def _load_files(data_dir, *, source_lang, target_lang, download, seed):
    del download, seed
    return load_text_files(data_dir, source_lang=source_lang, target_lang=target_lang)


@dataclasses.dataclass(frozen=True)
class CorpusEntry:
    """A corpus of the registry.

    Attributes:
        name: Its name (`train.py --dataset`).
        summary: One line for `train.py --help`.
        languages: Its two languages, the usual source first; None for the `files`
            corpus, whose languages are its files' suffixes, given by the caller.
        vocab_size: Size of the shared vocabulary learned on it.
        max_length: Longest training sequence in tokens (the training length cap).
        load: `(data_dir, *, source_lang, target_lang, download, seed) -> ParallelCorpus`.
        data_dir: What its `data_dir` (`--data-dir`) is, for help texts.
        needs_data_dir: Whether `data_dir` must be given (it has no default place).
    """

    name: str
    summary: str
    languages: tuple[str, str] | None
    vocab_size: int
    max_length: int
    load: Callable[..., ParallelCorpus]
    data_dir: str
    needs_data_dir: bool = False


CORPORA = {
    entry.name: entry
    for entry in (
        CorpusEntry(
            "multi30k", "EN-DE image captions", MULTI30K_LANGUAGES, 8000, 128, _load_multi30k,
            data_dir=f"its directory (default: ${MULTI30K_ENV}, then ~/.keras/datasets/multi30k, then a download)",
        ),
        # The paper's data, with its ~37000 shared tokens.
        CorpusEntry(
            "wmt14", "EN-DE, TFDS, the paper's", ("en", "de"), 37000, 256, _load_tfds_corpus("load_wmt14"),
            data_dir="a TFDS data directory",
        ),
        CorpusEntry(
            "ted_pt_en", "TFDS", ("pt", "en"), 8000, 256, _load_tfds_corpus("load_ted_pt_en"),
            data_dir="a TFDS data directory",
        ),
        CorpusEntry(
            "files", "DIR/{train,val,test}.LANG text files in --data-dir", None, 8000, 256, _load_files,
            data_dir="the directory of its files (required)", needs_data_dir=True,
        ),
    )
}


# The corpus of a run that names none.
DEFAULT_CORPUS = "multi30k"


def get_corpus_entry(name: str) -> CorpusEntry:
    """The `CORPORA` entry `name`; a ValueError naming the known ones otherwise."""
    try:
        return CORPORA[name]
    except KeyError:
        raise ValueError(f"Unknown corpus {name!r}; choose one of {tuple(CORPORA)}.") from None


def check_direction(
    name: str, source_lang: str | None = None, target_lang: str | None = None
) -> tuple[str, str]:
    """The direction `(source, target)` of corpus `name`, unset languages taken from its usual one.

    Cheap (reads nothing), so that callers can check their settings before loading.

    Raises:
        ValueError: For an unknown corpus, languages the corpus does not have, or (for
            the `files` corpus) a language not given.
    """
    entry = get_corpus_entry(name)
    if entry.languages is None:
        if not (source_lang and target_lang):
            raise ValueError(f"The {name} corpus needs source_lang and target_lang (the file suffixes).")
        return source_lang, target_lang
    default_source, default_target = entry.languages
    direction = (source_lang or default_source, target_lang or default_target)
    check_languages(name, entry.languages, *direction)
    return direction


def load_corpus(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    source_lang: str | None = None,
    target_lang: str | None = None,
    download: bool = True,
    seed: int | None = None,
) -> ParallelCorpus:
    """Loads corpus `name` of `CORPORA` in the given direction (default: its usual one).

    Args:
        name: "multi30k" (en->de), "wmt14" (en->de), "ted_pt_en" (pt->en) or "files".
        data_dir: Multi30k text directory, TFDS data directory for the TFDS corpora, the
            text-file directory for "files" (required there).
        source_lang: Source language; defaults to the corpus's usual source.
        target_lang: Target language; defaults to the corpus's usual target.
        download: Whether TFDS corpora may be downloaded and prepared. Multi30k, being
            small, is downloaded whenever neither `data_dir` nor `$MULTI30K_DIR` is given
            and no copy is cached; a given directory that lacks files is an error.
        seed: For TFDS corpora, the seed of the order in which the training files are
            read (see `tfds_corpora.load_wmt14`); `None` lets TFDS choose, and read, in any order.

    Returns:
        The corpus.

    Raises:
        ValueError: For an unknown name or language, or "files" without `data_dir`.
        DatasetUnavailableError: When the corpus cannot be found or downloaded.
        MissingPackageError: When a package that TFDS needs for the corpus is not installed.
    """
    entry = get_corpus_entry(name)
    source_lang, target_lang = check_direction(name, source_lang, target_lang)
    if entry.needs_data_dir and not data_dir:
        raise ValueError(f"The {name} corpus needs data_dir, the directory of its files.")
    return entry.load(data_dir, source_lang=source_lang, target_lang=target_lang, download=download, seed=seed)
