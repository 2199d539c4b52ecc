"""One line for an exception a library raised (TensorFlow, TFDS, SentencePiece).

Their messages can run to pages (a stack, gRPC details); this project's messages quote
one line of them. Standard library only.
"""

# What a TensorFlow graph's error puts before the line that says what failed.
_TF_GRAPH_HEADER = "Graph execution error:"


def first_line(error) -> str:
    """The first line of `error`'s message that says something; the name of its type if none does."""
    return _first_line(error) or type(error).__name__


def summary(error, most=300) -> str:
    """`Type: first line` of `error`, the line cut at `most` characters."""
    return f"{type(error).__name__}: {_first_line(error)[:most]}"


def _first_line(error):
    lines = (line.strip() for line in str(error).splitlines())
    return next((line for line in lines if line and line != _TF_GRAPH_HEADER), "")
