"""Export a trained run as a SavedModel that TF Serving serves, and check it before use.

`python -m export --run-dir RUN --out models/transformer` writes TF Serving's versioned
layout:

    models/transformer/<version>/saved_model.pb
                                 variables/
                                 assets/tokenizer.model                    the vocabulary
                                 assets.extra/tf_serving_warmup_requests   PredictionLogs

Signatures (tokenization, beam search and detokenization are all in the graph, through
tensorflow-text's SentencePiece ops, which TF Serving's model server links in):

* `serving_default`: `text` tf.string `[batch]` -> `translation` tf.string `[batch]`,
  `score` float32 `[batch]` (beam size and length penalty fixed at export). With
  `--jit-compile` its beam search is compiled by XLA (see `Translator`): TF Serving then
  needs `--xla_cpu_compilation_enabled=true` on CPUs.
* `translate_with_options`: `text`, `beam_size` int32 `[]`, `alpha` float32 `[]`,
  `max_length` int32 `[]`, `min_length` int32 `[]` -> `translation`, `score`, and the n-best lists
  `translations` tf.string `[batch, beam_size]`, `scores` float32 `[batch, beam_size]`.
  Scalars do not fit TF Serving's row format: call it with the columnar
  `{"inputs": {...}}` REST format.

The SentencePiece op keeps its model as a graph attribute, so the graph itself carries
the vocabulary; `assets/tokenizer.model` ships the same file for clients and for the
`sentencepiece` tools.

The version is written under a temporary name, reloaded and checked (it must translate
the check sentences exactly as the in-process `Translator` does), and only then renamed
to its number: TF Serving, which polls the base directory for numbered versions, never
sees a partial or unchecked model.
"""

import os
import shutil
from pathlib import Path

import numpy as np
import tensorflow as tf

from keras_transformer.translator import OPTIONS_SIGNATURE, SERVING_SIGNATURE, Translator

WARMUP_FILE = "tf_serving_warmup_requests"
VOCABULARY_ASSET = "tokenizer.model"

# Sentences every export is checked on, besides the caller's: ordinary ones, and the
# inputs a server must survive.
CHECK_SENTENCES = (
    "A man in a blue shirt is standing on a ladder.",
    "Two dogs are running through the snow.",
    "A little girl plays with a ball in the park.",
    "",
    "   ",
    "A dog 🐕 runs. 你好世界",
    "word " * 2000,
)


class ExportError(RuntimeError):
    """An export that cannot be written or that does not behave as the in-process model."""


def next_version(base_dir):
    """One more than the largest numbered version under `base_dir` (1 if none)."""
    base_dir = Path(base_dir)
    versions = (
        [int(p.name) for p in base_dir.iterdir() if p.name.isdigit()] if base_dir.is_dir() else []
    )
    return max(versions, default=0) + 1


def export_run(
    run_dir,
    out,
    *,
    version=None,
    which="best",
    model_name=None,
    check_sentences=(),
    log=print,
    **translator_options,
):
    """Exports the translator of a run directory as version `version` under `out`, checked.

    Args:
        run_dir: Training run directory (see `keras_transformer.run_dir`).
        out: Base directory of the model in TF Serving (e.g. `models/transformer`).
        version: Version number; defaults to `next_version(out)`. An existing
            version is never overwritten.
        which: Checkpoint of the run to export, see `run_dir.checkpoint_path`.
        model_name: Model name written in the warmup requests (default: `out`'s name).
        check_sentences: Sentences to check the export on, besides `CHECK_SENTENCES`.
        log: Receives one line per step and per check.
        **translator_options: `Translator` arguments (`beam_size`, `alpha`, ...).

    Returns:
        The version directory.

    Raises:
        ExportError: If the version is negative or exists, or the reloaded model is not the
            in-process one.
    """
    out = Path(out)
    version = next_version(out) if version is None else version
    if version < 0:
        raise ExportError(f"TF Serving loads versions numbered 0 or more, not {version}.")
    final = out / str(version)
    if final.exists():
        raise ExportError(
            f"{final} exists; choose another --version (next free: {next_version(out)})."
        )
    translator = Translator.from_run_dir(run_dir, which, **translator_options)
    out.mkdir(parents=True, exist_ok=True)
    # Not a number, so TF Serving ignores it; made like any directory (not mkdtemp's
    # owner-only mode), so a server running as another user can read the version.
    staging = out / f".export-{version}-{os.getpid()}"
    staging.mkdir()
    try:
        sentences = list(CHECK_SENTENCES) + list(check_sentences)
        save_translator(translator, staging)
        write_warmup_requests(staging, model_name or out.resolve().name, sentences[:3])
        log(f"Wrote {staging}; checking it.")
        for line in verify_export(staging, translator, sentences):
            log(f"  ok: {line}")
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"Exported {run_dir} ({which} checkpoint) to {final}.")
    return final


def save_translator(translator, directory):
    """Saves `translator` as a SavedModel with the `serving_default` and options signatures."""
    tf.saved_model.save(translator, str(directory), signatures=translator.signatures())


def warmup_records(model_name, sentence_batches):
    """Serialized `tensorflow.serving.PredictionLog`s, one `serving_default` request per batch.

    Uses the `tensorflow-serving-api` protos when installed; otherwise writes the same
    bytes from TensorFlow's `TensorProto` and the (stable) field numbers of TF
    Serving's `prediction_log.proto`, `predict.proto` and `model.proto`.
    """
    records = []
    for batch in sentence_batches:
        tensor = tf.make_tensor_proto(np.array(batch, dtype=object), dtype=tf.string)
        records.append(_prediction_log(model_name, SERVING_SIGNATURE, {"text": tensor}))
    return records


def _prediction_log(model_name, signature_name, inputs):
    try:
        from tensorflow_serving.apis import predict_pb2, prediction_log_pb2
    except ImportError:
        return _prediction_log_bytes(model_name, signature_name, inputs)
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model_name
    request.model_spec.signature_name = signature_name
    for name, tensor in inputs.items():
        request.inputs[name].CopyFrom(tensor)
    log = prediction_log_pb2.PredictionLog(
        predict_log=prediction_log_pb2.PredictLog(request=request)
    )
    return log.SerializeToString()


def _prediction_log_bytes(model_name, signature_name, inputs):
    """`PredictionLog{predict_log: PredictLog{request: PredictRequest}}` in protobuf wire format."""
    model_spec = _field(1, model_name.encode()) + _field(3, signature_name.encode())
    request = _field(1, model_spec) + b"".join(
        _field(2, _field(1, name.encode()) + _field(2, tensor.SerializeToString()))  # map entry
        for name, tensor in inputs.items()
    )
    return _field(6, _field(1, request))


def _field(number, payload):
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value):
    encoded = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        encoded.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(encoded)


def write_warmup_requests(directory, model_name, sentences):
    """Writes `assets.extra/tf_serving_warmup_requests`: a one-sentence request and a batch."""
    extra = Path(directory) / "assets.extra"
    extra.mkdir(exist_ok=True)
    with tf.io.TFRecordWriter(str(extra / WARMUP_FILE)) as writer:
        for record in warmup_records(model_name, [sentences[:1], sentences]):
            writer.write(record)


def verify_export(directory, translator, sentences):
    """Reloads the SavedModel in `directory` and checks it against `translator`.

    Args:
        directory: The SavedModel directory.
        translator: The in-process `Translator` that was saved.
        sentences: Sentences to translate with both.

    Yields:
        A description of each check that passed.

    Raises:
        ExportError: At the first check that fails.
    """
    directory = Path(directory)
    loaded = tf.saved_model.load(str(directory))
    yield _check_signatures(loaded)

    text = tf.constant(sentences, dtype=tf.string)
    expected = translator.translate(text)
    served = loaded.signatures[SERVING_SIGNATURE](text=text)
    _check_same(served, expected, f"{SERVING_SIGNATURE} vs the in-process translator")
    yield f"{SERVING_SIGNATURE} translates {len(sentences)} sentences as the in-process translator"

    with_options = loaded.signatures[OPTIONS_SIGNATURE](
        text=text,
        beam_size=tf.constant(translator.beam_size),
        alpha=tf.constant(translator.alpha, tf.float32),
        max_length=tf.constant(0),
        min_length=tf.constant(translator.min_length),
    )
    # The options signature runs in graph mode: against an XLA search, allow XLA's rounding.
    tolerance = 1e-4 if translator.jit_compile else 1e-6
    _check_same(
        with_options, expected, f"{OPTIONS_SIGNATURE} vs {SERVING_SIGNATURE}", tolerance
    )
    yield (
        f"{OPTIONS_SIGNATURE}(beam_size={translator.beam_size}, alpha={translator.alpha}) gives "
        f"the same best translations, with {with_options['translations'].shape[1]}-best lists"
    )

    vocabulary = directory / "assets" / VOCABULARY_ASSET
    if not vocabulary.is_file() or vocabulary.read_bytes() != translator.tokenizer.model_proto:
        raise ExportError(f"{vocabulary} is missing or differs from the tokenizer in the graph.")
    yield f"assets/{VOCABULARY_ASSET} is the tokenizer's SentencePiece model"

    warmup = directory / "assets.extra" / WARMUP_FILE
    count = sum(1 for _ in tf.data.TFRecordDataset(str(warmup)))
    yield f"assets.extra/{WARMUP_FILE} holds {count} PredictionLog records"


def _check_signatures(loaded):
    expected = {
        SERVING_SIGNATURE: ({"text": tf.string}, {"translation": tf.string, "score": tf.float32}),
        OPTIONS_SIGNATURE: (
            {
                "text": tf.string,
                "beam_size": tf.int32,
                "alpha": tf.float32,
                "max_length": tf.int32,
                "min_length": tf.int32,
            },
            {
                "translation": tf.string,
                "score": tf.float32,
                "translations": tf.string,
                "scores": tf.float32,
            },
        ),
    }
    for name, (inputs, outputs) in expected.items():
        if name not in loaded.signatures:
            raise ExportError(f"Signature {name} is missing.")
        function = loaded.signatures[name]
        found_inputs = {
            key: spec.dtype for key, spec in function.structured_input_signature[1].items()
        }
        found_outputs = {key: spec.dtype for key, spec in function.structured_outputs.items()}
        if found_inputs != inputs or found_outputs != outputs:
            raise ExportError(
                f"Signature {name} is {found_inputs} -> {found_outputs}, "
                f"expected {inputs} -> {outputs}."
            )
    return "signatures " + ", ".join(expected) + " have the expected inputs and outputs"


def _check_same(found, expected, what, tolerance=1e-6):
    translations = found["translation"].numpy()
    if not np.array_equal(translations, expected["translation"].numpy()):
        raise ExportError(f"{what}: the translations differ.")
    scores, expected_scores = found["score"].numpy(), expected["score"].numpy()
    if not np.allclose(scores, expected_scores, rtol=tolerance, atol=tolerance):
        raise ExportError(f"{what}: the scores differ.")
