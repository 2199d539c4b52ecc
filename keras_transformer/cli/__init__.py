"""The commands `kt-train`, `kt-translate`, `kt-export`: `python train.py`, `python translate.py`, `python -m export`.

Each module holds one command's parser and `main(argv=None) -> exit code` (`xla_batch`: a
flag two of them share). Library modules never import from here.
"""
