"""Translate sentences with a trained run or an exported SavedModel: `python translate.py --help` (`kt-translate`).

See `keras_transformer/cli/translate.py` for the command.
"""

import sys

from keras_transformer.cli.translate import main

if __name__ == "__main__":
    sys.exit(main())
