"""Clients of the translator served by TF Serving: REST (port 8501) and gRPC (port 8500).

REST, TF Serving's JSON API (`POST /v1/models/NAME[/versions/N]:predict`):

* `serving_default` in the row format: `{"signature_name": "serving_default",
  "instances": ["A sentence.", ...]}` -> `{"predictions": [{"translation": "...",
  "score": -0.4}, ...]}`.
* `translate_with_options` in the columnar format (its scalar inputs have no batch
  dimension, which the row format requires): `{"signature_name":
  "translate_with_options", "inputs": {"text": [...], "beam_size": 4, "alpha": 0.6,
  "max_length": 0, "min_length": -1}}` -> `{"outputs": {"translation": [...], "score": [...],
  "translations": [[...]], "scores": [[...]]}}`; `beam_size` 0 and a negative `alpha` or
  `min_length` stand for `serving_default`'s own.

gRPC: `tensorflow_serving.apis`' `PredictionService.Predict` with the same signatures
(needs the `serving` extra: `tensorflow-serving-api`).

Both return one dict per sentence: `translation` and `score`, plus `translations` and
`scores` (the n-best list) when options were given.

    python -m export.client --rest http://localhost:8501 --model transformer "A sentence."
    python -m export.client --grpc localhost:8500 --model transformer --beam-size 8 < input.txt

The command line sends `--batch-size` sentences per request (default 32; the 1,000
Multi30k test sentences in one request take about 100 s on a 2-core CPU, twice as long
as in batches of 32) and prints each batch's translations as they come. The REST
client uses the standard library only.
"""

import argparse
import codecs
import json
import os
import sys
import urllib.error
import urllib.request

SERVING_SIGNATURE = "serving_default"
OPTIONS_SIGNATURE = "translate_with_options"


class ServingError(RuntimeError):
    """The server answered with an error, or could not be reached."""


def rest_payload(sentences, options=None):
    """The JSON body of a predict request: row format, or columnar with `options`."""
    if options is None:
        return {"signature_name": SERVING_SIGNATURE, "instances": list(sentences)}
    return {"signature_name": OPTIONS_SIGNATURE, "inputs": {"text": list(sentences), **options}}


def translate_rest(server, model, sentences, *, options=None, version=None, timeout=60.0):
    """Translates `sentences` through TF Serving's REST API.

    Args:
        server: Base URL, e.g. "http://localhost:8501".
        model: Served model name.
        sentences: str sentences.
        options: `None` for `serving_default`, or a dict of `beam_size`, `alpha` and
            `max_length` for `translate_with_options`.
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
    request = urllib.request.Request(
        server.rstrip("/") + path,
        data=json.dumps(rest_payload(sentences, options)).encode(),
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
    if options is None:
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
    request.model_spec.signature_name = SERVING_SIGNATURE if options is None else OPTIONS_SIGNATURE
    if version is not None:
        request.model_spec.version.value = version
    request.inputs["text"].CopyFrom(
        tf.make_tensor_proto([s.encode() for s in sentences], dtype=tf.string)
    )
    dtypes = {"beam_size": tf.int32, "alpha": tf.float32, "max_length": tf.int32, "min_length": tf.int32}
    for name, value in (options or {}).items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(value, dtype=dtypes[name]))
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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m export.client",
        description="Translate with a TF Serving model server (REST or gRPC).",
    )
    server = parser.add_mutually_exclusive_group(required=True)
    server.add_argument("--rest", metavar="URL", help="REST base URL, e.g. http://localhost:8501.")
    server.add_argument("--grpc", metavar="HOST:PORT", help="gRPC address, e.g. localhost:8500.")
    parser.add_argument("--model", default="transformer", help="Served model name.")
    parser.add_argument("--version", type=int, help="Model version (default: the latest served).")
    parser.add_argument("--beam-size", type=int, help="Use translate_with_options with this beam.")
    parser.add_argument(
        "--alpha", type=float, help="Use translate_with_options with this length penalty."
    )
    parser.add_argument(
        "--max-length", type=int, help="Use translate_with_options with this output cap."
    )
    parser.add_argument(
        "--min-length",
        type=int,
        help="Use translate_with_options with this many tokens before EOS at the least (0: may be empty).",
    )
    parser.add_argument(
        "--n-best", action="store_true", help="Print every hypothesis (translate_with_options)."
    )
    parser.add_argument("--scores", action="store_true", help="Print 'score<TAB>translation'.")
    parser.add_argument(
        "--batch-size", type=int, default=32, help="Sentences per request (default: 32)."
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="Seconds to wait for each answer (default: 60)."
    )
    parser.add_argument(
        "sentences", nargs="*", help="Sentences to translate; default: lines of stdin."
    )
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1.")
    if args.timeout <= 0:
        parser.error("--timeout must be more than 0.")
    if args.min_length is not None and args.min_length < 0:
        parser.error("--min-length must be 0 or more.")
    return args


def read_sentences(args):
    """The sentences of the arguments or of stdin's lines, as valid str.

    Bytes that are not UTF-8 become U+FFFD here: JSON and protobuf strings cannot carry
    them (the model would read them as U+FFFD too). A line's "\\r\\n" and a byte order
    mark at the start of the input are not text.
    """
    if args.sentences:
        return [os.fsencode(sentence).decode("utf-8", errors="replace") for sentence in args.sentences]
    lines = sys.stdin.buffer.read().removeprefix(codecs.BOM_UTF8).split(b"\n")  # "\n" only: lines stay aligned.
    if lines[-1] == b"":
        lines.pop()
    return [line.rstrip(b"\r").decode("utf-8", errors="replace") for line in lines]


def request_options(args):
    """`translate_with_options` inputs if any option was given, else `None` (`serving_default`)."""
    if (
        args.beam_size is None
        and args.alpha is None
        and args.max_length is None
        and args.min_length is None
        and not args.n_best
    ):
        return None
    # 0, -1.0 and -1 ask for the served model's own beam size, length penalty and minimum length.
    return {
        "beam_size": 0 if args.beam_size is None else args.beam_size,
        "alpha": -1.0 if args.alpha is None else args.alpha,
        "max_length": 0 if args.max_length is None else args.max_length,
        "min_length": -1 if args.min_length is None else args.min_length,
    }


def main(argv=None):
    args = parse_args(argv)
    sentences = read_sentences(args)
    translate = translate_rest if args.rest else translate_grpc
    for start in range(0, len(sentences), args.batch_size):
        try:
            results = translate(
                args.rest or args.grpc,
                args.model,
                sentences[start : start + args.batch_size],
                options=request_options(args),
                version=args.version,
                timeout=args.timeout,
            )
        except ServingError as error:
            print(f"translation failed: {error}", file=sys.stderr)
            return 1
        print_results(results, start, args)
        sys.stdout.flush()  # Each batch as it comes: a long input shows its progress.
    return 0


def print_results(results, first_index, args):
    for index, result in enumerate(results, start=first_index):
        if args.n_best:
            for translation, score in zip(result["translations"], result["scores"], strict=True):
                print(f"{index} ||| {translation} ||| {score:.4f}")
        elif args.scores:
            print(f"{result['score']:.4f}\t{result['translation']}")
        else:
            print(result["translation"])


if __name__ == "__main__":
    sys.exit(main())
