"""The commands `kt-train`, `kt-translate`, `kt-export`, `kt-client`: `python train.py`,
`python translate.py`, `python -m export`, `python -m export.client`.

Each module holds one command's parser and `main(argv=None) -> exit code` (`xla_batch`,
`decoding_flags`: flags several of them share). Library modules never import from here.
"""
