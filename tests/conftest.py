"""Shared pytest fixtures."""

import os

# Before TensorFlow is imported anywhere: keep its C++ INFO/WARNING logs out of test output.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from made_once import made_once  # noqa: E402

# ---------------------------------------------------------------------------
# Data and tokenizer (corpora.py, tokenizer.py, data.py)
# ---------------------------------------------------------------------------

# Shared Multi30k copy, next to the repository (never inside it).
_SHARED_MULTI30K = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multi30k"
_MULTI30K_FILES = [
    f"{stem}.{lang}" for stem in ("train", "val", "test_2016_flickr") for lang in ("en", "de")
]
# Small enough for fast models in tests, large enough to tokenize like the default 8000.
_TOKENIZER_VOCAB_SIZE = 4000


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    """Directory of the raw Multi30k EN-DE files: `$MULTI30K_DIR`, else ../shared/data/multi30k.

    Skips the test when neither holds all six files.
    """
    directory = Path(os.environ.get("MULTI30K_DIR") or _SHARED_MULTI30K)
    missing = [name for name in _MULTI30K_FILES if not (directory / name).is_file()]
    if missing:
        pytest.skip(
            f"Multi30k not found in {directory} (missing {', '.join(missing)}); set "
            "MULTI30K_DIR to a directory holding train/val/test_2016_flickr .en/.de files."
        )
    return directory


@pytest.fixture(scope="session")
def multi30k_tokenizer(multi30k_dir):
    """A `SubwordTokenizer` of 4000 ids learned on Multi30k train.en + train.de.

    Trained once per session (under a second); treat it as read-only.
    """
    from keras_transformer.corpora import load_multi30k
    from keras_transformer.tokenizer import train_tokenizer

    corpus = load_multi30k(multi30k_dir)
    return train_tokenizer(corpus.training_sentences(), vocab_size=_TOKENIZER_VOCAB_SIZE)


# ---------------------------------------------------------------------------
# A tiny trained translation run (decoding.py, translator.py, export/)
# ---------------------------------------------------------------------------

_TINY_RUN_PAIRS = 3000
_TINY_RUN_STEPS = 300


@pytest.fixture(scope="session")
def tiny_translation_run(tmp_path_factory, multi30k_dir, multi30k_tokenizer) -> Path:
    """A run directory holding a "tiny" Transformer trained on 3000 Multi30k EN->DE pairs.

    300 steps without dropout (about 25 s on 2 cores): the translations are poor, but
    they end with EOS after a sentence's worth of tokens, as real ones do. Trained once
    per test run (`made_once`); treat it as read-only.
    """
    return made_once(
        tmp_path_factory, "tiny_translation_run", lambda run: _train_tiny_run(run, multi30k_dir, multi30k_tokenizer)
    )


def _train_tiny_run(run, multi30k_dir, multi30k_tokenizer):
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_transformer import Transformer, data, run_dir
    from keras_transformer.corpora import load_multi30k
    from keras_transformer.tokenizer import SubwordTokenizer

    # Seeding clears TensorFlow's kernel cache, which owns SentencePiece resources:
    # seed first, then make a fresh tokenizer.
    keras.utils.set_random_seed(0)
    tokenizer = SubwordTokenizer(multi30k_tokenizer.model_proto)
    corpus = load_multi30k(multi30k_dir)
    batches = data.make_training_dataset(
        corpus.train[:_TINY_RUN_PAIRS], tokenizer, token_budget=1024, max_length=32, seed=0
    )
    model = Transformer.from_preset("tiny", vocab_size=tokenizer.vocab_size, dropout_rate=0.0)
    model.build()
    optimizer = keras.optimizers.Adam(5e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    ids = tf.TensorSpec([None, None], tf.int32)

    @tf.function(input_signature=[(ids, ids), ids], autograph=False)  # as the Trainer's, which starts faster
    def train_step(inputs, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(inputs, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    for inputs, labels in batches.repeat().take(_TINY_RUN_STEPS):
        train_step(inputs, labels)

    run_dir.write_config(
        run,
        {"model": run_dir.model_config(model), "data": {"corpus": "multi30k", "max_length": 32}},
    )
    tokenizer.save(run_dir.tokenizer_path(run))
    tf.train.Checkpoint(model=model).save(str(run / run_dir.CHECKPOINT_DIR / "ckpt"))
    restored = run_dir.load_model(run)
    lost = [v.path for v, w in zip(model.weights, restored.weights) if not np.array_equal(v, w)]
    assert not lost, f"the checkpoint did not restore {len(lost)} weights, e.g. {lost[:3]}"
