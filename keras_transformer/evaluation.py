"""Translation quality: sacrebleu BLEU and chrF, corpus translation, and validation during training.

`corpus_scores` is the one place a corpus is scored; validation, the test set and the
checkpoint-averaging decision all go through it. BLEU, the headline figure and the one
decisions are taken on, is sacrebleu's corpus BLEU on detokenized, cased text against
raw references (its default 13a tokenization, exponential smoothing), the comparable
figure that the paper's tokenized "multi-bleu" is not. chrF (sacrebleu's chrF2:
character 6-grams, beta 2, no word n-grams) comes next to it: it needs no tokenization
and still moves when few 4-grams match, as early in training. Each score is reported
with sacrebleu's signature, e.g. `nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`
and `nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0`. For the test set,
`output_report` adds what the score hides: how many translations loop or stop early, and
lowercased BLEU, the figure nearest published Multi30k results.

Validation during training (`Validator`) computes the loss, perplexity and token
accuracy on the whole validation split (teacher forcing; pairs longer than the training
length cap left out, as training leaves them out by default), and BLEU and chrF on its first
`bleu_sentences` sentences only: decoding is the expensive part, and a fixed subset keeps
the curve comparable from one validation to the next. It also writes, for a few
validation sentences, the encoder-decoder attention of every decoder layer (mean over
heads) as TensorBoard images: heatmaps with the source's subword pieces across, the
translation's down and a colour bar (`keras_transformer.attention_plot`).

Both `translate` and `Validator` search with a `DecodingSettings` (`decoding=`). Lengths:
`translate` cuts sources at `max_source_length` tokens; `Validator`'s `max_length` is
the training length cap, which it uses as both its loss batches' limit and its
translations' source cut.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Callable, Sequence

import numpy as np
import sacrebleu
import tensorflow as tf

from keras_transformer import attention_plot, data, run_dir
from keras_transformer.decoding import DecodingSettings, beam_search
from keras_transformer.losses import label_smoothed_cross_entropy, token_accuracy
from keras_transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID, clean_text

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Scores:
    """BLEU and chrF of one corpus, each with the signature of its settings.

    Attributes:
        bleu: sacrebleu's `BLEUScore` (`.score` 0-100, `.precisions`, `.bp`, ...).
        chrf: sacrebleu's `CHRFScore` (`.score` 0-100).
        bleu_signature: e.g. "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0".
        chrf_signature: e.g. "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0".

    `str()` is two lines, BLEU first: sacrebleu's text, " | ", its signature.
    """

    bleu: sacrebleu.metrics.bleu.BLEUScore
    chrf: sacrebleu.metrics.chrf.CHRFScore
    bleu_signature: str
    chrf_signature: str

    def metrics(self) -> dict[str, float]:
        """`{"bleu", "chrf"}`: the scalars logged and written as TensorBoard summaries."""
        return {"bleu": self.bleu.score, "chrf": self.chrf.score}

    def __str__(self):
        return f"{self.bleu} | {self.bleu_signature}\n{self.chrf} | {self.chrf_signature}"


def _check_one_reference_each(hypotheses, references):
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references.")


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str], target_lang: str = "") -> Scores:
    """sacrebleu corpus BLEU and chrF of detokenized, cased hypotheses against one reference each.

    Args:
        hypotheses: Translations, one per reference, in order.
        references: Raw reference sentences.
        target_lang: Target language code; lets BLEU pick its tokenizer for zh/ja/ko
            (chrF does not tokenize).

    Returns:
        `Scores`.

    Raises:
        ValueError: If there are not as many hypotheses as references.
    """
    _check_one_reference_each(hypotheses, references)
    hypotheses, references = list(hypotheses), [list(references)]
    bleu, chrf = sacrebleu.metrics.BLEU(trg_lang=target_lang), sacrebleu.metrics.CHRF()
    bleu_score, chrf_score = bleu.corpus_score(hypotheses, references), chrf.corpus_score(hypotheses, references)
    # After scoring: a signature names the number of references, known only then.
    return Scores(bleu_score, chrf_score, str(bleu.get_signature()), str(chrf.get_signature()))


# Words and runs of punctuation: "U-Bahn-Bahn" is U, -, Bahn, -, Bahn; "..." is one token.
_TOKEN = re.compile(r"\w+|[^\w\s]+")
# A translation loops if a span of at most this many tokens comes this many times in a row.
LOOP_SPAN, LOOP_REPEATS = 4, 3
# A translation stops early if it has fewer than this share of its reference's tokens.
SHORT_SHARE = 0.5


def loops(text: str) -> bool:
    """Whether a span of 1 to `LOOP_SPAN` tokens comes `LOOP_REPEATS` or more times in a row in `text`."""
    tokens = _TOKEN.findall(text)
    for span in range(1, LOOP_SPAN + 1):
        for start in range(len(tokens) - span * LOOP_REPEATS + 1):
            first = tokens[start:start + span]
            if all(tokens[start + k * span:start + (k + 1) * span] == first for k in range(1, LOOP_REPEATS)):
                return True
    return False


def stops_early(translation: str, reference: str) -> bool:
    """Whether `translation` has fewer than `SHORT_SHARE` of `reference`'s tokens."""
    return len(_TOKEN.findall(translation)) < SHORT_SHARE * len(_TOKEN.findall(reference))


@dataclasses.dataclass(frozen=True)
class OutputReport:
    """What a corpus's translations look like beside their references, past the headline BLEU.

    Attributes:
        sentences: Translations looked at.
        looping: How many `loops` (a span of 1-4 tokens 3+ times in a row).
        short: How many `stops_early` (under half their reference's tokens).
        lowercase_bleu: sacrebleu's BLEU with `--lowercase` (13a), the figure closest to
            published Multi30k results, which are lowercased and tokenized.
        lowercase_signature: Its signature (`case:lc`).
    """

    sentences: int
    looping: int
    short: int
    lowercase_bleu: float
    lowercase_signature: str

    def __str__(self):
        return (f"{self.looping} of {self.sentences} translations loop (a span of 1-{LOOP_SPAN} tokens "
                f"{LOOP_REPEATS}+ times in a row), {self.short} under half their reference's length; "
                f"lowercased BLEU {self.lowercase_bleu:.2f} | {self.lowercase_signature}")


def output_report(hypotheses: Sequence[str], references: Sequence[str], target_lang: str = "") -> OutputReport:
    """Loops, early stops and lowercased BLEU of translations against one reference each."""
    _check_one_reference_each(hypotheses, references)
    bleu = sacrebleu.metrics.BLEU(trg_lang=target_lang, lowercase=True)
    score = bleu.corpus_score(list(hypotheses), [list(references)])
    return OutputReport(
        sentences=len(hypotheses),
        looping=sum(map(loops, hypotheses)),
        short=sum(map(stops_early, hypotheses, references)),
        lowercase_bleu=score.score,
        lowercase_signature=str(bleu.get_signature()),
    )


def translate(
    model,
    tokenizer,
    sources: Sequence[str],
    *,
    decoding: DecodingSettings = DecodingSettings(),
    batch_size: int = data.DEFAULT_EVAL_BATCH_SIZE,
    max_source_length: int = data.DEFAULT_MAX_LENGTH,
    on_batch: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Translates sentences with beam search (greedy for `DecodingSettings(beam_size=1)`).

    Sentences are decoded in batches of similar length (a batch decodes until its longest
    output ends), and returned in the order of `sources`.

    Args:
        model: A `Transformer`.
        tokenizer: The run's `SubwordTokenizer`.
        sources: Source sentences.
        decoding: The `DecodingSettings` of the search.
        batch_size: Sentences decoded together.
        max_source_length: Longest source in tokens, EOS included; longer ones are cut
            (and at `model.max_positions` for learned positional encodings, as
            `Translator` cuts them).
        on_batch: Optional `(translated, total)` callback after each batch, for
            progress output: sentences translated so far, and `len(sources)`.

    Returns:
        The translations, detokenized text; "" for a source that tokenization's cleaning
        leaves empty (`tokenizer.clean_text`).
    """
    if model.learned_positions:
        max_source_length = min(max_source_length, model.max_positions)
    # Blank sources translate to "", as the exported translator's do: the model is not asked to make one up.
    blank = [not text for text in clean_text(list(sources)).numpy()] if sources else []
    order = sorted((i for i in range(len(sources)) if not blank[i]), key=lambda i: len(sources[i]))
    by_length = [sources[i] for i in order]
    empty = len(sources) - len(order)
    outputs = []
    batches = data.make_translation_dataset(
        by_length, tokenizer, batch_size=batch_size, max_source_length=max_source_length
    ) if by_length else []
    for source_ids in batches:
        hypotheses = beam_search(model, source_ids, decoding)
        outputs.extend(text.decode("utf-8") for text in tokenizer.detokenize(hypotheses.tokens).numpy())
        if on_batch is not None:
            on_batch(empty + len(outputs), len(sources))
    translations = [""] * len(sources)
    for position, index in enumerate(order):
        translations[index] = outputs[position]
    return translations


def write_lines(path, lines: Sequence[str]) -> None:
    """Writes one line per string (UTF-8), creating parent directories; all of them or none (a full disk)."""
    run_dir.write_text_atomically(path, "".join(line.replace("\n", " ") + "\n" for line in lines))


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


@dataclasses.dataclass(frozen=True)
class TranslationAttention:
    """The encoder-decoder attention of one translation, as `attention_plot.attention_figure` takes it.

    Attributes:
        source_pieces: The source's subword pieces, EOS included.
        output_pieces: The translation's pieces, EOS included; the attention of row i is
            the one with which the model predicts piece i.
        layers: Per decoder layer, float32 `[heads, len(output_pieces), len(source_pieces)]`.
    """

    source_pieces: list[str]
    output_pieces: list[str]
    layers: list[np.ndarray]


def translation_attention(model, tokenizer, source_ids, output_ids) -> list[TranslationAttention]:
    """The attention with which the model reads each source while it writes `output_ids` (teacher forcing).

    Args:
        model: A `Transformer`.
        tokenizer: Its `SubwordTokenizer`, for the pieces.
        source_ids: int `[batch, source_length]`, ending with EOS, padded with `PAD_ID`.
        output_ids: int `[batch, output_length]`, e.g. a beam search's tokens; a row's
            pieces end at its first EOS, and padding is dropped.

    Returns:
        A `TranslationAttention` per row.
    """
    output_ids = tf.convert_to_tensor(output_ids, tf.int32)
    decoder_inputs = tf.concat([tf.fill([tf.shape(output_ids)[0], 1], BOS_ID), output_ids[:, :-1]], axis=1)
    weights = [layer.numpy() for layer in cross_attention(model, source_ids, decoder_inputs)]
    examples = []
    for row, (source, output) in enumerate(zip(np.asarray(source_ids), output_ids.numpy())):
        source, output = _real_tokens(source), _real_tokens(output)
        examples.append(
            TranslationAttention(
                _pieces(tokenizer, source),
                _pieces(tokenizer, output),
                [layer[row, :, : len(output), : len(source)] for layer in weights],
            )
        )
    return examples


class Validator:
    """The `validate_fn` of `Trainer`: loss, perplexity, accuracy, BLEU, chrF and attention images.

    Args:
        pairs: Validation `(source, target)` sentence pairs.
        tokenizer: The run's `SubwordTokenizer`; create it after seeding
            (`keras.utils.set_random_seed` drops TensorFlow's kernel cache, which holds
            the tokenizer's resource).
        label_smoothing: The training `eps`, so the validation loss is comparable.
        bleu_sentences: BLEU and chrF are computed on the first this many pairs (0: neither).
        decoding: The `DecodingSettings` of the BLEU and chrF translations and of the
            attention images.
        token_budget: Token budget of the loss batches.
        max_length: Longest sequence, as in training (the training length cap): the
            loss batches' (longer pairs are left out of the loss) and the translated
            sources' (`translate`'s `max_source_length`).
        attention_examples: Sentences whose attention is written as images.
        target_lang: Target language code for sacrebleu.

    Call arguments:
        model: The model being trained.
        step: The training step, for the image summaries.

    Returns:
        `{"loss", "perplexity", "accuracy"[, "bleu", "chrf"]}` as floats. The first call
        logs the sacrebleu signatures of BLEU and chrF (the dict has room for numbers only).
    """

    def __init__(
        self,
        pairs,
        tokenizer,
        *,
        label_smoothing=0.1,
        bleu_sentences=200,
        decoding=DecodingSettings(),
        token_budget=data.DEFAULT_TOKEN_BUDGET,
        max_length=data.DEFAULT_MAX_LENGTH,
        attention_examples=3,
        target_lang="",
    ):
        self.pairs = list(pairs)
        self.tokenizer = tokenizer
        self.label_smoothing = label_smoothing
        self.bleu_pairs = self.pairs[:bleu_sentences]
        self.decoding = decoding
        self.max_length = max_length
        self.attention_sources = [source for source, _ in self.pairs[:attention_examples]]
        self.target_lang = target_lang
        self._batches = data.make_training_dataset(
            self.pairs, tokenizer, token_budget=token_budget, max_length=max_length, shuffle=False
        )
        self._sums = None
        self._signatures_logged = False

    def __call__(self, model, step):
        metrics = self.teacher_forced_metrics(model)
        if self.bleu_pairs:
            sources, references = zip(*self.bleu_pairs)
            translations = translate(
                model, self.tokenizer, sources, decoding=self.decoding, max_source_length=self.max_length
            )
            scores = corpus_scores(translations, references, self.target_lang)
            metrics.update(scores.metrics())
            if not self._signatures_logged:
                self._signatures_logged = True
                logger.info("Validation BLEU and chrF (sacrebleu) on the first %d validation sentences: "
                            "BLEU %s, chrF %s", len(references), scores.bleu_signature, scores.chrf_signature)
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

        # Without AutoGraph, as the Trainer's step: nothing here needs it, and converting the model is slow.
        @tf.function(input_signature=[ids_spec, ids_spec, ids_spec], autograph=False)
        def sums(source_ids, decoder_inputs, labels):
            logits = model((source_ids, decoder_inputs), training=False)
            loss_sum, tokens = label_smoothed_cross_entropy(labels, logits, self.label_smoothing)
            nll_sum, _ = label_smoothed_cross_entropy(labels, logits, 0.0)
            correct, _ = token_accuracy(labels, logits)
            return loss_sum, nll_sum, correct, tokens

        return sums

    def write_attention_images(self, model, step):
        """An image per example and decoder layer: the heatmap of `attention_plot`, mean over heads.

        The translations are the beam search's of sources cut at `max_length`, as BLEU's; the images are tagged
        `attention/example_E/decoder_layer_L`.
        """
        sources = data.make_translation_dataset(
            self.attention_sources, self.tokenizer, max_source_length=self.max_length
        )
        source_ids = next(iter(sources))
        output_ids = beam_search(model, source_ids, self.decoding).tokens
        for example, attention in enumerate(translation_attention(model, self.tokenizer, source_ids, output_ids)):
            description = (
                f"rows: output `{' '.join(attention.output_pieces)}`  \n"
                f"columns: source `{' '.join(attention.source_pieces)}`"
            )
            for layer, weights in enumerate(attention.layers):
                figure = attention_plot.attention_figure(
                    [weights], attention.source_pieces, attention.output_pieces, layer_numbers=[layer]
                )
                tf.summary.image(
                    f"attention/example_{example}/decoder_layer_{layer}",
                    _png_image(attention_plot.figure_png(figure)),
                    step=step,
                    description=description,
                )


def _real_tokens(ids):
    """The ids up to and including the first EOS, without padding."""
    ids = ids[ids != PAD_ID]
    ends = np.flatnonzero(ids == EOS_ID)
    return ids[: ends[0] + 1] if ends.size else ids


def _pieces(tokenizer, ids):
    """The subword pieces of `ids` as text, e.g. ["▁Ein", "▁Hund", "</s>"]."""
    return [piece.decode("utf-8") for piece in tokenizer.id_to_piece(ids).numpy()]


def _png_image(png):
    """PNG bytes -> the uint8 `[1, height, width, 3]` batch `tf.summary.image` takes."""
    return tf.image.decode_png(png, channels=3)[tf.newaxis]
