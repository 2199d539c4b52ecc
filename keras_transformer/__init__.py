"""keras-transformer: the Transformer of "Attention Is All You Need" as Keras 3 layers.

Data flows one way: text -> `tokenizer` -> `data` (tf.data) -> `model` -> `decoding`
-> text; `trainer` trains, `translator` wraps a trained model for export.
"""

from keras_transformer.attention import MultiHeadAttention
from keras_transformer.blocks import DecoderLayer, EncoderLayer, FeedForward, LayerNormalization
from keras_transformer.corpora import (
    CorpusError,
    DatasetUnavailableError,
    ParallelCorpus,
    load_corpus,
    load_multi30k,
    load_text_corpus,
)
from keras_transformer.data import make_training_dataset, make_translation_dataset
from keras_transformer.decoding import beam_search
from keras_transformer.dropout import Dropout
from keras_transformer.embeddings import PositionalEncoding, SharedEmbedding, sinusoidal_encoding
from keras_transformer.losses import LabelSmoothedCrossEntropy, label_smoothed_cross_entropy, token_accuracy
from keras_transformer.masks import causal_mask, padding_mask
from keras_transformer.model import Decoder, Encoder, Transformer
from keras_transformer.presets import PRESETS, get_preset
from keras_transformer.schedule import FusedAdam, TransformerSchedule, make_optimizer
from keras_transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, SubwordTokenizer, train_tokenizer

__version__ = "0.1.0"

__all__ = [
    # Layers and the model.
    "MultiHeadAttention",
    "Dropout",
    "PositionalEncoding",
    "SharedEmbedding",
    "FeedForward",
    "LayerNormalization",
    "EncoderLayer",
    "DecoderLayer",
    "Encoder",
    "Decoder",
    "Transformer",
    "PRESETS",
    "get_preset",
    "causal_mask",
    "padding_mask",
    "sinusoidal_encoding",
    # Text and data.
    "SubwordTokenizer",
    "train_tokenizer",
    "PAD_ID",
    "UNK_ID",
    "BOS_ID",
    "EOS_ID",
    "ParallelCorpus",
    "load_corpus",
    "load_multi30k",
    "load_text_corpus",
    "DatasetUnavailableError",
    "CorpusError",
    "make_training_dataset",
    "make_translation_dataset",
    # Training and decoding.
    "TransformerSchedule",
    "FusedAdam",
    "make_optimizer",
    "LabelSmoothedCrossEntropy",
    "label_smoothed_cross_entropy",
    "token_accuracy",
    "beam_search",
]
