"""Train a Transformer translation model: `python train.py --help` (the same command as `kt-train`).

See `keras_transformer/cli/train.py` for the command and `docs/training.md` for the recipes.
"""

import sys

from keras_transformer.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
