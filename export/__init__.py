"""Serving a trained run: `export.saved_model` writes the SavedModel TF Serving loads,
`export.client` talks to the server.

    python -m export --run-dir RUN --out models/transformer       (export.__main__)
    python -m export.client --rest http://localhost:8501 "A sentence."

Nothing is imported here: the REST client needs only the standard library, not
TensorFlow, Keras or tensorflow-text (which has no wheels for some platforms).
"""
