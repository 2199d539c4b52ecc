"""Corpora from TensorFlow Datasets: WMT14 EN-DE (the paper's data) and TED pt->en.

Each loader returns a `keras_transformer.corpora.ParallelCorpus` whose training split
stays a streaming `tf.data.Dataset` (WMT14 has 4.5M pairs) and whose evaluation splits
are lists. TFDS is imported only when a corpus is loaded (it takes seconds). A dataset
that is neither prepared nor downloadable raises `DatasetUnavailableError` saying how to
prepare it elsewhere; an unreachable download host fails at once rather than after
TFDS's retries; a Python package TFDS lacks raises `MissingPackageError` naming it.
"""

from __future__ import annotations

import logging
import os
import urllib.error
import urllib.parse
import urllib.request

import tensorflow as tf

from keras_transformer import error_text
from keras_transformer.corpora import (
    CORPORA,
    DatasetUnavailableError,
    MissingPackageError,
    Pair,
    ParallelCorpus,
    check_languages,
)

logger = logging.getLogger(__name__)

WMT14_TFDS_NAME = "wmt14_translate/de-en"
TED_PT_EN_TFDS_NAME = "ted_hrlr_translate/pt_to_en"


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
        seed: Seed of the order of the training files. With a seed the training pairs
            come in the same order in every process and every iteration, as resuming
            and multi-worker sharding need; without one TFDS reads the files in any order.

    Returns:
        The corpus; `train` is a `tf.data.Dataset` of string pairs.

    Raises:
        DatasetUnavailableError: When the data is not prepared and cannot be downloaded.
    """
    return _load_tfds(
        WMT14_TFDS_NAME, CORPORA["wmt14"].languages, data_dir, source_lang, target_lang, download, seed
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
        TED_PT_EN_TFDS_NAME, CORPORA["ted_pt_en"].languages, data_dir, source_lang, target_lang, download, seed
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
    check_languages(tfds_name, languages, source_lang, target_lang)
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
        # Without a seed, TFDS also interleaves the shuffled files non-deterministically. With
        # one, every iteration of `train` reads the files in the same order: TFDS would
        # otherwise reshuffle them on each iteration, so the order the training stream got
        # would depend on how often the process had read `train` before (the chief reads it
        # once more, to learn the vocabulary, than the other workers and a resumed run do),
        # so a resumed run would not see the batches of the run it continues (and shards
        # taken by position would overlap and miss pairs). The data pipeline caches the
        # pairs and reshuffles them every epoch itself.
        read_config = tfds.ReadConfig(
            shuffle_seed=seed, shuffle_reshuffle_each_iteration=False if seed is not None else None
        )
        train = builder.as_dataset(split="train", shuffle_files=True, read_config=read_config)
        validation, test = builder.as_dataset(split=["validation", "test"], shuffle_files=False)
    except ImportError as error:
        # Some builders import optional packages only when used: not a missing dataset.
        raise _missing_package(tfds_name, error) from error
    except DatasetUnavailableError:
        raise
    except Exception as error:  # TFDS raises many types: not found, network, I/O.
        raise DatasetUnavailableError(
            f"TFDS dataset {tfds_name} is not available in {where} ({error_text.summary(error)}). "
            + _tfds_help(tfds_name)
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
