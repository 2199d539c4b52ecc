"""keras-transformer: the Transformer of "Attention Is All You Need" as Keras 3 layers.

Data flows one way: text -> `tokenizer` -> `data` (tf.data) -> `model` -> `decoding`
-> text; `trainer` trains, `translator` wraps a trained model for export.

The names below are loaded when first used: `import keras_transformer` does not import
TensorFlow, so that a command can choose TensorFlow's CPU kernels first
(`keras_transformer.cpu_kernels`). `from keras_transformer import Transformer` loads
what it needs, as does every submodule import; any layer, the loss or the schedule
loads all the classes a `.keras` file may name.
"""

import importlib

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    # Layers and the model.
    "MultiHeadAttention": "attention",
    "MimeticInitializer": "attention",
    "Dropout": "dropout",
    "PositionalEncoding": "embeddings",
    "SharedEmbedding": "embeddings",
    "sinusoidal_encoding": "embeddings",
    "FeedForward": "blocks",
    "LayerNormalization": "blocks",
    "EncoderLayer": "blocks",
    "DecoderLayer": "blocks",
    "Encoder": "model",
    "Decoder": "model",
    "Transformer": "model",
    "causal_mask": "masks",
    "padding_mask": "masks",
    # Recipes.
    "Recipe": "recipes",
    "RECIPES": "recipes",
    "get_recipe": "recipes",
    "get_preset": "recipes",
    # Text and data.
    "SubwordTokenizer": "tokenizer",
    "train_tokenizer": "tokenizer",
    "PAD_ID": "tokenizer",
    "UNK_ID": "tokenizer",
    "BOS_ID": "tokenizer",
    "EOS_ID": "tokenizer",
    "CORPORA": "corpora",
    "ParallelCorpus": "corpora",
    "load_corpus": "corpora",
    "load_multi30k": "corpora",
    "load_text_corpus": "corpora",
    "DatasetUnavailableError": "corpora",
    "CorpusError": "corpora",
    "make_training_dataset": "data",
    "make_translation_dataset": "data",
    # Training and decoding.
    "TransformerSchedule": "schedule",
    "FusedAdam": "schedule",
    "make_optimizer": "schedule",
    "LabelSmoothedCrossEntropy": "losses",
    "label_smoothed_cross_entropy": "losses",
    "token_accuracy": "losses",
    "DecodingSettings": "decoding_settings",
    "beam_search": "decoding",
}

__all__ = list(_EXPORTS)

# The modules whose classes `.keras` files name (registered with Keras). Loading a name
# from any of them loads them all, so that a file saved with any of those classes (a
# compiled model names its loss and learning-rate schedule too) loads after one import.
_SERIALIZABLE = ("attention", "blocks", "dropout", "embeddings", "losses", "model", "schedule")


def __getattr__(name):
    if name in _EXPORTS:
        if _EXPORTS[name] in _SERIALIZABLE:
            for module in _SERIALIZABLE:
                importlib.import_module(f"{__name__}.{module}")
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value  # Loaded once.
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")  # keras_transformer.decoding and the like.
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
