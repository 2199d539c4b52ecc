"""Tests of the tf.data pipelines (keras_transformer.data).

Expected contents are computed independently: with the Python `sentencepiece` package on
the tokenizer's model proto, and the length rules written out in plain Python.
"""

import collections

import numpy as np
import pytest
import sentencepiece
import tensorflow as tf

from keras_transformer.corpora import load_multi30k
from keras_transformer.data import (
    bucket_batch_sizes,
    bucket_boundaries,
    count_long_pairs,
    make_training_dataset,
    make_translation_dataset,
    shard_pairs,
)
from keras_transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID

BUDGET = 600
MAX_LENGTH = 24  # Short enough that some Multi30k pairs are too long.


@pytest.fixture(scope="module")
def pairs(multi30k_dir):
    """3000 Multi30k training pairs plus pairs with an empty side (which are dropped)."""
    return load_multi30k(multi30k_dir).train[:3000] + [("", "Leer."), ("Empty.", " ")]


@pytest.fixture(scope="module")
def encode(multi30k_tokenizer):
    """Python reference tokenization, not using tensorflow-text."""
    processor = sentencepiece.SentencePieceProcessor(model_proto=multi30k_tokenizer.model_proto)
    return processor.encode


def _expected_pairs(pairs, encode, truncate=False):
    """Multiset of (source tokens, target tokens) the pipeline must yield, BOS/EOS excluded."""
    kept = collections.Counter()
    for source, target in pairs:
        source_ids, target_ids = encode(source), encode(target)
        if truncate:
            source_ids, target_ids = source_ids[: MAX_LENGTH - 1], target_ids[: MAX_LENGTH - 1]
        fits = len(source_ids) < MAX_LENGTH and len(target_ids) < MAX_LENGTH
        if source_ids and target_ids and fits:
            kept[tuple(source_ids), tuple(target_ids)] += 1
    return kept


def _unpad(row):
    length = int(np.count_nonzero(row != PAD_ID))
    assert (row[length:] == PAD_ID).all(), "padding must only trail"
    return row[:length].tolist()


def _yielded_pairs(dataset):
    """Checks every batch's structure and budget; returns the multiset of pairs yielded."""
    yielded = collections.Counter()
    for (source, decoder_inputs), labels in dataset.as_numpy_iterator():
        assert source.dtype == decoder_inputs.dtype == labels.dtype == np.int32
        assert decoder_inputs.shape == labels.shape
        assert source.shape[0] * source.shape[1] <= BUDGET
        assert labels.shape[0] * labels.shape[1] <= BUDGET
        assert max(source.shape[1], labels.shape[1]) <= MAX_LENGTH
        for source_row, decoder_row, label_row in zip(source, decoder_inputs, labels):
            source_ids, decoder_ids, label_ids = map(_unpad, (source_row, decoder_row, label_row))
            assert source_ids[-1] == EOS_ID and label_ids[-1] == EOS_ID
            assert decoder_ids == [BOS_ID] + label_ids[:-1]
            yielded[tuple(source_ids[:-1]), tuple(label_ids[:-1])] += 1
    return yielded


def test_batches_hold_each_kept_pair_once_within_budget(pairs, encode, multi30k_tokenizer):
    dataset = make_training_dataset(
        pairs, multi30k_tokenizer, token_budget=BUDGET, max_length=MAX_LENGTH, seed=1
    )

    expected = _expected_pairs(pairs, encode)
    assert 0 < sum(expected.values()) < len(pairs) - 2  # Some pairs are too long.
    assert _yielded_pairs(dataset) == expected


def test_truncation_keeps_every_nonempty_pair_across_pools(pairs, encode, multi30k_tokenizer):
    dataset = make_training_dataset(
        pairs,
        multi30k_tokenizer,
        token_budget=BUDGET,
        max_length=MAX_LENGTH,
        long_sentences="truncate",
        pool_size=700,  # Five pools, the last one partial.
        seed=1,
    )

    expected = _expected_pairs(pairs, encode, truncate=True)
    assert sum(expected.values()) == len(pairs) - 2
    assert _yielded_pairs(dataset) == expected


def test_string_dataset_input_and_sharding_split_the_pairs(pairs, encode, multi30k_tokenizer):
    strings = tf.data.Dataset.from_tensor_slices(
        ([source for source, _ in pairs], [target for _, target in pairs])
    )
    shards = [
        _yielded_pairs(
            make_training_dataset(
                strings,
                multi30k_tokenizer,
                token_budget=BUDGET,
                max_length=MAX_LENGTH,
                input_context=tf.distribute.InputContext(2, pipeline, 2),
            )
        )
        for pipeline in (0, 1)
    ]

    assert shards[0] and shards[1]
    assert shards[0] + shards[1] == _expected_pairs(pairs, encode)


def test_the_long_pairs_counted_are_those_the_training_data_leaves_out(pairs, encode, multi30k_tokenizer):
    too_long = sum(max(len(encode(source)), len(encode(target))) >= MAX_LENGTH for source, target in pairs)
    assert 0 < too_long < len(pairs)
    assert count_long_pairs(pairs, multi30k_tokenizer, MAX_LENGTH) == too_long


def test_shards_are_alike_whatever_the_order_of_the_corpus(pairs, multi30k_tokenizer):
    """Multi30k's odd training lines are longer than its even ones: every other pair made unlike shards.

    Each worker cycles through its own shard, one batch a step: a shard of fewer batches
    per epoch has its pairs trained on more often.
    """
    strings = tf.data.Dataset.from_tensor_slices(([source for source, _ in pairs], [target for _, target in pairs]))
    shards = [set(shard_pairs(strings, 2, index).as_numpy_iterator()) for index in (0, 1)]
    assert not shards[0] & shards[1] and len(shards[0]) + len(shards[1]) == len(set(strings.as_numpy_iterator()))
    assert set(shard_pairs(strings.shuffle(len(pairs), seed=3), 2, 0).as_numpy_iterator()) == shards[0]

    def batches(index):
        dataset = make_training_dataset(  # The tiny preset's batches: few long pairs dropped.
            pairs, multi30k_tokenizer, token_budget=1024, max_length=128, seed=1,
            input_context=tf.distribute.InputContext(2, index, 2),
        )
        return int(dataset.reduce(0, lambda count, _: count + 1))

    counts = [batches(0), batches(1)]
    assert abs(counts[0] - counts[1]) <= 0.1 * max(counts), counts  # Every other pair: 36 and 47.


@pytest.mark.parametrize("num_shards", [3, 4])
def test_the_shards_of_more_than_two_pipelines_split_the_pairs_too(pairs, num_shards):
    """Every pair in exactly one shard for any number of input pipelines, not only two."""
    strings = tf.data.Dataset.from_tensor_slices(([source for source, _ in pairs], [target for _, target in pairs]))
    shards = [list(shard_pairs(strings, num_shards, index).as_numpy_iterator()) for index in range(num_shards)]
    assert all(shards)
    assert collections.Counter(pair for shard in shards for pair in shard) == collections.Counter(
        strings.as_numpy_iterator()
    )


def test_seed_makes_epochs_reproducible_and_each_epoch_reshuffles(pairs, multi30k_tokenizer):
    def epochs(count):
        dataset = make_training_dataset(
            pairs[:1000], multi30k_tokenizer, token_budget=BUDGET, max_length=MAX_LENGTH, seed=7
        )
        return [[labels for _, labels in dataset.as_numpy_iterator()] for _ in range(count)]

    first, second = epochs(2)
    (again,) = epochs(1)

    def same(a, b):
        return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))

    assert same(first, again)
    assert not same(first, second)


def test_each_epoch_batches_other_pairs_together_not_the_same_batches_in_another_order(pairs, multi30k_tokenizer):
    """The pairs are reshuffled before bucketing every epoch: the same batches, merely reordered, would show
    the model the same groups (and the same partial batches) epoch after epoch."""
    dataset = make_training_dataset(
        pairs[:1000], multi30k_tokenizer, token_budget=BUDGET, max_length=MAX_LENGTH, seed=7
    )

    def batches():
        return {frozenset(map(tuple, labels.tolist())) for _, labels in dataset.as_numpy_iterator()}

    first, second = batches(), batches()
    assert len(first) > 20
    # A bucket of fewer pairs than its batch size is one batch whatever the order: 5 of 32 here.
    assert len(first & second) < 0.5 * len(first)


def test_lengths_are_mixed_across_an_epoch_of_more_batches_than_the_batch_shuffle_buffer(pairs, multi30k_tokenizer):
    """Batches are cut bucket by bucket; their order must not carry a trend from short to long sentences."""
    dataset = make_training_dataset(pairs, multi30k_tokenizer, token_budget=96, max_length=MAX_LENGTH, seed=3)
    lengths = np.array([labels.shape[1] for _, labels in dataset.as_numpy_iterator()])
    assert len(lengths) > 256  # more than the batch shuffle buffer holds
    trend = np.corrcoef(np.arange(len(lengths)), lengths)[0, 1]
    assert abs(trend) < 0.1, trend
    halves = np.array_split(lengths, 2)
    assert abs(halves[0].mean() - halves[1].mean()) < 0.05 * lengths.mean()


def test_default_budget_batches_are_large_and_not_mostly_padding(pairs, multi30k_tokenizer):
    dataset = make_training_dataset(pairs, multi30k_tokenizer, seed=0)

    real = padded = 0
    for (source, _), labels in dataset.as_numpy_iterator():
        assert source.size <= 4096 and labels.size <= 4096
        real += np.count_nonzero(source) + np.count_nonzero(labels)
        padded += source.size + labels.size

    assert real / padded > 0.85


def test_bucket_batch_sizes_fill_but_never_exceed_the_budget():
    boundaries = bucket_boundaries(256)
    sizes = bucket_batch_sizes(boundaries, 256, 4096)

    assert boundaries == sorted(set(boundaries)) and boundaries[-1] <= 256
    longest = [boundary - 1 for boundary in boundaries] + [256]
    for size, length in zip(sizes, longest):
        assert size * length <= 4096 < (size + 1) * length


def test_budget_below_max_length_is_rejected(multi30k_tokenizer):
    with pytest.raises(ValueError, match="token_budget"):
        make_training_dataset([("a", "b")], multi30k_tokenizer, token_budget=100, max_length=128)


def test_translation_batches_keep_order_and_round_trip(multi30k_dir, multi30k_tokenizer):
    sources = [source for source, _ in load_multi30k(multi30k_dir).test]

    batches = list(make_translation_dataset(sources, multi30k_tokenizer, batch_size=64))

    assert [len(batch) for batch in batches] == [64] * 15 + [40]
    restored = [
        text.decode("utf-8")
        for batch in batches
        for text in multi30k_tokenizer.detokenize(batch).numpy()
    ]
    assert restored == sources
    for batch in batches:
        row_lengths = np.count_nonzero(batch.numpy(), axis=1)
        assert (batch.numpy()[np.arange(len(batch)), row_lengths - 1] == EOS_ID).all()


def test_translation_batches_truncate_long_sources(multi30k_tokenizer):
    sources = ["A very long sentence " * 20, "Short."]

    (batch,) = make_translation_dataset(sources, multi30k_tokenizer, max_source_length=10)

    assert batch.shape[0] == 2 and batch.shape[1] == 10
    assert batch.numpy()[0, -1] == EOS_ID


@pytest.mark.parametrize("max_length", [1, 0, -5])
def test_a_max_length_without_room_for_a_token_and_eos_is_rejected(multi30k_tokenizer, max_length):
    with pytest.raises(ValueError, match="max_length must leave room for a token and EOS"):
        make_training_dataset([("a", "b")], multi30k_tokenizer, max_length=max_length)
    with pytest.raises(ValueError, match="max_source_length must leave room for a token and EOS"):
        make_translation_dataset(["a b c"], multi30k_tokenizer, max_source_length=max_length)
