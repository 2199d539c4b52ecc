"""Translation quality: sacrebleu BLEU, corpus translation, and validation during training.

BLEU is sacrebleu's corpus BLEU on detokenized, cased text against raw references (its
default 13a tokenization, exponential smoothing), the comparable figure that the paper's
tokenized "multi-bleu" is not; each score is reported with sacrebleu's signature, e.g.
`nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`.

Validation during training (`Validator`) computes the loss, perplexity and token
accuracy on the whole validation split (teacher forcing), and BLEU on its first
`bleu_sentences` sentences only: decoding is the expensive part, and a fixed subset keeps
the curve comparable from one validation to the next. It also writes, for a few
validation sentences, the encoder-decoder attention of every decoder layer (mean over
heads) as TensorBoard images.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import sacrebleu
import tensorflow as tf

from keras_transformer import data
from keras_transformer.decoding import beam_search
from keras_transformer.losses import label_smoothed_cross_entropy, token_accuracy
from keras_transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID

# Pixels per attention weight in the heatmaps.
_HEATMAP_CELL = 8


@dataclasses.dataclass(frozen=True)
class BleuResult:
    """A corpus BLEU score.

    Attributes:
        score: BLEU, 0-100.
        text: sacrebleu's line, e.g. "BLEU = 35.12 66.1/42.3/28.9/19.8 (BP = 0.98 ...)".
        signature: sacrebleu's signature of the settings.
    """

    score: float
    text: str
    signature: str

    def __str__(self):
        return f"{self.text} | {self.signature}"


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str], target_lang: str = "") -> BleuResult:
    """sacrebleu corpus BLEU of detokenized, cased hypotheses against one reference each.

    Args:
        hypotheses: Translations, one per reference, in order.
        references: Raw reference sentences.
        target_lang: Target language code; lets sacrebleu pick its tokenizer for zh/ja/ko.

    Returns:
        A `BleuResult`.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references.")
    bleu = sacrebleu.metrics.BLEU(trg_lang=target_lang)
    score = bleu.corpus_score(list(hypotheses), [list(references)])
    return BleuResult(score.score, str(score), str(bleu.get_signature()))


def translate(
    model,
    tokenizer,
    sources: Sequence[str],
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    batch_size: int = data.DEFAULT_EVAL_BATCH_SIZE,
    max_length: int = data.DEFAULT_MAX_LENGTH,
    on_batch: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Translates sentences with beam search (greedy for `beam_size=1`).

    Sentences are decoded in batches of similar length (a batch decodes until its longest
    output ends), and returned in the order of `sources`.

    Args:
        model: A `Transformer`.
        tokenizer: The run's `SubwordTokenizer`.
        sources: Source sentences.
        beam_size: Beams per sentence (paper: 4).
        alpha: Length penalty (paper: 0.6).
        batch_size: Sentences decoded together.
        max_length: Longest source in tokens; longer ones are truncated.
        on_batch: Optional `(translated, total)` callback after each batch, for
            progress output: sentences translated so far, and `len(sources)`.

    Returns:
        The translations, detokenized text.
    """
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    by_length = [sources[i] for i in order]
    outputs = []
    for source_ids in data.make_translation_dataset(by_length, tokenizer, batch_size=batch_size, max_length=max_length):
        hypotheses = beam_search(model, source_ids, beam_size=beam_size, alpha=alpha)
        outputs.extend(text.decode("utf-8") for text in tokenizer.detokenize(hypotheses.tokens).numpy())
        if on_batch is not None:
            on_batch(len(outputs), len(sources))
    translations = [""] * len(sources)
    for position, index in enumerate(order):
        translations[index] = outputs[position]
    return translations


def write_lines(path, lines: Sequence[str]) -> None:
    """Writes one line per string (UTF-8), creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line.replace("\n", " ") + "\n" for line in lines), encoding="utf-8")


def cross_attention(model, source_ids, decoder_input_ids):
    """Encoder-decoder attention weights of every decoder layer (teacher forcing, no dropout).

    Args:
        model: A `Transformer`.
        source_ids: int `[batch, source_length]`.
        decoder_input_ids: int `[batch, target_length]`, starting with BOS.

    Returns:
        A list with one float32 `[batch, num_heads, target_length, source_length]` per layer.
    """
    encoder_outputs, source_mask = model.encode(source_ids, training=False)
    x = model.positional_encoding(model.embedding(decoder_input_ids))
    weights = []
    for layer in model.decoder.blocks:
        x, (_, layer_cross) = layer(
            x, encoder_outputs, source_mask, training=False, return_attention_scores=True
        )
        weights.append(layer_cross)
    return weights


class Validator:
    """The `validate_fn` of `Trainer`: loss, perplexity, accuracy, BLEU and attention images.

    Args:
        pairs: Validation `(source, target)` sentence pairs.
        tokenizer: The run's `SubwordTokenizer`; create it after seeding
            (`keras.utils.set_random_seed` drops TensorFlow's kernel cache, which holds
            the tokenizer's resource).
        label_smoothing: The training `eps`, so the validation loss is comparable.
        bleu_sentences: BLEU is computed on the first this many pairs (0: no BLEU).
        beam_size: Beam size of the BLEU translations (1: greedy).
        alpha: Length penalty.
        token_budget: Token budget of the loss batches.
        max_length: Longest sequence, as in training.
        attention_examples: Sentences whose attention is written as images.
        target_lang: Target language code for sacrebleu.

    Call arguments:
        model: The model being trained.
        step: The training step, for the image summaries.

    Returns:
        `{"loss", "perplexity", "accuracy"[, "bleu"]}` as floats.
    """

    def __init__(
        self,
        pairs,
        tokenizer,
        *,
        label_smoothing=0.1,
        bleu_sentences=200,
        beam_size=4,
        alpha=0.6,
        token_budget=data.DEFAULT_TOKEN_BUDGET,
        max_length=data.DEFAULT_MAX_LENGTH,
        attention_examples=3,
        target_lang="",
    ):
        self.pairs = list(pairs)
        self.tokenizer = tokenizer
        self.label_smoothing = label_smoothing
        self.bleu_pairs = self.pairs[:bleu_sentences]
        self.beam_size = beam_size
        self.alpha = alpha
        self.max_length = max_length
        self.attention_sources = [source for source, _ in self.pairs[:attention_examples]]
        self.target_lang = target_lang
        self._batches = data.make_training_dataset(
            self.pairs, tokenizer, token_budget=token_budget, max_length=max_length, shuffle=False
        )
        self._sums = None

    def __call__(self, model, step):
        metrics = self.teacher_forced_metrics(model)
        if self.bleu_pairs:
            sources, references = zip(*self.bleu_pairs)
            translations = translate(
                model, self.tokenizer, sources, beam_size=self.beam_size, alpha=self.alpha, max_length=self.max_length
            )
            metrics["bleu"] = corpus_bleu(translations, references, self.target_lang).score
        if self.attention_sources:
            self.write_attention_images(model, step)
        return metrics

    def teacher_forced_metrics(self, model):
        """Label-smoothed loss, perplexity and token accuracy over all validation pairs."""
        if self._sums is None:
            self._sums = self._make_sums_fn(model)
        totals = np.zeros(4)
        for (source_ids, decoder_inputs), labels in self._batches:
            totals += [float(value) for value in self._sums(source_ids, decoder_inputs, labels)]
        loss_sum, nll_sum, correct, tokens = totals
        tokens = max(tokens, 1.0)
        return {"loss": loss_sum / tokens, "perplexity": float(np.exp(nll_sum / tokens)), "accuracy": correct / tokens}

    def _make_sums_fn(self, model):
        ids_spec = tf.TensorSpec([None, None], tf.int32)

        @tf.function(input_signature=[ids_spec, ids_spec, ids_spec])
        def sums(source_ids, decoder_inputs, labels):
            logits = model((source_ids, decoder_inputs), training=False)
            loss_sum, tokens = label_smoothed_cross_entropy(labels, logits, self.label_smoothing)
            nll_sum, _ = label_smoothed_cross_entropy(labels, logits, 0.0)
            correct, _ = token_accuracy(labels, logits)
            return loss_sum, nll_sum, correct, tokens

        return sums

    def write_attention_images(self, model, step):
        """One heatmap per example and decoder layer, rows = output tokens, columns = source tokens."""
        source_ids = next(iter(data.make_translation_dataset(self.attention_sources, self.tokenizer)))
        output_ids = beam_search(model, source_ids, beam_size=self.beam_size, alpha=self.alpha).tokens
        decoder_inputs = tf.concat([tf.fill([tf.shape(output_ids)[0], 1], BOS_ID), output_ids[:, :-1]], axis=1)
        weights = [layer.numpy().mean(axis=1) for layer in cross_attention(model, source_ids, decoder_inputs)]
        for example in range(len(self.attention_sources)):
            source = _real_tokens(source_ids[example].numpy())
            output = _real_tokens(output_ids[example].numpy())
            description = (
                f"rows: output `{' '.join(self._pieces(output))}`  \n"
                f"columns: source `{' '.join(self._pieces(source))}`"
            )
            for layer, layer_weights in enumerate(weights):
                heatmap = layer_weights[example, : len(output), : len(source)]
                tf.summary.image(
                    f"attention/example_{example}/decoder_layer_{layer}",
                    _heatmap_image(heatmap),
                    step=step,
                    description=description,
                )

    def _pieces(self, ids):
        return [piece.decode("utf-8") for piece in self.tokenizer.id_to_piece(ids).numpy()]


def _real_tokens(ids):
    """The ids up to and including the first EOS, without padding."""
    ids = ids[ids != PAD_ID]
    ends = np.flatnonzero(ids == EOS_ID)
    return ids[: ends[0] + 1] if ends.size else ids


def _heatmap_image(weights):
    """`[rows, columns]` weights -> a `[1, height, width, 1]` image in [0, 1], scaled to its maximum."""
    weights = weights / max(float(weights.max()), 1e-9)
    pixels = np.kron(weights, np.ones((_HEATMAP_CELL, _HEATMAP_CELL), dtype=weights.dtype))
    return pixels[None, :, :, None]
