"""Serves requests with an XLA export as a server would, counting XLA's compilations.

Run by tests/test_export.py in a fresh process, with `XLA_FLAGS=--xla_dump_to=DUMP_DIR`
(XLA reads its flags once per process): `python count_xla_compilations.py EXPORT_DIR
DUMP_DIR REQUESTS_JSON RESULTS_JSON`. REQUESTS_JSON holds a list of batches of sentences
(each the base64 of its bytes: a server must survive bytes that are not UTF-8);
RESULTS_JSON receives, for each in turn, `serving_default`'s outputs and how many times
the beam search (the translator's `_search`, whose XLA module is named after it) had been
compiled by then: XLA dumps each module it compiles once, before optimizing it. (That the
graph-mode search compiles nothing is test_export.py's standalone test, which disables
XLA compilation.)
"""

import base64
import json
import sys
from pathlib import Path

import tensorflow as tf
import tensorflow_text  # noqa: F401  Registers the SentencePiece ops.
from standalone_translate import as_json  # tests/, this script's directory, is on sys.path


def search_compilations(dump_dir):
    return len(list(Path(dump_dir).glob("module_*_inference__search_*.before_optimizations.txt")))


def main(export_dir, dump_dir, requests_path, results_path):
    serving_default = tf.saved_model.load(export_dir).signatures["serving_default"]
    results = []
    for batch in json.loads(Path(requests_path).read_text()):
        text = tf.constant([base64.b64decode(sentence) for sentence in batch], dtype=tf.string)
        outputs = serving_default(text=text)
        results.append({**as_json(outputs), "search_compilations": search_compilations(dump_dir)})
    Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
