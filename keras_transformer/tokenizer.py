"""Shared source+target subword vocabulary, learned with SentencePiece and run in-graph.

Why BPE: the paper (Vaswani et al., 2017, section 5.1) encodes WMT EN-DE with byte-pair
encoding into one vocabulary of about 37000 tokens shared by source and target; sharing it
lets the model tie the embedding matrices. We learn it with SentencePiece's BPE trainer
because SentencePiece works on raw text: whitespace is an ordinary symbol ("▁"), so no
Moses-style pre-tokenizer is needed and detokenization is exact, giving back cased text
with its original spacing and punctuation, which is what sacrebleu wants to score.

Why tensorflow-text: `tensorflow_text.SentencepieceTokenizer` is a TF op that owns the
serialized model as a resource. Tokenization therefore runs inside `tf.data` pipelines and
`tf.function`s and is saved into a SavedModel with no Python left in the graph.

Choices, checked on Multi30k (vocabulary 8000, trained on train.en + train.de):

* Normalization `identity`: tokenize -> detokenize gives back every validation line,
  English and German, unchanged. `nfkc` and `nmt_nfkc` do not: they turn the
  no-break space in "120\\xa0cm" into a plain space. With `identity` the only changes made
  to text are that runs of ASCII spaces collapse to one, that U+2581 ("▁", SentencePiece's
  own space mark) comes back as a space, and `clean_text`'s: line breaks and tabs become
  spaces, and outer whitespace of any kind is stripped.
* `byte_fallback=True`: characters outside the vocabulary (emoji, unseen scripts) become
  their UTF-8 bytes (pieces "<0x00>".."<0xFF>") instead of `UNK_ID`, so detokenization
  stays lossless and the model can still copy such characters; it costs 256 ids. Because
  of it, `character_coverage` can stay below 1.0, so noisy characters of web corpora
  (WMT) do not each take a vocabulary slot.
* Invalid UTF-8 input does not fail: SentencePiece replaces each malformed byte with
  U+FFFD, so strings need no sanitizing before `tokenize`.
* Seeding is safe: tensorflow-text's model resource would vanish when
  `keras.utils.set_random_seed` clears TensorFlow's kernel cache; ours is shared by name
  (see `_SharedSentencepieceModel`), so tokenizers work before and after seeding.
* Reserved ids are fixed (`PAD_ID`, `UNK_ID`, `BOS_ID`, `EOS_ID`); the model and the
  decoders rely on them. `tokenize` adds neither BOS nor EOS: `keras_transformer.data`
  adds them where each side of the model needs them.

The tokenizer is saved as the SentencePiece model proto (e.g. `RUN/tokenizer.model`),
which the `sentencepiece` command-line tools can read as well.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import math
import os
import random
from typing import Iterable

import sentencepiece
import tensorflow as tf
import tensorflow_text
from tensorflow_text.python.ops.sentencepiece_tokenizer import gen_sentencepiece_tokenizer

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3

DEFAULT_VOCAB_SIZE = 8000
NORMALIZATION_RULE = "identity"
CHARACTER_COVERAGE = 0.9995
# Enough sentences to learn a 37k vocabulary; larger corpora are sampled down to this.
DEFAULT_MAX_TRAINING_SENTENCES = 2_000_000
# SentencePiece logs every step at INFO; 2 keeps errors only.
_SENTENCEPIECE_LOG_LEVEL = 2

# Whitespace as Python's `str.isspace` has it, plus the zero-width space and U+FEFF (a byte
# order mark when it starts a text); and the line and tab breaks among them.
_SPACE = r"\s\x0b\x1c-\x1f\x85\p{Z}\x{200B}\x{FEFF}"
_OUTER_SPACE = rf"^[{_SPACE}]+|[{_SPACE}]+$"
_BREAKS = r"[\t\n\x0b\x0c\r\x1c-\x1f\x85\x{2028}\x{2029}]+"


def clean_text(strings):
    """`strings` as a corpus reader leaves a line: breaks and tabs made spaces, outer whitespace gone.

    Why: with the `identity` normalization SentencePiece keeps a tab, a "\\r" or a no-break
    space as a piece of its own, and the model never saw them, since a corpus line is
    stripped and cut at line breaks. Before this, a trailing "\\r" (a line of a CRLF file)
    changed 37 of the first 64 Multi30k test translations of the `small` model. Inner
    no-break spaces ("120\\xa0cm") stay: they are in the corpus. Invalid UTF-8 bytes pass
    through unchanged.

    Args:
        strings: A string tensor (or list of str).

    Returns:
        A string tensor of the same shape.
    """
    spaced = tf.strings.regex_replace(strings, _BREAKS, " ")
    return tf.strings.regex_replace(spaced, _OUTER_SPACE, "")


class SubwordTokenizer(tf.Module):
    """Tokenizes strings into subword ids and back, with TF ops only.

    Usable eagerly, inside `tf.function`, in `tf.data` maps, and as a tracked child of a
    `tf.Module` that is exported with `tf.saved_model.save` (the model proto is embedded
    in the SavedModel).

    Args:
        model_proto: A serialized SentencePiece model whose pad/unk/bos/eos ids are
            `PAD_ID`, `UNK_ID`, `BOS_ID` and `EOS_ID`, e.g. from `train_tokenizer`.
        name: Optional module name.

    Raises:
        ValueError: If the model's reserved ids differ from this module's constants.
    """

    def __init__(self, model_proto: bytes, name: str | None = None):
        super().__init__(name=name)
        processor = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        _check_reserved_ids(processor)
        self._model_proto = bytes(model_proto)
        self._vocab_size = processor.get_piece_size()
        self._sentencepiece = tensorflow_text.SentencepieceTokenizer(
            model=self._model_proto, out_type=tf.int32
        )
        # Private attribute of tensorflow-text 2.21; see `_SharedSentencepieceModel`.
        self._sentencepiece._model_resource = _SharedSentencepieceModel(self._model_proto)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SubwordTokenizer:
        """Reads a tokenizer written by `save` (any path `tf.io.gfile` understands).

        Args:
            path: Path of the SentencePiece model file.

        Returns:
            The tokenizer.
        """
        with tf.io.gfile.GFile(os.fspath(path), "rb") as model_file:
            return cls(model_file.read())

    def save(self, path: str | os.PathLike) -> None:
        """Writes the SentencePiece model proto to `path`, creating parent directories.

        Args:
            path: Destination file, conventionally `RUN_DIR/tokenizer.model`.
        """
        path = os.fspath(path)
        parent = os.path.dirname(path)
        if parent:
            tf.io.gfile.makedirs(parent)
        with tf.io.gfile.GFile(path, "wb") as model_file:
            model_file.write(self._model_proto)

    @property
    def model_proto(self) -> bytes:
        """The serialized SentencePiece model."""
        return self._model_proto

    @property
    def vocab_size(self) -> int:
        """Number of ids, reserved ids included; valid ids are `0 .. vocab_size - 1`."""
        return self._vocab_size

    def tokenize(self, strings) -> tf.RaggedTensor:
        """Splits UTF-8 strings into subword ids, without adding BOS or EOS.

        The text is cleaned first (`clean_text`), so line breaks, tabs and outer
        whitespace of any kind do not become pieces the model never saw.

        Args:
            strings: A string tensor (or list of str); usually shape `[batch]`.

        Returns:
            int32 ids of shape `strings.shape + [(tokens)]`: a `tf.RaggedTensor` for
            batched input. Empty and whitespace-only strings give empty rows.
        """
        return self._sentencepiece.tokenize(clean_text(strings))

    def detokenize(self, ids) -> tf.Tensor:
        """Joins subword ids back into text.

        Each sequence is cut at its first `EOS_ID`, and `PAD_ID`s are dropped, so padded
        decoder output of shape `[batch, length]` can be passed as is. `BOS_ID` decodes
        to nothing. The text is one line, cleaned as `tokenize` cleans its input
        (`clean_text`): a generated byte piece for a line break or a tab is a space.

        Args:
            ids: int ids of shape `[length]` or `[batch, length]`, dense or ragged.

        Returns:
            A string tensor of shape `[]` or `[batch]`.
        """
        if isinstance(ids, tf.RaggedTensor):
            ids = ids.to_tensor(default_value=PAD_ID)
        ids = tf.cast(ids, tf.int32)
        before_eos = tf.math.cumsum(tf.cast(ids == EOS_ID, tf.int32), axis=-1) == 0
        keep = tf.logical_and(before_eos, ids != PAD_ID)
        # Byte fallback can spell "\n" or "\r", which would split a translation over lines of a file.
        return clean_text(self._sentencepiece.detokenize(tf.ragged.boolean_mask(ids, keep)))

    def id_to_piece(self, ids) -> tf.Tensor:
        """Maps ids to their subword strings (e.g. "▁Hund", "<0xF0>", "</s>").

        Args:
            ids: An int tensor of any shape.

        Returns:
            A string tensor of the same shape.
        """
        return self._sentencepiece.id_to_string(tf.cast(ids, tf.int32))


def train_tokenizer(
    sentences: Iterable[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    max_sentences: int = DEFAULT_MAX_TRAINING_SENTENCES,
    seed: int = 0,
    num_threads: int | None = None,
) -> SubwordTokenizer:
    """Learns a shared BPE vocabulary from source and target training sentences.

    Training is deterministic for a given input, seed and `max_sentences`, and logs
    nothing but errors. The input is streamed; when it holds more than `max_sentences`
    sentences, a seeded uniform sample of that many is learned from (`seeded_sample`;
    SentencePiece's own sampling of a sentence iterator ignores the seed).

    Args:
        sentences: Training sentences of both languages (e.g.
            `ParallelCorpus.training_sentences()`).
        vocab_size: Exact size of the vocabulary, reserved ids and the 256 byte pieces
            included (the paper used about 37000 for WMT EN-DE).
        max_sentences: Cap on the number of sentences used for learning merges.
        seed: Seed of the sampling above.
        num_threads: Trainer threads; defaults to the number of CPUs.

    Returns:
        The trained tokenizer.

    Raises:
        RuntimeError: From SentencePiece, e.g. when the text is too small for
            `vocab_size` pieces.
    """
    sentencepiece.set_random_generator_seed(seed)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(seeded_sample(sentences, max_sentences, seed)),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        normalization_rule_name=NORMALIZATION_RULE,
        character_coverage=CHARACTER_COVERAGE,
        byte_fallback=True,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        # Already at most this many: SentencePiece then only shuffles them, with the seed.
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        num_threads=num_threads or os.cpu_count() or 1,
        minloglevel=_SENTENCEPIECE_LOG_LEVEL,
    )
    return SubwordTokenizer(model.getvalue())


def seeded_sample(items: Iterable, size: int, seed: int) -> list:
    """A uniform random sample of `size` of `items` (all of them if fewer), the same for the same seed.

    Algorithm L (Li, 1994): one pass over `items`, keeping `size` of them in memory,
    with about `size * (1 + log(n / size))` random draws for `n` items, so a corpus
    of millions of sentences costs little more than reading it.

    Returns:
        The sample; while `items` holds at most `size`, all of them in their order.
    """
    rng = random.Random(seed)

    def uniform():  # In (0, 1): the logarithms below need it above 0.
        return rng.random() or uniform()

    iterator = iter(items)
    reservoir = list(itertools.islice(iterator, size))
    if len(reservoir) < size or size == 0:
        return reservoir
    weight = math.exp(math.log(uniform()) / size)
    while weight < 1.0:
        skip = math.floor(math.log(uniform()) / math.log1p(-weight))
        item = next(itertools.islice(iterator, skip, None), _END)
        if item is _END:
            break
        reservoir[rng.randrange(size)] = item
        weight *= math.exp(math.log(uniform()) / size)
    return reservoir


_END = object()


class _SharedSentencepieceModel(tf.saved_model.experimental.TrackableResource):
    """The SentencePiece model resource, registered under a name derived from the model.

    tensorflow-text 2.21 creates this resource owned by its kernel, and TensorFlow deletes
    it whenever it clears the eager kernel cache, which `tf.random.set_seed` and
    `keras.utils.set_random_seed` do: every tokenizer made before seeding then fails with
    "Resource ... SentencepieceResource does not exist". A shared name takes the resource
    out of the kernel's ownership; deriving it from the model's digest keeps tokenizers of
    different models apart. It replaces `SentencepieceTokenizer._model_resource`, so it is
    also what a SavedModel captures.
    """

    def __init__(self, model_proto: bytes):
        super().__init__()
        self._model_proto = model_proto
        self._shared_name = "sentencepiece_" + hashlib.sha256(model_proto).hexdigest()
        _ = self.resource_handle  # Creates the resource now, as tensorflow-text does.

    def _create_resource(self):
        return gen_sentencepiece_tokenizer.sentencepiece_op(
            model=self._model_proto, shared_name=self._shared_name
        )


def _check_reserved_ids(processor: sentencepiece.SentencePieceProcessor) -> None:
    """Raises ValueError unless the model uses this module's reserved ids."""
    expected = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}
    actual = {
        "pad": processor.pad_id(),
        "unk": processor.unk_id(),
        "bos": processor.bos_id(),
        "eos": processor.eos_id(),
    }
    if actual != expected:
        raise ValueError(
            f"SentencePiece model has reserved ids {actual}, expected {expected}; "
            "train it with keras_transformer.tokenizer.train_tokenizer."
        )
