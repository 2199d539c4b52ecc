"""`python -m export.client --rest http://localhost:8501 "A sentence."`: translate with a TF Serving server.

See `keras_transformer/cli/client.py` for the command and `keras_transformer/serving_client.py` for the
REST and gRPC clients (the REST one needs the standard library only).
"""

import sys

from keras_transformer.cli.client import main

if __name__ == "__main__":
    sys.exit(main())
