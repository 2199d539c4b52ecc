"""Corpus scores (BLEU and chrF) wherever they are reported: validation, the test set, checkpoint averaging.

Expected values come from sacrebleu's own `corpus_bleu`/`corpus_chrf` functions, an entry
point independent of the metric objects `keras_transformer.evaluation` uses, and the
TensorBoard scalars are read back from the event files.
"""

import logging
import re

import numpy as np
import pytest
import sacrebleu
import sentencepiece
import tensorflow as tf

from fake_runs import PAIRS, REFERENCES, checkpointed_run, fake_translations, validation_corpus
from keras_transformer import distribution, evaluation, run_dir, run_settings, training_run
from keras_transformer.decoding_settings import DecodingSettings
from keras_transformer.model import Transformer
from keras_transformer.tokenizer import BOS_ID, EOS_ID
from keras_transformer.trainer import Trainer, TrainingConfig

# Some right, some cased or inflected differently, one missing: neither score is 0 or 100.
HYPOTHESES = [
    "Ein Mann in einem roten Haus.",
    "ein Hund läuft auf dem Gras.",
    "Zwei Männer spielen auf die Straße",
    "Ein Kind.",
]
VERSION = sacrebleu.__version__
BLEU_SIGNATURE = f"nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:{VERSION}"
CHRF_SIGNATURE = f"nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:{VERSION}"


def test_chrf_is_sacrebleus_corpus_chrf_and_bleu_its_cased_13a_corpus_bleu():
    scores = evaluation.corpus_scores(HYPOTHESES, REFERENCES, "de")

    assert scores.chrf.score == sacrebleu.corpus_chrf(HYPOTHESES, [REFERENCES]).score
    assert scores.bleu.score == sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES], tokenize="13a").score
    assert 0 < scores.bleu.score < scores.chrf.score < 100
    assert (scores.bleu_signature, scores.chrf_signature) == (BLEU_SIGNATURE, CHRF_SIGNATURE)
    assert scores.metrics() == {"bleu": scores.bleu.score, "chrf": scores.chrf.score}
    # Cased: lowercasing a hypothesis changes BLEU.
    lowered = evaluation.corpus_scores([h.lower() for h in HYPOTHESES], REFERENCES, "de")
    assert lowered.bleu.score < scores.bleu.score


def test_scores_print_bleu_then_chrf_each_with_its_signature():
    scores = evaluation.corpus_scores(HYPOTHESES, REFERENCES, "de")
    bleu_line, chrf_line = str(scores).splitlines()
    assert re.fullmatch(rf"BLEU = {scores.bleu.score:.2f} [\d./]+ \(BP = .*\) \| {re.escape(BLEU_SIGNATURE)}",
                        bleu_line)
    assert chrf_line == f"chrF2 = {scores.chrf.score:.2f} | {CHRF_SIGNATURE}"


@pytest.mark.parametrize(
    "text, looping",
    [
        ("Ein Mann fährt U-Bahn-Bahn-Bahn.", True),  # "- Bahn" three times
        ("ja ja ja", True),
        ("auf dem Weg , auf dem Weg , auf dem Weg ,", True),  # a span of 4 tokens
        ("auf dem Weg , auf dem Weg , der auf dem Weg", False),  # not in a row
        ("Ein Kind , ein Kind , ein Kind , ein Kind", True),  # "Kind , ein": case counts
        ("Ein Kind , ein Kind , ein Kind", False),  # "Kind , ein" twice
        ("Zwei Hunde , zwei Hunde .", False),  # only twice
        ("Ein Hund wartet ...", False),  # "..." is one token
        ("", False),
    ],
)
def test_a_translation_loops_when_a_short_span_comes_three_times_in_a_row(text, looping):
    assert evaluation.loops(text) is looping


@pytest.mark.parametrize("kept", [0, 1, 2, 3, 4])
def test_a_translation_stops_early_with_fewer_than_half_its_references_tokens(kept):
    """Exactly half is not early: "fewer than `SHORT_SHARE`"."""
    reference = "Zwei Kinder spielen ."
    translation = " ".join(reference.split()[:kept])
    assert evaluation.stops_early(translation, reference) is (kept < evaluation.SHORT_SHARE * 4)


def test_bleu_tokenizes_a_chinese_target_as_sacrebleu_does_for_chinese():
    """`target_lang` picks sacrebleu's tokenizer: 13a would read each unspaced sentence as one word."""
    references = ["一个男人在红色的房子里。", "一只狗在草地上跑。"]
    hypotheses = ["一个男人在红房子里。", "一只狗在草上跑。"]
    expected = sacrebleu.corpus_bleu(hypotheses, [references], tokenize="zh").score
    assert expected != sacrebleu.corpus_bleu(hypotheses, [references], tokenize="13a").score

    scores = evaluation.corpus_scores(hypotheses, references, "zh")

    assert scores.bleu.score == expected and "tok:zh" in scores.bleu_signature


def test_the_output_report_counts_loops_and_early_stops_and_gives_lowercased_bleu():
    references = ["Ein Mann fährt mit der U-Bahn .", "Ein Hund rennt über das Gras .", "Zwei Kinder spielen ."]
    hypotheses = ["ein Mann fährt U-Bahn-Bahn-Bahn .", "Ein Hund .", "zwei Kinder spielen ."]

    report = evaluation.output_report(hypotheses, references, "de")

    # "Ein Hund ." has 3 of its reference's 8 tokens; "zwei Kinder spielen ." all 4.
    assert (report.sentences, report.looping, report.short) == (3, 1, 1)
    expected = sacrebleu.corpus_bleu(hypotheses, [references], lowercase=True)
    assert report.lowercase_bleu == expected.score
    assert report.lowercase_bleu > sacrebleu.corpus_bleu(hypotheses, [references]).score  # "ein", "zwei"
    assert "case:lc" in report.lowercase_signature
    with pytest.raises(ValueError, match="2 hypotheses for 3 references"):
        evaluation.output_report(hypotheses[:2], references)


def test_written_translations_stay_one_a_line_whatever_they_hold(tmp_path):
    """A translation may hold a line break (a generated <0x0A> byte piece): the file must stay line-aligned
    with the references, one translation a line, the break a space."""
    translations = ["Ein Hund\nrennt.", "", "Zwei\n\nKatzen.", "Ein Kind."]
    path = tmp_path / "out" / "test.de"

    evaluation.write_lines(path, translations)

    lines = path.read_bytes().decode("utf-8").split("\n")
    assert lines == [" ".join(text.split("\n")) for text in translations] + [""]


def test_as_many_hypotheses_as_references_are_needed():
    with pytest.raises(ValueError, match="3 hypotheses for 4 references"):
        evaluation.corpus_scores(HYPOTHESES[:3], REFERENCES)


def _values(scalars, tag):
    return [(step, value) for step, _, value in scalars[tag]]


def _translations_for_the_references(monkeypatch):
    """`evaluation.translate` answers `HYPOTHESES` for the `PAIRS` sources, whatever the model."""
    sources = [source for source, _ in PAIRS]

    def translate(model, tokenizer, texts, **kwargs):
        return [HYPOTHESES[sources.index(text)] for text in texts]

    monkeypatch.setattr(evaluation, "translate", translate)


def _copy_task(input_context):
    """Two `((source, decoder_inputs), labels)` batches of random ids."""
    ids = tf.random.stateless_uniform([2, 4, 10], seed=(1, 2), minval=4, maxval=50, dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices(((ids[:, :, :9], ids[:, :, :9]), ids[:, :, 1:]))


@pytest.mark.slow
def test_validation_logs_and_writes_chrf_next_to_bleu(tmp_path, multi30k_tokenizer, monkeypatch, caplog):
    """A training run's validation: the metrics, its log lines and its TensorBoard scalars hold both scores."""
    _translations_for_the_references(monkeypatch)
    caplog.set_level(logging.INFO, logger="keras_transformer")
    validator = evaluation.Validator(
        PAIRS, multi30k_tokenizer, bleu_sentences=len(PAIRS), decoding=DecodingSettings(beam_size=1),
        attention_examples=0, target_lang="de",
    )
    trainer = Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=multi30k_tokenizer.vocab_size, dtype=dtype),
        tmp_path,
        TrainingConfig(train_steps=2, warmup_steps=20, eval_every=1),
        validate_fn=validator,
    )

    trainer.fit(_copy_task)

    expected_bleu = sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score
    expected_chrf = sacrebleu.corpus_chrf(HYPOTHESES, [REFERENCES]).score
    scalars = run_dir.read_scalars(tmp_path / run_dir.LOG_DIR / "validation")
    assert _values(scalars, "bleu") == [(1, pytest.approx(expected_bleu)), (2, pytest.approx(expected_bleu))]
    assert _values(scalars, "chrf") == [(1, pytest.approx(expected_chrf)), (2, pytest.approx(expected_chrf))]
    messages = [record.getMessage() for record in caplog.records]
    validations = [message for message in messages if message.startswith("validation at step")]
    assert len(validations) == 2
    assert all(f"| bleu {expected_bleu:.3f} | chrf {expected_chrf:.3f}" in line for line in validations)
    # The signatures, once: they do not change from one validation to the next.
    (signatures,) = [message for message in messages if "sacrebleu" in message]
    assert signatures.endswith(f"first 4 validation sentences: BLEU {BLEU_SIGNATURE}, chrF {CHRF_SIGNATURE}")


def test_validation_bleu_and_chrf_are_those_of_the_first_bleu_sentences_pairs(multi30k_tokenizer, monkeypatch):
    """The fixed subset the curve is comparable on: the first `bleu_sentences`, in order, against their references."""
    _translations_for_the_references(monkeypatch)
    monkeypatch.setattr(evaluation.Validator, "teacher_forced_metrics", lambda self, model: {})
    validator = evaluation.Validator(
        PAIRS, multi30k_tokenizer, bleu_sentences=2, attention_examples=0, target_lang="de"
    )

    metrics = validator(None, 1)

    first = sacrebleu.corpus_bleu(HYPOTHESES[:2], [REFERENCES[:2]]).score
    assert first != sacrebleu.corpus_bleu(HYPOTHESES[-2:], [REFERENCES[-2:]]).score
    assert metrics == {
        "bleu": pytest.approx(first),
        "chrf": pytest.approx(sacrebleu.corpus_chrf(HYPOTHESES[:2], [REFERENCES[:2]]).score),
    }


def test_the_test_set_line_and_scalars_hold_bleu_and_chrf(tmp_path, monkeypatch, caplog):
    """train.py's final evaluation prints both scores with their signatures and writes both scalars."""
    _translations_for_the_references(monkeypatch)
    monkeypatch.setattr(run_dir, "checkpoint_path", lambda run, which: str(run / "checkpoints" / "ckpt-7"))
    monkeypatch.setattr(run_dir, "load_model", lambda run, which: None)
    monkeypatch.setattr(run_dir, "load_tokenizer", lambda run: None)
    caplog.set_level(logging.INFO, logger="keras_transformer")
    corpus = validation_corpus(test=PAIRS)
    settings = run_settings.layered(
        {"preset": "tiny", "average_last": 0, "bleu_sentences": 4, "beam_size": 1, "alpha": 0.6, "max_length": 16}
    )

    training_run.final_evaluation(tmp_path, corpus, settings)

    expected = evaluation.corpus_scores(HYPOTHESES, REFERENCES, "de")
    (line,) = [record.getMessage() for record in caplog.records if record.getMessage().startswith("Test ")]
    headline, bleu_line, chrf_line, report_line = line.splitlines()
    assert headline.startswith("Test BLEU and chrF (checkpoints/ckpt-7, 4 sentences, ")
    assert bleu_line == f"  {expected.bleu} | {BLEU_SIGNATURE}"
    assert chrf_line == f"  {expected.chrf} | {CHRF_SIGNATURE}"
    assert report_line == f"  {evaluation.output_report(HYPOTHESES, REFERENCES, 'de')}"
    scalars = run_dir.read_scalars(tmp_path / run_dir.LOG_DIR / "test")
    assert _values(scalars, "bleu") == [(7, pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score))]
    assert _values(scalars, "chrf") == [(7, pytest.approx(sacrebleu.corpus_chrf(HYPOTHESES, [REFERENCES]).score))]
    lowercase = sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES], lowercase=True).score
    assert _values(scalars, "bleu_lowercase") == [(7, pytest.approx(lowercase))]
    assert (tmp_path / run_dir.TRANSLATIONS_DIR / "test.de").read_text(encoding="utf-8").splitlines() == HYPOTHESES


# Higher BLEU, lower chrF than `CHRF_BETTER`: four-word runs in one sentence, little elsewhere.
BLEU_BETTER = ["Ein Mann in einem roten Haus.", "Hund.", "Männer.", "Mädchen."]
# Many right characters in wrongly inflected words: no matching 4-gram, BLEU 0.
CHRF_BETTER = [
    "Einen Manne im einen rotem Hause",
    "Einen Hunde rennen aufs den Grase",
    "Zweie Männern spielten aufs die Straßen",
    "Eine Mädchens springen ins dem Seen",
]


@pytest.mark.parametrize("bleu_better", ["averaged", "latest"])
def test_bleu_decides_whether_the_average_is_kept_and_chrf_is_logged_next_to_it(
    tmp_path, monkeypatch, caplog, bleu_better
):
    """Of two checkpoints, one better in BLEU and the other in chrF, the average is kept when it is BLEU's."""
    checkpointed_run(tmp_path, (100, 200))  # tiny's checkpoints: every 100 steps
    fake_translations(monkeypatch, winner=bleu_better, wins=BLEU_BETTER, loses=CHRF_BETTER)
    caplog.set_level(logging.INFO, logger="keras_transformer")
    settings = run_settings.layered(
        {"preset": "tiny", "average_last": 2, "bleu_sentences": 4, "beam_size": 1, "alpha": 0.6, "max_length": 16}
    )

    training_run.average_if_better(tmp_path, validation_corpus(), settings)

    assert (tmp_path / run_dir.AVERAGED_DIR).exists() == (bleu_better == "averaged")
    by_bleu, by_chrf = (evaluation.corpus_scores(h, REFERENCES, "de") for h in (BLEU_BETTER, CHRF_BETTER))
    assert by_bleu.bleu.score > by_chrf.bleu.score and by_bleu.chrf.score < by_chrf.chrf.score
    averaged, latest = (by_bleu, by_chrf) if bleu_better == "averaged" else (by_chrf, by_bleu)
    (line,) = [record.getMessage() for record in caplog.records if record.getMessage().startswith("Validation BLEU")]
    assert line == (
        f"Validation BLEU (4 sentences): averaged {averaged.bleu.score:.2f} (chrF {averaged.chrf.score:.2f}), "
        f"latest {latest.bleu.score:.2f} (chrF {latest.chrf.score:.2f})."
    )


def test_translate_reads_blank_and_long_sources_as_the_exported_translator_does(multi30k_tokenizer):
    """A line that tokenization's cleaning leaves empty (a byte order mark, a tab) translates to "", not a
    made-up sentence; a learned-positions model gets sources cut to its positions, not a ValueError."""
    from keras_transformer.translator import Translator

    model = Transformer.from_preset(
        "tiny", vocab_size=multi30k_tokenizer.vocab_size, learned_positions=True, max_positions=8
    )
    model.build()
    decoding = DecodingSettings(beam_size=2)
    sources = ["\ufeff", "a man", "\t", "two dogs run on the grass in front of a big white house ."]
    translator = Translator(model, multi30k_tokenizer, decoding=decoding)
    expected = [text.decode() for text in translator.translate(tf.constant(sources))["translation"].numpy()]
    assert expected[0] == expected[2] == ""
    assert evaluation.translate(model, multi30k_tokenizer, sources, decoding=decoding, batch_size=1) == expected


def test_the_validation_loss_perplexity_and_accuracy_are_per_token_means_over_the_pairs_that_fit(multi30k_tokenizer):
    """Written out in NumPy, one unpadded pair at a time: the smoothed loss, exp of the mean NLL, the argmax
    accuracy; a pair with a side over `max_length - 1` tokens is left out, as training leaves it out."""
    model = Transformer.from_preset("tiny", vocab_size=multi30k_tokenizer.vocab_size)
    model.build()
    encode = sentencepiece.SentencePieceProcessor(model_proto=multi30k_tokenizer.model_proto).encode
    max_length, eps, vocab_size = 12, 0.2, multi30k_tokenizer.vocab_size
    long_pair = ("A man in a red shirt is climbing a very tall rock wall.", "Ein Mann klettert.")
    pairs = [*PAIRS, long_pair]
    validator = evaluation.Validator(
        pairs, multi30k_tokenizer, label_smoothing=eps, bleu_sentences=0, attention_examples=0,
        token_budget=64, max_length=max_length,
    )

    loss = nll = correct = tokens = 0.0
    kept = 0
    for source, target in pairs:
        source_ids, target_ids = encode(source), encode(target)
        if max(len(source_ids), len(target_ids)) > max_length - 1:
            continue
        kept += 1
        labels = np.array(target_ids + [EOS_ID])
        logits = model((np.array([source_ids + [EOS_ID]]), np.array([[BOS_ID] + target_ids])), training=False)
        logits = np.asarray(logits, np.float64)[0]
        log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        log_probs -= logits.max(-1, keepdims=True)
        smoothed = np.full(log_probs.shape, eps / (vocab_size - 1))
        smoothed[np.arange(len(labels)), labels] = 1 - eps
        loss -= (smoothed * log_probs).sum()
        nll -= log_probs[np.arange(len(labels)), labels].sum()
        correct += (logits.argmax(-1) == labels).sum()
        tokens += len(labels)
    assert kept == len(PAIRS)  # the long pair is over the cap, the others fit

    metrics = validator(model, 1)

    assert metrics == {
        "loss": pytest.approx(loss / tokens, rel=1e-4),
        "perplexity": pytest.approx(np.exp(nll / tokens), rel=1e-4),
        "accuracy": pytest.approx(correct / tokens),
    }
