"""The commands `kt-train`, `kt-translate`, `kt-export`, `kt-client`: `python train.py`,
`python translate.py`, `python -m export`, `python -m export.client`.

Each module holds one command's parser and `main(argv=None) -> exit code` (`xla_batch`,
`decoding_flags`: flags several of them share). Library modules never import from here.

Importing this package quiets what TensorFlow says that means nothing to a command's
user: its C++ info and warning lines (CPU features, the asserts XLA leaves out), unless
`TF_CPP_MIN_LOG_LEVEL` is set, and the warning, at each load of an export, about the
custom gradients it leaves out on purpose (`saved_model.save_translator`).
"""

import logging
import os

# Read once, when TensorFlow loads: the commands' modules import it after this.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


class _WithoutCustomGradientWarnings(logging.Filter):
    def filter(self, record):
        return "unsaved custom gradients" not in record.getMessage()


logging.getLogger("absl").addFilter(_WithoutCustomGradientWarnings())
