"""Mixed precision in training: bfloat16 and float16 on CPUs, float16 steps that overflow.

Float16 overflows on one replica or one worker of several: test_distributed_training.py.
"""

import numpy as np
import pytest
import tensorflow as tf

from fake_runs import synthetic_pairs_dataset, training_losses
from keras_transformer import distribution, run_dir
from keras_transformer.model import Transformer
from keras_transformer.schedule import TransformerSchedule
from keras_transformer.trainer import Trainer, TrainingConfig


@pytest.fixture
def grappler_remapping():
    """Restores Grappler's process-wide remapper setting after the test."""
    before = tf.config.optimizer.get_experimental_options().get("remapping", True)
    yield
    tf.config.optimizer.set_experimental_options({"remapping": before})


@pytest.mark.parametrize("mixed_precision, fused", [("fp16", False), ("bf16", True), ("none", True)])
def test_float16_on_a_cpu_trains_without_the_matmul_bias_fusion(
    tmp_path, grappler_remapping, caplog, mixed_precision, fused
):
    """fp16 on CPUs turns Grappler's remapper off (TF 2.21 fuses float16 MatMul+BiasAdd into a
    reference kernel, ~1000x slower), with a warning, and trains; other precisions keep it."""
    tf.config.optimizer.set_experimental_options({"remapping": True})
    config = TrainingConfig(train_steps=2, warmup_steps=20, log_every=1, mixed_precision=mixed_precision)
    with caplog.at_level("WARNING", logger="keras_transformer.distribution"):
        trainer = Trainer(
            distribution.make_strategy(["CPU:0"]),
            lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
            tmp_path / "run",
            config,
        )
    assert tf.config.optimizer.get_experimental_options()["remapping"] is fused
    assert ("MatMul+BiasAdd fusion is turned off" in caplog.text) is not fused
    assert trainer.fit(synthetic_pairs_dataset).step == 2
    losses = training_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2] and all(np.isfinite(list(losses.values())))


def test_float16_steps_that_overflow_apply_no_update_and_the_logged_rate_follows_the_updates(tmp_path):
    """A loss scale far too high makes the first float16 steps overflow: the optimizer skips them
    (and halves the scale), so the schedule advances only with the updates applied, and so must
    the logged learning rate."""
    config = TrainingConfig(train_steps=8, warmup_steps=20, log_every=1, mixed_precision="fp16")
    trainer = Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
        tmp_path / "run",
        config,
    )
    trainer.optimizer.dynamic_scale.assign(2.0**22)  # overflows the first steps (4 of 8 here), not all
    assert trainer.fit(synthetic_pairs_dataset).step == 8

    updates = int(trainer.optimizer.iterations)
    assert 0 < updates < 8, updates  # some steps skipped, some applied
    rates = training_losses(tmp_path / "run", tag="learning_rate")
    schedule = TransformerSchedule(trainer.model.d_model, warmup_steps=20)
    assert rates[8] == pytest.approx(float(schedule(updates - 1)))
    assert rates[8] < float(schedule(7))  # the warm-up rate of step 8, which was not applied


def _precision_trainer(run, mixed_precision, train_steps):
    config = TrainingConfig(
        train_steps=train_steps, warmup_steps=20, log_every=1, checkpoint_every=2, mixed_precision=mixed_precision
    )
    return Trainer(
        distribution.make_strategy(["CPU:0"]),
        lambda dtype: Transformer.from_preset("tiny", vocab_size=50, dtype=dtype),
        run,
        config,
    )


@pytest.mark.parametrize(
    "trained, resumed, said",
    [
        ("fp16", "none", "was saved with mixed_precision='fp16', and this run has mixed_precision='none'"),
        ("bf16", "fp16", "was saved with mixed_precision 'none' or 'bf16', and this run has mixed_precision='fp16'"),
    ],
)
def test_a_run_resumed_in_another_precision_than_float16s_says_so(tmp_path, grappler_remapping, trained, resumed, said):
    """Float16's optimizer scales the loss, so its checkpoints do not fit another precision's optimizer (or the
    reverse): the error names the precisions, not "another architecture". bfloat16 and float32 runs share
    an optimizer (float32 weights in both): one resumes the other, which the last line checks."""
    run = tmp_path / "run"
    _precision_trainer(run, trained, train_steps=2).fit(synthetic_pairs_dataset)
    with pytest.raises(run_dir.RunDirError) as raised:
        _precision_trainer(run, resumed, train_steps=4).restore()
    message = str(raised.value)
    assert said in message and "another architecture" not in message, message
    assert message.endswith("resume it in the precision it was trained in."), message
    assert _precision_trainer(run, "none" if trained == "bf16" else trained, train_steps=4).restore() == 2


def test_the_logged_gradient_norm_of_float16_is_unscaled(tmp_path, grappler_remapping):
    """The gradients of a loss-scaled step are the scale (2^15 at first) times the true ones: the logged
    norm is divided by it, and so matches float32's norm of the same first step (same weights, no dropout)."""
    reference = Transformer.from_preset("tiny", vocab_size=50, dropout_rate=0.0)
    reference.build()
    initial = [variable.numpy() for variable in reference.trainable_variables]

    def model_fn(dtype):
        model = Transformer.from_preset("tiny", vocab_size=50, dropout_rate=0.0, dtype=dtype)
        model.build()
        for variable, value in zip(model.trainable_variables, initial, strict=True):
            variable.assign(value)
        return model

    norms = {}
    for mixed_precision in ("none", "fp16"):
        run = tmp_path / mixed_precision
        config = TrainingConfig(train_steps=1, warmup_steps=20, log_every=1, mixed_precision=mixed_precision)
        trainer = Trainer(distribution.make_strategy(["CPU:0"]), model_fn, run, config)
        trainer.fit(synthetic_pairs_dataset)
        if mixed_precision == "fp16":
            assert int(trainer.optimizer.iterations) == 1  # The step was applied, not skipped for an overflow.
            assert float(trainer.optimizer.scale_loss(1.0)) > 1000.0
        norms[mixed_precision] = training_losses(run, tag="grad_norm")[1]
    assert norms["fp16"] == pytest.approx(norms["none"], rel=0.05)
