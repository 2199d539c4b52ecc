"""Beam search on a `Transformer` (`decoding.beam_search`), on a tiny model trained on Multi30k.

Cached and uncached decoding agree, scores are the length-penalized log-probs of a full
forward pass, greedy decoding is argmax decoding with the full decoder, padding and other
rows change nothing, the growing self-attention cache, XLA, the output kernel, mixed
precision, output lengths, and `DecodingSettings` (how decoding settings travel). The
search itself, against brute force, is tested in test_search.py.
"""

import dataclasses
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import decoding
from keras_transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID
from length_penalty import penalty


# ---------------------------------------------------------------------------
# The Transformer wrapper, on a tiny model trained on Multi30k
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_model(tiny_translation_run):
    from keras_transformer import run_dir

    return run_dir.load_model(tiny_translation_run)


@pytest.fixture(scope="module")
def source_ids(tiny_translation_run, multi30k_dir):
    """12 Multi30k validation sentences, EOS-terminated and padded."""
    from keras_transformer import data, run_dir
    from keras_transformer.corpora import load_multi30k
    from keras_transformer.tokenizer import SubwordTokenizer

    tokenizer = SubwordTokenizer.load(run_dir.tokenizer_path(tiny_translation_run))
    sources = [source for source, _ in load_multi30k(multi30k_dir).validation[:12]]
    return next(
        iter(data.make_translation_dataset(sources, tokenizer, batch_size=len(sources)))
    ).numpy()


# The fields of `DecodingSettings`: `decode` passes Python values of them in one.
SETTINGS = {field.name for field in dataclasses.fields(decoding.DecodingSettings)}


def decode(model, source_ids, **options):
    """`decoding.beam_search` with numpy results; Python values of decoding settings go in a `DecodingSettings`."""
    python_values = [name for name in options if name in SETTINGS and not tf.is_tensor(options[name])]
    settings = {name: options.pop(name) for name in python_values}
    hypotheses = decoding.beam_search(model, source_ids, decoding.DecodingSettings(**settings), **options)
    return tf.nest.map_structure(np.asarray, hypotheses)


def source_lengths(source_ids):
    return (source_ids != PAD_ID).sum(axis=1)


def teacher_forced_scores(model, source_ids, hypotheses, alpha):
    """Scores of `hypotheses` (with `n_best`) recomputed by one full forward pass each."""
    tokens, lengths = hypotheses.tokens, hypotheses.lengths
    batch, n_best, _ = tokens.shape
    scores = np.zeros((batch, n_best))
    for rank in range(n_best):
        length = lengths[:, rank].max()
        targets = tokens[:, rank, :length]
        decoder_inputs = np.concatenate([np.full((batch, 1), BOS_ID), targets[:, :-1]], axis=1)
        logits = np.asarray(model((source_ids, decoder_inputs)), "float64")
        log_probs = logits - logits.max(-1, keepdims=True)
        log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
        token_log_probs = np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        inside = np.arange(length)[None, :] < lengths[:, rank, None]
        scores[:, rank] = (token_log_probs * inside).sum(1) / penalty(lengths[:, rank], alpha)
    return scores


def test_cached_and_uncached_decoding_give_the_same_hypotheses(trained_model, source_ids):
    for beam_size in (4, 1):
        cached = decode(trained_model, source_ids, beam_size=beam_size, n_best=beam_size)
        uncached = decode(
            trained_model, source_ids, beam_size=beam_size, n_best=beam_size, use_cache=False
        )
        np.testing.assert_array_equal(cached.tokens, uncached.tokens)
        np.testing.assert_array_equal(cached.lengths, uncached.lengths)
        np.testing.assert_allclose(cached.scores, uncached.scores, rtol=1e-5, atol=1e-5)
        # A trained model ends most outputs with EOS before the maximum length, so the
        # comparison covers finished hypotheses (the tiny model may loop on one sentence).
        ended = cached.tokens[np.arange(len(source_ids)), 0, cached.lengths[:, 0] - 1] == EOS_ID
        ended &= cached.lengths[:, 0] < source_lengths(source_ids) + 50
        assert ended.sum() >= len(source_ids) - 2


def test_scores_are_the_length_penalized_log_probs_of_the_outputs(trained_model, source_ids):
    hypotheses = decode(trained_model, source_ids, beam_size=4, alpha=0.6, n_best=4)
    expected = teacher_forced_scores(trained_model, source_ids, hypotheses, alpha=0.6)
    np.testing.assert_allclose(hypotheses.scores, expected, rtol=1e-4, atol=1e-4)
    assert (np.diff(hypotheses.scores, axis=1) <= 0).all()  # best first


@pytest.mark.parametrize("bos_id", [BOS_ID, 5])
def test_greedy_decoding_is_argmax_decoding_with_the_full_decoder(trained_model, source_ids, bos_id):
    """From the start token given (another model's may not be the tokenizer's)."""
    source_ids = source_ids[:6]
    result = decode(trained_model, source_ids, beam_size=1, bos_id=bos_id)
    max_lengths = source_lengths(source_ids) + 50
    prefix = np.full((len(source_ids), 1), bos_id)
    done = np.zeros(len(source_ids), bool)
    expected = [[] for _ in source_ids]
    last_logits = tf.function(
        lambda prefix: trained_model((source_ids, prefix))[:, -1], reduce_retracing=True
    )
    while not done.all():
        logits = last_logits(prefix).numpy()
        # Never generated: padding and the start token, and EOS first (min_length 1).
        logits[:, [PAD_ID, bos_id] + ([EOS_ID] if prefix.shape[1] == 1 else [])] = -np.inf
        tokens = logits.argmax(-1)
        for row in np.flatnonzero(~done):
            expected[row].append(int(tokens[row]))
            done[row] = tokens[row] == EOS_ID or len(expected[row]) == max_lengths[row]
        prefix = np.concatenate([prefix, tokens[:, None]], axis=1)
    for row, tokens in enumerate(expected):
        assert list(result.tokens[row, : result.lengths[row]]) == tokens


def test_padding_and_other_rows_do_not_change_a_translation(trained_model, source_ids):
    batch = decode(trained_model, source_ids[:4])
    long_row = np.random.default_rng(0).integers(4, trained_model.vocab_size, size=(1, 40))
    padded = np.zeros((5, 40), "int32")
    padded[:4, : source_ids.shape[1]] = source_ids[:4]
    padded[4] = long_row
    with_long_row = decode(trained_model, padded)
    for row in range(4):
        alone_ids = source_ids[row : row + 1, : source_lengths(source_ids)[row]]
        alone = decode(trained_model, alone_ids)
        for other in (batch, with_long_row):
            length = alone.lengths[0]
            assert other.lengths[row] == length
            np.testing.assert_array_equal(other.tokens[row, :length], alone.tokens[0, :length])
            np.testing.assert_allclose(other.scores[row], alone.scores[0], rtol=1e-5)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_a_row_of_padding_only_gets_no_hypothesis_and_changes_no_other_row(trained_model, source_ids, jit_compile):
    # What a translator pads a batch with, to a size XLA compiled before.
    expected = decode(trained_model, source_ids[:3])
    padded = np.concatenate([source_ids[:3], np.full((2, source_ids.shape[1]), PAD_ID, source_ids.dtype)])
    found = decode(trained_model, padded, jit_compile=jit_compile)
    np.testing.assert_array_equal(found.tokens[:3], expected.tokens)
    np.testing.assert_allclose(found.scores[:3], expected.scores, rtol=1e-5)
    np.testing.assert_array_equal(found.lengths[3:], 0)
    np.testing.assert_array_equal(found.scores[3:], decoding.NEG_INF)
    assert (found.tokens[3:] == PAD_ID).all()


def test_long_outputs_cross_the_growing_cache_segments_unchanged(trained_model, source_ids):
    # 40 tokens (an id never generated as EOS): the self-attention buffers grow
    # 16 -> 32 -> 40 positions in the cached search (8 -> 16 -> 32 -> 40 under XLA); the
    # uncached one has no buffer.
    options = dict(beam_size=4, n_best=4, max_output_length=40, eos_id=-1)
    uncached = decode(trained_model, source_ids[:3], use_cache=False, **options)
    np.testing.assert_array_equal(uncached.lengths, 40)
    for jit_compile in (False, True):
        cached = decode(trained_model, source_ids[:3], jit_compile=jit_compile, **options)
        np.testing.assert_array_equal(cached.tokens, uncached.tokens)
        np.testing.assert_allclose(cached.scores, uncached.scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_a_search_traces_the_decoder_once_for_all_its_loops(tiny_translation_run, source_ids, jit_compile):
    # One loop per cache length, 16 -> 32 -> 40 here (8 first under XLA, and one per batch size
    # under its halving):
    # tracing the decoder for each was a quarter to half of a translator's start-up.
    from keras_transformer import run_dir

    model = run_dir.load_model(tiny_translation_run)  # no search traced yet
    traces = []
    decode_step = model.decode_step

    def counted(*args, **kwargs):
        traces.append(1)
        return decode_step(*args, **kwargs)

    model.decode_step = counted
    decode(model, source_ids[:2], max_output_length=40, jit_compile=jit_compile)
    assert len(traces) == 1


def test_xla_compiled_decoding_gives_the_same_hypotheses(trained_model, source_ids):
    # Greedy decoding under XLA is covered with the fixed scoring function in test_search.py.
    expected = decode(trained_model, source_ids[:4])
    compiled = decode(trained_model, source_ids[:4], jit_compile=True)
    np.testing.assert_array_equal(compiled.tokens, expected.tokens)
    np.testing.assert_allclose(compiled.scores, expected.scores, rtol=1e-5)


def test_a_precomputed_output_kernel_gives_the_same_hypotheses(trained_model, source_ids):
    expected = decode(trained_model, source_ids[:4], n_best=4)
    kernel = tf.Variable(trained_model.embedding.transposed_embeddings())
    for jit_compile in (False, True):
        found = decode(
            trained_model, source_ids[:4], n_best=4, output_kernel=kernel, jit_compile=jit_compile
        )
        np.testing.assert_array_equal(found.tokens, expected.tokens)
        np.testing.assert_allclose(found.scores, expected.scores, rtol=1e-5)


def test_the_given_output_kernel_is_the_one_used(trained_model, source_ids):
    # All logits equal: every token has log-prob -log(vocab), ties go to the lowest
    # id (padding, never EOS), so each row runs to its maximum length.
    zeros = tf.zeros([trained_model.d_model, trained_model.vocab_size])
    found = decode(trained_model, source_ids[:3], beam_size=1, output_kernel=zeros)
    lengths = source_lengths(source_ids[:3]) + 50
    np.testing.assert_array_equal(found.lengths, lengths)
    expected = -lengths * np.log(trained_model.vocab_size) / penalty(lengths, 0.6)
    np.testing.assert_allclose(found.scores, expected, rtol=1e-5)


def test_a_translator_of_an_unbuilt_model_is_rejected():
    from keras_transformer import Transformer
    from keras_transformer.translator import Translator

    unbuilt = Transformer(vocab_size=100, num_layers=1, d_model=16, num_heads=2, d_ff=32)
    with pytest.raises(ValueError, match="not built"):
        Translator(unbuilt, tokenizer=None)


def test_a_translator_of_a_model_with_another_padding_id_is_rejected():
    from keras_transformer import Transformer
    from keras_transformer.translator import Translator

    model = Transformer(vocab_size=100, num_layers=1, d_model=16, num_heads=2, d_ff=32, pad_id=5)
    model.build()
    with pytest.raises(ValueError, match="model's pad_id is 5"):
        Translator(model, tokenizer=None)


def test_an_output_kernel_of_the_wrong_shape_is_rejected(trained_model, source_ids):
    wrong = trained_model.embedding.embeddings  # [vocab, d_model], not transposed
    with pytest.raises(ValueError, match="output_kernel must be the transposed embeddings"):
        decoding.beam_search(trained_model, source_ids[:1], output_kernel=wrong)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_models_decode_with_float32_scores(
    tiny_translation_run, source_ids, policy
):
    from keras_transformer import run_dir

    model = run_dir.load_model(tiny_translation_run, dtype=policy)
    hypotheses = decode(model, source_ids[:4], n_best=2)
    assert hypotheses.scores.dtype == np.float32
    assert np.isfinite(hypotheses.scores).all() and (hypotheses.lengths > 0).all()
    expected = teacher_forced_scores(model, source_ids[:4], hypotheses, alpha=0.6)
    np.testing.assert_allclose(hypotheses.scores, expected, rtol=0.05, atol=0.05)


def test_padding_and_the_start_token_are_never_generated():
    from keras_transformer import Transformer

    keras.utils.set_random_seed(0)  # the precondition below holds for most draws, not all
    model = Transformer.from_preset("tiny", vocab_size=30)
    model.build()
    # Long embeddings make the tied output projection favour padding and the start token.
    embeddings = model.embedding.embeddings.numpy()
    embeddings[[PAD_ID, BOS_ID]] *= 50.0
    model.embedding.embeddings.assign(embeddings)
    source = np.array([[7, 8, 9, EOS_ID], [10, 11, EOS_ID, PAD_ID]], "int32")
    first_logits = np.asarray(model((source, np.full((2, 1), BOS_ID, "int32"))))[:, 0]
    assert set(first_logits.argmax(-1)) <= {PAD_ID, BOS_ID}  # what an unconstrained search would pick
    for options in (dict(beam_size=4, n_best=4), dict(beam_size=1, n_best=1), dict(use_cache=False, n_best=4)):
        hypotheses = decode(model, source, **options)
        for row in range(len(source)):
            for tokens, length in zip(hypotheses.tokens[row], hypotheses.lengths[row], strict=True):
                assert length > 0 and not set(tokens[:length]) & {PAD_ID, BOS_ID}, options


def test_eager_tensor_options_act_as_their_values(trained_model, source_ids):
    expected = decode(trained_model, source_ids[:2], beam_size=2, max_output_length=5)
    found = decode(trained_model, source_ids[:2], beam_size=tf.constant(2), max_output_length=tf.constant(5))
    for name in ("tokens", "lengths", "scores"):
        np.testing.assert_array_equal(getattr(found, name), getattr(expected, name))
    with pytest.raises(ValueError, match="max_output_length must be a scalar"):
        decoding.beam_search(trained_model, source_ids[:2], max_output_length=tf.constant([5, 6]))


@pytest.mark.parametrize("cap", [0, -3, "tensor 0"])
def test_an_output_cap_below_one_token_is_refused(trained_model, source_ids, cap):
    """Every row still generated one token (the first step's), whatever the cap below 1."""
    value = tf.constant(0) if cap == "tensor 0" else cap
    with pytest.raises(ValueError, match=rf"max_output_length must be at least 1 \(None: no cap\), got {int(value)}\."):
        decoding.beam_search(trained_model, source_ids[:2], max_output_length=value)
    assert set(decode(trained_model, source_ids[:2], max_output_length=1).lengths) == {1}


@pytest.mark.parametrize("max_extra_length", [0, 3])
def test_each_output_has_at_most_its_source_length_plus_the_extra_length(trained_model, source_ids, max_extra_length):
    """EOS never comes (an id never generated): each row runs to its own limit, its source's real tokens
    (EOS included, padding not) + `max_extra_length`, whatever the other rows' lengths; under a cap, the cap."""
    rows = source_ids[:4]
    assert len(set(source_lengths(rows))) > 1  # padded rows: a limit from the padded width would show
    hypotheses = decode(trained_model, rows, beam_size=2, max_extra_length=max_extra_length, eos_id=-1)
    np.testing.assert_array_equal(hypotheses.lengths, source_lengths(rows) + max_extra_length)
    cap = int(source_lengths(rows).min()) + 1
    capped = decode(trained_model, rows, beam_size=2, max_extra_length=max_extra_length, eos_id=-1,
                    max_output_length=cap)
    np.testing.assert_array_equal(capped.lengths, np.minimum(source_lengths(rows) + max_extra_length, cap))


def test_learned_positions_cap_the_output_length():
    from keras_transformer import Transformer

    model = Transformer.from_preset("tiny", vocab_size=30, learned_positions=True, max_positions=12)
    model.build()
    source = np.full((2, 10), 5, "int32")
    source[:, -1] = EOS_ID
    hypotheses = decode(model, source, eos_id=-1)  # an id never generated
    np.testing.assert_array_equal(hypotheses.lengths, [12, 12])


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_source_longer_than_learned_positions_is_an_error_not_a_silent_clamp(jit_compile):
    """Under XLA the encoder's position lookup would read the last row for every later position."""
    from keras_transformer import Transformer

    model = Transformer.from_preset("tiny", vocab_size=30, learned_positions=True, max_positions=8)
    model.build()
    source = np.full((1, 12), 5, "int32")
    source[:, -1] = EOS_ID

    with pytest.raises(ValueError, match="12 tokens long, but the model's learned positional encodings cover 8"):
        decoding.beam_search(model, source, jit_compile=jit_compile)
    assert decoding.beam_search(model, source[:, 4:], jit_compile=jit_compile).tokens.shape[0] == 1


def test_a_source_longer_than_learned_positions_known_only_when_run_is_an_error_that_says_so():
    """In a `tf.function` of any source length, graph mode checks the length when run (the encoder's
    lookup failed with "indices[8] = 8 is not in [0, 8)"); XLA, which cannot, still compiles and runs."""
    from keras_transformer import Transformer

    model = Transformer.from_preset("tiny", vocab_size=30, learned_positions=True, max_positions=8)
    model.build()
    source = np.full((1, 12), 5, "int32")
    source[:, -1] = EOS_ID
    any_length = [tf.TensorSpec([None, None], tf.int32)]
    searches = {
        jit_compile: tf.function(
            lambda ids: decoding.beam_search(model, ids), input_signature=any_length, jit_compile=jit_compile
        )
        for jit_compile in (False, True)
    }
    told = r"\[12\] \[tokens long, .* learned positional encodings cover 8"
    with pytest.raises(tf.errors.InvalidArgumentError, match=told):
        searches[False](source)
    expected = decoding.beam_search(model, source[:, 4:])
    for search in searches.values():
        np.testing.assert_array_equal(search(source[:, 4:]).tokens, expected.tokens)


# ---------------------------------------------------------------------------
# DecodingSettings: how decoding settings travel
# ---------------------------------------------------------------------------


def test_decoding_settings_default_to_the_papers_and_check_every_field():
    settings = decoding.DecodingSettings()
    assert dataclasses.astuple(settings) == (4, 0.6, 50, 1, "exact")
    for changes, message in (
        (dict(beam_size=0), "beam_size must be between 1 and 16, got 0"),
        (dict(beam_size=17), "beam_size must be between 1 and 16, got 17"),
        (dict(alpha=-0.5), "alpha must be 0 or more, got -0.5"),
        (dict(alpha=10.5), "alpha must be at most 10, got 10.5"),
        (dict(max_extra_length=-1), "max_extra_length must be 0 or more, got -1"),
        (dict(min_length=-1), "min_length must be 0 or more, got -1"),
        (dict(early_stopping="never"), "early_stopping must be one of"),
    ):
        with pytest.raises(ValueError, match=message):
            settings.replace(**changes)
    # Unset flags (None) keep the settings they would replace.
    assert settings.replace(beam_size=None, alpha=1.0) == decoding.DecodingSettings(alpha=1.0)


def test_decoding_settings_take_the_ends_of_their_ranges_and_refuse_nan_and_booleans():
    """The limits themselves are allowed; NaN compares false with everything, so a range check must not let it
    through (it would make every score NaN); True is an int to Python, not a beam size."""
    from keras_transformer.decoding_settings import MAX_ALPHA, MAX_BEAM_SIZE

    ends = decoding.DecodingSettings(beam_size=MAX_BEAM_SIZE, alpha=MAX_ALPHA, max_extra_length=0, min_length=0)
    assert dataclasses.astuple(ends)[:4] == (MAX_BEAM_SIZE, MAX_ALPHA, 0, 0)
    assert decoding.DecodingSettings(beam_size=1, alpha=0).beam_size == 1
    with pytest.raises(ValueError, match="alpha must be 0 or more, got nan"):
        decoding.DecodingSettings(alpha=float("nan"))
    for name in ("beam_size", "max_extra_length", "min_length"):
        with pytest.raises(TypeError, match=f"{name} must be an integer, got True"):
            decoding.DecodingSettings(**{name: True})


def test_numpy_numbers_in_decoding_settings_search_as_python_ones(trained_model, source_ids):
    """A NumPy beam size (from an array, a config read with NumPy) is a Python int in the settings, so the
    search keeps static shapes and compiles under XLA; a number that is no integer is refused by name."""
    numpy_settings = decoding.DecodingSettings(
        beam_size=np.int64(2), alpha=np.float32(0.5), max_extra_length=np.int32(10), min_length=np.int64(1)
    )
    assert [type(value) for value in dataclasses.astuple(numpy_settings)] == [int, float, int, int, str]
    python_settings = decoding.DecodingSettings(beam_size=2, alpha=0.5, max_extra_length=10, min_length=1)
    expected = decoding.beam_search(trained_model, source_ids[:2], python_settings, jit_compile=True)
    found = decoding.beam_search(trained_model, source_ids[:2], numpy_settings, jit_compile=True)
    np.testing.assert_array_equal(found.tokens, expected.tokens)
    with pytest.raises(TypeError, match="beam_size must be an integer, got 2.5"):
        decoding.DecodingSettings(beam_size=2.5)


def test_beam_search_takes_one_settings_object_and_tensor_overrides_of_it(trained_model, source_ids):
    greedy = decode(trained_model, source_ids[:3], beam_size=1, n_best=1)
    for beam_size in (1, tf.constant(1)):
        overridden = decoding.beam_search(
            trained_model, source_ids[:3], decoding.DecodingSettings(beam_size=3), beam_size=beam_size, n_best=1
        )
        np.testing.assert_array_equal(overridden.tokens, greedy.tokens)
    with pytest.raises(TypeError, match="decoding must be a DecodingSettings"):
        decoding.beam_search(trained_model, source_ids[:1], 4)
    with pytest.raises(ValueError, match="beam_size must be between 1 and 16, got 17"):
        decoding.beam_search(trained_model, source_ids[:1], beam_size=17)


def test_decoding_reexports_its_settings_and_search_core_and_the_settings_need_no_tensorflow():
    import subprocess
    import sys

    from keras_transformer import decoding_settings, search_core

    assert decoding.DecodingSettings is decoding_settings.DecodingSettings
    assert decoding.MAX_BEAM_SIZE == decoding_settings.MAX_BEAM_SIZE == 16
    public = [name for name, value in vars(decoding_settings).items()
              if not name.startswith("_") and not inspect.ismodule(value)]
    assert "MAX_ALPHA" in public
    for name in public:  # Every name of the settings, as `from keras_transformer.decoding import ...` too.
        assert name in decoding.__all__ and getattr(decoding, name) is getattr(decoding_settings, name), name
    assert decoding.search is search_core.search and decoding.Hypotheses is search_core.Hypotheses
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, keras_transformer.decoding_settings; print(*sys.modules)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert "keras_transformer.decoding_settings" in loaded
    assert not [name for name in loaded if name.split(".")[0] in ("tensorflow", "keras", "numpy")]
