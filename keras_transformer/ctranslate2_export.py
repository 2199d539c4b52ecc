"""Export a trained run as a CTranslate2 model directory, checked against the in-process model.

`export_run` (the library of `kt-export --format ctranslate2` / `python -m export --format
ctranslate2 --run-dir RUN --out DIR`, `keras_transformer.cli.export`) writes:

    DIR/model.bin                the weights, float32 (the shared embedding stored once)
        config.json              special tokens, add_source_eos, layer_norm_epsilon
        shared_vocabulary.json   the SentencePiece pieces, in id order (source = target)
        tokenizer.model          the run's SentencePiece model, to make those pieces

The contract: `ctranslate2.Translator(DIR)` given the pieces of a sentence (as
`sentencepiece` gives them, `encode(text, out_type=str)`, without EOS) computes what our
`Transformer` computes for the ids `Translator` makes of it (the pieces' ids + EOS), from
our start token (BOS), to float32 rounding: `score_batch`'s token log-probabilities are
our model's log-softmax. Its search is CTranslate2's own; with length_penalty=0 it finds
what `decoding.beam_search` with alpha 0 finds, but for rare differences of the two
searches' bookkeeping (see `translate_ids`, which runs it with our settings: 199 of 200
Multi30k translations of the tests' tiny model are the same).

How our model maps onto CTranslate2's `TransformerSpec`:

* Post-LN (`norm_first=False`: `pre_norm=False`, no final norm) or pre-LN (`pre_norm=True`,
  each stack's final LayerNorm as the spec's `layer_norm`); ReLU feed-forward networks.
* LayerNorm epsilon: config.json's `layer_norm_epsilon`, the model's (CTranslate2 would
  otherwise use 1e-5); any non-negative float32 is represented.
* One embedding matrix for the encoder's and decoder's embeddings and the output
  projection (no output bias); `scale_embeddings` multiplies lookups by sqrt(d_model).
* Positions: the spec's `position_encodings` table, added from position 0 in both
  stacks. Learned encodings are the trained table; sinusoidal ones are ours (sines and
  cosines interleaved, `embeddings.sinusoidal_encoding`) written out for
  `model.max_positions` positions (default 1024), since CTranslate2's built-in table is
  another one (positions from 1, sines then cosines). CTranslate2 refuses sources and
  outputs past the table ("No position encodings are defined for positions >= N").
* Attention: our kernels `[d_model, heads, head_dim]` become CTranslate2's `[out, in]`
  weights `[heads * head_dim, d_model]` (heads major, as it splits them), self-attention's
  query, key and value fused into one linear layer, cross-attention's key and value into
  another; the output kernel `[heads, head_dim, d_model]` becomes `[d_model, heads * head_dim]`.
  Biases go with them (a model without biases has none). Queries are scaled by
  1/sqrt(head_dim) by both.
* Special tokens: `unk_token`, `bos_token`, `eos_token` are the pieces of our `UNK_ID`,
  `BOS_ID`, `EOS_ID`; `decoder_start_token` is BOS's piece; `add_source_eos` appends
  EOS to every source, as `Translator` and `keras_transformer.data` do (no source BOS).
  Padding is not a token there: CTranslate2 masks by lengths, as our `pad_id` mask does.
* Any dtype policy: weights are written as float32 (CTranslate2 quantizes at load time,
  `compute_type="int8"`).

`ctranslate2` is an optional dependency (`pip install -e ".[ctranslate2]"`), imported
only by the functions that need it; without it they raise an ImportError saying so.
"""

import math
import os
import shutil
from pathlib import Path

import keras
import numpy as np
from keras import ops

from keras_transformer import run_dir as run_dirs
from keras_transformer.decoding_settings import DecodingSettings
from keras_transformer.embeddings import sinusoidal_encoding
from keras_transformer.saved_model import ExportError
from keras_transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from keras_transformer.translator import DEFAULT_MAX_SOURCE_LENGTH

__all__ = [
    "CHECK_SENTENCES",
    "CHECK_TOLERANCE",
    "ExportError",
    "check_export",
    "export_model",
    "export_run",
    "our_log_probs",
    "position_table",
    "score_ids",
    "tokenize_sources",
    "transformer_spec",
    "translate_ids",
    "vocabulary_pieces",
]

EXTRA = 'pip install -e ".[ctranslate2]"'
# Sentences every export is checked on, besides the caller's; the last one needs byte pieces.
CHECK_SENTENCES = (
    "A man in a blue shirt is standing on a ladder.",
    "Two dogs are running through the snow.",
    "A dog 🐕 runs. 你好世界",
)
# Largest difference allowed between CTranslate2's token log-probabilities and ours.
CHECK_TOLERANCE = 1e-3


def _ctranslate2():
    """The `ctranslate2` module.

    Raises:
        ImportError: One line naming the extra that installs it.
    """
    try:
        import ctranslate2
    except ImportError:
        raise ImportError(f"--format ctranslate2 needs the ctranslate2 package: {EXTRA}") from None
    return ctranslate2


def vocabulary_pieces(model_proto):
    """The pieces of a SentencePiece model, in id order (CTranslate2's vocabulary).

    Args:
        model_proto: The serialized model (`SubwordTokenizer.model_proto`).

    Returns:
        A list of `vocab_size` strings.
    """
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


def _float32(weight):
    """A weight as a float32 NumPy array, whatever the model's dtype policy."""
    return np.asarray(ops.convert_to_numpy(ops.cast(weight, "float32")), dtype=np.float32)


def _set_linear(spec, kernel, bias, input_axes=1):
    """A linear layer from a Keras kernel `[...in, ...out]` (`input_axes` input axes) and bias `[...out]` or None.

    CTranslate2's weights are `[out, in]` matrices.
    """
    kernel = _float32(kernel)
    spec.weight = np.ascontiguousarray(kernel.reshape(math.prod(kernel.shape[:input_axes]), -1).T)
    if bias is not None:
        spec.bias = _float32(bias).reshape(-1)


def _set_fused_linear(spec, kernels, biases):
    """One linear layer computing several projections of the same input, outputs concatenated."""
    weights = [_float32(kernel) for kernel in kernels]
    spec.weight = np.concatenate([w.reshape(w.shape[0], -1).T for w in weights], axis=0)
    if biases[0] is not None:
        spec.bias = np.concatenate([_float32(bias).reshape(-1) for bias in biases])


def _set_layer_norm(spec, norm):
    spec.gamma = _float32(norm.gamma)
    spec.beta = _float32(norm.beta)


def _set_attention(spec, attention, norm, self_attention):
    """CTranslate2's attention: [fused QKV, output] for self-attention, [Q, fused KV, output] else."""
    a = attention
    if self_attention:
        _set_fused_linear(
            spec.linear[0], [a.query_kernel, a.key_kernel, a.value_kernel], [a.query_bias, a.key_bias, a.value_bias]
        )
    else:
        _set_linear(spec.linear[0], a.query_kernel, a.query_bias)
        _set_fused_linear(spec.linear[1], [a.key_kernel, a.value_kernel], [a.key_bias, a.value_bias])
    _set_linear(spec.linear[-1], a.output_kernel, a.output_bias, input_axes=2)  # [heads, head_dim, d_model]
    _set_layer_norm(spec.layer_norm, norm)


def _set_feed_forward(spec, layer):
    ffn = layer.feed_forward
    _set_linear(spec.linear_0, ffn.inner.kernel, ffn.inner.bias)
    _set_linear(spec.linear_1, ffn.outer.kernel, ffn.outer.bias)
    _set_layer_norm(spec.layer_norm, layer.feed_forward_norm)


def position_table(model):
    """The `[max_positions, d_model]` float32 encodings our model adds to positions 0, 1, ...

    The learned table, or our sinusoidal encoding for `model.max_positions` positions.
    """
    if model.learned_positions:
        return _float32(model.positional_encoding.position_embeddings)
    return _float32(sinusoidal_encoding(ops.arange(model.max_positions), model.d_model))


def _set_stack_inputs(spec, model, positions):
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings  # the encoder's: a list
    embeddings.weight = _float32(model.embedding.embeddings)
    spec.scale_embeddings = True  # times sqrt(d_model), as SharedEmbedding does
    spec.position_encodings.encodings = positions


def _check_mappable(model):
    """Raises ExportError for a model CTranslate2's Transformer cannot represent."""
    epsilon = model.layer_norm_epsilon
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon >= 0):
        raise ExportError(f"CTranslate2 takes a finite LayerNorm epsilon of 0 or more, not {epsilon!r}.")
    activations = {layer.feed_forward.activation for layer in model.encoder.blocks + model.decoder.blocks}
    if activations != {"relu"}:
        raise ExportError(f"the CTranslate2 export maps ReLU feed-forward networks, not {sorted(activations)}.")


def transformer_spec(model):
    """A `ctranslate2.specs.TransformerSpec` holding `model`'s architecture and float32 weights.

    The vocabulary and special tokens are not set: `export_model` adds them.

    Args:
        model: A built `keras_transformer.Transformer`, in any dtype policy.

    Returns:
        The spec, with `config.layer_norm_epsilon` the model's.

    Raises:
        ExportError: For a model CTranslate2 cannot represent (an activation other than
            ReLU, an epsilon that is not a finite number of 0 or more).
        ImportError: Without ctranslate2.
    """
    specs = _ctranslate2().specs
    if not model.built:
        raise ExportError("the model is not built: load it with run_dir.load_model, or call it on a batch first.")
    _check_mappable(model)
    spec = specs.TransformerSpec.from_config(
        model.num_layers, model.num_heads, pre_norm=model.norm_first, activation=specs.Activation.RELU
    )
    positions = position_table(model)
    for stack_spec in (spec.encoder, spec.decoder):
        _set_stack_inputs(stack_spec, model, positions)
    spec.decoder.projection.weight = _float32(model.embedding.embeddings)  # tied, no bias
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder.blocks, strict=True):
        _set_attention(layer_spec.self_attention, layer.self_attention, layer.self_attention_norm, True)
        _set_feed_forward(layer_spec.ffn, layer)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder.blocks, strict=True):
        _set_attention(layer_spec.self_attention, layer.self_attention, layer.self_attention_norm, True)
        _set_attention(layer_spec.attention, layer.cross_attention, layer.cross_attention_norm, False)
        _set_feed_forward(layer_spec.ffn, layer)
    if model.norm_first:
        _set_layer_norm(spec.encoder.layer_norm, model.encoder.final_norm)
        _set_layer_norm(spec.decoder.layer_norm, model.decoder.final_norm)
    spec.config.layer_norm_epsilon = float(model.layer_norm_epsilon)
    return spec


def export_model(model, pieces, directory, *, files=()):
    """Writes `model` with its vocabulary as a CTranslate2 model directory.

    Args:
        model: A built `keras_transformer.Transformer`.
        pieces: Its vocabulary, one string per id (`vocabulary_pieces`); ids `UNK_ID`,
            `BOS_ID` and `EOS_ID` are the special tokens.
        directory: The model directory, made if missing; must not hold a model.
        files: Paths of other files to copy into it (the tokenizer).

    Returns:
        `directory` as a Path.

    Raises:
        ExportError: For a vocabulary of another size, repeated pieces, or a model
            CTranslate2 cannot represent.
        ImportError: Without ctranslate2.
    """
    if len(pieces) != model.vocab_size:
        raise ExportError(f"the vocabulary has {len(pieces)} pieces, the model {model.vocab_size} ids.")
    if len(set(pieces)) != len(pieces):
        raise ExportError("the vocabulary repeats pieces: CTranslate2 maps pieces to ids one to one.")
    spec = transformer_spec(model)
    spec.register_source_vocabulary(list(pieces))
    spec.register_target_vocabulary(list(pieces))
    config = spec.config
    config.unk_token, config.bos_token, config.eos_token = pieces[UNK_ID], pieces[BOS_ID], pieces[EOS_ID]
    config.decoder_start_token = pieces[BOS_ID]
    config.add_source_bos, config.add_source_eos = False, True
    for path in files:
        spec.register_file(str(path))
    spec.validate()
    spec.optimize()  # aliases the shared embedding's copies: model.bin stores it once
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    spec.save(str(directory))
    return directory


def export_run(run_dir, out, *, which="best", check_sentences=(), log=print):
    """Exports the model of a run directory as the CTranslate2 model directory `out`, checked.

    The directory is written under a temporary name next to `out`, loaded by
    CTranslate2 and checked (`check_export`), and only then renamed to `out`.

    Args:
        run_dir: Training run directory (see `keras_transformer.run_dir`).
        out: The model directory to make; it must not exist, or be empty.
        which: Checkpoint of the run to export, see `run_dir.checkpoint_path`.
        check_sentences: Sentences to check the export on, besides `CHECK_SENTENCES`.
        log: Receives one line per step and per check.

    Returns:
        `out` as a Path.

    Raises:
        ExportError: If `out` holds files, or the export does not score as the model does.
        RunDirError: If the run's config, checkpoint or tokenizer cannot be loaded.
        ImportError: Without ctranslate2 (before anything is loaded).
    """
    _ctranslate2()
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory; choose another --out.")
    model = run_dirs.load_model(run_dir, which)
    tokenizer = run_dirs.load_tokenizer(run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        export_model(
            model, vocabulary_pieces(tokenizer.model_proto), staging, files=[run_dirs.tokenizer_path(run_dir)]
        )
        log(f"Wrote {staging}; checking it.")
        for line in check_export(staging, model, tokenizer, list(CHECK_SENTENCES) + list(check_sentences)):
            log(f"  ok: {line}")
        os.rename(staging, out)  # onto an empty directory too
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"Exported {run_dirs.checkpoint_label(run_dir, which)} to {out} (CTranslate2).")
    return out


def tokenize_sources(tokenizer, sentences, max_source_length=DEFAULT_MAX_SOURCE_LENGTH):
    """Our source ids of `sentences`, as `Translator` makes them: cut, ending with EOS (lists of ints)."""
    tokens = tokenizer.tokenize(list(sentences))
    return [[int(i) for i in row[: max_source_length - 1]] + [EOS_ID] for row in tokens.to_list()]


def check_export(directory, model, tokenizer, sentences):
    """Loads the CTranslate2 model in `directory` and checks it against `model`.

    Each non-blank sentence is translated by CTranslate2 (greedy, up to source length +
    50 tokens), and the token log-probabilities CTranslate2 gives that translation must
    be `model`'s within `CHECK_TOLERANCE`: a weight, position or special token mapped
    wrongly changes them. Sources and translations stay within the position table
    (`model.max_positions`, the EOS scored after a translation included), as `Translator`
    and `beam_search` keep a model with learned positions.

    Args:
        directory: The CTranslate2 model directory.
        model: The `Transformer` that was exported.
        tokenizer: Its `SubwordTokenizer`.
        sentences: Sentences to check on.

    Yields:
        A description of each check that passed.

    Raises:
        ExportError: At the first check that fails.
    """
    translator = _ctranslate2().Translator(str(directory), device="cpu")
    pieces = vocabulary_pieces(tokenizer.model_proto)
    yield f"CTranslate2 loads {directory}"
    max_source_length = min(DEFAULT_MAX_SOURCE_LENGTH, model.max_positions)
    sources = [ids for ids in tokenize_sources(tokenizer, sentences, max_source_length) if len(ids) > 1]
    greedy = DecodingSettings(beam_size=1, alpha=0.0)
    # One position left for the EOS scored after a translation that ran to the limit.
    targets = [
        ids for ids, _ in translate_ids(translator, sources, pieces, greedy, max_output_length=model.max_positions - 1)
    ]
    theirs = score_ids(translator, sources, targets, pieces)
    ours = our_log_probs(model, sources, targets)
    for i, (their_row, our_row) in enumerate(zip(theirs, ours, strict=True)):
        difference = np.abs(np.asarray(their_row) - np.asarray(our_row))
        if len(their_row) != len(our_row) or difference.max() > CHECK_TOLERANCE:
            worst = int(np.argmax(difference)) if len(their_row) == len(our_row) else -1
            raise ExportError(
                f"CTranslate2 scores check sentence {i + 1}'s translation unlike the in-process model "
                f"(token {worst}: {their_row[worst]:.5f} against {our_row[worst]:.5f}); the export is wrong."
            )
    yield (
        f"CTranslate2 translates {len(sources)} sentences and scores their tokens as the in-process model "
        f"(within {CHECK_TOLERANCE})"
    )


def _without_eos(ids, what):
    ids = [int(i) for i in ids if int(i) != PAD_ID]
    if not ids or ids[-1] != EOS_ID:
        raise ValueError(f"{what} must end with EOS ({EOS_ID}) before any padding, got {ids[-5:]}...")
    return ids[:-1]


def translate_ids(translator, source_ids, pieces, decoding, *, max_output_length=None):
    """Translates our source ids with a CTranslate2 translator, searching as `decoding.beam_search` does.

    The settings become CTranslate2's: `beam_size`; `length_penalty=0` (alpha must be 0,
    see below); `max_decoding_length` source length (EOS included) + `max_extra_length`
    per sentence (sentences are batched by that length), capped at `max_output_length`;
    `min_decoding_length=min_length` (EOS forbidden before that many tokens). With no
    length penalty CTranslate2 stops a sentence once its best candidate is EOS, which no
    later hypothesis can beat: exact, as our search is (`patience`, which counts finished
    hypotheses, plays no part then), and our `early_stopping` rules agree with alpha 0.

    What still differs, rarely: CTranslate2 finishes the EOS candidates among a step's
    best `beam_size` only, ours among the best `2 * beam_size`. And our search never emits
    padding or BOS, which this does not forbid: CTranslate2 suppresses tokens before the
    softmax (`suppress_sequences`), renormalizing the others, which changes more results
    than a trained model's choosing them does. Its minimum length renormalizes the first
    step the same way, so scores are those of `beam_search` plus -log(1 - p(EOS first)).

    Args:
        translator: A `ctranslate2.Translator` of an export.
        source_ids: Sequences of our ids, each ending with EOS and possibly padded with
            `PAD_ID` after it (rows of `beam_search`'s `source_ids`).
        pieces: The vocabulary (`vocabulary_pieces`).
        decoding: The `DecodingSettings`, with alpha 0.
        max_output_length: Optional cap on generated tokens, as `beam_search`'s.

    Returns:
        One `(ids, score)` per source: the generated ids, ending with EOS unless the
        maximum length came first (`beam_search`'s tokens up to their length), and
        CTranslate2's summed log-probability. A source of EOS alone gives `([], 0.0)`:
        CTranslate2 does not translate empty sources.

    Raises:
        ValueError: For alpha other than 0 (CTranslate2's penalty divides by `length ** p`,
            not by GNMT's `((5 + length) / 6) ** alpha`), or a source not ending with EOS.
    """
    if decoding.alpha != 0:
        raise ValueError(
            f"translate_ids searches as beam_search only with alpha 0, got {decoding.alpha}: CTranslate2's "
            "length penalty divides by length ** p, not by GNMT's ((5 + length) / 6) ** alpha."
        )
    index = {piece: i for i, piece in enumerate(pieces)}
    sources = [[pieces[i] for i in _without_eos(ids, "each source")] for ids in source_ids]
    limits = [len(tokens) + 1 + decoding.max_extra_length for tokens in sources]
    if max_output_length is not None:
        limits = [min(limit, max_output_length) for limit in limits]
    results = [None] * len(sources)
    for limit in sorted(set(limits)):
        rows = [i for i, row_limit in enumerate(limits) if row_limit == limit]
        translations = translator.translate_batch(
            [sources[i] for i in rows],
            beam_size=decoding.beam_size,
            patience=1,
            length_penalty=0,
            max_input_length=0,
            max_decoding_length=max(limit, 1),
            min_decoding_length=decoding.min_length,
            return_end_token=True,
            return_scores=True,
        )
        for i, translation in zip(rows, translations, strict=True):
            score = translation.scores[0] if translation.scores else 0.0
            results[i] = ([index[piece] for piece in translation.hypotheses[0]], score)
    return results


def score_ids(translator, source_ids, target_ids, pieces):
    """CTranslate2's log-probabilities of each target token and of the EOS after it, from BOS.

    Args:
        translator: A `ctranslate2.Translator` of an export.
        source_ids: Our source ids, each ending with EOS (padding after it is dropped).
        target_ids: Target ids, without BOS; a final EOS is dropped (EOS is scored after them).
        pieces: The vocabulary (`vocabulary_pieces`).

    Returns:
        One list of `len(target) + 1` floats per pair.
    """
    sources = [[pieces[i] for i in _without_eos(ids, "each source")] for ids in source_ids]
    targets = [[pieces[i] for i in _target_tokens(ids)] for ids in target_ids]
    results = translator.score_batch(sources, targets, max_input_length=0)
    return [list(result.log_probs) for result in results]


def _target_tokens(ids):
    ids = [int(i) for i in ids]
    return ids[:-1] if ids and ids[-1] == EOS_ID else ids


def our_log_probs(model, source_ids, target_ids):
    """`model`'s log-probabilities of each target token and of the EOS after it, from BOS (teacher forcing).

    Args and Returns: as `score_ids`, with `model` a `Transformer` for the translator.
    """
    sources = [[int(i) for i in ids if int(i) != PAD_ID] for ids in source_ids]
    labels = [_target_tokens(ids) + [EOS_ID] for ids in target_ids]
    source_batch = _padded(sources, model.pad_id)
    decoder_inputs = _padded([[BOS_ID] + row[:-1] for row in labels], model.pad_id)
    logits = model((source_batch, decoder_inputs), training=False)
    log_probs = ops.convert_to_numpy(ops.log_softmax(ops.cast(logits, "float32"), axis=-1))
    return [[float(log_probs[r, t, token]) for t, token in enumerate(row)] for r, row in enumerate(labels)]


def _padded(rows, pad_id):
    width = max(len(row) for row in rows)
    return keras.ops.convert_to_tensor(
        np.array([row + [pad_id] * (width - len(row)) for row in rows], dtype=np.int32)
    )
