"""Benchmark: train.py's speed on a CPU with one replica on all cores, or replicas that split them.

Usage:
    python bench/cpu_replicas.py --data-dir ../shared/data/multi30k                  # medium, 300 steps x 3 variants x 2 rounds (~15 min on 2 cores)
    python bench/cpu_replicas.py --data-dir DIR --preset small --steps 200 --rounds 1

Each variant is a real `train.py` run in a process of its own, on real batches, stopped
once its training loop ends (before the final evaluation): `--preset P --train-steps N
--max-minutes 0 --eval-every 0` and the variant's flags. The variants keep the global
batch at the preset's token budget times its CPU replicas:

* `1 replica`: `--cpu-replicas 1` with the whole budget, TensorFlow's default threads
  (a thread per core for each op);
* `1 replica, 1 thread`: the same with `TF_NUM_INTRAOP_THREADS=1`, i.e. what the other
  cores buy one replica;
* `N replicas`: `--cpu-replicas N` (default 2), each with the budget over N and its
  share of the cores.

The rounds alternate the variants. Recorded per run: train.py's own "Trained steps ...;
X target tokens/s" (real target tokens over the timed steps), and the wall time. Writes
`bench/results/<machine>/cpu_replicas.json`.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (standard library only at import)

_TRAINED = re.compile(r"^Trained steps \d+-\d+ in \S+; ([\d,.]+) target tokens/s\.")


def variants(token_budget: int, replicas: int) -> dict:
    """`{name: (extra flags, extra environment)}` of the runs compared, each of the same global batch."""
    whole = ["--cpu-replicas", "1", "--token-budget", str(token_budget * replicas)]
    return {
        "1 replica": (whole, {}),
        "1 replica, 1 thread": (whole, {"TF_NUM_INTRAOP_THREADS": "1"}),
        f"{replicas} replicas": (["--cpu-replicas", str(replicas), "--token-budget", str(token_budget)], {}),
    }


def run_train_py(flags: list[str], env: dict, args, run_dir: Path) -> dict:
    """One train.py run, stopped when its training loop reports its speed."""
    command = [sys.executable, "train.py", "--preset", args.preset, "--run-dir", str(run_dir),
               "--train-steps", str(args.steps), "--max-minutes", "0", "--eval-every", "0", *flags]
    if args.data_dir:
        command += ["--data-dir", args.data_dir]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=common.REPO_ROOT, env={**os.environ, **env}, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail = collections.deque(maxlen=20)
    try:
        for line in process.stdout:
            tail.append(line.rstrip())
            match = _TRAINED.match(line)
            if match:
                return {"tokens_per_s": float(match.group(1).replace(",", "")),
                        "wall_s": round(time.perf_counter() - started, 1)}
    finally:
        process.kill()
        process.wait()
    raise SystemExit(f"train.py ended without its speed line ({' '.join(command)}):\n" + "\n".join(tail))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=os.environ.get("MULTI30K_DIR"), help="the Multi30k files [MULTI30K_DIR]")
    parser.add_argument("--preset", default="medium", help="train.py's --preset [medium]")
    parser.add_argument("--steps", type=int, default=300, help="steps of each run [300]")
    parser.add_argument("--replicas", type=int, default=2, help="CPU replicas of the split variant [2]")
    parser.add_argument("--token-budget", type=int, default=2048,
                        help="tokens per replica of the split variant; the others take this times --replicas [2048]")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each running every variant once [2]")
    parser.add_argument("--output-name", default="cpu_replicas")
    common.add_load_args(parser)
    common.add_results_dir_arg(parser)
    args = parser.parse_args()
    if min(args.steps, args.replicas, args.token_budget, args.rounds) < 1:
        parser.error("--steps, --replicas, --token-budget and --rounds must be 1 or more.")

    load = common.quiet(args)
    payload = common.header("cpu_replicas", args, with_keras=False)
    runs = variants(args.token_budget, args.replicas)
    results = {name: [] for name in runs}
    for round_index in range(args.rounds):
        for name, (flags, env) in runs.items():
            with tempfile.TemporaryDirectory(prefix="cpu_replicas-") as scratch:
                record = run_train_py(flags, env, args, Path(scratch) / "run")
            results[name].append(record)
            print(f"[bench] round {round_index + 1}, {name}: {record['tokens_per_s']:,.0f} target tokens/s", flush=True)
    medians = {name: statistics.median(r["tokens_per_s"] for r in records) for name, records in results.items()}
    payload["variants"] = {
        name: {
            "flags": runs[name][0], "environment": runs[name][1], "runs": records,
            "median_tokens_per_s": medians[name],
            "vs_1_replica": round(medians[name] / medians["1 replica"], 3),
        }
        for name, records in results.items()
    }
    payload["load"] = common.finish_load(load)
    for name, entry in payload["variants"].items():
        print(f"[bench] {name}: median {entry['median_tokens_per_s']:,.0f} target tokens/s "
              f"({entry['vs_1_replica']:.2f}x one replica)", flush=True)
    common.write_json(args.output_name, payload, args.results_dir)


if __name__ == "__main__":
    main()
