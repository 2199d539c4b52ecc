"""Attention heatmaps: labelled with the pieces, readable in size, in TensorBoard and from translate.py --attention."""

import io

import matplotlib.image
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import attention_plot, data, evaluation, run_dir
from keras_transformer.decoding import DecodingSettings, beam_search
from keras_transformer.tokenizer import PAD_ID
from keras_transformer.translator import Translator
from cli_modules import load_translate_cli  # noqa: E402

SOURCE_PIECES = ["▁A", "▁dog", "▁run", "s", "▁on", "▁the", "▁grass", ".", "</s>"]
OUTPUT_PIECES = ["▁Ein", "▁Hund", "▁läuft", "▁auf", "▁dem", "▁Gras", ".", "</s>"]
# attention_plot's smallest image side: readable labels, not a few grey pixels.
MIN_PIXELS = 400


def _attention(heads, rows, columns, seed=0):
    """Random attention weights `[heads, rows, columns]`, each row summing to 1."""
    return np.random.default_rng(seed).dirichlet(np.ones(columns), size=(heads, rows)).astype(np.float32)


def _heatmap_axes(figure):
    return [ax for ax in figure.axes if ax.get_label() != "<colorbar>"]


def _png_shape(png):
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    return matplotlib.image.imread(io.BytesIO(png)).shape


def test_the_heatmaps_are_labelled_with_the_pieces_and_say_what_they_show():
    layers = [_attention(4, len(OUTPUT_PIECES), len(SOURCE_PIECES), seed) for seed in range(2)]

    figure = attention_plot.attention_figure(layers, SOURCE_PIECES, OUTPUT_PIECES)

    heatmaps = _heatmap_axes(figure)
    assert [ax.get_title() for ax in heatmaps] == ["decoder layer 0", "decoder layer 1"]
    assert "mean over 4 heads" in figure.get_suptitle()
    assert len(figure.axes) - len(heatmaps) == 2  # A colour bar per layer.
    for ax, weights in zip(heatmaps, layers):
        assert [label.get_text() for label in ax.get_xticklabels()] == SOURCE_PIECES
        assert [label.get_text() for label in ax.get_yticklabels()] == OUTPUT_PIECES
        np.testing.assert_allclose(ax.images[0].get_array(), weights.mean(axis=0), rtol=1e-6)


def test_the_png_is_readable_in_size_and_grows_with_the_sentence():
    one_layer = [_attention(4, len(OUTPUT_PIECES), len(SOURCE_PIECES))]
    height, width, _ = _png_shape(
        attention_plot.figure_png(attention_plot.attention_figure(one_layer, SOURCE_PIECES, OUTPUT_PIECES))
    )
    assert height >= MIN_PIXELS and width >= MIN_PIXELS

    long_source = [f"▁w{index}" for index in range(60)]
    figure = attention_plot.attention_figure([_attention(2, 3, 60)], long_source, ["▁a", ".", "</s>"])
    assert _png_shape(attention_plot.figure_png(figure))[1] >= 60 * attention_plot.CELL_INCHES * attention_plot.DPI


def test_pieces_are_drawn_as_text_not_as_formulas(tmp_path):
    """Mathtext cannot parse "$_$" and would fail the drawing (and with it a validation)."""
    pieces = ["$_$", "▁$5", "</s>"]
    figure = attention_plot.attention_figure([_attention(1, 3, 3)], pieces, pieces)
    attention_plot.save_png(figure, tmp_path / "dollars.png")
    assert matplotlib.image.imread(tmp_path / "dollars.png").shape[0] >= MIN_PIXELS
    assert [label.get_text() for label in _heatmap_axes(figure)[0].get_xticklabels()] == pieces


def test_weights_that_do_not_fit_the_pieces_are_refused():
    with pytest.raises(ValueError, match=r"not \[4 heads, 8 output pieces, 9 source pieces\]"):
        attention_plot.attention_figure(
            [_attention(4, len(OUTPUT_PIECES), len(SOURCE_PIECES)), _attention(4, 8, 8)], SOURCE_PIECES, OUTPUT_PIECES
        )


# ---------------------------------------------------------------------------
# A trained model's attention: the Validator's TensorBoard images, translate.py --attention
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_model(tiny_translation_run):
    return run_dir.load_model(tiny_translation_run), run_dir.load_tokenizer(tiny_translation_run)


@pytest.fixture(scope="module")
def validation_pairs(multi30k_dir):
    from keras_transformer.corpora import load_multi30k

    return load_multi30k(multi30k_dir).validation[:2]


def test_translation_attention_pairs_each_row_with_its_pieces(run_model, validation_pairs):
    model, tokenizer = run_model
    sources = [source for source, _ in validation_pairs]
    source_ids = next(iter(data.make_translation_dataset(sources, tokenizer)))  # Padded to the longer one.
    output_ids = beam_search(model, source_ids, DecodingSettings(beam_size=2)).tokens

    examples = evaluation.translation_attention(model, tokenizer, source_ids, output_ids)

    assert len(examples) == 2
    for source, example, row_ids in zip(sources, examples, output_ids.numpy()):
        pieces = [piece.decode() for piece in tokenizer.id_to_piece(tokenizer.tokenize([source])[0]).numpy()]
        assert example.source_pieces == pieces + ["</s>"]
        # Up to EOS, which ends it unless the tiny model ran to the length limit.
        generated = [int(i) for i in row_ids if i != PAD_ID]
        expected = [piece.decode() for piece in tokenizer.id_to_piece(generated).numpy()]
        assert example.output_pieces == expected and "</s>" not in example.output_pieces[:-1]
        assert len(example.layers) == model.num_layers
        for weights in example.layers:
            assert weights.shape == (model.num_heads, len(example.output_pieces), len(example.source_pieces))
            np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-5)  # Padding gets no weight.


def test_validation_writes_readable_attention_images_to_tensorboard(run_model, validation_pairs, tmp_path):
    model, tokenizer = run_model
    validator = evaluation.Validator(validation_pairs, tokenizer, bleu_sentences=0, attention_examples=2)
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=7):
        validator.write_attention_images(model, step=7)
    writer.flush()

    images = {}
    for path in tmp_path.glob("events.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                width, height, png = tf.make_ndarray(value.tensor)  # tf.summary.image's layout, one image.
                images[value.tag] = (int(width), int(height), _png_shape(png))
    assert sorted(images) == [
        f"attention/example_{example}/decoder_layer_{layer}" for example in range(2) for layer in range(2)
    ]
    for width, height, shape in images.values():
        assert width >= MIN_PIXELS and height >= MIN_PIXELS
        assert shape[:2] == (height, width)


def test_attention_images_read_the_source_cut_as_validation_translates_it(run_model, validation_pairs, tmp_path):
    """The images show the translations BLEU scores: sources cut at the `Validator`'s `max_length`."""
    model, tokenizer = run_model
    max_length = 4
    validator = evaluation.Validator(
        validation_pairs, tokenizer, bleu_sentences=0, attention_examples=1, max_length=max_length
    )
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=7):
        validator.write_attention_images(model, step=7)
    writer.flush()

    descriptions = [
        value.metadata.summary_description
        for path in tmp_path.glob("events.*")
        for event in tf.compat.v1.train.summary_iterator(str(path))
        for value in event.summary.value
    ]
    source = validation_pairs[0][0]
    cut = next(iter(data.make_translation_dataset([source], tokenizer, max_source_length=max_length)))[0]
    pieces = " ".join(piece.decode() for piece in tokenizer.id_to_piece(cut).numpy())
    assert len(tokenizer.tokenize([source])[0]) > max_length  # It is cut.
    assert descriptions and all(text.endswith(f"columns: source `{pieces}`") for text in descriptions), descriptions


def test_translate_draws_the_attention_of_its_translation(tiny_translation_run, tmp_path, capsys):
    sentence = "A dog runs on the grass."
    picture = tmp_path / "attention.png"

    exit_code = load_translate_cli().main(
        ["--run-dir", str(tiny_translation_run), "--attention", str(picture), sentence]
    )

    translator = Translator.from_run_dir(tiny_translation_run)
    expected = translator.translate(tf.constant([sentence]))["translation"][0].numpy().decode()
    captured = capsys.readouterr()
    assert exit_code == 0 and captured.out == expected + "\n"
    assert captured.err.splitlines()[-1] == f"translate.py: drew the attention of the translation in {picture}"
    height, width, _ = matplotlib.image.imread(picture).shape
    # The tiny model's two decoder layers side by side.
    assert height >= MIN_PIXELS and width >= 2 * MIN_PIXELS


def test_translate_reports_an_attention_file_it_cannot_write(tiny_translation_run, tmp_path, capsys):
    picture = tmp_path / "missing" / "attention.png"
    exit_code = load_translate_cli().main(
        ["--run-dir", str(tiny_translation_run), "--attention", str(picture), "A dog."]
    )
    assert exit_code == 2
    assert capsys.readouterr().err.strip().startswith(f"translate.py: error: cannot write --attention {picture}: ")
