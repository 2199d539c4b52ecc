"""The repository's scripts (`train.py`, `translate.py`), imported as modules by the tests.

They are not part of the installed package, so the tests load them from the repository.
"""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def import_train_script():
    """`train.py` as the module `train` (imported once, like any module)."""
    sys.path.insert(0, str(REPO))
    try:
        import train
    finally:
        sys.path.remove(str(REPO))
    return train


def load_translate_cli():
    """A fresh module of `translate.py` (each test gets its own, to monkeypatch freely)."""
    spec = importlib.util.spec_from_file_location("translate_cli", REPO / "translate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
