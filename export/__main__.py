"""`python -m export --run-dir RUN --out models/transformer [--version N]`: the command `kt-export`.

See `keras_transformer/cli/export.py` for the command and `keras_transformer/saved_model.py` for the export.
"""

import sys

from keras_transformer.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
