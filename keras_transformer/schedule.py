"""The paper's learning-rate schedule and optimizer (Vaswani et al., 2017, section 5.3).

    lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

The rate grows linearly for the first `warmup_steps` updates and then decays with
the inverse square root of the step; `d_model^-0.5` scales it to the model's width,
so one schedule serves every model size. The peak, at `step == warmup_steps`, is
`d_model^-0.5 * warmup_steps^-0.5` (7e-4 for the base model with warmup 4000).

A cooldown (`cooldown > 0`, off in the paper) then takes the rate linearly to zero over
the last `cooldown` fraction of the run's budget, steps or minutes, whichever runs out
first: a run that stops on a time budget ends annealed instead of at the decay's
still-high rate. How much of the budget is used is a variable (`budget_used`) the
trainer sets before each step, since a time budget's end is known only on the clock.

Steps count from 1: Keras optimizers call the schedule with `optimizer.iterations`,
the number of updates already applied (0 before the first), so the schedule adds one.
Without that, the first update would get a learning rate of exactly 0. A float16 step
whose gradients overflow applies no update (see `AgreedLossScaleOptimizer`): the
schedule does not advance on it.
"""

import keras
from keras import ops

ADAM_BETA_1 = 0.9
ADAM_BETA_2 = 0.98
ADAM_EPSILON = 1e-9
DEFAULT_WARMUP_STEPS = 4000


@keras.saving.register_keras_serializable(package="keras_transformer")
class TransformerSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)`, then a cooldown.

    Times `clip((1 - budget_used) / cooldown, 0, 1)` with a cooldown.

    Args:
        d_model: Model width; the rate scales with `d_model^-0.5`.
        warmup_steps: Updates of linear warm-up (paper: 4000).
        scale: Multiplier of the whole schedule (paper: 1.0). Small models on small
            corpora often train better with a larger peak rate.
        cooldown: Fraction of the run's budget at its end over which the rate falls
            linearly to zero, in `[0, 1]`; 0 (the paper): none; 1: the whole run.

    Attributes:
        budget_used: float32 variable, the fraction of the run's budget used so far,
            set by the trainer before each update (with a cooldown only; else None).

    Call arguments:
        iterations: The number of updates already applied (`optimizer.iterations`);
            the rate returned is the one of step `iterations + 1`.

    Returns:
        The learning rate as a float32 scalar tensor.
    """

    def __init__(self, d_model, warmup_steps=DEFAULT_WARMUP_STEPS, scale=1.0, cooldown=0.0):
        if d_model <= 0 or warmup_steps <= 0 or scale <= 0:
            raise ValueError(
                "d_model, warmup_steps and scale must be positive, got "
                f"{d_model!r}, {warmup_steps!r} and {scale!r}."
            )
        if not 0.0 <= cooldown <= 1.0:
            raise ValueError(f"cooldown must be in [0, 1], got {cooldown!r}.")
        self.d_model = d_model
        self.warmup_steps = warmup_steps
        self.scale = scale
        self.cooldown = cooldown
        # Not a checkpointed variable: the trainer recomputes it from the budget on resume.
        self.budget_used = None
        if cooldown:
            self.budget_used = keras.Variable(0.0, dtype="float32", trainable=False, name="budget_used")

    def __call__(self, iterations):
        step = ops.cast(iterations, "float32") + 1.0
        warmup = float(self.warmup_steps)
        rate = (self.scale * self.d_model**-0.5) * ops.minimum(ops.rsqrt(step), step * warmup**-1.5)
        if not self.cooldown:
            return rate
        return rate * ops.clip((1.0 - self.budget_used) / self.cooldown, 0.0, 1.0)

    def get_config(self):
        return {
            "d_model": self.d_model, "warmup_steps": self.warmup_steps, "scale": self.scale, "cooldown": self.cooldown
        }


@keras.saving.register_keras_serializable(package="keras_transformer")
class FusedAdam(keras.optimizers.Adam):
    """`keras.optimizers.Adam` whose TensorFlow update is one fused kernel per variable.

    Keras's Adam updates a variable with about ten element-wise ops, each a pass over
    the weights or its two slots: a visible share of a training step on a CPU (see
    docs/performance.md). TensorFlow's `ResourceApplyAdam` does the same arithmetic in one pass:

        m = m + (g - m) (1 - beta_1);  v = v + (g^2 - v) (1 - beta_2)
        w = w - lr sqrt(1 - beta_2^t) / (1 - beta_1^t) * m / (sqrt(v) + epsilon)

    Same arguments, slots and checkpoints as `keras.optimizers.Adam`. On other
    backends, and with `amsgrad`, Keras's own update runs.
    """

    def update_step(self, gradient, variable, learning_rate):
        if keras.backend.backend() != "tensorflow" or self.amsgrad:
            return super().update_step(gradient, variable, learning_rate)
        import tensorflow as tf

        dtype = variable.dtype
        local_step = ops.cast(self.iterations + 1, dtype)
        index = self._get_variable_index(variable)
        beta_1, beta_2 = ops.cast(self.beta_1, dtype), ops.cast(self.beta_2, dtype)
        tf.raw_ops.ResourceApplyAdam(
            var=_resource_handle(variable),
            m=_resource_handle(self._momentums[index]),
            v=_resource_handle(self._velocities[index]),
            beta1_power=ops.power(beta_1, local_step),
            beta2_power=ops.power(beta_2, local_step),
            lr=ops.cast(learning_rate, dtype),
            beta1=beta_1,
            beta2=beta_2,
            epsilon=ops.cast(self.epsilon, dtype),
            grad=ops.cast(tf.convert_to_tensor(gradient), dtype),  # IndexedSlices -> dense
            use_locking=False,
        )


def _resource_handle(variable):
    """The TF resource handle of a Keras or TF variable (inside a strategy update, this device's copy)."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    return variable.handle


@keras.saving.register_keras_serializable(package="keras_transformer")
class AgreedLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """`keras.optimizers.LossScaleOptimizer` whose replicas and workers agree on skipping a step.

    A step is skipped, and the loss scale halved, when ANY replica's gradients are not
    finite; otherwise every replica applies it and counts it towards doubling the scale
    (Keras's rule). Same arguments, variables and checkpoints as Keras's optimizer.

    Why: under `tf.distribute`, `apply` receives each replica's own gradients, summed
    over the replicas only later, by the inner optimizer. Keras decides on those local
    gradients: on the merge-call path (every strategy but XLA-compiled replicas on GPUs)
    it takes the first local replica's answer, although its comment says the gradients
    were all-reduced; on the other path each replica decides alone. An overflow on
    another replica then goes through the sum into every weight (NaN) without lowering
    the scale, and workers, each reading its own first replica, can disagree: one waits
    forever in the gradient all-reduce another skipped. Here each replica's overflow flag
    (0 or 1) is summed over all replicas of all workers first (one scalar all-reduce a
    step), so every replica takes the same decision.
    """

    def check_finite(self, grads):
        finite = super().check_finite(grads)
        if keras.backend.backend() != "tensorflow":
            return finite
        import tensorflow as tf

        context = tf.distribute.get_replica_context()
        # None: cross-replica context, whose gradients are already the combined ones.
        if context is None or context.num_replicas_in_sync == 1:
            return finite
        overflowed = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32))
        return tf.equal(overflowed, 0.0)


def make_optimizer(learning_rate, loss_scaling=False):
    """Adam(beta_1=0.9, beta_2=0.98, epsilon=1e-9), the paper's optimizer.

    Args:
        learning_rate: Usually a `TransformerSchedule`.
        loss_scaling: Wrap the optimizer in an `AgreedLossScaleOptimizer` (dynamic
            loss scaling), needed for float16 mixed precision (not for bfloat16).

    Returns:
        The optimizer; create it inside the distribution strategy's scope.
    """
    optimizer = FusedAdam(
        learning_rate=learning_rate, beta_1=ADAM_BETA_1, beta_2=ADAM_BETA_2, epsilon=ADAM_EPSILON
    )
    if loss_scaling:
        optimizer = AgreedLossScaleOptimizer(optimizer)
    return optimizer
