"""keras-transformer: the Transformer of "Attention Is All You Need" as Keras 3 layers."""

from keras_transformer.attention import MultiHeadAttention
from keras_transformer.blocks import DecoderLayer, EncoderLayer, FeedForward
from keras_transformer.embeddings import PositionalEncoding, SharedEmbedding, sinusoidal_encoding
from keras_transformer.masks import causal_mask, padding_mask
from keras_transformer.model import Decoder, Encoder, Transformer
from keras_transformer.presets import PRESETS, get_preset

__version__ = "0.1.0"

__all__ = [
    "MultiHeadAttention",
    "PositionalEncoding",
    "SharedEmbedding",
    "FeedForward",
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
]
