"""Encoder-decoder attention as heatmaps a person can read: labelled, scaled, PNG.

`attention_figure` draws one heatmap per decoder layer: the source's subword pieces on
the x axis, the translation's on the y axis (row i is the attention while the model
predicts piece i), each weight the mean over the layer's heads, with a colour bar per
layer (scaled from 0 to that layer's largest weight, so that a diffuse layer is still
legible). Cells are about `CELL_INCHES` square and a heatmap is at least
`MIN_PANEL_INCHES` on a side, so every image is at least `MIN_PANEL_INCHES * DPI`
pixels wide and high.

Figures are drawn with Agg on a `matplotlib.figure.Figure` of their own, never through
`pyplot`: nothing global (backend, open figures) changes, and a figure is freed with
its last reference. Piece texts are drawn as they are: `$` is not read as mathtext.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# Pixels per inch of the PNGs.
DPI = 100
# Side of one weight's cell: room for a 9-point piece label per row and column.
CELL_INCHES = 0.3
# Smallest heatmap side (with its labels and colour bar): at least 400 pixels at DPI.
MIN_PANEL_INCHES = 4.5
# Room for the piece labels, axis titles and the colour bar around the cells.
_MARGIN_INCHES = (2.5, 2.0)
# Layers side by side before a new row starts.
MAX_COLUMNS = 3
_LABEL_POINTS = 9
_COLORMAP = "viridis"


def attention_figure(
    layers: Sequence[np.ndarray],
    source_pieces: Sequence[str],
    output_pieces: Sequence[str],
    *,
    layer_numbers: Sequence[int] | None = None,
) -> Figure:
    """Heatmaps of encoder-decoder attention, one per decoder layer, each the mean over heads.

    Args:
        layers: Per decoder layer, weights `[heads, len(output_pieces), len(source_pieces)]`.
        source_pieces: The source's subword pieces, EOS included: the x tick labels.
        output_pieces: The translation's pieces, EOS included: the y tick labels.
        layer_numbers: The layers' indices in the decoder, for the titles (default 0, 1, ...).

    Returns:
        A `Figure` with an Agg canvas; see `figure_png`.

    Raises:
        ValueError: If there is no layer, or the layers differ in shape or do not fit the pieces.
    """
    layers = [np.asarray(weights, dtype=np.float32) for weights in layers]
    layer_numbers = list(range(len(layers)) if layer_numbers is None else layer_numbers)
    _check_shapes(layers, layer_numbers, len(source_pieces), len(output_pieces))
    columns = min(len(layers), MAX_COLUMNS)
    rows = math.ceil(len(layers) / columns)
    panel_width, panel_height = _panel_inches(len(source_pieces), len(output_pieces))
    figure = Figure(figsize=(columns * panel_width, rows * panel_height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, weights, number in zip(axes, layers, layer_numbers):
        _draw_heatmap(figure, ax, weights.mean(axis=0), source_pieces, output_pieces)
        ax.set_title(f"decoder layer {number}")
    for ax in axes[len(layers):]:
        ax.remove()
    figure.suptitle(f"Encoder-decoder attention, mean over {layers[0].shape[0]} heads")
    return figure


def figure_png(figure: Figure) -> bytes:
    """The figure as PNG bytes, `figsize * DPI` pixels."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def save_png(figure: Figure, path) -> None:
    """Writes the figure as a PNG file at `path` (its directory must exist)."""
    Path(path).write_bytes(figure_png(figure))


def _check_shapes(layers, layer_numbers, source_length, output_length):
    if not layers:
        raise ValueError("No decoder layer to draw.")
    if len(layer_numbers) != len(layers):
        raise ValueError(f"{len(layer_numbers)} layer numbers for {len(layers)} layers.")
    expected = (layers[0].shape[0], output_length, source_length)
    for number, weights in zip(layer_numbers, layers):
        if weights.shape != expected:
            raise ValueError(
                f"Decoder layer {number}'s weights have shape {weights.shape}, not [{expected[0]} heads, "
                f"{expected[1]} output pieces, {expected[2]} source pieces]."
            )


def _panel_inches(source_length, output_length):
    """`(width, height)` of one layer's heatmap with its labels and colour bar."""
    width = max(MIN_PANEL_INCHES, source_length * CELL_INCHES + _MARGIN_INCHES[0])
    height = max(MIN_PANEL_INCHES, output_length * CELL_INCHES + _MARGIN_INCHES[1])
    return width, height


def _draw_heatmap(figure, ax, weights, source_pieces, output_pieces):
    # From 0: a weight's colour reads as its share of the row, not relative to the row's smallest.
    image = ax.imshow(weights, cmap=_COLORMAP, vmin=0.0, vmax=max(float(weights.max()), 1e-9), aspect="auto")
    # parse_math=False: a piece such as "$5" is text, not the start of a formula.
    label_style = {"fontsize": _LABEL_POINTS, "parse_math": False}
    ax.set_xticks(range(len(source_pieces)), labels=list(source_pieces), rotation=90, **label_style)
    ax.set_yticks(range(len(output_pieces)), labels=list(output_pieces), **label_style)
    ax.set_xlabel("source pieces")
    ax.set_ylabel("translation pieces")
    figure.colorbar(image, ax=ax, label="attention weight")
