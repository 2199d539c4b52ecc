"""The paper's learning-rate schedule against its formula, computed independently in NumPy."""

import keras
import numpy as np
import pytest

from keras_transformer.schedule import FusedAdam, TransformerSchedule, make_optimizer


def paper_rate(step, d_model, warmup_steps):
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), step counted from 1."""
    step = np.float64(step)
    return d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


@pytest.mark.parametrize("d_model, warmup_steps", [(512, 4000), (256, 800)])
@pytest.mark.parametrize("step", [1, 2, 100, 799, 800, 801, 3999, 4000, 4001, 10_000, 100_000])
def test_rate_of_update_step_equals_the_formula(step, d_model, warmup_steps):
    schedule = TransformerSchedule(d_model, warmup_steps)
    # Keras calls the schedule with the number of updates already applied.
    rate = float(schedule(step - 1))
    np.testing.assert_allclose(rate, paper_rate(step, d_model, warmup_steps), rtol=1e-6)


def test_first_update_has_a_nonzero_rate_and_the_peak_is_at_warmup():
    schedule = TransformerSchedule(512, 4000)
    assert float(schedule(0)) > 0
    peak = float(schedule(3999))  # update number 4000
    assert float(schedule(3998)) < peak > float(schedule(4000))
    np.testing.assert_allclose(peak, 512**-0.5 * 4000**-0.5, rtol=1e-6)  # 7.0e-4


def test_scale_multiplies_the_rate():
    np.testing.assert_allclose(
        float(TransformerSchedule(256, 800, scale=2.0)(99)), 2.0 * paper_rate(100, 256, 800), rtol=1e-6
    )


@pytest.mark.parametrize("cooldown", [0.2, 1.0])
@pytest.mark.parametrize("budget_used", [0.0, 0.5, 0.8, 0.85, 0.99, 1.0, 1.3])
def test_a_cooldown_falls_linearly_to_zero_over_the_end_of_the_budget(budget_used, cooldown):
    schedule = TransformerSchedule(256, 800, cooldown=cooldown)
    schedule.budget_used.assign(budget_used)
    factor = min(max((1.0 - budget_used) / cooldown, 0.0), 1.0)
    np.testing.assert_allclose(float(schedule(4999)), factor * paper_rate(5000, 256, 800), rtol=1e-5, atol=1e-12)


def test_config_round_trip():
    schedule = TransformerSchedule(256, warmup_steps=800, scale=1.5, cooldown=0.25)
    copy = TransformerSchedule.from_config(schedule.get_config())
    assert copy.get_config() == {"d_model": 256, "warmup_steps": 800, "scale": 1.5, "cooldown": 0.25}
    restored = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(schedule))
    assert isinstance(restored, TransformerSchedule)
    for budget_used in (0.0, 0.9):
        schedule.budget_used.assign(budget_used)
        restored.budget_used.assign(budget_used)
        for iterations in (0, 799, 5000):
            assert float(restored(iterations)) == float(schedule(iterations))


def test_rejects_non_positive_arguments_and_a_cooldown_outside_0_1():
    with pytest.raises(ValueError, match="positive"):
        TransformerSchedule(512, warmup_steps=0)
    for cooldown in (-0.1, 1.1):
        with pytest.raises(ValueError, match=r"cooldown must be in \[0, 1\]"):
            TransformerSchedule(512, cooldown=cooldown)


def test_optimizer_is_the_papers_adam_and_survives_serialization():
    optimizer = make_optimizer(TransformerSchedule(512, 4000))
    assert isinstance(optimizer, keras.optimizers.Adam)
    assert (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon) == (0.9, 0.98, 1e-9)
    np.testing.assert_allclose(float(optimizer.learning_rate), paper_rate(1, 512, 4000), rtol=1e-6)
    restored = keras.optimizers.Adam.from_config(optimizer.get_config())
    assert restored.get_config()["learning_rate"]["class_name"].endswith("TransformerSchedule")


def test_fp16_optimizer_scales_the_loss():
    optimizer = make_optimizer(TransformerSchedule(512, 4000), loss_scaling=True)
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert float(optimizer.scale_loss(1.0)) > 1.0


def test_fused_adam_follows_keras_adam_step_for_step():
    # Keras's own Adam, same arguments and schedule, is the reference: same weights and
    # slots after several updates, with dense gradients and with IndexedSlices ones
    # (what an embedding lookup gives).
    import tensorflow as tf

    rng = np.random.default_rng(0)
    initial = rng.normal(size=(6, 3)).astype("float32")
    gradients = []
    for i in range(6):
        if i % 2 == 0:
            gradients.append(tf.constant(rng.normal(size=initial.shape).astype("float32")))
        else:
            rows = tf.constant(rng.normal(size=(2, 3)).astype("float32"))
            gradients.append(tf.IndexedSlices(rows, tf.constant([1, 4]), tf.constant(initial.shape)))
    arguments = dict(
        learning_rate=TransformerSchedule(16, warmup_steps=3, scale=10.0), beta_1=0.9, beta_2=0.98, epsilon=1e-9
    )
    results = []
    for optimizer in (keras.optimizers.Adam(**arguments), FusedAdam(**arguments)):
        variable = keras.Variable(initial)
        optimizer.build([variable])
        step = tf.function(lambda gradient: optimizer.apply([gradient], [variable]))
        for gradient in gradients:
            step(gradient)
        results.append((variable.numpy(), optimizer._momentums[0].numpy(), optimizer._velocities[0].numpy()))
    assert not np.allclose(results[1][0], initial, atol=1e-3)
    for keras_value, fused_value in zip(*results, strict=True):
        # float32 rounding of weights of size ~5 (the fused kernel orders the arithmetic its own way)
        np.testing.assert_allclose(fused_value, keras_value, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("epsilon", [1e-9, 0.5])
def test_fused_adam_divides_by_the_root_of_v_plus_its_own_epsilon(epsilon):
    # The update's formula, in NumPy, after one step from zero slots: with epsilon = 0.5
    # the denominator sqrt(v) + epsilon is far from sqrt(v), so an epsilon not passed to
    # the kernel shows (Keras's default 1e-7 and the paper's 1e-9 differ too little).
    initial = np.array([1.0, -2.0, 3.0], "float32")
    gradient = np.array([0.5, -0.25, 2.0], "float32")
    learning_rate, beta_1, beta_2 = 0.1, 0.9, 0.98
    optimizer = FusedAdam(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)
    variable = keras.Variable(initial)
    optimizer.build([variable])
    optimizer.apply([gradient], [variable])
    m, v = (1 - beta_1) * gradient, (1 - beta_2) * gradient**2
    step = learning_rate * np.sqrt(1 - beta_2) / (1 - beta_1) * m / (np.sqrt(v) + epsilon)
    np.testing.assert_allclose(variable.numpy(), initial - step, rtol=1e-6)
