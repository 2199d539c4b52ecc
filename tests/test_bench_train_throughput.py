"""bench/train_throughput.py's peer: KerasHub's layers in our architecture, whatever start a preset chooses."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.parametrize("preset", ["tiny", "small", "medium"])  # tiny: none, small and medium: mimetic
def test_the_peer_builds_our_architecture_for_presets_that_choose_an_attention_start(preset):
    """A preset's attention_init (small's and medium's: mimetic) only sets our start: the peer still builds.

    Same architecture, same weights to train: the peer has as many parameters as our model.
    """
    pytest.importorskip("keras_hub")
    import train_throughput

    ours = train_throughput.build_model("ours", preset, vocab_size=100)
    peer = train_throughput.build_model("peer_noattndrop", preset, vocab_size=100)
    assert peer.count_params() == ours.count_params()
