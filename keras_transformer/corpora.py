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
  `load_wmt14`, `load_ted_pt_en`.
* Any line-aligned pair of text files: `read_parallel_files`, `load_text_corpus`.

Text files are read as bytes and decoded line by line, so one bad line costs one pair,
never the alignment: a pair whose source or target line is empty or not valid UTF-8 is
skipped, and the number skipped is reported in one warning per file pair. Files with
different line counts raise `CorpusError`. A corpus that cannot be found or downloaded
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
import urllib.error
import urllib.parse
import urllib.request
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import keras
import tensorflow as tf

logger = logging.getLogger(__name__)

Pair = tuple[str, str]

MULTI30K_ENV = "MULTI30K_DIR"
MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"
MULTI30K_SPLITS = {"train": "train", "validation": "val", "test": "test_2016_flickr"}
MULTI30K_LANGUAGES = ("en", "de")

WMT14_TFDS_NAME = "wmt14_translate/de-en"
TED_PT_EN_TFDS_NAME = "ted_hrlr_translate/pt_to_en"

CORPUS_NAMES = ("multi30k", "wmt14", "ted_pt_en")
# The two languages of each corpus, its usual source first.
CORPUS_LANGUAGES = {"multi30k": MULTI30K_LANGUAGES, "wmt14": ("en", "de"), "ted_pt_en": ("pt", "en")}

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
            for source, target in self.train.as_numpy_iterator():
                yield source.decode("utf-8")
                yield target.decode("utf-8")
        else:
            for source, target in self.train:
                yield source
                yield target


def load_corpus(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    source_lang: str | None = None,
    target_lang: str | None = None,
    download: bool = True,
    seed: int | None = None,
) -> ParallelCorpus:
    """Loads one of `CORPUS_NAMES` in the given direction (default: its usual one).

    Args:
        name: "multi30k" (en->de), "wmt14" (en->de) or "ted_pt_en" (pt->en).
        data_dir: Multi30k text directory, or TFDS data directory for the others.
        source_lang: Source language; defaults to the corpus's usual source.
        target_lang: Target language; defaults to the corpus's usual target.
        download: Whether TFDS corpora may be downloaded and prepared. Multi30k, being
            small, is downloaded whenever neither `data_dir` nor `$MULTI30K_DIR` is given
            and no copy is cached; a given directory that lacks files is an error.
        seed: For TFDS corpora, the seed of the order in which the training files are
            read (see `load_wmt14`); `None` lets TFDS choose, and read, in any order.

    Returns:
        The corpus.

    Raises:
        ValueError: For an unknown name or language.
        DatasetUnavailableError: When the corpus cannot be found or downloaded.
        MissingPackageError: When a package that TFDS needs for the corpus is not installed.
    """
    loaders = {
        "multi30k": (load_multi30k, {}),
        "wmt14": (load_wmt14, {"download": download, "seed": seed}),
        "ted_pt_en": (load_ted_pt_en, {"download": download, "seed": seed}),
    }
    source_lang, target_lang = check_direction(name, source_lang, target_lang)
    loader, options = loaders[name]
    return loader(data_dir, source_lang=source_lang, target_lang=target_lang, **options)


def check_direction(
    name: str, source_lang: str | None = None, target_lang: str | None = None
) -> tuple[str, str]:
    """The direction `(source, target)` of corpus `name`, unset languages taken from its usual one.

    Cheap (reads nothing), so that callers can check their settings before loading.

    Raises:
        ValueError: For an unknown corpus, or languages the corpus does not have.
    """
    if name not in CORPUS_LANGUAGES:
        raise ValueError(f"Unknown corpus {name!r}; choose one of {CORPUS_NAMES}.")
    default_source, default_target = CORPUS_LANGUAGES[name]
    direction = (source_lang or default_source, target_lang or default_target)
    _check_direction(name, CORPUS_LANGUAGES[name], *direction)
    return direction


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
    _check_direction("Multi30k", MULTI30K_LANGUAGES, source_lang, target_lang)
    directory = find_multi30k_dir(data_dir, cache_dir=cache_dir)
    splits = {
        split: read_parallel_files(
            directory / f"{stem}.{source_lang}", directory / f"{stem}.{target_lang}"
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
        return _complete_multi30k_dir(Path(data_dir), origin="data_dir")
    if os.environ.get(MULTI30K_ENV):
        return _complete_multi30k_dir(Path(os.environ[MULTI30K_ENV]), origin=MULTI30K_ENV)
    cache = Path(cache_dir or os.environ.get("KERAS_HOME") or Path.home() / ".keras")
    cached = cache / "datasets" / "multi30k"
    if _missing_multi30k_files(cached):
        return _download_multi30k(cache)
    return cached


def _complete_multi30k_dir(directory: Path, origin: str) -> Path:
    """Returns `directory`, or raises DatasetUnavailableError naming its missing files."""
    missing = _missing_multi30k_files(directory)
    if missing:
        raise DatasetUnavailableError(
            f"Multi30k directory {directory} (from {origin}) lacks {', '.join(missing)}. "
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


def load_wmt14(
    data_dir: str | os.PathLike | None = None,
    *,
    source_lang: str = "en",
    target_lang: str = "de",
    download: bool = True,
    seed: int | None = None,
) -> ParallelCorpus:
    """Loads TFDS `wmt14_translate/de-en` (newstest2013 validation, newstest2014 test).

    Args:
        data_dir: TFDS data directory (default: TFDS's, `$TFDS_DATA_DIR` or
            `~/tensorflow_datasets`).
        source_lang: "en" or "de".
        target_lang: The other one.
        download: Whether TFDS may download and prepare the data (several GB).
        seed: Seed of the (per-epoch) order of the training files. With a seed the
            training pairs come in the same order in every process, as resuming and
            multi-worker sharding need; without one TFDS reads the files in any order.

    Returns:
        The corpus; `train` is a `tf.data.Dataset` of string pairs.

    Raises:
        DatasetUnavailableError: When the data is not prepared and cannot be downloaded.
    """
    return _load_tfds(
        WMT14_TFDS_NAME, CORPUS_LANGUAGES["wmt14"], data_dir, source_lang, target_lang, download, seed
    )


def load_ted_pt_en(
    data_dir: str | os.PathLike | None = None,
    *,
    source_lang: str = "pt",
    target_lang: str = "en",
    download: bool = True,
    seed: int | None = None,
) -> ParallelCorpus:
    """Loads TFDS `ted_hrlr_translate/pt_to_en` (about 51k training pairs).

    Args:
        data_dir: TFDS data directory.
        source_lang: "pt" or "en".
        target_lang: The other one.
        download: Whether TFDS may download and prepare the data.
        seed: As for `load_wmt14`.

    Returns:
        The corpus; `train` is a `tf.data.Dataset` of string pairs.

    Raises:
        DatasetUnavailableError: When the data is not prepared and cannot be downloaded.
    """
    return _load_tfds(
        TED_PT_EN_TFDS_NAME, CORPUS_LANGUAGES["ted_pt_en"], data_dir, source_lang, target_lang, download, seed
    )


def _load_tfds(
    tfds_name: str,
    languages: tuple[str, str],
    data_dir: str | os.PathLike | None,
    source_lang: str,
    target_lang: str,
    download: bool,
    seed: int | None,
) -> ParallelCorpus:
    """Loads a TFDS translation dataset whose examples are `{language: sentence}` dicts."""
    _check_direction(tfds_name, languages, source_lang, target_lang)
    try:
        import tensorflow_datasets as tfds  # Imported here: it takes seconds to import.
    except ImportError as error:
        raise _missing_package(tfds_name, error) from error

    data_dir = None if data_dir is None else os.fspath(data_dir)
    where = data_dir or "the default TFDS data directory"
    try:
        builder = tfds.builder(tfds_name, data_dir=data_dir)
        if download and not builder.is_prepared():
            _check_download_hosts(tfds_name, builder.url_infos)
            # Minutes to hours: say what is going on before TFDS goes quiet.
            logger.info(
                "TFDS dataset %s is not prepared in %s; downloading and preparing it (needs internet access; "
                "WMT14 takes several GB and hours).", tfds_name, where,
            )
            builder.download_and_prepare()
        # Without a seed, TFDS also interleaves the shuffled files non-deterministically.
        train = builder.as_dataset(split="train", shuffle_files=True, read_config=tfds.ReadConfig(shuffle_seed=seed))
        validation, test = builder.as_dataset(split=["validation", "test"], shuffle_files=False)
    except ImportError as error:
        # Some builders import optional packages only when used: not a missing dataset.
        raise _missing_package(tfds_name, error) from error
    except DatasetUnavailableError:
        raise
    except Exception as error:  # TFDS raises many types: not found, network, I/O.
        raise DatasetUnavailableError(
            f"TFDS dataset {tfds_name} is not available in {where} ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). " + _tfds_help(tfds_name)
        ) from None

    def to_pair(example):
        return example[source_lang], example[target_lang]

    return ParallelCorpus(
        name=tfds_name,
        source_lang=source_lang,
        target_lang=target_lang,
        train=train.map(to_pair, num_parallel_calls=tf.data.AUTOTUNE),
        validation=_decode_pairs(validation.map(to_pair)),
        test=_decode_pairs(test.map(to_pair)),
    )


def _tfds_help(tfds_name: str) -> str:
    return (
        f"Prepare it with `tfds build {tfds_name} --data_dir DIR` on a machine with internet access and "
        "pass DIR with --data-dir (or set TFDS_DATA_DIR)."
    )


def _check_download_hosts(tfds_name: str, url_infos: dict | None, timeout: float = 15.0) -> None:
    """Fails at once if a host the dataset downloads from cannot be reached.

    Offline, TFDS retries each download ten times with growing back-off (about 3.5
    minutes) before it fails, and leaves partial downloads behind. One request per host,
    without retries, tells the same in about a second. Any HTTP answer, an error status
    included, counts as reachable: only a failed connection (no DNS, refused, timed out)
    stops the download. Proxies in the environment are used, as TFDS uses them.
    """
    urls_by_host = {}
    for url in url_infos or {}:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme in ("http", "https"):
            urls_by_host.setdefault(parts.netloc, url)
    for host, url in sorted(urls_by_host.items()):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
                pass
        except urllib.error.HTTPError:
            pass  # The server answered.
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise DatasetUnavailableError(
                f"TFDS dataset {tfds_name} is not prepared and downloading it needs {host}, which cannot be "
                f"reached ({reason}). " + _tfds_help(tfds_name)
            ) from None


def _decode_pairs(dataset: tf.data.Dataset) -> list[Pair]:
    return [
        (source.decode("utf-8"), target.decode("utf-8"))
        for source, target in dataset.as_numpy_iterator()
    ]


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

    def read(paths):
        return read_parallel_files(*paths) if paths else []

    return ParallelCorpus(name, source_lang, target_lang, read(train), read(validation), read(test))


def read_parallel_files(
    source_path: str | os.PathLike, target_path: str | os.PathLike
) -> list[Pair]:
    """Reads line-aligned source and target files into `(source, target)` pairs.

    Lines are stripped of surrounding whitespace. A pair is skipped when either line is
    empty or not valid UTF-8; one warning per call reports how many were skipped.

    Args:
        source_path: File with one source sentence per line (any `tf.io.gfile` path).
        target_path: File with the aligned target sentences.

    Returns:
        The kept pairs, in file order.

    Raises:
        CorpusError: When the files have different numbers of lines.
    """
    source_lines = _read_lines(source_path)
    target_lines = _read_lines(target_path)
    if len(source_lines) != len(target_lines):
        raise CorpusError(
            f"Parallel files are not line-aligned: {source_path} has {len(source_lines)} "
            f"lines but {target_path} has {len(target_lines)}."
        )
    pairs = []
    empty = invalid = 0
    for source_line, target_line in zip(source_lines, target_lines):
        try:
            pair = (source_line.decode("utf-8").strip(), target_line.decode("utf-8").strip())
        except UnicodeDecodeError:
            invalid += 1
            continue
        if not (pair[0] and pair[1]):
            empty += 1
            continue
        pairs.append(pair)
    if empty or invalid:
        warnings.warn(
            f"Skipped {empty + invalid} of {len(source_lines)} pairs of {source_path} / "
            f"{target_path}: {empty} with an empty side, {invalid} not valid UTF-8.",
            stacklevel=2,
        )
    return pairs


def _read_lines(path: str | os.PathLike) -> list[bytes]:
    """Splits a file on "\\n" only (dropping a "\\r" before it), keeping it undecoded.

    A UTF-8 byte order mark at the start, which some editors write, is not text: left
    in, it would begin the first sentence, source and reference alike.
    """
    with tf.io.gfile.GFile(os.fspath(path), "rb") as text_file:
        lines = text_file.read().removeprefix(codecs.BOM_UTF8).split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


def _missing_package(tfds_name: str, error: ImportError) -> MissingPackageError:
    """The error for a package that TFDS needs to load `tfds_name` (`error.name` is the module)."""
    module = (error.name or "").split(".")[0]
    if not module:  # "cannot import name ..." from an installed but incompatible package.
        return MissingPackageError(
            f"Loading TFDS dataset {tfds_name} failed on an import ({error}); install or upgrade "
            "the package it names (pip install -U PACKAGE)."
        )
    # Pip normalizes "_" and "-", so the module name installs the package in the usual case.
    package = "tensorflow-datasets" if module == "tensorflow_datasets" else module
    return MissingPackageError(
        f"Loading TFDS dataset {tfds_name} needs the Python package {package!r}, which is not "
        f"installed ({error}); install it with `pip install {package}` and try again.",
        name=error.name,
    )


def _check_direction(
    corpus: str, languages: tuple[str, str], source_lang: str, target_lang: str
) -> None:
    if {source_lang, target_lang} != set(languages):
        raise ValueError(
            f"{corpus} translates between {languages[0]!r} and {languages[1]!r}; got "
            f"source_lang={source_lang!r}, target_lang={target_lang!r}."
        )
