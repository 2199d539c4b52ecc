"""The exported SavedModel: TF Serving's layout, the self-check and warmup requests, the signatures,
a process with only TensorFlow, bad inputs, XLA, the export's own decoding settings, translate.py.

Serving it (the REST and gRPC clients, the client CLI, TF Serving's configs) is tested in test_serving.py.
"""

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_text  # noqa: F401

from keras_transformer import decoding, run_dir, saved_model, serving_client, signatures
from keras_transformer.decoding import DecodingSettings
from keras_transformer.translator import Translator
from cli_modules import load_translate_cli  # noqa: E402
pytest.register_assert_rewrite("export_fixtures")  # before importing it: it is a plugin (pytest_plugins below)
from export_fixtures import BAD_INPUTS, LONG_TEXT, MODEL_NAME, REPO, translate  # noqa: E402

pytest_plugins = ["export_fixtures"]  # sentences, exported, served, translator, served_beam_2
pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------
# Layout and self-check
# ---------------------------------------------------------------------------


def test_export_writes_a_checked_version_in_tf_servings_layout(exported, tiny_translation_run):
    version_dir, lines = exported
    assert version_dir.name == "1" and [p.name for p in version_dir.parent.iterdir()] == ["1"]
    for name in ("saved_model.pb", "variables/variables.index", "assets/tokenizer.model"):
        assert (version_dir / name).is_file(), name
    assert (version_dir / "assets/tokenizer.model").read_bytes() == run_dir.tokenizer_path(
        tiny_translation_run
    ).read_bytes()
    checks = [line for line in lines if line.strip().startswith("ok:")]
    assert len(checks) == 6 and any("as the in-process translator" in line for line in checks)
    assert any("loaded as TF Serving loads it" in line for line in checks)
    # The last line names the checkpoint that "best" was in this run.
    exported_from = re.fullmatch(rf"Exported (\S+) \(best\) to {re.escape(str(version_dir))}\.", lines[-1])
    assert exported_from and Path(exported_from[1]).parent.parent == Path(tiny_translation_run), lines[-1]
    assert Path(exported_from[1] + ".index").is_file()
    assert saved_model.next_version(version_dir.parent) == 2
    with pytest.raises(saved_model.ExportError, match="exists"):
        saved_model.export_run(tiny_translation_run, version_dir.parent, version=1)


@pytest.mark.parametrize("failing", ["save_translator", "verify_export"])
def test_an_export_that_fails_leaves_no_version_and_no_staging_directory(tiny_translation_run, tmp_path, monkeypatch,
                                                                         failing):
    """TF Serving serves any numbered directory it finds: a failed attempt, at the save or at the checks, must
    leave no version and no staging directory behind (nor keep its number from the next export)."""
    def fail(*args, **kwargs):
        raise saved_model.ExportError("refused")

    monkeypatch.setattr(saved_model, "save_translator", lambda translator, path: (Path(path) / "saved_model.pb")
                        .write_bytes(b"not checked yet"))
    monkeypatch.setattr(saved_model, failing, fail)
    with pytest.raises(saved_model.ExportError, match="^refused$"):
        saved_model.export_run(tiny_translation_run, tmp_path / "model", version=3, log=lambda line: None)
    assert list((tmp_path / "model").iterdir()) == []
    assert saved_model.next_version(tmp_path / "model") == 1


class _OwnSettingsChanged:
    """A translator as `verify_export` reads it, translating as `translator` but with other `DecodingSettings`."""

    def __init__(self, translator, **settings):
        self.tokenizer, self.jit_compile = translator.tokenizer, translator.jit_compile
        self.translate = translator.translate
        self.decoding = translator.decoding.replace(**settings)


def test_the_exports_self_check_refuses_outputs_that_are_not_its_translators(exported, translator, served, sentences):
    """Each comparison of the self-check fails on a difference of its own; one comparing a tensor with itself
    passed every test (every export checked was right)."""
    expected = translator.translate(tf.constant(sentences[:3]))
    found = served["serving_default"](text=tf.constant(sentences[:3]))
    saved_model._check_same(found, expected, "same")  # the truth passes
    other_translation = {**found, "translation": tf.constant([b"x", *found["translation"].numpy()[1:]])}
    with pytest.raises(saved_model.ExportError, match="^other: the translations differ"):
        saved_model._check_same(other_translation, expected, "other")
    with pytest.raises(saved_model.ExportError, match="^other: the scores differ"):
        saved_model._check_same({**found, "score": found["score"] - 0.01}, expected, "other")
    # serving_default translates as the translator; translate_with_options, asked for the translator's own
    # settings, does not give what they give.
    with pytest.raises(saved_model.ExportError, match=r"translate_with_options vs serving_default: the \w+ differ"):
        list(saved_model.verify_export(exported[0], _OwnSettingsChanged(translator, alpha=0.0), sentences[:3]))


def _while_loops(graph_def):
    """The number of while loops in `graph_def` and the functions of its library."""
    nodes = [*graph_def.node, *(node for function in graph_def.library.function for node in function.node_def)]
    return sum(node.op in ("While", "StatelessWhile") for node in nodes)


def _assert_each_search_saved_once(version_dir, loaded_signatures):
    """Every loop of the SavedModel is one of its signatures' (a retraced copy doubled the file and its load)."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel.FromString((version_dir / "saved_model.pb").read_bytes())
    signature_loops = sum(
        _while_loops(loaded_signatures[name].graph.as_graph_def()) for name in signatures.SIGNATURES
    )
    assert signature_loops > 0
    assert _while_loops(proto.meta_graphs[0].graph_def) == signature_loops


def test_the_export_saves_each_signatures_search_once(exported, served):
    _assert_each_search_saved_once(exported[0], served)


def test_warmup_requests_are_prediction_logs_that_the_model_answers(exported, served):
    from tensorflow_serving.apis import prediction_log_pb2

    records = list(tf.data.TFRecordDataset(str(exported[0] / "assets.extra" / saved_model.WARMUP_FILE)))
    texts = []
    for record in records:
        log = prediction_log_pb2.PredictionLog.FromString(record.numpy())
        assert log.WhichOneof("log_type") == "predict_log"
        request = log.predict_log.request
        assert request.model_spec.name == MODEL_NAME
        assert request.model_spec.signature_name == "serving_default"
        assert list(request.inputs) == ["text"] and request.inputs["text"].dtype == tf.string.as_datatype_enum
        text = tf.make_ndarray(request.inputs["text"])
        texts.append([t.decode() for t in text])
        assert len(translate(served["serving_default"], list(text))["translation"]) == len(text)
    # One sentence, then a batch: the first shapes a server meets.
    assert texts == [list(saved_model.CHECK_SENTENCES[:1]), list(saved_model.CHECK_SENTENCES[:3])]
    assert any("PredictionLog requests are answered" in line for line in exported[1])


def test_without_the_serving_api_the_export_has_no_warmup_requests_and_says_how_to_get_them(
    tiny_translation_run, tmp_path, monkeypatch
):
    # None in sys.modules makes an import fail, as when the package is not installed.
    for module in ("tensorflow_serving", "tensorflow_serving.apis"):
        monkeypatch.setitem(sys.modules, module, None)
    lines = []

    version_dir = saved_model.export_run(tiny_translation_run, tmp_path / MODEL_NAME, log=lines.append)

    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and 'pip install -e ".[serving]"' in warnings[0]
    assert not (version_dir / "assets.extra").exists()
    assert len([line for line in lines if line.strip().startswith("ok:")]) == 5  # all checks but the warmups'
    with pytest.raises(ImportError):
        saved_model.warmup_records(MODEL_NAME, [["A dog."]])


def parse_saved_model_cli(output):
    """`{signature: {"inputs"|"outputs": {name: (dtype, shape)}}}` from `saved_model_cli show`."""
    signatures, signature, section, tensor = {}, None, None, None
    for line in output.splitlines():
        line = line.strip()
        if match := re.match(r"signature_def\['(.+)'\]:", line):
            signature = signatures.setdefault(match[1], {"inputs": {}, "outputs": {}})
        elif match := re.match(r"(inputs|outputs)\['(.+)'\] tensor_info:", line):
            section, tensor = match[1], match[2]
        elif match := re.match(r"dtype: (\w+)", line):
            dtype = match[1]
        elif (match := re.match(r"shape: (.+)", line)) and signature is not None:
            signature[section][tensor] = (dtype, match[1])
    return signatures


def test_saved_model_cli_lists_the_signatures(exported):
    output = subprocess.run(
        ["saved_model_cli", "show", "--all", "--dir", str(exported[0])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    signatures = parse_saved_model_cli(output)
    assert signatures["serving_default"] == {
        "inputs": {"text": ("DT_STRING", "(-1)")},
        "outputs": {"translation": ("DT_STRING", "(-1)"), "score": ("DT_FLOAT", "(-1)")},
    }
    assert signatures["translate_with_options"] == {
        "inputs": {
            "text": ("DT_STRING", "(-1)"),
            "beam_size": ("DT_INT32", "()"),
            "alpha": ("DT_FLOAT", "()"),
            "max_length": ("DT_INT32", "()"),
            "min_length": ("DT_INT32", "()"),
        },
        "outputs": {
            "translation": ("DT_STRING", "(-1)"),
            "score": ("DT_FLOAT", "(-1)"),
            "translations": ("DT_STRING", "(-1, -1)"),
            "scores": ("DT_FLOAT", "(-1, -1)"),
        },
    }


def test_the_signature_table_is_what_the_export_has_and_its_self_check_holds_it_to_it(served):
    for name, signature in signatures.SIGNATURES.items():
        function = served[name]
        inputs = function.structured_input_signature[1]
        assert set(inputs) == set(signature.input_dtypes())
        for tensor in signature.inputs:
            assert (inputs[tensor.name].dtype.name, tuple(inputs[tensor.name].shape.as_list())) == (
                tensor.dtype, tensor.shape
            )
        outputs = {tensor.name: tensor.dtype for tensor in signature.outputs}
        assert outputs == {key: spec.dtype.name for key, spec in function.structured_outputs.items()}
    assert signatures.SERVING_DEFAULT.batched and not signatures.TRANSLATE_WITH_OPTIONS.batched

    class Loaded:
        pass

    Loaded.signatures = dict(served)
    assert "have the expected inputs and outputs" in saved_model._check_signatures(Loaded)
    options = served["translate_with_options"]
    renamed = {("max_output_length" if key == "max_length" else key): spec
               for key, spec in options.structured_input_signature[1].items()}
    Loaded.signatures["translate_with_options"] = type(
        "Renamed", (), {"structured_input_signature": ((), renamed), "structured_outputs": options.structured_outputs}
    )
    with pytest.raises(saved_model.ExportError, match="Signature translate_with_options is .*max_output_length"):
        saved_model._check_signatures(Loaded)


def test_the_unset_options_and_request_formats_come_from_the_signature_table():
    assert signatures.options_request() == {"beam_size": 0, "alpha": -1.0, "max_length": 0, "min_length": -1}
    assert signatures.options_request(beam_size=2, min_length=None) == {
        "beam_size": 2, "alpha": -1.0, "max_length": 0, "min_length": -1
    }
    with pytest.raises(TypeError, match="no option max_output_length"):
        signatures.options_request(max_output_length=3)
    for option in signatures.TRANSLATE_WITH_OPTIONS.options:
        assert not option.is_set(option.unset) and option.is_set(option.smallest)
    assert serving_client.rest_payload(["A dog."]) == {"signature_name": "serving_default", "instances": ["A dog."]}
    assert serving_client.rest_payload(["A dog."], signatures.options_request(beam_size=2)) == {
        "signature_name": "translate_with_options",
        "inputs": {"text": ["A dog."], "beam_size": 2, "alpha": -1.0, "max_length": 0, "min_length": -1},
    }


def test_the_translator_translates_like_beam_search_with_the_models_own_weights(
    translator, sentences
):
    """The translator's own copy of the output kernel changes the speed, not the results."""
    source_ids, _ = translator._source_ids(tf.constant(sentences))
    best = decoding.beam_search(translator.model, source_ids)
    expected = translator.tokenizer.detokenize(best.tokens).numpy()
    found = translate(translator.translate, sentences)
    assert list(found["translation"]) == list(expected)
    np.testing.assert_allclose(found["score"], best.scores.numpy(), rtol=1e-5)


# ---------------------------------------------------------------------------
# Serving without this package
# ---------------------------------------------------------------------------


def test_a_process_with_only_tensorflow_translates_like_the_in_process_translator(
    exported, translator, sentences, tmp_path
):
    """As TF Serving runs the export by default: without this package, and with XLA compilation disabled.

    The graph-mode search's cache writes used to be XLA ops, which TensorFlow runs outside
    XLA by compiling them on demand: TF Serving answered "XLA compilation disabled".
    """
    options = {"beam_size": 2, "alpha": 1.0, "max_length": 0, "min_length": -1}
    requests = tmp_path / "requests.json"
    results = tmp_path / "results.json"
    requests.write_text(json.dumps({"text": sentences, "options": options}))
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "standalone_translate.py"),
            str(exported[0]),
            str(requests),
            str(results),
        ],
        check=True,
        cwd=tmp_path,  # not the repository, so that nothing of it is importable by accident
    )
    found = json.loads(results.read_text())
    assert not found["keras_transformer_imported"]

    expected = translate(translator.translate, sentences)
    assert found["serving_default"]["translation"] == [t.decode() for t in expected["translation"]]
    np.testing.assert_allclose(found["serving_default"]["score"], expected["score"], rtol=1e-5)
    expected = translate(translator.translate_with_options, sentences, **options)
    assert found["translate_with_options"]["translations"] == [
        [t.decode() for t in row] for row in expected["translations"]
    ]
    np.testing.assert_allclose(
        found["translate_with_options"]["scores"], expected["scores"], rtol=1e-5
    )


# ---------------------------------------------------------------------------
# Bad inputs, against the reloaded model
# ---------------------------------------------------------------------------


def test_an_empty_batch_gives_empty_outputs(served):
    for name, options in (
        ("serving_default", {}),
        ("translate_with_options", {"beam_size": 3, "alpha": 0.6, "max_length": 0}),
    ):
        outputs = translate(served[name], [], **options)
        assert all(len(value) == 0 for value in outputs.values())


def test_bad_inputs_never_fail_and_do_not_change_their_neighbours(served, sentences):
    signature = served["serving_default"]
    alone = [translate(signature, [sentence]) for sentence in sentences[:4]]
    mixed_batch = [
        sentences[0],
        *BAD_INPUTS[:3],
        sentences[1],
        *BAD_INPUTS[3:],
        sentences[2],
        sentences[3],
    ]
    mixed = translate(signature, mixed_batch)
    for index, sentence_alone in zip((0, 4, 7, 8), alone, strict=True):
        assert mixed["translation"][index] == sentence_alone["translation"][0]
        np.testing.assert_allclose(mixed["score"][index], sentence_alone["score"][0], rtol=1e-5)
    for text in mixed["translation"]:
        text.decode("utf-8")  # valid UTF-8, as JSON responses need
    assert np.isfinite(mixed["score"]).all()
    # Empty and whitespace-only inputs translate to nothing, with certainty; any other input to something.
    assert list(mixed["translation"][1:3]) == [b"", b""] and list(mixed["score"][1:3]) == [0.0, 0.0]
    assert all(text.strip() for index, text in enumerate(mixed["translation"]) if index not in (1, 2))


def run_as_tf_serving(export_dir, signature_name, inputs):
    """A signature's outputs as TF Serving computes them: the SavedModel loaded into a session, whose
    checkpoint's restore op sets the variables, and `inputs` fed whatever their shape (TF Serving checks
    none; a Python session's `run` would, so the session's own call is used)."""
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
        signature = tf.compat.v1.saved_model.load(session, ["serve"], str(export_dir)).signature_def[signature_name]
        feeds = {
            graph.get_tensor_by_name(signature.inputs[name].name)._as_tf_output(): np.asarray(
                value, object if name == "text" else signatures.SIGNATURES[signature_name].input(name).dtype
            )
            for name, value in inputs.items()
        }
        names = sorted(signature.outputs)
        fetches = [graph.get_tensor_by_name(signature.outputs[name].name)._as_tf_output() for name in names]
        return dict(zip(names, session._call_tf_sessionrun(None, feeds, fetches, [], None), strict=True))


def test_tf_servings_loading_gives_the_signatures_every_trained_weight(exported, served, sentences):
    """Saved as a Keras model, the weights were restored into copies that the signatures do not read:
    TF Serving answered "Could not find variable transformer/shared_embedding/embeddings"."""
    options = {"beam_size": 3, "alpha": 0.6, "max_length": 0, "min_length": -1}
    for name, inputs in (
        ("serving_default", {"text": sentences[:3]}),
        ("translate_with_options", {"text": sentences[:3], **options}),
    ):
        found = run_as_tf_serving(exported[0], name, inputs)
        expected = translate(served[name], inputs.pop("text"), **inputs)
        assert found.keys() == expected.keys()
        for output, values in expected.items():
            if values.dtype == object:
                np.testing.assert_array_equal(found[output], values)
            else:
                np.testing.assert_allclose(found[output], values, rtol=1e-5)


def test_the_exports_session_check_refuses_a_keras_variable_a_server_leaves_unset_and_says_so(tmp_path):
    """The bug the check is for, in miniature: a `tf.Module` that tracks a Keras 3 layer saves copies of its
    variables, which TF Serving's restore op sets, while the signature reads the originals. The error must
    name the cause, not only the session's "Graph execution error:" heading."""
    import keras

    class KerasInside(tf.Module):
        def __init__(self):
            super().__init__()
            self.layer = keras.layers.Dense(1)
            self.layer.build((None, 1))

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
        def translate(self, text):
            return {"translation": text, "score": self.layer(tf.ones([tf.size(text), 1]))[:, 0]}

    module = KerasInside()
    tf.saved_model.save(module, str(tmp_path), signatures={"serving_default": module.translate})
    with pytest.raises(saved_model.ExportError, match="TF Serving loads it: Could not find variable dense"):
        saved_model._check_served_as_tf_serving_loads(tmp_path, module, ["A dog."])


@pytest.mark.parametrize(
    "signature_name, inputs, message",
    [
        ("serving_default", {"text": [["A dog.", "A cat."]]}, "text must be a vector [batch], got the shape] [1 2]"),
        ("serving_default", {"text": "A dog."}, "text must be a vector [batch], got the shape] []"),
        (
            "translate_with_options",
            {"text": ["A dog."], "beam_size": 2, "alpha": 0.6, "max_length": 0, "min_length": [1, 2]},
            "min_length must be a scalar, got the shape] [2]",
        ),
        (
            "translate_with_options",
            {"text": ["A dog."], "beam_size": [[2]], "alpha": 0.6, "max_length": 0, "min_length": 1},
            "beam_size must be a scalar, got the shape] [1 1]",
        ),
    ],
)
def test_an_input_of_another_rank_than_its_signatures_is_refused_by_name(exported, signature_name, inputs, message):
    """It failed without naming the input ("Incompatible shapes: [4000] vs. [2]") or, for a `text` of rank 2,
    translated the flattened batch."""
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
        run_as_tf_serving(exported[0], signature_name, inputs)


def test_a_text_with_as_many_strings_as_rows_is_read_as_a_batch(exported, sentences):
    """The rank check lets `[batch, 1]` (TF Serving's row format of one-element lists), `[batch, 1, 1]` and
    `[0, n]` through, as the docs say: each must translate as the `[batch]` of its strings."""
    as_vector = run_as_tf_serving(exported[0], "serving_default", {"text": sentences[:2]})
    for text in ([[sentence] for sentence in sentences[:2]], [[[sentence]] for sentence in sentences[:2]]):
        found = run_as_tf_serving(exported[0], "serving_default", {"text": text})
        np.testing.assert_array_equal(found["translation"], as_vector["translation"])
    empty = run_as_tf_serving(exported[0], "serving_default", {"text": np.zeros([0, 3], object)})
    assert all(value.shape == (0,) for value in empty.values())


@pytest.fixture(scope="module")
def eos_first_translator(tiny_translation_run):
    """A translator whose model puts a large extra logit on EOS at the first step, so that
    without a minimum length every sentence translates to ""."""
    from keras_transformer.tokenizer import EOS_ID

    model = run_dir.load_model(tiny_translation_run)
    decode_step = model.decode_step

    def eos_first_decode_step(token_ids, cache, cache_index, *args, **kwargs):
        logits, cache = decode_step(token_ids, cache, cache_index, *args, **kwargs)
        first = tf.cast(tf.equal(cache_index, 0), logits.dtype)
        return logits + first * 100.0 * tf.one_hot(EOS_ID, tf.shape(logits)[-1], dtype=logits.dtype), cache

    model.decode_step = eos_first_decode_step
    return Translator(model, run_dir.load_tokenizer(tiny_translation_run))


def test_no_sentence_translates_to_an_empty_string_whichever_signature(
    eos_first_translator, sentences, tmp_path, capsys
):
    translator = eos_first_translator
    texts = sentences[:4] + [BAD_INPUTS[0]]
    saved_model.save_translator(translator, tmp_path / "eos_first")
    served = tf.saved_model.load(str(tmp_path / "eos_first")).signatures
    for translate_fn, options_fn in (
        (translator.translate, translator.translate_with_options),
        (served["serving_default"], served["translate_with_options"]),
    ):
        best = translate(translate_fn, texts)["translation"]
        assert all(text.strip() for text in best[:4]) and best[4] == b""
        n_best = translate(options_fn, texts, beam_size=2, alpha=0.6, max_length=0)["translations"]
        assert all(text.strip() for text in n_best[:4].ravel())
        # min_length=0 lets the model's EOS come first: the check above means something.
        empty = translate(options_fn, texts, beam_size=2, alpha=0.6, max_length=0, min_length=0)
        assert list(empty["translation"]) == [b""] * 5
    # translate.py --min-length reaches the export's options signature (dropping it passed every test).
    cli = load_translate_cli()
    for flags, empty in (([], False), (["--min-length", "0"], True)):
        assert cli.main(["--saved-model", str(tmp_path / "eos_first"), *flags, *sentences[:2]]) == 0
        assert [line == "" for line in capsys.readouterr().out.splitlines()] == [empty, empty]


def test_a_blank_line_has_an_empty_n_best_list_with_score_0_first(translator, served, sentences):
    """As the signature table says: "" in every slot, 0.0 for the first and NEG_INF for the empty ones; its
    neighbours translate as they do alone. Blank rows scored 0.0 in every slot passed every test."""
    texts = [sentences[0], "", sentences[1], " \t "]
    options = {"beam_size": 3, "alpha": 0.6, "max_length": 0}
    for signature in (translator.translate_with_options, served["translate_with_options"]):
        found = translate(signature, texts, **options)
        alone = translate(signature, [sentences[0], sentences[1]], **options)
        for blank in (1, 3):
            assert found["translation"][blank] == b"" and found["score"][blank] == 0.0
            assert list(found["translations"][blank]) == [b""] * 3
            assert list(found["scores"][blank]) == [0.0, decoding.NEG_INF, decoding.NEG_INF]
        np.testing.assert_array_equal(found["translations"][[0, 2]], alone["translations"])
        np.testing.assert_allclose(found["scores"][[0, 2]], alone["scores"], rtol=1e-5)


def test_line_ends_tabs_and_outer_spaces_do_not_change_a_translation(served, sentences):
    """Text from a CRLF file, with a byte order mark or tabs, means what the clean line means."""
    signature = served["serving_default"]
    clean = translate(signature, sentences[:3])
    variants = [
        sentences[0] + "\r",
        "\ufeff" + sentences[1] + "\t",
        "\u00a0" + sentences[2].replace(" ", " \t ") + "\u3000",
        "\u00a0\u3000\u200b",
    ]

    found = translate(signature, [text.encode("utf-8") for text in variants])

    assert list(found["translation"]) == [*clean["translation"], b""]
    np.testing.assert_allclose(found["score"], [*clean["score"], 0.0], rtol=1e-5)


def test_source_buckets_cover_every_length_once():
    from keras_transformer.translator import pad_to_bucket, xla_buckets

    assert xla_buckets(256) == [16, 32, 64, 128, 256]
    assert xla_buckets(100) == [16, 32, 64, 100]
    assert xla_buckets(16) == [16]
    for length in (1, 15, 16, 17, 33, 64, 65, 100):
        ids = tf.ones([2, length], tf.int32)
        padded = pad_to_bucket(ids, xla_buckets(100)).numpy()
        expected_width = min(b for b in xla_buckets(100) if b >= length)
        assert padded.shape == (2, expected_width)
        assert (padded[:, :length] == 1).all() and (padded[:, length:] == 0).all()


def test_batch_sizes_cover_every_batch_once():
    from keras_transformer.translator import pad_to_bucket, xla_batch_sizes

    assert xla_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert xla_batch_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert xla_batch_sizes(1) == [1]
    assert xla_batch_sizes(0) == []
    for rows in (1, 3, 4, 5, 17, 24):
        ids = tf.ones([rows, 7], tf.int32)
        padded = pad_to_bucket(ids, xla_batch_sizes(24), axis=0).numpy()
        assert padded.shape == (min(b for b in xla_batch_sizes(24) if b >= rows), 7)
        assert (padded[:rows] == 1).all() and (padded[rows:] == 0).all()


def test_an_xla_translators_loop_over_chunks_is_one_call_that_is_never_inlined(tiny_translation_run):
    """`translate` picks one XLA search of the batch or a loop over chunks of it with a cond,
    whose untaken branch still passes a dead tensor through each of its ops: the loop must
    stay one call, or its ops would slow down every translation of a small batch."""
    translator = Translator.from_run_dir(tiny_translation_run, jit_compile=True, xla_max_batch=2)
    graph = translator.translate.get_concrete_function().graph
    library = {function.signature.name: function for function in graph.as_graph_def().library.function}

    def calls(branch):
        return [library[node.attr["f"].func.name] for node in branch.node_def if "f" in node.attr]

    ((_, loop_branch),) = [
        (library[op.get_attr("then_branch").name], library[op.get_attr("else_branch").name])
        for op in graph.get_operations()
        if op.type in ("If", "StatelessIf")
        and any(function.attr["_XlaMustCompile"].b for function in calls(library[op.get_attr("then_branch").name]))
    ]

    (loop,) = calls(loop_branch)
    assert len(loop_branch.node_def) < 10
    assert loop.attr["_noinline"].b  # else TensorFlow inlines it when it runs


def test_an_xla_export_translates_like_the_graph_translator_and_compiles_each_batch_shape_once(
    tiny_translation_run, translator, sentences, tmp_path
):
    """XLA and padded sources change the speed, not the translations (graph mode is the truth).

    Batches of up to `xla_max_batch` sentences are searched at once, larger ones that many
    sentences at a time, each chunk padded to its own longest source; all give the graph
    translator's results. Served in a process of its own, whose XLA compilations are
    counted (`--xla_dump_to`): a batch shape compiles the first time only, a batch padded
    to a size met before (3 to 4) does not compile, and an empty one is not searched (an
    empty request used to compile for batch 0).
    """
    xla_max_batch = 4
    lines = []
    version_dir = saved_model.export_run(
        tiny_translation_run, tmp_path / MODEL_NAME, jit_compile=True, xla_max_batch=xla_max_batch, log=lines.append
    )
    assert lines[-1].endswith("TF Serving serves it on CPUs only when started with --xla_cpu_compilation_enabled=true.")
    _assert_each_search_saved_once(version_dir, tf.saved_model.load(str(version_dir)).signatures)  # XLA's too.
    batch = [text.encode("utf-8") for text in sentences[:6]] + BAD_INPUTS
    # Each request: a slice of the batch. 1:4 holds 3 of 0:4's sentences, the longest
    # included: the same source bucket, and 3 rows padded to 4.
    slices = [(0, xla_max_batch), (0, len(batch)), (0, xla_max_batch), (1, 4), (0, 0), (0, 1), (0, 2)]
    dump_dir, requests_path, results_path = tmp_path / "xla_dump", tmp_path / "requests.json", tmp_path / "results.json"
    requests_path.write_text(
        json.dumps([[base64.b64encode(text).decode() for text in batch[start:end]] for start, end in slices])
    )
    subprocess.run(
        [sys.executable, str(REPO / "tests" / "count_xla_compilations.py"), str(version_dir), str(dump_dir),
         str(requests_path), str(results_path)],
        check=True, cwd=tmp_path, env={**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump_dir}"},
    )
    results = json.loads(results_path.read_text())

    # The 11 sentences are 3 chunks: 0:4, the first request's shape, then 4:8 and 8:11 (3 rows
    # padded to 4; the long text's bucket), of buckets of their own: 2 more compilations.
    assert [result["search_compilations"] for result in results] == [1, 3, 3, 3, 3, 4, 5]
    expected = translate(translator.translate, batch)
    for (start, end), found in zip(slices, results, strict=True):
        assert found["translation"] == [text.decode("utf-8") for text in expected["translation"][start:end]]
        np.testing.assert_allclose(found["score"], expected["score"][start:end], rtol=1e-4, atol=1e-5)


def test_long_inputs_are_translated_from_their_first_tokens(served, tiny_translation_run):
    from keras_transformer.tokenizer import SubwordTokenizer
    from keras_transformer.translator import DEFAULT_MAX_SOURCE_LENGTH

    tokenizer = SubwordTokenizer.load(run_dir.tokenizer_path(tiny_translation_run))
    kept = tokenizer.tokenize([LONG_TEXT])[:, : DEFAULT_MAX_SOURCE_LENGTH - 1]
    truncated_text = tokenizer.detokenize(kept).numpy()[0]
    assert len(truncated_text) < len(LONG_TEXT)
    signature = served["serving_default"]
    assert (
        translate(signature, [LONG_TEXT])["translation"]
        == translate(signature, [truncated_text])["translation"]
    )


def test_a_beam_over_the_limit_is_refused_and_other_options_out_of_range_are_unset(served, sentences):
    signature = served["translate_with_options"]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"beam_size is at most 16"):
        translate(signature, sentences[:2], beam_size=17, alpha=0.6, max_length=0)
    for alpha in (float("nan"), float("inf")):  # NaN was read as unset: the model's own alpha
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"alpha must be a finite number"):
            translate(signature, sentences[:2], beam_size=4, alpha=alpha, max_length=0)
    for beam_size, width in ((16, 16), (-3, 4)):  # -3: unset, serving_default's 4
        outputs = translate(
            signature, sentences[:2] + [BAD_INPUTS[0]], beam_size=beam_size, alpha=0.6, max_length=0
        )
        assert outputs["translations"].shape == (3, width) and outputs["scores"].shape == (3, width)
    capped = translate(signature, sentences[:2], beam_size=2, alpha=0.0, max_length=3)
    assert (capped["score"] < 0).all()
    greedy = translate(
        served["translate_with_options"], sentences[:2], beam_size=1, alpha=0.6, max_length=0
    )
    assert greedy["translations"].shape == (2, 1)


def test_an_alpha_over_the_limit_is_refused_not_overflowed(translator, sentences):
    # What DecodingSettings and the command lines refuse: a larger alpha overflows the
    # length penalty of longer outputs, ((5 + 45) / 6) ** 50 > float32's largest, and
    # every such output would score -0, the best score, whatever its log-probability.
    assert np.isinf(np.float32(((5 + 45) / 6) ** 50))
    signature = translator.translate_with_options
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"alpha is at most 10"):
        translate(signature, sentences[:2], beam_size=2, alpha=50.0, max_length=0)
    at_the_limit = translate(signature, sentences[:2], beam_size=2, alpha=10.0, max_length=0)
    assert np.isfinite(at_the_limit["scores"]).all() and (at_the_limit["scores"] < 0).all()
    for alpha in (float("nan"), float("inf")):  # still told as not finite
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"alpha must be a finite number"):
            translate(signature, sentences[:2], beam_size=2, alpha=alpha, max_length=0)


def test_the_exports_early_stop_is_saved_and_searches_both_signatures(
    served_beam_2, tiny_translation_run, sentences, monkeypatch, capsys
):
    _, module, signatures = served_beam_2
    assert module.early_stopping_rule.numpy() == b"current_length"
    # The export checked itself against this in-process translator, which passes its
    # early stop to the search of both signatures.
    rules = []
    search = decoding.search
    monkeypatch.setattr(decoding, "search", lambda *a, **k: rules.append(k["early_stopping"]) or search(*a, **k))
    translator = Translator.from_run_dir(
        tiny_translation_run, decoding=DecodingSettings(beam_size=2, alpha=1.0, early_stopping="current_length")
    )
    expected = translate(translator.translate, sentences[:6])
    translate(translator.translate_with_options, sentences[:1], beam_size=0, alpha=-1.0, max_length=0)
    assert rules == ["current_length", "current_length"]
    expected = [text.decode() for text in expected["translation"]]
    served = translate(signatures["serving_default"], sentences[:6])
    assert [text.decode() for text in served["translation"]] == expected
    # translate.py --run-dir takes the same option.
    flags = ["--beam-size", "2", "--alpha", "1.0", "--early-stopping", "current_length"]
    capsys.readouterr()
    assert load_translate_cli().main(["--run-dir", str(tiny_translation_run), *flags, *sentences[:6]]) == 0
    assert capsys.readouterr().out.splitlines() == expected
    assert len(rules) > 2 and set(rules) == {"current_length"}


def test_an_unknown_early_stop_is_refused(tiny_translation_run):
    with pytest.raises(ValueError, match="early_stopping must be one of"):
        Translator.from_run_dir(tiny_translation_run, decoding=run_dir.decoding_settings(tiny_translation_run).replace(
            early_stopping="never"
        ))


def test_unset_options_are_the_exports_own_beam_size_and_length_penalty(served_beam_2, sentences, capsys):
    version_dir, _, signatures = served_beam_2
    options = signatures["translate_with_options"]
    unset = translate(options, sentences[:6], beam_size=0, alpha=-1.0, max_length=0)
    given = translate(options, sentences[:6], beam_size=2, alpha=1.0, max_length=0)
    assert unset["translations"].shape == (6, 2)
    assert (unset["translations"] == given["translations"]).all()
    np.testing.assert_array_equal(unset["scores"], given["scores"])
    default = translate(signatures["serving_default"], sentences[:6])
    assert (unset["translation"] == default["translation"]).all()
    # Another length penalty changes some score: alpha=-1.0 above was not taken literally.
    no_penalty = translate(options, sentences[:6], beam_size=2, alpha=0.0, max_length=0)
    assert not np.allclose(no_penalty["scores"], given["scores"])

    # translate.py's unset --beam-size and --alpha are the export's too, not 4 and 0.6.
    cli = load_translate_cli()
    assert cli.main(["--saved-model", str(version_dir), "--n-best", sentences[0]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ||| ")[0] for line in lines] == ["0", "0"]
    assert lines[0].split(" ||| ")[1] == default["translation"][0].decode()


# ---------------------------------------------------------------------------
# translate.py
# ---------------------------------------------------------------------------


def test_translate_cli_with_a_saved_model_and_with_a_run_dir(
    exported, tiny_translation_run, translator, sentences, tmp_path, capsys
):
    cli = load_translate_cli()
    input_file = tmp_path / "input.txt"
    input_file.write_text("\n".join(sentences[:5]) + "\n")
    expected = [t.decode() for t in translate(translator.translate, sentences[:5])["translation"]]

    assert (
        cli.main(
            [
                "--saved-model",
                str(exported[0].parent),
                "--input",
                str(input_file),
                "--batch-size",
                "2",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.splitlines() == expected

    assert cli.main(["--run-dir", str(tiny_translation_run), *sentences[:2]]) == 0
    assert capsys.readouterr().out.splitlines() == expected[:2]

    assert (
        cli.main(["--saved-model", str(exported[0]), "--n-best", "--beam-size", "2", sentences[0]])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.startswith("0 ||| ") for line in lines)


def test_translate_cli_scores_and_n_best_lines_are_their_sentences_across_batches(
    exported, translator, sentences, capsys
):
    """--scores prints each line's own score, and --n-best numbers the sentences on from batch to batch, with
    each hypothesis's score: as the translator gives them. Neither was checked beyond one sentence."""
    cli = load_translate_cli()
    texts = sentences[:3]
    expected = translate(translator.translate, texts)
    assert cli.main(["--saved-model", str(exported[0]), "--scores", "--batch-size", "2", *texts]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [translation for _, translation in rows] == [text.decode() for text in expected["translation"]]
    np.testing.assert_allclose([float(score) for score, _ in rows], expected["score"], atol=1e-4)

    n_best = translate(translator.translate_with_options, texts, beam_size=2, alpha=-1.0, max_length=0)
    flags = ["--n-best", "--beam-size", "2", "--batch-size", "2"]
    assert cli.main(["--saved-model", str(exported[0]), *flags, *texts]) == 0
    rows = [line.split(" ||| ") for line in capsys.readouterr().out.splitlines()]
    assert [(int(index), translation) for index, translation, _ in rows] == [
        (index, text.decode()) for index in range(3) for text in n_best["translations"][index]
    ]
    np.testing.assert_allclose([float(score) for *_, score in rows], n_best["scores"].ravel(), atol=1e-4)


def test_translate_cli_says_when_the_saved_model_refuses_a_beam_size(exported, sentences, capsys):
    cli = load_translate_cli()
    assert cli.main(["--saved-model", str(exported[0]), "--beam-size", "17", sentences[0]]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "translate.py: error: the model refused the request: beam_size is at most 16\n" in captured.err


def test_a_run_translates_with_its_own_beam_size_and_length_penalty(tiny_translation_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_translation_run, run)
    config = run_dir.read_config(run)
    config["train"] = {"beam_size": 2, "alpha": 1.0}
    run_dir.write_config(run, config)
    own = Translator.from_run_dir(run)
    assert (own.decoding.beam_size, own.decoding.alpha) == (2, 1.0)
    given = Translator.from_run_dir(run, decoding=run_dir.decoding_settings(run).replace(beam_size=3))
    assert (given.decoding.beam_size, given.decoding.alpha) == (3, 1.0)
    unsaved = Translator.from_run_dir(tiny_translation_run)  # a run that saved neither
    assert (unsaved.decoding.beam_size, unsaved.decoding.alpha) == (4, 0.6)


def test_translate_says_in_one_line_that_an_export_copied_in_part_cannot_load(exported, tmp_path, capsys):
    version = tmp_path / "1"
    shutil.copytree(exported[0], version)
    (data,) = (version / "variables").glob("variables.data-*")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    exit_code = load_translate_cli().main(["--saved-model", str(tmp_path), "A dog."])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"translate.py: error: cannot load the SavedModel in {version}: ")


@pytest.mark.parametrize("to_stdout", [False, True])
def test_translations_that_cannot_be_written_are_one_line(exported, to_stdout):
    """/dev/full fails every write with ENOSPC, as a full disk does."""
    output = [] if to_stdout else ["--output", "/dev/full"]
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "translate.py", "--saved-model", str(exported[0]), *output, "A dog.", "Two cats."],
            cwd=REPO, stdout=full if to_stdout else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            timeout=240,
        )
    where = "the translations to stdout" if to_stdout else "--output /dev/full"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"translate.py: error: cannot write {where}: No space left on device."
