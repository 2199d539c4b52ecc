"""The commands' modules (`keras_transformer.cli`), loaded afresh for tests that monkeypatch them."""

import importlib.util


def load_translate_cli():
    """A fresh module of the `translate.py` command, `keras_transformer.cli.translate`: each test gets its own."""
    origin = importlib.util.find_spec("keras_transformer.cli.translate").origin
    spec = importlib.util.spec_from_file_location("translate_cli", origin)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
