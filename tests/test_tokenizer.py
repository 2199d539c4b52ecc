"""Tests of the shared subword tokenizer (keras_transformer.tokenizer)."""

import io
import re

import numpy as np
import pytest
import sentencepiece
import tensorflow as tf

from keras_transformer.corpora import read_parallel_files
from keras_transformer.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    SubwordTokenizer,
    seeded_sample,
    train_tokenizer,
)


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def _strings(tensor):
    return [text.decode("utf-8") for text in tensor.numpy()]


@pytest.mark.parametrize("language", ["en", "de"])
def test_round_trip_restores_validation_text(multi30k_dir, multi30k_tokenizer, language):
    originals = _lines(multi30k_dir / f"val.{language}")

    restored = _strings(multi30k_tokenizer.detokenize(multi30k_tokenizer.tokenize(originals)))

    share = np.mean([a == b for a, b in zip(restored, originals)])
    print(f"round trip val.{language}: {share:.2%} of {len(originals)} lines identical")
    assert len(restored) == len(originals)
    assert share >= 0.99


def test_vocabulary_has_requested_size_and_reserved_pieces(multi30k_dir):
    sentences = _lines(multi30k_dir / "val.en") + _lines(multi30k_dir / "val.de")

    tokenizer = train_tokenizer(sentences, vocab_size=1500)

    assert tokenizer.vocab_size == 1500
    assert sentencepiece.SentencePieceProcessor(
        model_proto=tokenizer.model_proto
    ).get_piece_size() == 1500
    reserved = tokenizer.id_to_piece([PAD_ID, UNK_ID, BOS_ID, EOS_ID])
    assert _strings(reserved) == ["<pad>", "<unk>", "<s>", "</s>"]


def test_training_is_deterministic(multi30k_dir):
    sentences = _lines(multi30k_dir / "val.en") + _lines(multi30k_dir / "val.de")

    first = train_tokenizer(sentences, vocab_size=1000, max_sentences=1500, seed=3)
    second = train_tokenizer(sentences, vocab_size=1000, max_sentences=1500, seed=3)

    assert first.model_proto == second.model_proto


_SAMPLED_VOCABULARY = """
import hashlib, sys
from keras_transformer.tokenizer import train_tokenizer
lines = [line for path in sys.argv[1:] for line in open(path, encoding="utf-8").read().splitlines()]
print(hashlib.sha256(train_tokenizer(lines, 1000, max_sentences=1500, seed=3).model_proto).hexdigest())
"""


@pytest.mark.slow
def test_a_sampled_vocabulary_is_the_same_in_every_process(multi30k_dir):
    """SentencePiece's own sampling of an iterator differs from process to process, whatever the seed."""
    import subprocess
    import sys

    command = [sys.executable, "-c", _SAMPLED_VOCABULARY, str(multi30k_dir / "val.en"), str(multi30k_dir / "val.de")]
    digests = {subprocess.run(command, capture_output=True, text=True, check=True).stdout for _ in range(3)}
    assert len(digests) == 1, digests


def test_the_seeded_sample_is_uniform_and_reproducible():
    """Each of 50 items is kept with probability 10/50 (binomial bounds over 4000 seeds); one seed, one sample."""
    counts = np.zeros(50)
    for seed in range(4000):
        sample = seeded_sample(range(50), 10, seed)
        assert len(sample) == len(set(sample)) == 10
        counts[sample] += 1
    expected, spread = 4000 * 0.2, np.sqrt(4000 * 0.2 * 0.8)  # 800, 25
    assert np.all(np.abs(counts - expected) < 5 * spread), counts
    assert seeded_sample(iter(range(1000)), 30, 7) == seeded_sample(range(1000), 30, 7)
    assert seeded_sample(iter(range(1000)), 30, 7) != seeded_sample(range(1000), 30, 8)
    assert seeded_sample(["a", "b"], 5, 0) == ["a", "b"]


def test_ids_match_python_sentencepiece_and_have_no_bos_eos(multi30k_dir, multi30k_tokenizer):
    sentences = _lines(multi30k_dir / "val.de")[:200]
    reference = sentencepiece.SentencePieceProcessor(model_proto=multi30k_tokenizer.model_proto)

    ids = multi30k_tokenizer.tokenize(sentences)

    assert ids.dtype == tf.int32
    assert ids.to_list() == reference.encode(sentences)
    special = np.isin(ids.flat_values.numpy(), [PAD_ID, BOS_ID, EOS_ID])
    assert not special.any()


def test_empty_and_whitespace_strings_give_empty_rows(multi30k_tokenizer):
    ids = multi30k_tokenizer.tokenize(["", "   ", "\t", "A dog."])

    assert ids.row_lengths().numpy()[:2].tolist() == [0, 0]
    assert ids.row_lengths().numpy()[3] > 0


def test_every_unicode_whitespace_is_blank_and_line_breaks_are_spaces(multi30k_tokenizer):
    spaces = [chr(code) for code in range(0x110000) if chr(code).isspace()]  # Python's whitespace
    assert len(spaces) > 20

    ids = multi30k_tokenizer.tokenize(["".join(spaces), *spaces, "\u200b\ufeff"])

    assert ids.row_lengths().numpy().tolist() == [0] * (len(spaces) + 2)
    line = "Two dogs run through the snow."
    broken = [line.replace(" ", "\t"), line.replace(" ", "\r\n"), line.replace(" ", " \u2028 ")]
    assert multi30k_tokenizer.tokenize(broken).to_list() == multi30k_tokenizer.tokenize([line] * 3).to_list()


def test_whitespace_of_any_kind_at_either_end_is_no_piece(multi30k_tokenizer):
    """SentencePiece drops outer ASCII spaces itself, not a trailing no-break, ideographic or zero-width space:
    those must go as Python's `str.strip` (and a corpus reader) would take them away."""
    line = "Two dogs run through the snow."
    spaces = [chr(code) for code in range(0x110000) if chr(code).isspace()] + ["\u200b", "\ufeff"]
    texts = [text for space in spaces for text in (line + space, space + line, space + line + space)]

    ids = multi30k_tokenizer.tokenize(texts)

    assert ids.to_list() == multi30k_tokenizer.tokenize([line] * len(texts)).to_list()


def test_lines_as_served_tokenize_as_the_corpus_reader_leaves_them(multi30k_dir, multi30k_tokenizer, tmp_path):
    """A served sentence may come from a CRLF file with a byte order mark: training never saw those."""
    lines = _lines(multi30k_dir / "val.en")[:50]
    served = ["\ufeff" + lines[0] + "\r", *(f"\u00a0{line} \t\r" for line in lines[1:])]
    path = tmp_path / "crlf.en"
    path.write_bytes("\n".join(served).encode("utf-8") + b"\n")
    read = [source for source, _ in read_parallel_files(path, path)]
    assert read == lines

    ids = multi30k_tokenizer.tokenize(served)

    assert ids.to_list() == multi30k_tokenizer.tokenize(read).to_list()


def test_invalid_utf8_is_replaced_not_fatal(multi30k_tokenizer):
    ids = multi30k_tokenizer.tokenize(tf.constant([b"bad \xff\xfe bytes", b"\xc3"]))

    restored = [text.decode("utf-8") for text in multi30k_tokenizer.detokenize(ids).numpy()]

    assert restored == ["bad \ufffd\ufffd bytes", "\ufffd"]


def test_unseen_characters_fall_back_to_bytes_losslessly(multi30k_tokenizer):
    text = "Ein Hund 🐕 läuft über 東京."

    ids = multi30k_tokenizer.tokenize([text])
    pieces = _strings(multi30k_tokenizer.id_to_piece(ids.flat_values))

    assert UNK_ID not in ids.flat_values.numpy()
    assert "<0xF0>" in pieces  # First byte of the dog emoji.
    assert _strings(multi30k_tokenizer.detokenize(ids)) == [text]


def test_generated_line_breaks_and_tabs_detokenize_to_one_line(multi30k_tokenizer):
    """Byte fallback has a piece for every byte: a model can spell "\\n", "\\r", a tab or U+2028, which split a
    translation over two lines of translate.py's output (or of a file sacrebleu reads). SentencePiece's own decoding
    keeps them; ours is that text made one line as a corpus line is, break runs a space, outer ones gone."""
    processor = sentencepiece.SentencePieceProcessor(model_proto=multi30k_tokenizer.model_proto)
    pieces = [
        ["<0x09>", "▁Hund"],
        ["▁Ein", "▁Hund", "<0x0A>", "▁läuft", "<0x0D>", "<0x0A>"],
        ["▁Ein", "<0xE2>", "<0x80>", "<0xA8>", "▁Hund", "<0x0B>", "<0x0C>", "."],
    ]
    rows = [[processor.piece_to_id(piece) for piece in row] for row in pieces]
    theirs = [processor.decode(row) for row in rows]
    assert all(len(text.splitlines()) > 1 or "\t" in text for text in theirs)

    ours = _strings(multi30k_tokenizer.detokenize(tf.ragged.constant(rows)))

    def one_line(text):  # Python's own line breaks, and the tab, a space each run; outer spaces gone.
        return " ".join(part for part in re.split(r"[\t\n\x0b\x0c\r\x1c-\x1e\x85\u2028\u2029]+", text)).strip()

    assert ours == [one_line(text) for text in theirs] == ["Hund", "Ein Hund  läuft", "Ein  Hund ."]


def test_detokenize_dense_ids_stops_at_eos_and_skips_padding(multi30k_tokenizer):
    texts = ["A dog runs.", "Zwei Katzen schlafen."]
    rows = multi30k_tokenizer.tokenize(texts).to_list()
    garbage = rows[0][:2]
    width = max(len(row) for row in rows) + 6
    dense = [
        ([BOS_ID] + row + [EOS_ID] + garbage + [PAD_ID] * width)[:width] for row in rows
    ]

    assert _strings(multi30k_tokenizer.detokenize(tf.constant(dense))) == texts
    assert _strings(multi30k_tokenizer.detokenize(tf.ragged.constant(dense))) == texts
    assert multi30k_tokenizer.detokenize(tf.constant(dense[1])).numpy().decode() == texts[1]


def test_methods_work_inside_tf_function(multi30k_tokenizer):
    @tf.function
    def round_trip(strings):
        return multi30k_tokenizer.detokenize(multi30k_tokenizer.tokenize(strings))

    assert _strings(round_trip(tf.constant(["Ein Mann fährt Fahrrad."]))) == [
        "Ein Mann fährt Fahrrad."
    ]


def test_save_and_load_file(multi30k_tokenizer, tmp_path):
    path = tmp_path / "run" / "tokenizer.model"

    multi30k_tokenizer.save(path)
    loaded = SubwordTokenizer.load(path)

    assert loaded.model_proto == multi30k_tokenizer.model_proto
    assert loaded.vocab_size == multi30k_tokenizer.vocab_size
    text = ["Eine Frau mit einem roten Hut."]
    assert loaded.tokenize(text).to_list() == multi30k_tokenizer.tokenize(text).to_list()


class _Exported(tf.Module):
    """A module that serves tokenization, as an exported translator would."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def tokenize(self, strings):
        return self.tokenizer.tokenize(strings).to_tensor(default_value=PAD_ID)

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32)])
    def detokenize(self, ids):
        return self.tokenizer.detokenize(ids)


def test_tokenizer_survives_saved_model_round_trip(multi30k_tokenizer, tmp_path):
    texts = tf.constant(["A man in a blue shirt.", "Kinder spielen im Park.", ""])
    expected = multi30k_tokenizer.tokenize(texts).to_tensor(default_value=PAD_ID)
    tf.saved_model.save(_Exported(multi30k_tokenizer), str(tmp_path / "saved"))

    restored = tf.saved_model.load(str(tmp_path / "saved"))

    np.testing.assert_array_equal(restored.tokenize(texts).numpy(), expected.numpy())
    assert restored.detokenize(expected).numpy().tolist() == texts.numpy().tolist()


def test_rejects_model_with_other_reserved_ids(multi30k_dir):
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_lines(multi30k_dir / "val.en")),
        model_writer=model,
        vocab_size=500,
        minloglevel=2,
    )  # SentencePiece's defaults: unk=0, bos=1, eos=2, no pad.

    with pytest.raises(ValueError, match="reserved ids"):
        SubwordTokenizer(model.getvalue())


def test_tokenizer_survives_global_reseeding(multi30k_tokenizer):
    text = ["Ein Hund rennt über die Wiese."]
    before = multi30k_tokenizer.tokenize(text).to_list()

    tf.random.set_seed(1)  # Clears TensorFlow's eager kernel cache (as Keras seeding does).

    assert multi30k_tokenizer.tokenize(text).to_list() == before
