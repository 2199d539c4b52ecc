"""How `translate.py` and the client end when their user stops them: an exit code, no traceback."""

import os
import sys


def exit_code_of(run, prog):
    """`run()`'s exit code, or 130 after Ctrl-C and 1 when stdout's reader left (`| head`).

    Either ends with no traceback; what was printed or written before stays.
    """
    try:
        return run()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # As Python's signal docs advise: no second error when stdout is flushed at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
