"""Lines of an input read as they arrive, in batches of what has arrived: `translate.py`'s and the client's.

A sentence typed at a terminal or written to a pipe is answered at once, and a file of
any size is read in full batches with bounded memory, never whole. Standard library
only: the REST client needs nothing more.
"""

import codecs
import collections
import os
import select

# Bytes asked of the input at a time: a few batches of typical lines, never the whole input.
READ_CHUNK_BYTES = 1 << 16


class LineReader:
    """The lines of a binary stream, read a chunk at a time as they arrive.

    Lines end at "\\n" only, as the corpus reader's: a stray "\\r" inside a line does not
    split it. A line's trailing "\\r"s (CRLF files) and the first line's UTF-8 byte order
    mark (an editor's mark, not text) are dropped; a last line without "\\n" is a line.
    Bytes are not decoded: invalid UTF-8 is passed on (the translator copes).

    A stream with a file descriptor is read with `os.read`, past any Python buffer:
    nothing else may have read from it. Memory holds what one read returned at most,
    beyond the line being completed.
    """

    def __init__(self, stream, chunk_bytes=READ_CHUNK_BYTES):
        self._stream = stream
        self._chunk_bytes = chunk_bytes
        self._fd = _file_descriptor(stream)
        self._lines = collections.deque()  # Whole lines read and not yet returned.
        self._partial = []  # The pieces of the line being read.
        self._at_end = False
        self._first = True

    def __iter__(self):
        while (line := self.next_line()) is not None:
            yield line

    def next_line(self):
        """The next line, waiting for it if need be; `None` at the end of the input."""
        while not self._lines and not self._at_end:
            self._read_chunk()
        if not self._lines:
            return None
        line = self._lines.popleft()
        if self._first:
            self._first = False
            line = line.removeprefix(codecs.BOM_UTF8)
        return line.rstrip(b"\r")

    def line_ready(self):
        """Whether `next_line` returns without waiting: a whole line, or the end, has arrived."""
        while not self._lines and not self._at_end and self._readable_now():
            self._read_chunk()
        return bool(self._lines) or self._at_end

    def _read_chunk(self):
        if self._fd is not None:
            chunk = os.read(self._fd, self._chunk_bytes)
        else:
            chunk = _read_some(self._stream, self._chunk_bytes)
        if not chunk:
            self._at_end = True  # Never read again: a terminal would wait for a second Ctrl-D.
            if self._partial:
                self._lines.append(b"".join(self._partial))
                self._partial = []
            return
        *whole, rest = chunk.split(b"\n")
        if whole:
            whole[0] = b"".join([*self._partial, whole[0]])
            self._partial = []
            self._lines.extend(whole)
        if rest:
            self._partial.append(rest)

    def _readable_now(self):
        """Whether a read returns without waiting (always, for a stream `select` cannot poll)."""
        if self._fd is None:
            return True
        try:
            return bool(select.select([self._fd], [], [], 0)[0])
        except (OSError, ValueError):  # Windows pipes: a batch then waits until it is full or the input ends.
            return True


def _file_descriptor(stream):
    """`stream`'s file descriptor, or `None` for an in-memory stream such as `io.BytesIO`."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the latter.
        return None


def _read_some(stream, size):
    """Up to `size` bytes of a stream without a file descriptor, with one read if it allows."""
    return stream.read1(size) if hasattr(stream, "read1") else stream.read(size)


def sentence_batches(arguments, stream, size, report):
    """Batches of at most `size` sentences as bytes: the command-line `arguments` if any, else `stream`'s lines.

    `report(message)` is told of sentences that are not UTF-8 (`reporting_invalid_utf8`).
    """
    return reporting_invalid_utf8(_batches(arguments, stream, size), "sentence" if arguments else "line", report)


def _batches(arguments, stream, size):
    if not arguments:
        yield from arriving_batches(LineReader(stream), size)
        return
    # fsencode: the bytes as given, also those that are not UTF-8.
    sentences = [os.fsencode(sentence) for sentence in arguments]
    for start in range(0, len(sentences), size):
        yield sentences[start : start + size]


def reporting_invalid_utf8(batches, noun, report):
    """`batches` as they are; `report(message)` names the first sentence that is not UTF-8, and at the end how many.

    The model reads each malformed byte as U+FFFD, so such a sentence loses its accented
    letters without failing: most often the file is in a legacy encoding (Latin-1).
    Sentences are counted from 1 as `noun`s ("line", "sentence").
    """
    invalid = count = 0
    for batch in batches:
        for sentence in batch:
            count += 1
            if _is_utf8(sentence):
                continue
            invalid += 1
            if invalid == 1:
                report(f"{noun} {count} is not UTF-8: its malformed bytes translate as U+FFFD "
                       "(a Latin-1 file? `iconv -f LATIN1 -t UTF-8` converts it).")
        yield batch
    if invalid > 1:
        report(f"{invalid:,} of the {count:,} {noun}s were not UTF-8.")


def _is_utf8(sentence):
    try:
        sentence.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def arriving_batches(lines, size):
    """Batches of the lines of a `LineReader`: the first waited for, then those already there, up to `size`."""
    while (first := lines.next_line()) is not None:
        batch = [first]
        while len(batch) < size and lines.line_ready():
            line = lines.next_line()
            if line is None:
                break
            batch.append(line)
        yield batch
