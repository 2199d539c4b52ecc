"""One line of a library's error message, as this project's messages quote it."""

from keras_transformer import error_text


def test_the_first_line_that_says_something_not_tensorflows_graph_header():
    error = RuntimeError("\n  Graph execution error:\n\n  Detected at node Foo  \nstack ...")
    assert error_text.first_line(error) == "Detected at node Foo"
    assert error_text.summary(error) == "RuntimeError: Detected at node Foo"


def test_a_message_without_a_line_is_named_by_its_type():
    assert error_text.first_line(IndexError()) == "IndexError"
    assert error_text.summary(IndexError("\n ")) == "IndexError: "


def test_the_summary_cuts_a_long_line():
    assert error_text.summary(ValueError("x" * 500)) == "ValueError: " + "x" * 300
