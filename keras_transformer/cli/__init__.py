"""The commands `kt-train`, `kt-translate`, `kt-export`, `kt-client`: `python train.py`,
`python translate.py`, `python -m export`, `python -m export.client`.

Each module holds one command's parser and `main(argv=None) -> exit code` (`xla_batch`,
`decoding_flags`: flags several of them share). Library modules never import from here.

Importing this package quiets what TensorFlow says that means nothing to a command's
user: its C++ info and warning lines (CPU features, the asserts XLA leaves out; not those
printed before its logging starts, see docs/training.md), unless `TF_CPP_MIN_LOG_LEVEL` is
set; the warning, at each load of an export, about the custom gradients it leaves out on
purpose (`saved_model.save_translator`); and the deprecation of the loader that the
export's check loads it with, as TF Serving does.
"""

import logging
import os

# Read once, when TensorFlow loads: the commands' modules import it after this.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


class _Without(logging.Filter):
    """Drops the records that contain one of `phrases`."""

    def __init__(self, *phrases):
        super().__init__()
        self.phrases = phrases

    def filter(self, record):
        message = record.getMessage()
        return not any(phrase in message for phrase in self.phrases)


logging.getLogger("absl").addFilter(_Without("unsaved custom gradients"))
# The export's check loads it as TF Serving does, with TensorFlow 1's loader (`saved_model.verify_export`).
logging.getLogger("tensorflow").addFilter(_Without("loader_impl) is deprecated"))
