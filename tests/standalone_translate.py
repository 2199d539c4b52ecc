"""Translates with an exported SavedModel using only `tensorflow` and `tensorflow_text`.

Run by tests/test_export.py in a fresh process, as a serving host without this package
would: `python standalone_translate.py EXPORT_DIR REQUESTS_JSON RESULTS_JSON`. XLA
compilation is disabled first, as TF Serving disables it unless started with
`--xla_cpu_compilation_enabled=true`: a graph-mode export must not need it.
REQUESTS_JSON holds `{"text": [...], "options": {"beam_size": .., "alpha": .., "max_length": .., "min_length": ..}}`;
RESULTS_JSON receives the outputs of `serving_default` and `translate_with_options`.
"""

import ctypes
import json
import os
import sys

import numpy as np
import tensorflow as tf
import tensorflow_text  # noqa: F401  Registers the SentencePiece ops.


def as_json(outputs):
    """Outputs as lists of str and float."""
    return {
        name: np.char.decode(tensor.numpy().astype(bytes), "utf-8").tolist()
        if tensor.dtype == tf.string
        else tensor.numpy().tolist()
        for name, tensor in outputs.items()
    }


def disable_xla_compilation():
    """What TF Serving's server does without `--xla_cpu_compilation_enabled`: `tensorflow::DisableXlaCompilation()`."""
    library = ctypes.CDLL(os.path.join(os.path.dirname(tf.__file__), "libtensorflow_cc.so.2"))
    library._ZN10tensorflow21DisableXlaCompilationEv()
    library._ZN10tensorflow20FailOnXlaCompilationEv.restype = ctypes.c_bool
    assert library._ZN10tensorflow20FailOnXlaCompilationEv()


def main(export_dir, requests_path, results_path):
    assert "keras_transformer" not in sys.modules
    disable_xla_compilation()
    with open(requests_path) as file:
        requests = json.load(file)
    signatures = tf.saved_model.load(export_dir).signatures
    text = tf.constant(requests["text"], dtype=tf.string)
    options = requests["options"]
    results = {
        "serving_default": as_json(signatures["serving_default"](text=text)),
        "translate_with_options": as_json(
            signatures["translate_with_options"](
                text=text,
                beam_size=tf.constant(options["beam_size"]),
                alpha=tf.constant(options["alpha"], tf.float32),
                max_length=tf.constant(options["max_length"]),
                min_length=tf.constant(options["min_length"]),
            )
        ),
        "keras_transformer_imported": any(
            name.startswith("keras_transformer") for name in sys.modules
        ),
    }
    with open(results_path, "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main(*sys.argv[1:])
