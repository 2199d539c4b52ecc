"""The paper's learning-rate schedule and optimizer (Vaswani et al., 2017, section 5.3).

    lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

The rate grows linearly for the first `warmup_steps` updates and then decays with
the inverse square root of the step; `d_model^-0.5` scales it to the model's width,
so one schedule serves every model size. The peak, at `step == warmup_steps`, is
`d_model^-0.5 * warmup_steps^-0.5` (7e-4 for the base model with warmup 4000).

Steps count from 1: Keras optimizers call the schedule with `optimizer.iterations`,
the number of updates already applied (0 before the first), so the schedule adds one.
Without that, the first update would get a learning rate of exactly 0.
"""

import keras
from keras import ops

ADAM_BETA_1 = 0.9
ADAM_BETA_2 = 0.98
ADAM_EPSILON = 1e-9
DEFAULT_WARMUP_STEPS = 4000


@keras.saving.register_keras_serializable(package="keras_transformer")
class TransformerSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)`.

    Args:
        d_model: Model width; the rate scales with `d_model^-0.5`.
        warmup_steps: Updates of linear warm-up (paper: 4000).
        scale: Multiplier of the whole schedule (paper: 1.0). Small models on small
            corpora often train better with a larger peak rate.

    Call arguments:
        iterations: The number of updates already applied (`optimizer.iterations`);
            the rate returned is the one of step `iterations + 1`.

    Returns:
        The learning rate as a float32 scalar tensor.
    """

    def __init__(self, d_model, warmup_steps=DEFAULT_WARMUP_STEPS, scale=1.0):
        if d_model <= 0 or warmup_steps <= 0 or scale <= 0:
            raise ValueError(
                "d_model, warmup_steps and scale must be positive, got "
                f"{d_model!r}, {warmup_steps!r} and {scale!r}."
            )
        self.d_model = d_model
        self.warmup_steps = warmup_steps
        self.scale = scale

    def __call__(self, iterations):
        step = ops.cast(iterations, "float32") + 1.0
        warmup = float(self.warmup_steps)
        rate = ops.minimum(ops.rsqrt(step), step * warmup**-1.5)
        return (self.scale * self.d_model**-0.5) * rate

    def get_config(self):
        return {"d_model": self.d_model, "warmup_steps": self.warmup_steps, "scale": self.scale}


def make_optimizer(learning_rate, loss_scaling=False):
    """Adam(beta_1=0.9, beta_2=0.98, epsilon=1e-9), the paper's optimizer.

    Args:
        learning_rate: Usually a `TransformerSchedule`.
        loss_scaling: Wrap the optimizer in `keras.optimizers.LossScaleOptimizer`,
            needed for float16 mixed precision (not for bfloat16).

    Returns:
        The optimizer; create it inside the distribution strategy's scope.
    """
    optimizer = keras.optimizers.Adam(
        learning_rate=learning_rate, beta_1=ADAM_BETA_1, beta_2=ADAM_BETA_2, epsilon=ADAM_EPSILON
    )
    if loss_scaling:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
