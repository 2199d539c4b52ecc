"""Attention masks: which key positions each query position may attend to.

Masks are boolean, `True` meaning "may attend", as in Keras. Attention replaces
the logits of masked positions by `MASKED_LOGIT` before the softmax (the paper's
"setting to -inf", kept finite so a fully masked row gives a uniform softmax
instead of NaN). Logits are float32 when the mask is applied, so -1e9 is safe
whatever the layer's compute dtype.
"""

import functools

from keras import ops

MASKED_LOGIT = -1e9


def padding_mask(token_ids, pad_id=0):
    """`[batch, 1, length]` mask that hides padding tokens from attention.

    Args:
        token_ids: Int tensor `[batch, length]`.
        pad_id: The padding token id.

    Returns:
        Boolean tensor `[batch, 1, length]`, broadcastable over query positions.
    """
    return ops.expand_dims(ops.not_equal(token_ids, pad_id), axis=1)


def causal_mask(query_length, key_length, query_offset=0):
    """`[1, query_length, key_length]` mask letting query `i` see keys `<= i + query_offset`.

    `query_offset` is the position of the first query, non-zero when the
    queries are the newest tokens of an incrementally decoded sequence.
    """
    query_positions = ops.arange(query_length) + query_offset
    key_positions = ops.arange(key_length)
    mask = ops.expand_dims(query_positions, 1) >= ops.expand_dims(key_positions, 0)
    return ops.expand_dims(mask, 0)


def written_mask(key_length, written_length):
    """`[1, 1, key_length]` mask letting every query see the first `written_length` keys only.

    For a decoding cache, whose buffer is longer than what has been written into it.
    """
    return ops.reshape(ops.arange(key_length) < written_length, (1, 1, -1))


def intersect(*masks):
    """What every given mask lets attend (their logical AND, broadcast); None entries are skipped.

    Masks of rank 3 (`[batch, queries, keys]`) and 4 (`[batch, heads, queries, keys]`)
    combine: with a rank-4 mask among them, the rank-3 ones apply to every head.

    Returns None when no mask is given.
    """
    present = [ops.cast(mask, "bool") for mask in masks if mask is not None]
    if any(len(mask.shape) == 4 for mask in present):
        present = [ops.expand_dims(mask, axis=1) if len(mask.shape) == 3 else mask for mask in present]
    return functools.reduce(ops.logical_and, present) if present else None


def check_attention_mask(mask):
    """Raises a clear error for a mask whose rank attention cannot broadcast."""
    if mask is None:
        return
    rank = len(mask.shape)
    if rank not in (3, 4):
        raise ValueError(
            "attention_mask must have rank 3 ([batch, query_length or 1, key_length]) or "
            f"rank 4 ([batch, num_heads or 1, query_length or 1, key_length]); got rank {rank} "
            f"with shape {tuple(mask.shape)}. For a [batch, key_length] padding mask use "
            "keras_transformer.masks.padding_mask or expand it at axis 1."
        )
