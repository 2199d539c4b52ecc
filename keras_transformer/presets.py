"""Named model sizes.

`base` and `big` are the paper's Table 3 configurations. `small` trains on a
2-core CPU in minutes (the default of `train.py`); `medium` is the CPU preset
for the best BLEU on Multi30k in about an hour; `tiny` is for tests.
"""

PRESETS = {
    "tiny": dict(num_layers=2, d_model=32, num_heads=4, d_ff=64, dropout_rate=0.1),
    "small": dict(num_layers=3, d_model=256, num_heads=4, d_ff=1024, dropout_rate=0.1),
    "medium": dict(num_layers=4, d_model=256, num_heads=8, d_ff=1024, dropout_rate=0.2),
    "base": dict(num_layers=6, d_model=512, num_heads=8, d_ff=2048, dropout_rate=0.1),
    "big": dict(num_layers=6, d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3),
}


def get_preset(name):
    """The keyword arguments of `Transformer` for preset `name`."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"Unknown preset {name!r}; choose one of {', '.join(PRESETS)}.") from None
