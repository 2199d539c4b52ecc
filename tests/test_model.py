"""The encoder-decoder Transformer: masking, caching, sizes, precision, XLA and errors."""

import numpy as np
import pytest
import keras
import tensorflow as tf

from keras_transformer import Decoder, DecoderLayer, Encoder, EncoderLayer, Transformer

VOCAB = 40


@pytest.fixture(scope="module")
def tiny_model():
    keras.utils.set_random_seed(0)
    model = Transformer.from_preset("tiny", vocab_size=VOCAB)
    model.build()
    return model


def random_ids(shape, seed):
    return np.random.default_rng(seed).integers(4, VOCAB, size=shape).astype("int32")


def test_changing_later_target_tokens_never_changes_earlier_outputs(tiny_model):
    source = random_ids((2, 6), 0)
    target = random_ids((2, 8), 1)
    logits = np.asarray(tiny_model((source, target)))
    for i in range(7):
        changed = target.copy()
        changed[:, i + 1 :] = random_ids((2, 7 - i), 10 + i)
        changed_logits = np.asarray(tiny_model((source, changed)))
        np.testing.assert_allclose(changed_logits[:, : i + 1], logits[:, : i + 1], atol=1e-5)
        assert not np.allclose(changed_logits[:, i + 1 :], logits[:, i + 1 :])


def test_changing_padded_source_positions_never_changes_any_output():
    keras.utils.set_random_seed(1)
    encoder = Encoder(num_layers=2, d_model=16, num_heads=4, d_ff=32)
    decoder_layer = DecoderLayer(16, 4, 32)
    rng = np.random.default_rng(0)
    source = rng.normal(size=(2, 7, 16)).astype("float32")
    target = rng.normal(size=(2, 5, 16)).astype("float32")
    mask = np.ones((2, 7), bool)
    mask[0, 4:] = False
    mask[1, 6:] = False
    changed = source.copy()
    changed[~mask] = rng.normal(size=changed[~mask].shape)

    def run(src):
        memory = encoder(src, padding_mask=mask)
        return np.asarray(memory), np.asarray(decoder_layer(target, memory, mask))

    memory, decoded = run(source)
    changed_memory, changed_decoded = run(changed)
    np.testing.assert_allclose(changed_memory[mask], memory[mask], atol=1e-5)
    np.testing.assert_allclose(changed_decoded, decoded, atol=1e-5)


def test_extra_source_padding_does_not_change_the_logits(tiny_model):
    source = random_ids((2, 6), 2)
    target = random_ids((2, 4), 3)
    padded = np.concatenate([source, np.zeros((2, 5), "int32")], axis=1)
    np.testing.assert_allclose(tiny_model((padded, target)), tiny_model((source, target)), atol=1e-5)


def _layer_norm(x, epsilon):
    """LayerNorm over the last axis with the initial gain 1 and bias 0, in NumPy."""
    centered = x - x.mean(-1, keepdims=True)
    return centered / np.sqrt((centered**2).mean(-1, keepdims=True) + epsilon)


@pytest.mark.parametrize("stack_class", [Encoder, Decoder])
def test_a_pre_ln_stack_is_its_blocks_then_a_final_layer_norm_and_gives_them_its_activation(stack_class):
    """Pre-LN's residual stream is never normalised inside the blocks: the stack's final LayerNorm
    does it. Stack arguments such as the feed-forward activation reach every block."""
    keras.utils.set_random_seed(3)
    stack = stack_class(num_layers=2, d_model=16, num_heads=4, d_ff=32, norm_first=True, activation="gelu",
                        layer_norm_epsilon=1e-3)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 5, 16)).astype("float32") * 3.0
    memory = (rng.normal(size=(2, 6, 16)).astype("float32"),) if stack_class is Decoder else ()
    output = np.asarray(stack(x, *memory))
    blocks_only = x
    for block in stack.blocks:
        assert block.activation == "gelu" and block.feed_forward.inner.activation is keras.activations.gelu
        blocks_only = block(blocks_only, *memory)
    np.testing.assert_allclose(output, _layer_norm(np.asarray(blocks_only), 1e-3), atol=1e-4)
    restored = stack_class.from_config(stack.get_config())
    assert all(block.activation == "gelu" for block in restored.blocks)


def test_a_pad_id_other_than_0_is_the_source_padding_hidden_from_attention():
    keras.utils.set_random_seed(2)
    model = Transformer(vocab_size=VOCAB, num_layers=1, d_model=16, num_heads=2, d_ff=32, pad_id=3)
    source = random_ids((2, 6), 2)  # ids from 4 up: no padding
    target = random_ids((2, 4), 3)
    padded = np.concatenate([source, np.full((2, 5), 3, "int32")], axis=1)
    np.testing.assert_allclose(model((padded, target)), model((source, target)), atol=1e-5)
    _, source_mask = model.encode(padded)
    np.testing.assert_array_equal(source_mask, padded != 3)


def test_incremental_decoding_gives_the_logits_of_the_full_decoder(tiny_model):
    source = random_ids((3, 9), 4)
    source[1, 6:] = 0  # a padded row
    target = random_ids((3, 7), 5)
    full = np.asarray(tiny_model((source, target)))
    encoder_outputs, source_mask = tiny_model.encode(source)
    cache = tiny_model.init_cache(encoder_outputs, max_decode_length=10)
    for i in range(7):
        logits, cache = tiny_model.decode_step(target[:, i : i + 1], cache, i, source_mask)
        np.testing.assert_allclose(logits[:, 0], full[:, i], atol=1e-4)


def test_a_new_model_decodes_step_by_step_first_and_then_trains():
    """`encode` builds the whole model: its cached steps give the full pass's logits, and it still fits."""
    keras.utils.set_random_seed(2)
    model = Transformer.from_preset("tiny", vocab_size=VOCAB)
    source, target = random_ids((2, 6), 6), random_ids((2, 5), 7)
    encoder_outputs, source_mask = model.encode(source)
    cache = model.init_cache(encoder_outputs, max_decode_length=5)
    steps = []
    for i in range(5):
        logits, cache = model.decode_step(target[:, i : i + 1], cache, i, source_mask)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), model((source, target)), atol=1e-4)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit((source, target), target, verbose=0)
    assert not np.allclose(model((source, target)), np.concatenate(steps, axis=1), atol=1e-4)  # it trained


def expected_parameter_count(vocab, layers, d_model, d_ff):
    """Counted from the paper's architecture, independently of the code."""
    attention = 4 * (d_model * d_model + d_model)  # W_Q, W_K, W_V, W_O with biases
    feed_forward = d_model * d_ff + d_ff + d_ff * d_model + d_model
    norm = 2 * d_model
    encoder_layer = attention + feed_forward + 2 * norm
    decoder_layer = 2 * attention + feed_forward + 3 * norm
    return vocab * d_model + layers * (encoder_layer + decoder_layer)  # one shared embedding


@pytest.mark.parametrize(
    "preset, layers, d_model, d_ff, expected",
    [("base", 6, 512, 2048, 63_082_496), ("big", 6, 1024, 4096, 214_245_376)],
)
def test_parameter_counts_of_the_paper_presets(preset, layers, d_model, d_ff, expected):
    model = Transformer.from_preset(preset, vocab_size=37000)
    model.build()
    assert model.count_params() == expected_parameter_count(37000, layers, d_model, d_ff) == expected
    # The paper reports 65M (base) and 213M (big); see README "Parameter counts".
    assert abs(model.count_params() - {"base": 65e6, "big": 213e6}[preset]) / 1e6 < 2.5


def test_no_two_kernels_of_a_new_model_start_alike():
    """Every kernel is its own draw: no two of the same size are correlated (independent draws of
    16,384 values correlate by about 0.01). One initializer instance used to give each attention
    layer's four kernels the same values."""
    model = Transformer.from_preset("small", vocab_size=VOCAB, attention_init="independent")
    model.build()
    kernels = [w for w in model.weights if w.path.endswith("kernel")]
    assert len(kernels) == 4 * (4 + 2) + 4 * (8 + 2)  # 4 layers each side: attention and feed-forward
    for i, first in enumerate(kernels):
        for second in kernels[i + 1 :]:
            if np.size(first) == np.size(second):
                correlation = np.corrcoef(np.ravel(first), np.ravel(second))[0, 1]
                assert abs(correlation) < 0.06, (first.path, second.path)


def _attention_layers(model):
    layers = [block.self_attention for block in model.encoder.blocks + model.decoder.blocks]
    return layers + [block.cross_attention for block in model.decoder.blocks]


def test_tied_attention_init_reaches_every_attention_layer_and_round_trips():
    model = Transformer.from_preset("tiny", vocab_size=VOCAB, attention_init="tied")
    model.build()
    old_config = {k: v for k, v in model.get_config().items() if k != "attention_init"}
    for config in (model.get_config(), {**old_config, "tied_attention_init": True}):  # saved before the rename
        restored = Transformer.from_config(config)
        restored.build()
        assert len(_attention_layers(restored)) == 6
        for layer in _attention_layers(restored):
            np.testing.assert_array_equal(layer.query_kernel, layer.key_kernel)


def test_mimetic_attention_init_reaches_every_attention_layer():
    """Each attention layer, cross-attention included, starts attending to the matching position."""
    model = Transformer.from_preset("tiny", vocab_size=VOCAB, attention_init="mimetic")
    model.build()
    restored = Transformer.from_config(model.get_config())
    restored.build()
    for layer in _attention_layers(model) + _attention_layers(restored):
        assert layer.attention_init == "mimetic"
        query_key = np.einsum("dhk,ehk->hde", np.asarray(layer.query_kernel), np.asarray(layer.key_kernel))
        value_output = np.asarray(layer.value_kernel).reshape(32, 32) @ np.asarray(layer.output_kernel).reshape(32, 32)
        assert np.trace(query_key, axis1=1, axis2=2).min() > 0  # independent draws: about 0 either way
        assert np.trace(value_output) < 0


@pytest.mark.parametrize(
    "rates", [(0.5, 0.0), (0.0, 0.5)], ids=["attention", "activation"]
)
def test_attention_and_activation_dropout_reach_every_block_round_trip_and_drop_only_in_training(rates):
    """With the residual and embedding dropout at 0, either rate alone makes a training pass differ from inference.

    A config saved before these rates existed builds the paper's model: none.
    """
    attention_rate, activation_rate = rates
    model = Transformer(vocab_size=VOCAB, num_layers=2, d_model=16, num_heads=2, d_ff=32, dropout_rate=0.0,
                        attention_dropout_rate=attention_rate, activation_dropout_rate=activation_rate)
    source, target = random_ids((2, 6), 1), random_ids((2, 5), 1)
    model((source, target))
    old_config = {k: v for k, v in model.get_config().items() if not k.endswith("ion_dropout_rate")}
    for built, expected in ((model, rates), (Transformer.from_config(model.get_config()), rates),
                            (Transformer.from_config(old_config), (0.0, 0.0))):
        built.build()
        blocks = built.encoder.blocks + built.decoder.blocks
        assert {layer.dropout.rate for layer in _attention_layers(built)} == {expected[0]}
        assert {block.feed_forward.dropout.rate for block in blocks} == {expected[1]}
    inference = np.asarray(model((source, target), training=False))
    np.testing.assert_array_equal(np.asarray(model((source, target))), inference)
    assert np.abs(np.asarray(model((source, target), training=True)) - inference).max() > 1e-3


def test_the_norm_order_and_layer_norm_epsilon_reach_every_block_and_round_trip():
    """A pre-LN model is pre-LN in every block, with a final LayerNorm after each stack, and every
    LayerNorm has the model's epsilon (the blocks' defaults, post-LN and 1e-6, would otherwise pass)."""
    model = Transformer(vocab_size=VOCAB, num_layers=2, d_model=8, num_heads=2, d_ff=16, norm_first=True,
                        layer_norm_epsilon=0.25)
    model.build()
    for built in (model, Transformer.from_config(model.get_config())):
        built.build()
        blocks = built.encoder.blocks + built.decoder.blocks
        assert all(block.norm_first for block in blocks)
        norms = [layer for layer in built._flatten_layers() if isinstance(layer, keras.layers.LayerNormalization)]
        assert len(norms) == 2 * 2 + 2 * 3 + 2  # two per encoder layer, three per decoder layer, two final ones
        assert {norm.epsilon for norm in norms} == {0.25}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_keeps_logits_and_attention_in_float32(policy):
    model = Transformer.from_preset("tiny", vocab_size=VOCAB, dtype=policy)
    source, target = random_ids((2, 6), 6), random_ids((2, 5), 7)
    logits = model((source, target))
    assert logits.dtype == "float32"
    assert np.all(np.isfinite(logits))
    layer = model.encoder.blocks[0]
    assert layer.compute_dtype == policy.split("_")[1]
    x = keras.ops.cast(np.ones((2, 6, 32)), layer.compute_dtype)
    _, scores = layer(x, padding_mask=np.ones((2, 6), bool), return_attention_scores=True)
    assert scores.dtype == "float32"
    np.testing.assert_allclose(np.sum(scores, axis=-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("policy, tolerance", [("mixed_bfloat16", 3e-2), ("mixed_float16", 5e-3)])
def test_mixed_precision_logits_are_the_float32_logits_on_the_same_weights(policy, tolerance):
    source, target = random_ids((2, 6), 6), random_ids((2, 5), 7)
    reference = Transformer.from_preset("tiny", vocab_size=VOCAB, dropout_rate=0.0)
    expected = np.asarray(reference((source, target)))
    mixed = Transformer.from_preset("tiny", vocab_size=VOCAB, dropout_rate=0.0, dtype=policy)
    mixed((source, target))
    mixed.set_weights(reference.get_weights())
    logits = mixed((source, target))
    assert logits.dtype == "float32"
    np.testing.assert_allclose(logits, expected, atol=tolerance * np.abs(expected).max())


def test_jit_compiled_forward_equals_eager(tiny_model):
    source, target = random_ids((2, 6), 8), random_ids((2, 5), 9)
    compiled = tf.function(lambda s, t: tiny_model((s, t)), jit_compile=True)
    np.testing.assert_allclose(compiled(source, target), tiny_model((source, target)), atol=1e-5)


def test_keras_fit_with_jit_compile_lowers_the_loss():
    keras.utils.set_random_seed(2)
    model = Transformer.from_preset("tiny", vocab_size=VOCAB, dropout_rate=0.0)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    source = random_ids((16, 6), 10)
    target = source[:, ::-1].copy()  # learn to reverse
    decoder_inputs = np.concatenate([np.full((16, 1), 2, "int32"), target[:, :-1]], axis=1)
    history = model.fit((source, decoder_inputs), target, epochs=15, batch_size=16, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.7 * losses[0]


def test_bad_inputs_get_clear_errors(tiny_model):
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by num_heads \(4\)"):
        Transformer(vocab_size=10, d_model=30, num_heads=4)
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by num_heads \(4\)"):
        EncoderLayer(30, 4, 64)
    with pytest.raises(ValueError, match="Unknown preset 'huge'"):
        Transformer.from_preset("huge", vocab_size=10)
    with pytest.raises(ValueError, match="source_ids must be \\[batch, length\\]"):
        tiny_model((np.zeros((2, 3, 1), "int32"), np.zeros((2, 3), "int32")))
    with pytest.raises(ValueError, match="expects inputs \\(source_ids, decoder_input_ids\\)"):
        tiny_model(np.zeros((2, 3), "int32"))
    with pytest.raises(ValueError, match="got a tuple of 3"):
        tiny_model((np.zeros((2, 3), "int32"),) * 3)
    with pytest.raises(ValueError, match="d_model=16"):
        EncoderLayer(16, 4, 32)(np.zeros((1, 3, 8), "float32"))
    for pad_id in (None, -1, 10, 0.0):
        with pytest.raises(ValueError, match=rf"pad_id must be a token id in \[0, 10\).*got {pad_id}"):
            Transformer(vocab_size=10, num_layers=1, d_model=8, num_heads=2, d_ff=16, pad_id=pad_id)


def test_a_decoder_stack_with_a_cache_returns_the_same_structure_symbolically_as_eagerly():
    from keras_transformer import Decoder

    decoder = Decoder(2, 8, 2, 16, dropout_rate=0.0)
    memory = np.random.default_rng(5).normal(size=(2, 4, 8)).astype("float32")
    token = np.random.default_rng(6).normal(size=(2, 1, 8)).astype("float32")
    decoder(token, memory)  # builds it
    cache = decoder.init_cache(memory, 3)
    eager = decoder(token, memory, cache=cache, cache_index=0)
    symbolic_cache = keras.tree.map_structure(lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype), cache)
    symbolic_token = keras.Input(batch_shape=token.shape)
    symbolic = decoder(symbolic_token, None, cache=symbolic_cache, cache_index=0)
    keras.tree.assert_same_structure(symbolic, eager)
    assert isinstance(symbolic, tuple) and isinstance(symbolic[1], list)
    for spec, value in zip(keras.tree.flatten(symbolic), keras.tree.flatten(eager), strict=True):
        assert tuple(spec.shape) == tuple(value.shape) and spec.dtype == value.dtype


def test_the_learned_position_table_is_max_positions_and_old_configs_max_length_still_builds_it():
    """Saved runs' config.json call it max_length: `Transformer(**config["model"])` and `from_config` take both."""
    from keras_transformer import PositionalEncoding

    model = Transformer.from_preset("tiny", vocab_size=VOCAB, learned_positions=True, max_positions=12)
    config = model.get_config()
    assert config["max_positions"] == model.max_positions == model.positional_encoding.max_positions == 12
    assert "max_length" not in config
    old_config = {**{k: v for k, v in config.items() if k != "max_positions"}, "max_length": 9}
    for rebuilt in (Transformer(**old_config), Transformer.from_config(old_config)):
        assert rebuilt.max_positions == 9 and rebuilt.get_config()["max_positions"] == 9
        rebuilt.build()
        assert rebuilt.positional_encoding.position_embeddings.shape == (9, 32)
    old_layer = PositionalEncoding.from_config({"learned": True, "max_length": 6, "name": "old"})
    assert old_layer.max_positions == 6 and old_layer.get_config()["max_positions"] == 6
    with pytest.raises(ValueError, match="max_positions or its old name max_length, not both"):
        Transformer(vocab_size=VOCAB, max_positions=8, max_length=8)
    with pytest.raises(ValueError, match="max_positions must be a positive integer, got 0"):
        PositionalEncoding(max_positions=0)
