"""tf.data input pipelines: sentence pairs -> padded, token-budget batches of subword ids.

Training batches follow the paper (section 5.1): "sentence pairs were batched together by
approximate sequence length. Each training batch contained a set of sentence pairs
containing approximately 25000 source tokens and 25000 target tokens." Counting tokens
instead of sentences keeps the work per step steady whatever the sentence lengths. Here the
budget is a hard bound with padding counted: every batch satisfies
`batch_size * padded_source_length <= token_budget` and
`batch_size * padded_target_length <= token_budget`.

How: pairs are put in length buckets by their longer side (bucket edges grow by 10% from
length 8, so padding stays small); a bucket whose longest length is
L is cut into batches of `token_budget // L` pairs, each padded to its own longest pair.
This is what `Dataset.bucket_by_sequence_length` does, but that op calls a function per
pair; here the shuffled pairs are taken in pools of `pool_size` and each pool is bucketed
and cut with a few vectorized ops, which takes well under half the CPU time per epoch
(see docs/performance.md). Each pool ends with at most one partial batch per
bucket (as `bucket_by_sequence_length` does once per epoch); a pool's batches are put in
random order, and then shuffled across pools, so lengths are mixed across steps.

Each element is Keras's `(inputs, labels)` with `inputs = (source_ids, decoder_inputs)`,
all int32 and padded with `PAD_ID`:

    source_ids     = tokens(source) + [EOS]
    decoder_inputs = [BOS] + tokens(target)
    labels         = tokens(target) + [EOS]

so `decoder_inputs[:, 1:] == labels[:, :-1]` (teacher forcing, shifted right).
`max_length` bounds each of these three sequences; longer pairs are dropped or cut.

Speed: strings are tokenized in chunks of `_TOKENIZE_CHUNK` by parallel map calls (no
Python per element), and the ids are cached (in memory, or in a file for corpora that do
not fit), so later epochs only shuffle, bucket and pad.
"""

from __future__ import annotations

from typing import Literal, Sequence

import tensorflow as tf

from keras_transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID, SubwordTokenizer

DEFAULT_TOKEN_BUDGET = 4096
DEFAULT_MAX_LENGTH = 256
DEFAULT_SHUFFLE_BUFFER_SIZE = 50_000
DEFAULT_POOL_SIZE = 65_536
DEFAULT_EVAL_BATCH_SIZE = 64

_TOKENIZE_CHUNK = 1024
_MIN_BUCKET_BOUNDARY = 8
_BUCKET_GROWTH = 1.1
_BATCH_SHUFFLE_BUFFER_SIZE = 256

LongSentences = Literal["filter", "truncate"]


def make_training_dataset(
    pairs: Sequence[tuple[str, str]] | tf.data.Dataset,
    tokenizer: SubwordTokenizer,
    *,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    max_length: int = DEFAULT_MAX_LENGTH,
    long_sentences: LongSentences = "filter",
    shuffle: bool = True,
    shuffle_buffer_size: int = DEFAULT_SHUFFLE_BUFFER_SIZE,
    pool_size: int = DEFAULT_POOL_SIZE,
    seed: int | None = None,
    input_context: tf.distribute.InputContext | None = None,
    cache_file: str = "",
) -> tf.data.Dataset:
    """Builds one epoch of token-budget batches for training (or validation loss).

    Every kept pair appears exactly once per iteration of the dataset; repeat it (or
    iterate it again) for more epochs: each iteration reshuffles.

    Args:
        pairs: `(source, target)` sentences: a sequence of str pairs, or a dataset of
            scalar string pairs such as `ParallelCorpus.train` for TFDS corpora.
        tokenizer: The shared subword tokenizer.
        token_budget: Per-replica bound on padded tokens per batch, for each side.
        max_length: Longest sequence fed to the model (EOS/BOS included).
        long_sentences: "filter" drops pairs with a side longer than `max_length`;
            "truncate" cuts such sides to fit (the cut side still ends with EOS).
        shuffle: Whether to shuffle pairs before bucketing and batches after it.
        shuffle_buffer_size: Pairs in the shuffle buffer; at least the corpus size
            gives a full shuffle.
        pool_size: Pairs bucketed together; larger pools give fewer partial batches. A
            pool is held padded to its longest pair: at most `pool_size * max_length`
            ids per sequence (200 MB for the three sequences at the defaults).
        seed: Shuffle seed, for reproducible batches.
        input_context: From `tf.distribute.Strategy.distribute_datasets_from_function`;
            with several input pipelines, this one keeps only its shard of the pairs
            (`shard_pairs`).
        cache_file: Where to cache the tokenized pairs; "" caches in memory.

    Returns:
        A dataset of `((source_ids, decoder_inputs), labels)`, int32 `[batch, length]`.
        Pairs with an empty side are dropped.

    Raises:
        ValueError: For a `max_length` below 2, a `token_budget` smaller than
            `max_length`, or an unknown `long_sentences`.
    """
    if long_sentences not in ("filter", "truncate"):
        raise ValueError(f"long_sentences must be 'filter' or 'truncate', got {long_sentences!r}.")
    if token_budget < max_length:
        raise ValueError(
            f"token_budget ({token_budget}) must be at least max_length ({max_length}), "
            "or the longest pairs would not fit in any batch."
        )
    strings = _string_pairs(pairs)
    if input_context is not None and input_context.num_input_pipelines > 1:
        strings = shard_pairs(strings, input_context.num_input_pipelines, input_context.input_pipeline_id)
    examples = encode_pairs(strings, tokenizer, max_length, long_sentences).cache(cache_file)
    if shuffle:
        examples = examples.shuffle(shuffle_buffer_size, seed=seed, reshuffle_each_iteration=True)
    boundaries = bucket_boundaries(max_length)
    pools = examples.padded_batch(pool_size, padding_values=((PAD_ID, PAD_ID), PAD_ID))
    if shuffle:
        # A seed per pool for the order of its batches; new ones each iteration (epoch),
        # the same ones for the same `seed`.
        pool_seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).batch(2)
        pools = tf.data.Dataset.zip(pools, pool_seeds).map(lambda pool, seeds: (*pool, seeds))
    batches = (
        pools.map(
            _pool_splitter(boundaries, bucket_batch_sizes(boundaries, max_length, token_budget)),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
        .unbatch()
        .map(_pad_batch, num_parallel_calls=tf.data.AUTOTUNE)
    )
    if shuffle:
        batches = batches.shuffle(_BATCH_SHUFFLE_BUFFER_SIZE, seed=seed)
    return batches.prefetch(tf.data.AUTOTUNE)


def make_translation_dataset(
    sources: Sequence[str],
    tokenizer: SubwordTokenizer,
    *,
    batch_size: int = DEFAULT_EVAL_BATCH_SIZE,
    max_source_length: int = DEFAULT_MAX_LENGTH,
) -> tf.data.Dataset:
    """Builds batches of source ids to translate, in the order of `sources`.

    Nothing is dropped or reordered, so the i-th translation matches the i-th reference;
    sources longer than `max_source_length` tokens (EOS included) are truncated.

    Args:
        sources: Source sentences, e.g. `[source for source, _ in corpus.test]`.
        tokenizer: The shared subword tokenizer.
        batch_size: Sentences per batch (the last batch may be smaller).
        max_source_length: Longest source fed to the model.

    Returns:
        A dataset of int32 `source_ids` of shape `[batch, length]`, ending with EOS and
        padded with `PAD_ID`.

    Raises:
        ValueError: For a `max_source_length` below 2.
    """
    _check_room(max_source_length, "max_source_length")

    def encode(strings):
        ids = tokenizer.tokenize(strings)[:, : max_source_length - 1]
        return _pad(_append(ids, EOS_ID))

    strings = tf.data.Dataset.from_tensor_slices(tf.constant(list(sources), dtype=tf.string))
    return (
        strings.batch(batch_size)
        .map(encode, num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(tf.data.AUTOTUNE)
    )


def _check_room(length, name="max_length"):
    if length < 2:
        raise ValueError(f"{name} must leave room for a token and EOS (at least 2), got {length}.")


def encode_pairs(
    strings: tf.data.Dataset,
    tokenizer: SubwordTokenizer,
    max_length: int = DEFAULT_MAX_LENGTH,
    long_sentences: LongSentences = "filter",
) -> tf.data.Dataset:
    """Tokenizes string pairs into unpadded `((source_ids, decoder_inputs), labels)`.

    Args:
        strings: Dataset of `(source, target)` scalar strings.
        tokenizer: The shared subword tokenizer.
        max_length: Longest sequence fed to the model (EOS/BOS included).
        long_sentences: "filter" or "truncate", see `make_training_dataset`.

    Returns:
        A dataset of 1-D int32 tensors, in input order, without pairs with an empty side.

    Raises:
        ValueError: For a `max_length` below 2.
    """
    _check_room(max_length)
    longest_text = max_length - 1  # Room for the EOS or BOS.

    def encode_chunk(sources, targets):
        source_tokens = tokenizer.tokenize(sources)
        target_tokens = tokenizer.tokenize(targets)
        if long_sentences == "truncate":
            source_tokens = source_tokens[:, :longest_text]
            target_tokens = target_tokens[:, :longest_text]
        keep = (
            (source_tokens.row_lengths() > 0)
            & (target_tokens.row_lengths() > 0)
            & ~_side_too_long(source_tokens, target_tokens, max_length)
        )
        source_tokens = tf.ragged.boolean_mask(source_tokens, keep)
        target_tokens = tf.ragged.boolean_mask(target_tokens, keep)
        return (
            (_append(source_tokens, EOS_ID), _prepend(target_tokens, BOS_ID)),
            _append(target_tokens, EOS_ID),
        )

    return (
        strings.batch(_TOKENIZE_CHUNK)
        .map(encode_chunk, num_parallel_calls=tf.data.AUTOTUNE)
        .unbatch()
        # `unbatch` yields ragged specs of rank 1, which padded batching rejects; a map
        # turns them into plain dense tensors.
        .map(lambda inputs, labels: (inputs, labels))
    )


def count_long_pairs(
    pairs: Sequence[tuple[str, str]] | tf.data.Dataset,
    tokenizer: SubwordTokenizer,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> int:
    """How many `(source, target)` pairs have a side longer than `max_length` leaves room for.

    Those are the pairs `make_training_dataset` drops, or cuts to fit with
    `long_sentences="truncate"`: a side of more than `max_length - 1` tokens, with no room
    for its EOS or BOS. Reads `pairs` once, tokenizing them in chunks.
    """
    _check_room(max_length)

    def count_chunk(sources, targets):
        too_long = _side_too_long(tokenizer.tokenize(sources), tokenizer.tokenize(targets), max_length)
        return tf.reduce_sum(tf.cast(too_long, tf.int64))

    chunks = _string_pairs(pairs).batch(_TOKENIZE_CHUNK).map(count_chunk, num_parallel_calls=tf.data.AUTOTUNE)
    return int(chunks.reduce(tf.constant(0, tf.int64), lambda total, count: total + count))


def _side_too_long(source_tokens, target_tokens, max_length):
    """Which rows of ragged `[pairs, (tokens)]` have a side with no room left in `max_length` for its EOS or BOS."""
    longest_text = max_length - 1
    return (source_tokens.row_lengths() > longest_text) | (target_tokens.row_lengths() > longest_text)


def shard_pairs(strings: tf.data.Dataset, num_shards: int, index: int) -> tf.data.Dataset:
    """The pairs of `strings` in shard `index` of `num_shards`, by a hash of their text.

    Each pair is in exactly one shard, the same in every process, whatever the order of
    `strings`; and the shards are random samples of the corpus, so their length
    distributions, and with them the numbers of token-budget batches per epoch, are
    alike. `Dataset.shard`'s every n-th pair follows any pattern of the corpus's order:
    Multi30k's odd training lines are 40% longer than its even ones, which gave 2
    workers 99 and 130 batches per epoch, and each worker cycles through its own shard,
    so the pairs of the first were trained on 1.3 times as often as the others.

    Args:
        strings: Dataset of `(source, target)` scalar strings.
        num_shards: Number of shards (input pipelines).
        index: This shard, in `[0, num_shards)`.

    Returns:
        A dataset of the pairs of shard `index`, in the order of `strings`.
    """

    def keep(sources, targets):
        text = tf.strings.join([sources, targets], separator="\x00")
        mine = tf.strings.to_hash_bucket_fast(text, num_shards) == index
        return tf.boolean_mask(sources, mine), tf.boolean_mask(targets, mine)

    return strings.batch(_TOKENIZE_CHUNK).map(keep).unbatch()


def bucket_boundaries(max_length: int) -> list[int]:
    """Length bucket edges, growing by `_BUCKET_GROWTH` from `_MIN_BUCKET_BOUNDARY`.

    Args:
        max_length: Longest sequence length; all edges are at most this.

    Returns:
        Increasing edges `b`; bucket `i` holds lengths in `[b[i-1], b[i])`, and the last
        bucket lengths from `b[-1]` to `max_length`.
    """
    boundaries = []
    boundary = _MIN_BUCKET_BOUNDARY
    while boundary <= max_length:
        boundaries.append(boundary)
        boundary = max(boundary + 1, int(boundary * _BUCKET_GROWTH))
    return boundaries


def bucket_batch_sizes(boundaries: Sequence[int], max_length: int, token_budget: int) -> list[int]:
    """Sentences per batch for each bucket, so padded batches stay within the budget.

    Args:
        boundaries: Edges from `bucket_boundaries(max_length)`.
        max_length: Longest sequence length (the last bucket's longest).
        token_budget: Bound on `batch_size * padded_length`.

    Returns:
        `len(boundaries) + 1` batch sizes: `token_budget // longest length in bucket`.
    """
    longest_per_bucket = [boundary - 1 for boundary in boundaries] + [max_length]
    return [token_budget // longest for longest in longest_per_bucket]


def _string_pairs(pairs: Sequence[tuple[str, str]] | tf.data.Dataset) -> tf.data.Dataset:
    """Dataset of `(source, target)` scalar strings from a pair sequence or dataset."""
    if isinstance(pairs, tf.data.Dataset):
        return pairs
    sources = tf.constant([source for source, _ in pairs], dtype=tf.string)
    targets = tf.constant([target for _, target in pairs], dtype=tf.string)
    return tf.data.Dataset.from_tensor_slices((sources, targets))


def _pool_splitter(boundaries: Sequence[int], batch_sizes: Sequence[int]):
    """Returns a map function cutting a padded pool of examples into token-budget batches.

    The function's output is nested ragged, `[batch, (pairs), (tokens)]` per sequence;
    within a bucket, pairs keep their (shuffled) pool order. Given a `seed` (a stateless
    seed, shape `[2]`), the batches come in a random order, else bucket by bucket.
    """
    boundaries = tf.constant(boundaries, tf.int64)
    batch_sizes = tf.constant(batch_sizes, tf.int64)

    def split_pool(inputs, labels, seed=None):
        source_ids, decoder_inputs = (
            tf.RaggedTensor.from_tensor(ids, padding=PAD_ID) for ids in inputs
        )
        labels = tf.RaggedTensor.from_tensor(labels, padding=PAD_ID)
        lengths = tf.maximum(source_ids.row_lengths(), labels.row_lengths())
        bucket = tf.searchsorted(boundaries, lengths, side="right", out_type=tf.int64)
        order = tf.argsort(bucket, stable=True)
        bucket = tf.gather(bucket, order)
        first_in_bucket = tf.searchsorted(bucket, bucket, side="left", out_type=tf.int64)
        position_in_bucket = tf.range(tf.size(bucket, out_type=tf.int64)) - first_in_bucket
        starts_batch = position_in_bucket % tf.gather(batch_sizes, bucket) == 0
        batch_ids = tf.cumsum(tf.cast(starts_batch, tf.int64)) - 1
        if seed is not None:
            # Bucket by bucket, a pool's batches run from short to long sentences: a pool
            # of more batches than the batch shuffle buffer would reach the model so.
            num_batches = batch_ids[-1] + 1
            new_position = tf.cast(tf.argsort(tf.random.stateless_uniform([num_batches], seed)), tf.int64)
            batch_ids = tf.gather(new_position, batch_ids)
            by_batch = tf.argsort(batch_ids, stable=True)
            order, batch_ids = tf.gather(order, by_batch), tf.gather(batch_ids, by_batch)

        def group(ids):
            return tf.RaggedTensor.from_value_rowids(tf.gather(ids, order), batch_ids)

        return (group(source_ids), group(decoder_inputs)), group(labels)

    return split_pool


def _pad_batch(inputs, labels):
    """Pads a ragged batch `((source_ids, decoder_inputs), labels)` to dense tensors."""
    source_ids, decoder_inputs = inputs
    return (_pad(source_ids), _pad(decoder_inputs)), _pad(labels)


def _pad(ids: tf.RaggedTensor) -> tf.Tensor:
    return ids.to_tensor(default_value=PAD_ID)


def _append(tokens: tf.RaggedTensor, token_id: int) -> tf.RaggedTensor:
    column = tf.fill([tokens.nrows(), 1], tf.constant(token_id, tokens.dtype))
    return tf.concat([tokens, column], axis=1)


def _prepend(tokens: tf.RaggedTensor, token_id: int) -> tf.RaggedTensor:
    column = tf.fill([tokens.nrows(), 1], tf.constant(token_id, tokens.dtype))
    return tf.concat([column, tokens], axis=1)
