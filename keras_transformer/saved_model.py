"""Export a trained run as a SavedModel that TF Serving serves, and check it before use.

`export_run` (the library of `kt-export` / `python -m export --run-dir RUN --out
models/transformer`, `keras_transformer.cli.export`) writes TF Serving's versioned layout:

    models/transformer/<version>/saved_model.pb
                                 variables/
                                 assets/tokenizer.model                    the vocabulary
                                 assets.extra/tf_serving_warmup_requests   PredictionLogs (*)

The signatures are the table of `keras_transformer.signatures` (`serving_default` and
`translate_with_options`); tokenization, beam search and detokenization are all in the
graph, through tensorflow-text's SentencePiece ops, which TF Serving's model server
links in. `serving_default` searches with the export's `DecodingSettings` (the run's
unless given). With `jit_compile=True` its beam search is compiled by XLA (see
`Translator`): TF Serving then needs `--xla_cpu_compilation_enabled=true` on CPUs.
`translate_with_options` has scalar inputs, which fit neither TF Serving's row format
(call it with the columnar `{"inputs": {...}}` REST format) nor its batching, which
needs a batch dimension on every input: a server started with `--enable_batching` (see
`export/batching.config`) refuses this signature with INVALID_ARGUMENT and batches
`serving_default`, whose inputs and outputs are all `[batch]`, so that the rows of
merged requests are split back as they came.

(*) Built with tensorflow-serving-api's protos (the `serving` extra). Without it the export
is written and checked all the same, with a warning and no warmup requests: TF Serving
then runs a version's graph set-up (with `jit_compile`, its XLA compilations) in its
first requests instead of before serving it.

The SentencePiece op keeps its model as a graph attribute, so the graph itself carries
the vocabulary; `assets/tokenizer.model` ships the same file for clients and for the
`sentencepiece` tools.

The version is written under a temporary name, reloaded and checked (it must translate
the check sentences exactly as the in-process `Translator` does, also when loaded into a
session as TF Serving loads it, and its signatures must be the table's), and only then
renamed to its number: TF Serving, which polls the base
directory for numbered versions, never sees a partial or unchecked model.
"""

import os
import shutil
from pathlib import Path

import numpy as np
import tensorflow as tf

from keras_transformer import error_text
from keras_transformer import run_dir as run_dirs  # Not `run_dir`: export_run's argument.
from keras_transformer.signatures import (
    OPTIONS_SIGNATURE,
    SCORE,
    SERVING_SIGNATURE,
    SIGNATURES,
    TEXT,
    TRANSLATE_WITH_OPTIONS,
    TRANSLATION,
    options_request,
)
from keras_transformer.translator import Translator

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


def check_model_directory(out):
    """Refuses an `out` that is a version directory: the versions must go in the model's directory.

    Raises:
        ExportError: If `out` holds a SavedModel or is named as a version (a number), which
            TF Serving would read as a version of `out`'s parent.
    """
    holds_savedmodel = (out / "saved_model.pb").exists()
    if holds_savedmodel or out.name.isdigit():
        kind = "holds a SavedModel" if holds_savedmodel else "is named as a version"
        raise ExportError(
            f"{out} {kind}: give the model's directory, which the versions go in (--out {out.parent}, "
            f"with --version N to choose the number)."
        )


def export_run(
    run_dir,
    out,
    *,
    version=None,
    which="best",
    model_name=None,
    check_sentences=(),
    log=print,
    decoding=None,
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
        log: Receives one line per step and per check, and a "warning: ..." line when
            tensorflow-serving-api is missing (no warmup requests then).
        decoding: The `DecodingSettings` of `serving_default` (and of the unset options of
            `translate_with_options`); `None` for the run's own (`run_dir.decoding_settings`).
        **translator_options: Other `Translator` arguments (`max_source_length`, `jit_compile`, `xla_max_batch`).

    Returns:
        The version directory.

    Raises:
        ExportError: If `out` is a version directory (`check_model_directory`), the version is
            negative or exists, or the reloaded model is not the in-process one.
    """
    out = Path(out)
    check_model_directory(out)
    version = next_version(out) if version is None else version
    if version < 0:
        raise ExportError(f"TF Serving loads versions numbered 0 or more, not {version}.")
    final = out / str(version)
    if final.exists():
        raise ExportError(
            f"{final} exists; choose another --version (next free: {next_version(out)})."
        )
    translator = Translator.from_run_dir(run_dir, which, decoding=decoding, **translator_options)
    out.mkdir(parents=True, exist_ok=True)
    # Not a number, so TF Serving ignores it; made like any directory (not mkdtemp's
    # owner-only mode), so a server running as another user can read the version.
    staging = out / f".export-{version}-{os.getpid()}"
    staging.mkdir()
    try:
        sentences = list(CHECK_SENTENCES) + list(check_sentences)
        save_translator(translator, staging)
        try:
            write_warmup_requests(staging, model_name or out.resolve().name, sentences[:3])
        except ImportError as error:  # Warmups speed up a version's first requests; it serves without them.
            log(f"warning: no warmup requests written ({error}); TF Serving will answer the first requests of "
                'this version slowly. pip install -e ".[serving]" (tensorflow-serving-api) writes them.')
        log(f"Wrote {staging}; checking it.")
        for line in verify_export(staging, translator, sentences):
            log(f"  ok: {line}")
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"Exported {run_dirs.checkpoint_label(run_dir, which)} to {final}.")
    if translator.jit_compile:
        log("Its search is compiled with XLA: TF Serving serves it on CPUs only when started with "
            "--xla_cpu_compilation_enabled=true.")
    return final


def save_translator(translator, directory):
    """Saves `translator` as a SavedModel with the `serving_default` and options signatures."""
    # No custom gradients: a search is never differentiated, and tracing the LayerNorm's at its every use is slow.
    options = tf.saved_model.SaveOptions(experimental_custom_gradients=False)
    tf.saved_model.save(translator, str(directory), signatures=translator.signatures(), options=options)


def warmup_records(model_name, sentence_batches):
    """Serialized `tensorflow.serving.PredictionLog`s, one `serving_default` request per batch.

    Raises:
        ImportError: Without tensorflow-serving-api, whose protos these are.
    """
    from tensorflow_serving.apis import predict_pb2, prediction_log_pb2

    records = []
    for batch in sentence_batches:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = model_name
        request.model_spec.signature_name = SERVING_SIGNATURE
        request.inputs[TEXT.name].CopyFrom(tf.make_tensor_proto(np.array(batch, dtype=object), dtype=tf.string))
        log = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))
        records.append(log.SerializeToString())
    return records


def write_warmup_requests(directory, model_name, sentences):
    """Writes `assets.extra/tf_serving_warmup_requests`: a one-sentence request and a batch.

    Raises:
        ImportError: Without tensorflow-serving-api; nothing is written then.
    """
    records = warmup_records(model_name, [sentences[:1], sentences])
    extra = Path(directory) / "assets.extra"
    extra.mkdir(exist_ok=True)
    with tf.io.TFRecordWriter(str(extra / WARMUP_FILE)) as writer:
        for record in records:
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

    settings = translator.decoding
    # The translator's own settings given as options, and no output cap: serving_default's search.
    options = options_request(beam_size=settings.beam_size, alpha=settings.alpha, min_length=settings.min_length)
    with_options = loaded.signatures[OPTIONS_SIGNATURE](
        text=text,
        **{
            name: tf.constant(value, TRANSLATE_WITH_OPTIONS.input(name).dtype)
            for name, value in options.items()
        },
    )
    # The options signature runs in graph mode: against an XLA search, allow XLA's rounding.
    tolerance = 1e-4 if translator.jit_compile else 1e-6
    _check_same(
        with_options, expected, f"{OPTIONS_SIGNATURE} vs {SERVING_SIGNATURE}", tolerance
    )
    yield (
        f"{OPTIONS_SIGNATURE}(beam_size={settings.beam_size}, alpha={settings.alpha}) gives "
        f"the same best translations, with {with_options['translations'].shape[1]}-best lists"
    )

    yield _check_served_as_tf_serving_loads(directory, translator, sentences[:3])

    vocabulary = directory / "assets" / VOCABULARY_ASSET
    if not vocabulary.is_file() or vocabulary.read_bytes() != translator.tokenizer.model_proto:
        raise ExportError(f"{vocabulary} is missing or differs from the tokenizer in the graph.")
    yield f"assets/{VOCABULARY_ASSET} is the tokenizer's SentencePiece model"

    warmup = directory / "assets.extra" / WARMUP_FILE
    if warmup.is_file():
        yield _check_warmup_requests(loaded, warmup)


def _check_served_as_tf_serving_loads(directory, translator, sentences):
    """Translates `sentences` with `serving_default` loaded as TF Serving loads it: into a session, whose
    variables the checkpoint's restore op sets. `tf.saved_model.load` restores by object instead, and
    would hide variables that the restore op leaves unset."""
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
        try:
            signature = tf.compat.v1.saved_model.load(session, ["serve"], str(directory)).signature_def[
                SERVING_SIGNATURE
            ]
            found = session.run(
                {name: output.name for name, output in signature.outputs.items()},
                {signature.inputs[TEXT.name].name: np.array(sentences, dtype=object)},
            )
        except tf.errors.OpError as error:
            cause = error_text.first_line(error)
            raise ExportError(f"{SERVING_SIGNATURE} fails as TF Serving loads it: {cause}") from error
    expected = translator.translate(tf.constant(sentences, dtype=tf.string))
    _check_same({name: tf.constant(value) for name, value in found.items()}, expected, "TF Serving's loading")
    return f"{SERVING_SIGNATURE} translates as the in-process translator when loaded as TF Serving loads it"


def _check_warmup_requests(loaded, path):
    """Replays the warmup requests as TF Serving does before it serves a version: each must be answered."""
    from tensorflow_serving.apis import prediction_log_pb2

    records = [record.numpy() for record in tf.data.TFRecordDataset(str(path))]
    for record in records:
        request = prediction_log_pb2.PredictionLog.FromString(record).predict_log.request
        if request.model_spec.signature_name not in loaded.signatures:
            raise ExportError(f"{path.name} asks for a signature {request.model_spec.signature_name!r}.")
        inputs = {name: tf.make_ndarray(tensor) for name, tensor in request.inputs.items()}
        outputs = loaded.signatures[request.model_spec.signature_name](**inputs)
        if any(len(value) != len(inputs[TEXT.name]) for value in outputs.values()):
            raise ExportError(f"{path.name}: a request of {len(inputs['text'])} rows is answered with other sizes.")
    return f"assets.extra/{WARMUP_FILE}: its {len(records)} PredictionLog requests are answered"


def _check_signatures(loaded):
    """Raises an ExportError unless `loaded` has the signatures of `keras_transformer.signatures`."""
    for name, signature in SIGNATURES.items():
        if name not in loaded.signatures:
            raise ExportError(f"Signature {name} is missing.")
        function = loaded.signatures[name]
        found_inputs = _dtypes_and_shapes(function.structured_input_signature[1])
        found_outputs = _dtypes_and_shapes(function.structured_outputs)
        inputs = {tensor.name: (tensor.dtype, tensor.shape) for tensor in signature.inputs}
        outputs = {tensor.name: (tensor.dtype, tensor.shape) for tensor in signature.outputs}
        if found_inputs != inputs or found_outputs != outputs:
            raise ExportError(
                f"Signature {name} is {found_inputs} -> {found_outputs}, "
                f"expected {inputs} -> {outputs}."
            )
    return "signatures " + ", ".join(SIGNATURES) + " have the expected inputs and outputs"


def _dtypes_and_shapes(specs):
    """`{name: (dtype name, shape tuple)}` of a dict of `tf.TensorSpec`s, as the signature table writes them."""
    return {name: (spec.dtype.name, tuple(spec.shape.as_list())) for name, spec in specs.items()}


def _check_same(found, expected, what, tolerance=1e-6):
    translations = found[TRANSLATION.name].numpy()
    if not np.array_equal(translations, expected[TRANSLATION.name].numpy()):
        raise ExportError(f"{what}: the translations differ.")
    scores, expected_scores = found[SCORE.name].numpy(), expected[SCORE.name].numpy()
    if not np.allclose(scores, expected_scores, rtol=tolerance, atol=tolerance):
        raise ExportError(f"{what}: the scores differ.")
