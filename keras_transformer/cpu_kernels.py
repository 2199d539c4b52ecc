"""TensorFlow's CPU kernels, chosen before TensorFlow is imported.

TensorFlow turns its oneDNN CPU kernels on by itself only on x86 CPUs with AVX-512
VNNI/BF16 or AMX, but training steps run faster with them on AVX2 CPUs too (see
docs/performance.md). The variables are read once, when TensorFlow loads, so the
commands (`kt-train`, `train.py`) and the benchmarks call `configure()` first thing.
`import keras_transformer` does not import TensorFlow, so it may come before.
"""

import os
import platform
import sys


def configure():
    """Turns oneDNN on for x86 CPUs and quiets TensorFlow's C++ info logs, unless set already.

    `TF_ENABLE_ONEDNN_OPTS=0` in the environment keeps TensorFlow's own choice.

    Returns:
        False when TensorFlow was imported already, so that the setting came too late.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if platform.machine().lower() in ("x86_64", "amd64"):
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    return "tensorflow" not in sys.modules
