"""GNMT's length penalty, computed in Python: the reference the decoding tests score outputs with.

Used by test_search.py (brute force, a plain Python beam search) and test_decoding.py
(scores recomputed by teacher forcing).
"""


def penalty(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha
