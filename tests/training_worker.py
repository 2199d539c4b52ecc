"""Runs the `Trainer` on a fixed synthetic data set in a fresh process, for the distributed-training tests.

Logical CPU devices and `MultiWorkerMirroredStrategy` must be set up before TensorFlow
initializes its devices, which a pytest process has long done; so these runs get their
own process.

    python tests/training_worker.py replicas OUT.npz RUN_DIR
        Trains the same steps on 1 replica and on 2 replicas (two logical CPUs, each
        replica half of every global batch) and saves both final weights.
    python tests/training_worker.py one OUT.npz RUN_DIR
        Trains the same steps on 1 replica (the whole global batch); saves the initial
        and final weights.
    python tests/training_worker.py dropout OUT.npz -
        The dropout masks each of two replicas draws for the same input, on two steps.
    TF_CONFIG=... python tests/training_worker.py worker OUT.npz RUN_DIR
        One worker of a MultiWorkerMirroredStrategy run (each worker feeds half of every
        global batch); saves its initial and final weights.
    [TF_CONFIG=...] python tests/training_worker.py overflow OUT.npz RUN_DIR
        A float16 run on 2 replicas (two logical CPUs, or one per worker under TF_CONFIG)
        whose replica 1 alone overflows in step `OVERFLOW_STEP`; saves, before and after
        every step, each local replica's weights and loss-scaling state.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from keras_transformer import distribution  # noqa: E402

VOCAB_SIZE = 40
GLOBAL_BATCH = 8
LENGTH = 9
STEPS = 3
OVERFLOW_STEP = 2


def global_batches(num_steps=STEPS, seed=0):
    """`num_steps` global batches `((source, decoder_inputs), labels)` with padding, as numpy."""
    rng = np.random.default_rng(seed)
    shape = (num_steps, GLOBAL_BATCH, LENGTH)
    source = rng.integers(4, VOCAB_SIZE, size=shape).astype("int32")
    target = rng.integers(4, VOCAB_SIZE, size=shape).astype("int32")
    source_lengths = rng.integers(3, LENGTH + 1, size=shape[:2])
    target_lengths = rng.integers(3, LENGTH, size=shape[:2])
    positions = np.arange(LENGTH)
    source = np.where(positions < source_lengths[..., None], source, 0)
    target = np.where(positions < target_lengths[..., None], target, 0)
    decoder_inputs = np.concatenate([np.full(shape[:2] + (1,), 2, "int32"), target[..., :-1]], axis=-1)
    labels = np.where(positions == target_lengths[..., None], 3, target).astype("int32")
    decoder_inputs = np.where(positions <= target_lengths[..., None], decoder_inputs, 0).astype("int32")
    return (source, decoder_inputs), labels


def dataset_fn(input_context):
    """This pipeline's share of each global batch: replica r gets rows r::replicas.

    With one pipeline feeding several local replicas, `tf.distribute` hands consecutive
    batches to the replicas in turn, so the pipeline interleaves its replicas' shares.
    """
    import tensorflow as tf

    replicas = input_context.num_replicas_in_sync
    local = replicas // input_context.num_input_pipelines
    first = input_context.input_pipeline_id * local
    (source, decoder_inputs), labels = global_batches()

    def share(array, replica):
        return array[:, replica::replicas]

    per_replica = [
        ((share(source, r), share(decoder_inputs, r)), share(labels, r)) for r in range(first, first + local)
    ]
    steps = [tf.data.Dataset.from_tensor_slices(part) for part in per_replica]
    return tf.data.Dataset.choose_from_datasets(steps, tf.data.Dataset.range(local).repeat(STEPS))


def make_trainer(strategy, run_dir, mixed_precision="none"):
    """A seeded `Trainer` of the tiny model without dropout, for `STEPS` steps, the last half cooling down.

    The cooldown's rate comes from the steps and the clock, agreed by the workers: they stay in lockstep.
    """
    import keras

    from keras_transformer.model import Transformer
    from keras_transformer.trainer import Trainer, TrainingConfig

    keras.utils.set_random_seed(0)
    config = TrainingConfig(
        train_steps=STEPS, warmup_steps=10, log_every=1, checkpoint_every=STEPS, max_minutes=10, cooldown=0.5,
        mixed_precision=mixed_precision,
    )
    return Trainer(
        strategy,
        lambda dtype: Transformer.from_preset("tiny", VOCAB_SIZE, dropout_rate=0.0, dtype=dtype),
        run_dir,
        config,
    )


def train(strategy, run_dir):
    """Trains the tiny model for `STEPS` steps; returns its initial and final weights."""
    trainer = make_trainer(strategy, run_dir)
    initial = _weights(trainer.model)
    trainer.fit(dataset_fn)
    return initial, _weights(trainer.model)


def overflow_run(strategy, run_dir):
    """A float16 run whose replica 1 alone overflows in step `OVERFLOW_STEP`, step by step.

    Returns:
        `{f"step{s}/local{r}/{name}": value}`: before (s = 0) and after each step s, local
        replica r's trainable weights (`weight000`, ...), loss scale, count of finite
        steps towards growing it (`growth_counter`), and count of updates applied.
    """
    trainer = make_trainer(strategy, run_dir, mixed_precision="fp16")
    _overflow_on_replica_1(trainer, OVERFLOW_STEP)
    # Step by step rather than `fit`, to read every replica's state between steps.
    iterator = iter(trainer._training_stream(dataset_fn, 0))
    train_step = trainer._train_step(with_grad_norm=False)
    states = _replica_states(trainer, 0)
    for step in range(1, STEPS + 1):
        train_step(iterator)
        states.update(_replica_states(trainer, step))
    trainer._cleanup_worker_checkpoints()
    return states


def _overflow_on_replica_1(trainer, step):
    """Makes one gradient of replica 1 infinite in `step` (from 1), as a float16 overflow there alone would."""
    import tensorflow as tf

    gradients = trainer._gradients  # read by the step function when it is traced

    def overflowing(source_ids, decoder_inputs, labels, global_tokens):
        grads, loss_sum, correct = gradients(source_ids, decoder_inputs, labels, global_tokens)
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        hit = tf.logical_and(tf.equal(replica, 1), tf.equal(trainer.step, step - 1))
        first = tf.convert_to_tensor(grads[0])  # an embedding's gradient may be IndexedSlices
        return [first + tf.where(hit, float("inf"), 0.0), *grads[1:]], loss_sum, correct

    trainer._gradients = overflowing


def _replica_states(trainer, step):
    """The state `overflow_run` records after `step`, for every local replica."""
    optimizer = trainer.optimizer
    tracked = {
        "loss_scale": optimizer.dynamic_scale,
        "growth_counter": optimizer.step_counter,
        "updates": optimizer.iterations,
        **{f"weight{index:03d}": variable for index, variable in enumerate(trainer.model.trainable_variables)},
    }
    return {
        f"step{step}/local{replica}/{name}": value.numpy()
        for name, variable in tracked.items()
        for replica, value in enumerate(trainer.strategy.experimental_local_results(variable.value))
    }


def dropout_masks(strategy, steps=2):
    """`{f"step{s}/replica{r}": kept}`: which elements of a ones input each replica's `Dropout(0.5)` keeps."""
    import tensorflow as tf

    from keras_transformer.dropout import Dropout

    with strategy.scope():
        layer = Dropout(0.5, seed=3)

    @tf.function
    def step():
        return strategy.run(lambda: layer(tf.ones([16, 64]), training=True))

    return {
        f"step{index}/replica{replica}": (mask.numpy() != 0)
        for index in range(steps)
        for replica, mask in enumerate(strategy.experimental_local_results(step()))
    }


def _weights(model):
    """Trainable weights by position and name (names differ between models of a process)."""
    variables = enumerate(model.trainable_variables)
    return {f"{index:03d}_{variable.name}": variable.numpy() for index, variable in variables}


def main(mode, output, run_dir):
    if mode == "replicas":
        distribution.split_cpu(2)
        initial, one = train(distribution.make_strategy(["CPU:0"]), os.path.join(run_dir, "one"))
        _, two = train(distribution.make_strategy(["CPU:0", "CPU:1"]), os.path.join(run_dir, "two"))
        runs = {"initial": initial, "one": one, "two": two}
    elif mode == "dropout":
        distribution.split_cpu(2)
        np.savez(output, **dropout_masks(distribution.make_strategy(["CPU:0", "CPU:1"])))
        return
    elif mode == "one":
        initial, final = train(distribution.make_strategy(["CPU:0"]), run_dir)
        runs = {"initial": initial, "final": final}
    elif mode == "worker":
        initial, final = train(distribution.make_strategy(), run_dir)
        runs = {"initial": initial, "final": final}
    elif mode == "overflow":
        # One replica per worker under TF_CONFIG, else two logical CPUs.
        devices = None if distribution.cluster_task_count() > 1 else ["CPU:0", "CPU:1"]
        np.savez(output, **overflow_run(distribution.make_strategy(devices), run_dir))
        return
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    np.savez(output, **{f"{run}/{name}": value for run, weights in runs.items() for name, value in weights.items()})


if __name__ == "__main__":
    main(*sys.argv[1:])
