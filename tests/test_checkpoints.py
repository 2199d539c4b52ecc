"""A run directory's checkpoints: averaging them, and loading one that does not fit, is missing or is damaged.

Which checkpoint train.py keeps (the average or not): test_train_command.py; the trainer's
own checkpoints (resuming): test_trainer.py.
"""

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from fake_runs import run_with_checkpoint
from keras_transformer import run_dir
from keras_transformer.model import Transformer


def _run_with_constant_checkpoints(run, steps, keep):
    """A tiny model's run whose checkpoint of each step holds that step in every weight; returns its manager."""
    model = Transformer.from_preset("tiny", vocab_size=50)
    model.build()
    run_dir.write_config(run, {"model": run_dir.model_config(model)})
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(run / "checkpoints"), keep)
    for step in steps:
        for variable in model.trainable_variables:
            variable.assign(np.full(variable.shape, step, "float32"))
        manager.save(checkpoint_number=step)
    return manager


def test_averaging_the_last_checkpoints(tmp_path):
    """`average_checkpoints` writes the mean of the kept checkpoints' weights."""
    manager = _run_with_constant_checkpoints(tmp_path, (10, 20, 30), keep=3)
    path, averaged = run_dir.average_checkpoints(tmp_path, 2)
    assert Path(path).name == "ckpt-30" and [Path(p).name for p in averaged] == ["ckpt-20", "ckpt-30"]
    loaded = run_dir.load_model(tmp_path, "best")
    for variable in loaded.trainable_variables:
        np.testing.assert_allclose(variable.numpy(), 25.0, err_msg=variable.path)
    assert run_dir.checkpoint_path(tmp_path, "best") == path
    config = run_dir.read_config(tmp_path)
    run_dir.write_config(tmp_path, {**config, "train": {"average_last": 0}})  # Run again with --average-last 0.
    assert Path(run_dir.checkpoint_path(tmp_path, "best")).parent.name == run_dir.CHECKPOINT_DIR
    run_dir.write_config(tmp_path, config)
    manager.save(checkpoint_number=40)  # Training went on: the average is stale.
    assert Path(run_dir.checkpoint_path(tmp_path, "best")).name == "ckpt-40"


@pytest.mark.parametrize(
    "steps, averaged_steps",
    [
        ((10, 20, 25, 30), (10, 20, 30)),
        ((10, 20, 30, 35), (20, 30, 35)),
        ((20, 30), (20, 30)),
        ((10, 25, 30), (10, 30)),
    ],
    ids=["interrupted-and-resumed", "stopped-off-the-schedule", "fewer-than-asked", "fewer-of-the-schedule"],
)
def test_averaging_skips_a_checkpoint_saved_between_two_of_the_schedule(tmp_path, steps, averaged_steps):
    """Every 10 steps, interrupted at 25 and resumed: 20, 25 and 30 would weigh steps 20-30 twice in three."""
    model = Transformer.from_preset("tiny", vocab_size=50)
    model.build()
    run_dir.write_config(tmp_path, {"model": run_dir.model_config(model)})
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(tmp_path / "checkpoints"), 5)
    for step in steps:
        for variable in model.trainable_variables:
            variable.assign(np.full(variable.shape, step, "float32"))
        manager.save(checkpoint_number=step)

    path, averaged = run_dir.average_checkpoints(tmp_path, 3, every=10)

    assert [run_dir.checkpoint_step(p) for p in averaged] == list(averaged_steps)
    assert Path(path).name == f"ckpt-{steps[-1]}"
    for variable in run_dir.load_model(tmp_path, "best").trainable_variables:
        np.testing.assert_allclose(variable.numpy(), np.mean(averaged_steps), rtol=1e-6, err_msg=variable.path)


@pytest.mark.parametrize("change", [{"num_layers": 3}, {"d_model": 64}], ids=["more-layers", "wider"])
def test_a_checkpoint_of_another_architecture_is_refused(tmp_path, change):
    """A 2-layer checkpoint under a 3-layer config.json used to load partly, layer 3 left random."""
    path = run_with_checkpoint(tmp_path, **change)
    with pytest.raises(run_dir.RunDirError, match=f"Checkpoint {path} does not fit the model"):
        run_dir.load_model(tmp_path, "latest")
    with pytest.raises(run_dir.RunDirError, match=f"Checkpoint {path} does not fit the model"):
        run_dir.average_checkpoints(tmp_path, 2)
    assert not (tmp_path / run_dir.AVERAGED_DIR).exists()


def test_a_checkpoint_path_that_does_not_exist_is_a_clear_error(tmp_path):
    run_with_checkpoint(tmp_path)
    missing = str(tmp_path / run_dir.CHECKPOINT_DIR / "ckpt-7")
    with pytest.raises(run_dir.RunDirError, match=f"Checkpoint {missing} does not exist"):
        run_dir.load_model(tmp_path, missing)
    assert run_dir.checkpoint_path(tmp_path, missing[:-1] + "5") == missing[:-1] + "5"


def test_a_damaged_checkpoint_is_a_clear_error(tmp_path):
    """A truncated file used to escape as a bare IndexError from TensorFlow's reader."""
    path = run_with_checkpoint(tmp_path)
    with open(f"{path}.data-00000-of-00001", "r+b") as data_file:
        data_file.truncate(100)
    with pytest.raises(run_dir.RunDirError, match=f"Checkpoint {path} does not fit .* damaged file"):
        run_dir.load_model(tmp_path, "latest")


def test_checkpoints_are_ordered_by_step_number_not_by_name(tmp_path):
    """ckpt-9, ckpt-10, ckpt-100: by name, ckpt-9 would be the newest and ckpt-10 the oldest."""
    _run_with_constant_checkpoints(tmp_path, (9, 10, 100), keep=5)

    found = run_dir.checkpoints(tmp_path / run_dir.CHECKPOINT_DIR)
    assert [run_dir.checkpoint_step(path) for path in found] == [9, 10, 100]
    assert run_dir.checkpoint_path(tmp_path, "latest") == found[-1]
    path, averaged = run_dir.average_checkpoints(tmp_path, 2)
    assert Path(path).name == "ckpt-100" and averaged == found[1:]
    for variable in run_dir.load_model(tmp_path, "best").trainable_variables:
        np.testing.assert_allclose(variable.numpy(), (10 + 100) / 2, rtol=1e-6, err_msg=variable.path)
