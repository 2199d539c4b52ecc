"""Clients of the translator served by TF Serving: REST (port 8501) and gRPC (port 8500).

The signatures, their inputs and outputs are the table of `keras_transformer.signatures`.
REST, TF Serving's JSON API (`POST /v1/models/NAME[/versions/N]:predict`):

* `serving_default` in the row format: `{"signature_name": "serving_default",
  "instances": ["A sentence.", ...]}` -> `{"predictions": [{"translation": "...",
  "score": -0.4}, ...]}`.
* `translate_with_options` in the columnar format (its scalar inputs have no batch
  dimension, which the row format requires): `{"signature_name":
  "translate_with_options", "inputs": {"text": [...], "beam_size": 8, "alpha": 1.0,
  "max_length": 0, "min_length": -1}}` -> `{"outputs": {"translation": [...], "score": [...],
  "translations": [[...]], "scores": [[...]]}}`; an option's `unset` value (0, -1.0, -1)
  stands for `serving_default`'s own (`signatures.options_request` fills them in).

gRPC: `tensorflow_serving.apis`' `PredictionService.Predict` with the same signatures
(needs the `serving` extra: `tensorflow-serving-api`, and TensorFlow).

Both return one dict per sentence: `translation` and `score`, plus `translations` and
`scores` (the n-best list) when options were given.

The REST client uses the standard library only: it runs where TensorFlow and
tensorflow-text are not installed. The command line is `python -m export.client`
(`keras_transformer.cli.client`).
"""

import json
import urllib.error
import urllib.request

from keras_transformer.signatures import OPTIONS_SIGNATURE, SERVING_SIGNATURE, SIGNATURES, TEXT


class ServingError(RuntimeError):
    """The server answered with an error, or could not be reached."""


def signature_name(options=None):
    """The signature a request with `options` (or none) goes to."""
    return SERVING_SIGNATURE if options is None else OPTIONS_SIGNATURE


def rest_payload(sentences, options=None):
    """The JSON body of a predict request: row format, or columnar with `options` (see `signatures`)."""
    name = signature_name(options)
    if SIGNATURES[name].batched:
        return {"signature_name": name, "instances": list(sentences)}
    return {"signature_name": name, "inputs": {TEXT.name: list(sentences), **options}}


def translate_rest(server, model, sentences, *, options=None, version=None, timeout=60.0):
    """Translates `sentences` through TF Serving's REST API.

    Args:
        server: Base URL, e.g. "http://localhost:8501".
        model: Served model name.
        sentences: str sentences.
        options: `None` for `serving_default`, or a dict of the options of
            `translate_with_options` (`signatures.options_request(...)`).
        version: A model version; `None` for the latest the server loaded.
        timeout: Seconds to wait for the answer.

    Returns:
        One dict per sentence (see the module docstring).

    Raises:
        ServingError: On an HTTP or connection error, with the server's message.
    """
    if not sentences:
        return []
    path = f"/v1/models/{model}" + ("" if version is None else f"/versions/{version}") + ":predict"
    payload = rest_payload(sentences, options)
    request = urllib.request.Request(
        server.rstrip("/") + path,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as error:
        raise ServingError(
            f"{error.code} from {request.full_url}: {error.read().decode(errors='replace')}"
        ) from None
    except urllib.error.URLError as error:
        raise ServingError(f"Cannot reach {request.full_url}: {error.reason}") from None
    except TimeoutError:  # Raised bare when the answer, not the connection, is late.
        raise ServingError(f"No answer from {request.full_url} within {timeout:g} s.") from None
    except (OSError, ValueError) as error:  # A dropped connection, or an answer that is not JSON.
        raise ServingError(f"Bad answer from {request.full_url}: {error}") from None
    if "instances" in payload:
        return answer["predictions"]
    return _rows(answer["outputs"])


def translate_grpc(server, model, sentences, *, options=None, version=None, timeout=60.0):
    """Translates `sentences` through TF Serving's gRPC `PredictionService`.

    Args: as `translate_rest`, with `server` a "host:port" address, e.g. "localhost:8500".

    Returns:
        One dict per sentence (see the module docstring).

    Raises:
        ServingError: On a gRPC error, with the server's message.
    """
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    if not sentences:
        return []
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.model_spec.signature_name = signature_name(options)
    if version is not None:
        request.model_spec.version.value = version
    request.inputs[TEXT.name].CopyFrom(
        tf.make_tensor_proto([s.encode() for s in sentences], dtype=tf.string)
    )
    dtypes = SIGNATURES[request.model_spec.signature_name].input_dtypes()
    for name, value in (options or {}).items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(value, dtype=tf.as_dtype(dtypes[name])))
    with grpc.insecure_channel(server) as channel:
        try:
            response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
                request, timeout=timeout
            )
        except grpc.RpcError as error:
            raise ServingError(f"{error.code().name} from {server}: {error.details()}") from None
    outputs = {
        name: _python_values(tf.make_ndarray(tensor)) for name, tensor in response.outputs.items()
    }
    return _rows(outputs)


def _python_values(array):
    """Lists of str and float from a numpy array of bytes or numbers."""
    if array.dtype == object:
        return (
            [_python_values(row) for row in array]
            if array.ndim > 1
            else [s.decode() for s in array]
        )
    return array.tolist()


def _rows(columns):
    """`{"output": [per sentence]}` -> `[{"output": value} per sentence]`."""
    names = list(columns)
    return [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]
