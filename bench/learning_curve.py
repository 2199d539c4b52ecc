"""A run's learning curve from its TensorBoard events: validation BLEU and loss against minutes.

Usage:
    python bench/learning_curve.py --run-dir runs/multi30k-medium
    python bench/learning_curve.py --run-dir runs/multi30k-medium --name multi30k-medium-new \
        --against bench/results/MACHINE/learning_curve-multi30k-medium-old-recipe.json   # overlay an earlier curve

Reads `RUN/logs/{train,validation,test}` (the events `train.py` writes) and writes
`bench/results/<machine>/learning_curve-NAME.json` and `.png` (NAME: the run directory's
name unless `--name`). Minutes are wall-clock minutes since
the run's first training summary (written after its first `--log-every` steps, so the
set-up and those steps are not counted); they include the time spent validating (and a
resumed run's pause: the JSON keeps the raw wall times).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (standard library only at import)


def learning_curve(run_dir: Path) -> dict:
    """Validation metrics of `run_dir` by step and minutes since the start of training."""
    from keras_transformer.run_dir import read_scalars

    logs = run_dir / "logs"
    train = read_scalars(logs / "train")
    if not train:
        raise SystemExit(f"{logs / 'train'} holds no training summaries: is {run_dir} a train.py run directory?")
    started = min(wall for points in train.values() for _, wall, _ in points)
    validation = read_scalars(logs / "validation")
    test = read_scalars(logs / "test") if (logs / "test").is_dir() else {}

    def by_step(points):
        return [{"step": step, "minutes": round((wall - started) / 60, 2), "value": value}
                for step, wall, value in points]

    return {
        "run_dir": str(run_dir),
        "started_wall_time": started,
        "validation": {tag: by_step(points) for tag, points in validation.items()},
        "test": {tag: by_step(points) for tag, points in test.items()},
        "train_loss": by_step(train.get("loss", [])),
    }


def plot(curve: dict, path: Path, against: dict[str, dict] | None = None) -> None:
    """Validation (and test) BLEU and the losses against minutes; `against`: earlier curves' BLEU by label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bleu_axis, loss_axis) = plt.subplots(1, 2, figsize=(11, 4))
    bleu = curve["validation"].get("bleu", [])
    bleu_axis.plot([p["minutes"] for p in bleu], [p["value"] for p in bleu], "o-", label="validation BLEU")
    for label, other in (against or {}).items():
        points = other["validation"].get("bleu", [])
        bleu_axis.plot([p["minutes"] for p in points], [p["value"] for p in points], "x--", alpha=0.7,
                       label=f"validation BLEU, {label}")
    test_bleu = curve["test"].get("bleu", [])
    if test_bleu:
        bleu_axis.plot([p["minutes"] for p in test_bleu], [p["value"] for p in test_bleu], "s",
                       color="C3", label="test BLEU (final model)")
    bleu_axis.set(xlabel="minutes since training started", ylabel="BLEU", title="BLEU")
    bleu_axis.grid(alpha=0.3)
    bleu_axis.legend()
    train_loss = curve["train_loss"]
    loss_axis.plot([p["minutes"] for p in train_loss], [p["value"] for p in train_loss], label="training loss")
    val_loss = curve["validation"].get("loss", [])
    loss_axis.plot([p["minutes"] for p in val_loss], [p["value"] for p in val_loss], "o-", label="validation loss")
    loss_axis.set(xlabel="minutes since training started", ylabel="label-smoothed cross entropy", title="loss")
    loss_axis.grid(alpha=0.3)
    loss_axis.legend()
    fig.suptitle(path.stem.removeprefix("learning_curve-"))  # the results' name (--name), as the JSON's
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="a train.py run directory")
    parser.add_argument("--name", help="the results' name (default: the run directory's name)")
    parser.add_argument("--against", type=Path, nargs="+", default=[],
                        help="earlier curves (this script's JSON) whose validation BLEU the plot shows too")
    args = parser.parse_args()

    curve = learning_curve(args.run_dir)
    against = {path.stem.removeprefix("learning_curve-"): json.loads(path.read_text()) for path in args.against}
    name = f"learning_curve-{args.name or args.run_dir.resolve().name}"
    common.write_json(name, curve)
    plot(curve, common.RESULTS_DIR / f"{name}.png", against)
    for point in curve["validation"].get("bleu", []):
        print(f"step {point['step']:>6}  {point['minutes']:6.1f} min  validation BLEU {point['value']:.2f}")
    for point in curve["test"].get("bleu", []):
        print(f"step {point['step']:>6}  {point['minutes']:6.1f} min  test BLEU {point['value']:.2f}")


if __name__ == "__main__":
    main()
