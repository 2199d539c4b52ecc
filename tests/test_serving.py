"""Serving the export: the REST and gRPC clients, the client CLI (`python -m export.client`), TF Serving's configs.

TF Serving itself cannot run here (no Docker); the REST and gRPC clients are tested
against local servers on 127.0.0.1 that evaluate the SavedModel, so the request and
response formats are exercised end to end. export/models.config and export/batching.config
are parsed with TF Serving's own messages, and its batching of requests is replayed.
"""

import contextlib
import http.server
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
from concurrent import futures

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import serving_client
from keras_transformer.cli import client as client_cli
pytest.register_assert_rewrite("export_fixtures")  # before importing it: it is a plugin (pytest_plugins below)
from export_fixtures import BAD_INPUTS, MODEL_NAME, REPO, translate  # noqa: E402

pytest_plugins = ["export_fixtures"]  # sentences, served, translator, served_beam_2
pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------
# REST and gRPC clients, against local servers that evaluate the SavedModel
# ---------------------------------------------------------------------------


class PredictHandler(http.server.BaseHTTPRequestHandler):
    """TF Serving's REST predict API (row and columnar formats) over `self.server.signatures`."""

    def do_POST(self):  # noqa: N802 (http.server's naming)
        match = re.fullmatch(r"/v1/models/([^/:]+)(?:/versions/\d+)?:predict", self.path)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not match or match[1] != MODEL_NAME:
            return self.answer(404, {"error": f"Servable not found for request: {self.path}"})
        signature = self.server.signatures[body.get("signature_name", "serving_default")]
        if "instances" in body:
            outputs = translate(signature, body["instances"])
            columns = {name: self.json_values(value) for name, value in outputs.items()}
            rows = [
                dict(zip(columns, row, strict=True)) for row in zip(*columns.values(), strict=True)
            ]
            return self.answer(200, {"predictions": rows})
        inputs = dict(body["inputs"])
        try:
            outputs = translate(signature, inputs.pop("text"), **inputs)
        except tf.errors.InvalidArgumentError as error:  # As TF Serving answers a refused input.
            return self.answer(400, {"error": error.message})
        return self.answer(
            200, {"outputs": {name: self.json_values(value) for name, value in outputs.items()}}
        )

    @staticmethod
    def json_values(array):
        return (
            np.char.decode(array.astype(bytes), "utf-8").tolist()
            if array.dtype == object
            else array.tolist()
        )

    def answer(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving_rest(signatures):
    """The base URL of a local REST server answering predict requests with `signatures`."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), PredictHandler)
    server.signatures = signatures
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def rest_server(served):
    with serving_rest(served) as url:
        yield url


def test_rest_client_row_and_columnar_requests(rest_server, translator, sentences):
    expected = translate(translator.translate, sentences[:3])
    results = serving_client.translate_rest(rest_server, MODEL_NAME, sentences[:3])
    assert [r["translation"] for r in results] == [t.decode() for t in expected["translation"]]
    np.testing.assert_allclose([r["score"] for r in results], expected["score"], rtol=1e-5)

    options = {"beam_size": 3, "alpha": 0.6, "max_length": 0, "min_length": -1}
    results = serving_client.translate_rest(rest_server, MODEL_NAME, sentences[:3], options=options)
    assert [len(r["translations"]) for r in results] == [3, 3, 3]
    assert [r["translations"][0] for r in results] == [r["translation"] for r in results]

    with pytest.raises(serving_client.ServingError, match="404"):
        serving_client.translate_rest(rest_server, "no_such_model", sentences[:1])


class RecordingHandler(PredictHandler):
    """`PredictHandler` that also keeps each request's path, in `self.server.paths`."""

    def do_POST(self):  # noqa: N802 (http.server's naming)
        self.server.paths.append(self.path)
        return super().do_POST()


def test_a_version_asked_for_is_in_the_rest_path_and_the_grpc_model_spec(served, grpc_server, sentences, monkeypatch):
    """TF Serving answers the version the request names (else its latest): the client CLI's --version must reach
    the URL and the gRPC ModelSpec. Neither was looked at by any test's server."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RecordingHandler)
    server.signatures, server.paths = served, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for flags in ([], ["--version", "7"]):
            assert client_cli.main(["--rest", url, "--model", MODEL_NAME, *flags, sentences[0]]) == 0
    finally:
        server.shutdown()
        server.server_close()
    assert server.paths == [f"/v1/models/{MODEL_NAME}:predict", f"/v1/models/{MODEL_NAME}/versions/7:predict"]

    from tensorflow_serving.apis import prediction_service_pb2_grpc

    specs = []
    real_stub = prediction_service_pb2_grpc.PredictionServiceStub

    class RecordingStub:
        def __init__(self, channel):
            self._stub = real_stub(channel)

        def Predict(self, request, **kwargs):  # noqa: N802 (the gRPC method name)
            specs.append((request.model_spec.HasField("version"), request.model_spec.version.value))
            return self._stub.Predict(request, **kwargs)

    monkeypatch.setattr(prediction_service_pb2_grpc, "PredictionServiceStub", RecordingStub)
    for flags in ([], ["--version", "7"]):
        assert client_cli.main(["--grpc", grpc_server, "--model", MODEL_NAME, *flags, sentences[0]]) == 0
    assert specs == [(False, 0), (True, 7)]


def test_client_cli_scores_and_n_best_lines_are_their_sentences_across_batches(
    rest_server, translator, sentences, capsys
):
    """--scores prints each sentence's score, and --n-best numbers the sentences on from batch to batch:
    as the translator gives them. No test printed either."""
    texts = sentences[:3]
    expected = translate(translator.translate, texts)
    flags = ["--rest", rest_server, "--model", MODEL_NAME, "--batch-size", "2"]
    assert client_cli.main([*flags, "--scores", *texts]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [translation for _, translation in rows] == [text.decode() for text in expected["translation"]]
    np.testing.assert_allclose([float(score) for score, _ in rows], expected["score"], atol=1e-4)

    n_best = translate(translator.translate_with_options, texts, beam_size=2, alpha=-1.0, max_length=0)
    assert client_cli.main([*flags, "--n-best", "--beam-size", "2", *texts]) == 0
    rows = [line.split(" ||| ") for line in capsys.readouterr().out.splitlines()]
    assert [(int(index), translation) for index, translation, _ in rows] == [
        (index, text.decode()) for index in range(3) for text in n_best["translations"][index]
    ]
    np.testing.assert_allclose([float(score) for *_, score in rows], n_best["scores"].ravel(), atol=1e-4)


def test_client_cli_prints_translations(rest_server, translator, sentences, capsys):
    assert (
        client_cli.main(["--rest", rest_server, "--model", MODEL_NAME, sentences[0], sentences[1]]) == 0
    )
    expected = translate(translator.translate, sentences[:2])["translation"]
    assert capsys.readouterr().out.splitlines() == [t.decode() for t in expected]


def test_client_cli_sends_batches_of_clean_stdin_lines(rest_server, translator, sentences, capsys, monkeypatch):
    """A CRLF file with a byte order mark and a byte that is not UTF-8, in requests of --batch-size lines."""
    raw_lines = [sentence.encode() for sentence in sentences[:4]] + [b"bad \xff"]
    stdin = io.BytesIO(b"\xef\xbb\xbf" + b"".join(line + b"\r\n" for line in raw_lines))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(stdin))
    requests = []
    real_translate_rest = serving_client.translate_rest

    def spy(server, model, batch, **kwargs):
        requests.append(list(batch))
        return real_translate_rest(server, model, batch, **kwargs)

    monkeypatch.setattr(serving_client, "translate_rest", spy)

    assert client_cli.main(["--rest", rest_server, "--model", MODEL_NAME, "--batch-size", "2"]) == 0

    expected_texts = [*sentences[:4], "bad \ufffd"]
    assert requests == [expected_texts[:2], expected_texts[2:4], expected_texts[4:]]
    expected = translate(translator.translate, [text.encode() for text in expected_texts])["translation"]
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [t.decode() for t in expected]
    assert captured.err.splitlines() == [
        f"{client_cli.PROG}: line 5 is not UTF-8: its malformed bytes translate as U+FFFD "
        "(a Latin-1 file? `iconv -f LATIN1 -t UTF-8` converts it)."]


def test_client_cli_sends_a_line_written_to_stdin_before_stdin_closes(capsys, monkeypatch):
    """The next line is written only once the first is answered: a client that waited for the end would hang."""
    read_end, write_end = os.pipe()
    writer = os.fdopen(write_end, "wb", buffering=0)
    requests = []

    def answer(server, model, batch, **kwargs):
        requests.append(list(batch))
        if len(requests) == 1:
            writer.write(b"A cat.\n")
            writer.close()
        return [{"translation": f"<{text}>", "score": 0.0} for text in batch]

    monkeypatch.setattr(serving_client, "translate_rest", answer)
    writer.write(b"A dog.\n")
    unblock = threading.Timer(60, writer.close)  # Ends stdin for a client that waits for it (and fails the test).
    unblock.start()
    try:
        with os.fdopen(read_end, "rb") as reader:
            monkeypatch.setattr("sys.stdin", io.TextIOWrapper(reader))
            assert client_cli.main(["--rest", "http://localhost:8501", "--model", MODEL_NAME]) == 0
    finally:
        unblock.cancel()
    assert requests == [["A dog."], ["A cat."]]
    assert capsys.readouterr().out.splitlines() == ["<A dog.>", "<A cat.>"]


def test_ctrl_c_ends_the_client_in_one_line(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(serving_client, "translate_rest", interrupted)
    assert client_cli.main(["--rest", "http://localhost:8501", "A dog."]) == 130
    assert capsys.readouterr().err == "python -m export.client: interrupted\n"


def test_a_rest_address_without_its_scheme_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as raised:
        client_cli.main(["--rest", "localhost:8501", "A dog."])
    assert raised.value.code == 2
    assert "--rest takes a URL with its scheme, e.g. http://localhost:8501." in capsys.readouterr().err


# What the REST client (and `python -m export.client`) loads of the package: no module that needs more than Python.
STANDARD_LIBRARY_ONLY = {
    "keras_transformer",
    "keras_transformer.cli",
    "keras_transformer.cli.client",
    "keras_transformer.cli.decoding_flags",
    "keras_transformer.cli.interrupts",
    "keras_transformer.cli.line_input",
    "keras_transformer.decoding_settings",
    "keras_transformer.serving_client",
    "keras_transformer.signatures",
}


def test_the_rest_client_imports_no_tensorflow():
    """It needs the standard library only, so it runs where tensorflow-text has no wheel."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, export.client, keras_transformer.serving_client; print(*sys.modules)"],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout.split()
    assert "export.client" in loaded
    assert not [name for name in loaded if name.split(".")[0] in ("tensorflow", "keras", "numpy")]
    assert {name for name in loaded if name.split(".")[0] == "keras_transformer"} <= STANDARD_LIBRARY_ONLY


def test_rest_client_gives_up_on_a_server_that_never_answers():
    with socket.socket() as silent:  # Accepts connections (the backlog), never answers.
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(serving_client.ServingError, match=r"No answer from .* within 0.5 s"):
            serving_client.translate_rest(url, MODEL_NAME, ["A dog."], timeout=0.5)


def test_client_cli_reports_a_beam_size_the_server_refuses(rest_server, sentences, capsys):
    assert client_cli.main(["--rest", rest_server, "--model", MODEL_NAME, "--beam-size", "17", sentences[0]]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("python -m export.client: error: translation failed: 400 from ")
    assert "beam_size is at most 16" in captured.err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--beam-size", "0"], "--beam-size must be at least 1."),
        (["--alpha", "-2"], "--alpha must be 0 or more."),
        (["--alpha", "nan"], "--alpha must be a finite number, got nan."),
        (["--max-length", "-3"], "--max-length must be at least 1."),
        (["--scores", "--n-best"], "argument --n-best: not allowed with argument --scores"),
    ],
)
def test_client_cli_refuses_options_that_the_server_would_read_as_unset(capsys, flags, message):
    """The signature reads 0 and negative options as "the model's own": a typo must not quietly become that."""
    with pytest.raises(SystemExit) as raised:
        client_cli.parse_args(["--rest", "http://localhost:8501", *flags, "A dog."])
    assert raised.value.code == 2 and message in capsys.readouterr().err


def test_client_cli_says_what_grpc_needs_when_it_is_not_installed(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_serving.apis", None)  # As when the package is not installed.
    assert client_cli.main(["--grpc", "localhost:8500", "A dog."]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("python -m export.client: error: --grpc needs tensorflow-serving-api")
    assert 'pip install -e ".[serving]"' in line


def test_client_cli_n_best_uses_the_served_models_own_beam_size(served_beam_2, sentences, capsys):
    _, _, signatures = served_beam_2
    with serving_rest(signatures) as url:
        assert client_cli.main(["--rest", url, "--model", MODEL_NAME, "--n-best", sentences[0]]) == 0
    lines = capsys.readouterr().out.splitlines()
    best = translate(signatures["serving_default"], sentences[:1])["translation"][0].decode()
    assert len(lines) == 2 and lines[0].startswith(f"0 ||| {best} ||| ")


@pytest.fixture(scope="module")
def grpc_server(served):
    import grpc
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    class PredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
        def Predict(self, request, context):  # noqa: N802 (the gRPC method name)
            signature = served[request.model_spec.signature_name or "serving_default"]
            inputs = {name: tf.make_ndarray(tensor) for name, tensor in request.inputs.items()}
            outputs = signature(**{name: tf.constant(value) for name, value in inputs.items()})
            response = predict_pb2.PredictResponse()
            for name, value in outputs.items():
                response.outputs[name].CopyFrom(tf.make_tensor_proto(value.numpy()))
            return response

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(PredictionService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_grpc_client(grpc_server, translator, sentences):
    expected = translate(translator.translate, sentences[:3])
    results = serving_client.translate_grpc(grpc_server, MODEL_NAME, sentences[:3])
    assert [r["translation"] for r in results] == [t.decode() for t in expected["translation"]]
    np.testing.assert_allclose([r["score"] for r in results], expected["score"], rtol=1e-5)
    results = serving_client.translate_grpc(
        grpc_server,
        MODEL_NAME,
        sentences[:2],
        options={"beam_size": 2, "alpha": 0.6, "max_length": 0, "min_length": -1},
    )
    assert [len(r["scores"]) for r in results] == [2, 2]


# ---------------------------------------------------------------------------
# TF Serving's model-server and batching configs
# ---------------------------------------------------------------------------


def test_the_example_models_config_is_a_valid_model_server_config():
    from google.protobuf import text_format
    from tensorflow_serving.config import model_server_config_pb2

    config = text_format.Parse(
        (REPO / "export" / "models.config").read_text(), model_server_config_pb2.ModelServerConfig()
    )
    (model,) = config.model_config_list.config
    assert (model.name, model.base_path) == (MODEL_NAME, f"/models/{MODEL_NAME}")


def batching_parameters_class():
    """`tensorflow.serving.BatchingParameters`, built from its definition in TF Serving's
    `session_bundle_config.proto` (tensorflow-serving-api does not ship that module)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, wrappers_pb2

    field = descriptor_pb2.FieldDescriptorProto
    wrapped = {"max_batch_size": (1, "Int64Value"), "batch_timeout_micros": (2, "Int64Value"),
               "max_enqueued_batches": (3, "Int64Value"), "num_batch_threads": (4, "Int64Value"),
               "thread_pool_name": (5, "StringValue"), "enable_large_batch_splitting": (8, "BoolValue"),
               "max_execution_batch_size": (9, "Int64Value")}
    file = descriptor_pb2.FileDescriptorProto(
        name="tensorflow_serving/servables/tensorflow/session_bundle_config.proto", package="tensorflow.serving",
        dependency=["google/protobuf/wrappers.proto"], syntax="proto3",
    )
    message = file.message_type.add(name="BatchingParameters")
    for name, (number, type_name) in wrapped.items():
        message.field.add(name=name, number=number, label=field.LABEL_OPTIONAL, type=field.TYPE_MESSAGE,
                          type_name=f".google.protobuf.{type_name}")
    message.field.add(name="allowed_batch_sizes", number=6, label=field.LABEL_REPEATED, type=field.TYPE_INT64)
    message.field.add(name="pad_variable_length_inputs", number=7, label=field.LABEL_OPTIONAL, type=field.TYPE_BOOL)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.serving.BatchingParameters"))


def batching_config():
    """export/batching.config, parsed."""
    from google.protobuf import text_format

    return text_format.Parse((REPO / "export" / "batching.config").read_text(), batching_parameters_class()())


def test_the_batching_config_is_valid_batching_parameters_that_tf_serving_accepts():
    params = batching_config()
    # Every field set, none left to TF Serving's defaults by a typo.
    assert {field.name for field, _ in params.ListFields()} >= {
        "max_batch_size", "batch_timeout_micros", "num_batch_threads", "max_enqueued_batches"
    }
    assert params.num_batch_threads.value >= 1 and params.max_enqueued_batches.value >= 1
    assert 0 <= params.batch_timeout_micros.value <= 10_000  # TF Serving's CPU advice: 0-10 ms
    assert not params.enable_large_batch_splitting.value and not params.pad_variable_length_inputs
    # python -m export.client's default requests fit in a batch.
    assert params.max_batch_size.value >= client_cli.parse_args(["--rest", "http://localhost:8501"]).batch_size
    # Unset: TF Serving would pad batches with copies of a row, which are translated
    # (an XLA export pads its batches itself, with rows it does not search).
    assert not params.allowed_batch_sizes


def test_every_field_of_the_batching_config_says_why():
    lines = (REPO / "export" / "batching.config").read_text().splitlines()
    for index, line in enumerate(lines):
        if line.strip() and not line.startswith("#"):
            assert lines[index - 1].startswith("# "), f"{line!r} has no comment above it"


def tf_serving_batch(signature, requests, allowed_batch_sizes):
    """The outputs of `requests` (lists of sentences) run as one TF Serving batch, split back per request.

    As TF Serving's BatchingSession does: inputs concatenated along dimension 0, padded to
    the next allowed size (if any) with copies of the last request's first row, outputs split
    along dimension 0 (which every output must have).
    """
    rows = [len(request) for request in requests]
    padded = min((size for size in allowed_batch_sizes if size >= sum(rows)), default=sum(rows))
    merged = [text for request in requests for text in request] + [requests[-1][0]] * (padded - sum(rows))
    outputs = translate(signature, merged)
    assert all(value.ndim >= 1 and len(value) == padded for value in outputs.values())
    bounds = np.cumsum([0, *rows])
    return [{name: value[start:end] for name, value in outputs.items()} for start, end in zip(bounds, bounds[1:])]


def test_serving_default_answers_batched_requests_as_each_alone(served, sentences):
    """TF Serving's batching merges requests and splits the outputs; each request gets its own answer."""
    signature = served["serving_default"]
    specs = [*signature.structured_input_signature[1].values(), *signature.structured_outputs.values()]
    assert all(spec.shape.rank == 1 and spec.shape[0] is None for spec in specs)  # [batch] only
    requests = [sentences[:1], [*sentences[1:3], BAD_INPUTS[0].decode()], sentences[3:5]]

    # As export/batching.config batches (no padding), and padded to allowed sizes.
    for allowed_batch_sizes in (list(batching_config().allowed_batch_sizes), [1, 2, 4, 8, 16, 32]):
        batched = tf_serving_batch(signature, requests, allowed_batch_sizes)

        for request, answer in zip(requests, batched, strict=True):
            alone = translate(signature, request)
            assert list(answer["translation"]) == list(alone["translation"])
            np.testing.assert_allclose(answer["score"], alone["score"], rtol=1e-5)


def test_translate_with_options_has_scalar_inputs_which_tf_serving_cannot_batch(served):
    """What export/batching.config and README say: under --enable_batching only serving_default is served."""
    inputs = served["translate_with_options"].structured_input_signature[1]
    assert {name for name, spec in inputs.items() if spec.shape.rank == 0} == {
        "beam_size", "alpha", "max_length", "min_length"
    }
    assert "translate_with_options" in (REPO / "export" / "batching.config").read_text()
