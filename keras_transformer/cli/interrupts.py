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
        discard_stdout()
        return 1


def discard_stdout():
    """Points stdout at /dev/null after a write to it failed: no second error when Python flushes it at exit.

    As Python's signal docs advise for a reader that left (`| head`); a full disk is the same.
    """
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
