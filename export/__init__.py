"""Serving files of the repository: `python -m export` (`kt-export`) and `python -m export.client`.

The commands live in `keras_transformer.cli` and their library in the package
(`keras_transformer.saved_model`, `keras_transformer.serving_client`); this directory
keeps the `python -m` entry points and TF Serving's example configuration files
(`models.config`, `batching.config`). It is not installed. Nothing is imported here:
the REST client needs only the standard library.
"""
