"""bench/cpu_replicas.py: real train.py runs, each variant's speed read from train.py's own line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_every_variant_trains_on_the_same_global_batch():
    import cpu_replicas

    def global_batch(flags):
        return int(flags[flags.index("--cpu-replicas") + 1]) * int(flags[flags.index("--token-budget") + 1])

    runs = cpu_replicas.variants(token_budget=1024, replicas=3)
    assert {name: global_batch(flags) for name, (flags, _) in runs.items()} == dict.fromkeys(runs, 3072)


@pytest.mark.slow
def test_the_benchmark_records_each_variants_train_py_speed(tmp_path, multi30k_dir):
    result = subprocess.run(
        [sys.executable, "bench/cpu_replicas.py", "--data-dir", str(multi30k_dir), "--preset", "tiny", "--steps", "30",
         "--token-budget", "256", "--rounds", "1", "--max-load", "-1", "--results-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    variants = json.loads((tmp_path / "cpu_replicas.json").read_text())["variants"]
    assert sorted(variants) == ["1 replica", "1 replica, 1 thread", "2 replicas"]
    for name, entry in variants.items():
        (run,) = entry["runs"]
        assert run["tokens_per_s"] > 0 and run["wall_s"] > 0, name
    assert variants["1 replica"]["vs_1_replica"] == 1.0
