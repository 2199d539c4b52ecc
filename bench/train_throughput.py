"""Benchmark: training throughput (tokens/s) and model FLOPs utilisation, ours vs a KerasHub peer.

Usage:
    python bench/train_throughput.py                       # small + base, all configurations
    python bench/train_throughput.py --presets small --precisions float32 --jit off

One training step is forward + backward + Adam update: logits of the teacher-forced
decoder, the masked label-smoothed cross entropy (`keras_transformer.losses`, eps 0.1),
its gradients, and Adam(0.9, 0.98, 1e-9) (`FusedAdam`) with the paper's schedule
(`keras_transformer.schedule.make_optimizer`), run by our `Trainer`'s training step
(`--step trainer`, the default; `--step standalone` puts it all in one `tf.function`),
with and without `jit_compile` (XLA). Configurations: preset x precision (float32, mixed_bfloat16 where
the device has native bfloat16) x XLA (off/on) x implementation (ours, peer).

Batches are synthetic with fixed lengths (default: source and target 24 tokens, about the
longest common Multi30k bucket), every token real. Batch 128 sentences = 3072 source +
3072 target tokens for every preset but `big` (64): near `train.py`'s 4096-token padded
budget (the `small` default's is 2048), and the paper's per-GPU share of its 25k-token
batches (8 GPUs). tokens/s =
batch * (source_length + target_length) / step time, padding excluded (there is none).

The peer is the same encoder-decoder built from KerasHub's `TransformerEncoder`,
`TransformerDecoder`, `ReversibleEmbedding` (tied input/output embedding, shared between
source and target, like ours) and `SinePositionEncoding`: same d_model, heads, d_ff,
layers, vocabulary, post-LN, epsilon, dropout 0.1, batch, loss, optimizer and training
step (the peer runs through our `Trainer` too). One difference needs a switch: KerasHub
applies its `dropout` also to the attention weights (ours, like the paper, only to
sub-layer outputs and embeddings). `peer_noattndrop` (the default peer) turns the
attention-weight dropout off after building, which makes it exactly our architecture
(Keras's attention then takes its `ops.dot_product_attention` path); `peer` keeps
KerasHub's standard dropout everywhere (more work per step; `--impls ours peer`).
Remaining differences: KerasHub's sinusoids are computed in the compute dtype (ours in
float32), and its epsilon/initialisers are set to ours.

Model FLOPs per step (counted from the architecture, forward; training = 3x forward,
backward = 2x forward; biases, LayerNorm, softmax and the embedding gather not counted),
with S = source tokens, T = target tokens, B = batch, Ls/Lt = lengths, N layers, d =
d_model, f = d_ff, V = vocabulary:

    encoder dense      2 * S * N * (4 d^2 + 2 d f)            (Q, K, V, O; FFN)
    decoder dense      2 * T * N * (4 d^2 + 2 d^2 + 2 d f)    (self Q,K,V,O; cross Q,O; FFN)
                     + 2 * S * N * (2 d^2)                    (cross K, V project the source)
    output projection  2 * T * d * V                          (tied embedding, transposed)
    attention          2 * 2 * B * N * d * (Ls^2 + Lt^2 + Lt Ls)   (QK^T and PV, full
                                                               matrices, causal half not skipped)

i.e. the "6 x non-embedding parameters per token" rule for training plus the attention
score FLOPs plus the output projection. MFU = model FLOPs/s / peak matmul FLOP/s, the
peak measured in the same run (the best square `tf.linalg.matmul` of sizes 1024 to 4096,
under `tf.function` with and without XLA, in float32 and in bfloat16; see
`common.peak_matmul_flops`); mixed-precision runs are also given against the float32 peak.

Writes `bench/results/<machine>/train_throughput.json`.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.use_train_py_cpu_kernels()  # before TensorFlow is imported

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

from keras_transformer import distribution  # noqa: E402
from keras_transformer.losses import label_smoothed_cross_entropy  # noqa: E402
from keras_transformer.model import Transformer  # noqa: E402
from keras_transformer.recipes import get_preset  # noqa: E402
from keras_transformer.schedule import make_optimizer  # noqa: E402

DEFAULT_BATCH = {"tiny": 128, "small": 128, "medium": 128, "base": 128, "big": 64}
LABEL_SMOOTHING = 0.1

# The peak matmul each precision's MFU is measured against.
PEAK_DTYPES = {"float32": "float32", "mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}


# --------------------------------------------------------------------------- FLOPs


def model_flops_per_step(config: dict, vocab_size: int, batch: int, src_len: int, tgt_len: int) -> dict:
    """Training FLOPs of one step, from the architecture (see the module docstring)."""
    n, d, f = config["num_layers"], config["d_model"], config["d_ff"]
    s_tokens, t_tokens = batch * src_len, batch * tgt_len
    encoder_dense = 2 * s_tokens * n * (4 * d * d + 2 * d * f)
    decoder_dense = 2 * t_tokens * n * (6 * d * d + 2 * d * f) + 2 * s_tokens * n * (2 * d * d)
    output_projection = 2 * t_tokens * d * vocab_size
    attention = 2 * 2 * batch * n * d * (src_len**2 + tgt_len**2 + tgt_len * src_len)
    forward = encoder_dense + decoder_dense + output_projection + attention
    return {
        "forward": forward,
        "train": 3 * forward,
        "train_per_token": 3 * forward / (s_tokens + t_tokens),
        "share_attention": attention / forward,
        "share_output_projection": output_projection / forward,
    }


# --------------------------------------------------------------------------- the peer


class PeerTransformer(keras.Model):
    """The same encoder-decoder from KerasHub layers (tied, shared embedding; post-LN)."""

    def __init__(
        self,
        vocab_size,
        num_layers,
        d_model,
        num_heads,
        d_ff,
        dropout_rate=0.1,
        attention_dropout=True,
        layer_norm_epsilon=1e-6,
        pad_id=0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        import keras_hub

        self.d_model = d_model
        self.pad_id = pad_id
        self.embedding = keras_hub.layers.ReversibleEmbedding(
            vocab_size,
            d_model,
            tie_weights=True,
            embeddings_initializer=keras.initializers.RandomNormal(stddev=d_model**-0.5),
            name="shared_embedding",
        )
        self.position = keras_hub.layers.SinePositionEncoding(name="position")
        self.embedding_dropout = keras.layers.Dropout(dropout_rate)
        layer_args = dict(
            intermediate_dim=d_ff,
            num_heads=num_heads,
            dropout=dropout_rate,
            layer_norm_epsilon=layer_norm_epsilon,
            normalize_first=False,
        )
        self.encoder_layers = [
            keras_hub.layers.TransformerEncoder(name=f"encoder_{i}", **layer_args) for i in range(num_layers)
        ]
        self.decoder_layers = [
            keras_hub.layers.TransformerDecoder(name=f"decoder_{i}", **layer_args) for i in range(num_layers)
        ]
        # Also as attributes: TF checkpoints (which the Trainer checks) do not see Keras
        # layers kept only in Python lists.
        for layer in self.encoder_layers + self.decoder_layers:
            setattr(self, layer.name, layer)
        if not attention_dropout:
            # Residual/embedding dropout stays; the attention-weight dropout (absent from
            # the paper and from our layers) is switched off before the layers are built.
            for layer in self.encoder_layers + self.decoder_layers:
                layer._peer_no_attention_dropout = True

    def build(self, inputs_shape=None):
        d = self.d_model
        self.embedding.build((None, None))
        self.position.build((None, None, d))
        for layer in self.encoder_layers:
            layer.build((None, None, d))
            if getattr(layer, "_peer_no_attention_dropout", False):
                _zero_attention_dropout(layer._self_attention_layer)
        for layer in self.decoder_layers:
            layer.build((None, None, d), (None, None, d))
            if getattr(layer, "_peer_no_attention_dropout", False):
                _zero_attention_dropout(layer._self_attention_layer)
                _zero_attention_dropout(layer._cross_attention_layer)
        self.built = True

    def _embed(self, ids, training):
        x = self.embedding(ids) * ops.cast(math.sqrt(self.d_model), self.compute_dtype)
        x = x + self.position(x)
        return self.embedding_dropout(x, training=training)

    def call(self, inputs, training=None):
        source_ids, decoder_input_ids = inputs
        source_mask = ops.not_equal(source_ids, self.pad_id)
        x = self._embed(source_ids, training)
        for layer in self.encoder_layers:
            x = layer(x, padding_mask=source_mask, training=training)
        y = self._embed(decoder_input_ids, training)
        for layer in self.decoder_layers:
            y = layer(y, x, encoder_padding_mask=source_mask, training=training)
        return ops.cast(self.embedding(y, reverse=True), "float32")


def _zero_attention_dropout(mha):
    mha._dropout = 0.0
    if hasattr(mha, "_dropout_layer"):
        mha._dropout_layer.rate = 0.0


# --------------------------------------------------------------------------- steps


def build_model(impl: str, preset: str, vocab_size: int, build: bool = True):
    config = get_preset(preset)
    # How our attention's weights start: KerasHub's layers have no such choice, and it costs nothing per step.
    config.pop("attention_init", None)
    if impl == "ours":
        model = Transformer.from_preset(preset, vocab_size)
    elif impl == "peer":
        model = PeerTransformer(vocab_size, **config)
    elif impl == "peer_noattndrop":
        model = PeerTransformer(vocab_size, attention_dropout=False, **config)
    else:
        raise ValueError(impl)
    if build:
        model.build(None)
    return model


def make_train_step(model, optimizer, jit_compile: bool):
    """forward + label-smoothed masked loss + backward + Adam, in one tf.function."""

    def step(source_ids, decoder_inputs, labels):
        with tf.GradientTape() as tape:
            logits = model((source_ids, decoder_inputs), training=True)
            loss_sum, num_tokens = label_smoothed_cross_entropy(labels, logits, LABEL_SMOOTHING)
            loss = loss_sum / tf.maximum(num_tokens, 1.0)
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        optimizer.apply(grads, variables)
        return loss

    return tf.function(step, jit_compile=jit_compile, reduce_retracing=True)


def synthetic_batch(batch: int, src_len: int, tgt_len: int, vocab_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    # ids >= 4 skip PAD/UNK/BOS/EOS: every token is real.
    source = rng.integers(4, vocab_size, size=(batch, src_len), dtype=np.int32)
    target = rng.integers(4, vocab_size, size=(batch, tgt_len + 1), dtype=np.int32)
    return tf.constant(source), tf.constant(target[:, :-1]), tf.constant(target[:, 1:])


def single_device_strategy():
    """One device (the first GPU, else the CPU): the figures are per device."""
    return distribution.make_strategy(["GPU:0"] if common.has_gpu() else ["CPU:0"])


def _build_under_policy(impl, preset, vocab_size, precision, build=True):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        return build_model(impl, preset, vocab_size, build)
    finally:
        keras.config.set_dtype_policy(previous)


class Runner:
    """One configuration (implementation, preset, precision, XLA): its model, optimizer and step.

    `step="trainer"` times the project's own training step, `keras_transformer.trainer.Trainer`
    (its `tf.function` step under the distribution strategy: the forward and backward
    pass, XLA-compiled with `jit_compile`, then the Adam update outside XLA; plus the
    token accuracy it logs), fed from a `tf.data` stream repeating one batch.
    `step="standalone"` times `make_train_step`: the same loss and optimizer, with the
    Adam update inside the (XLA) function too.
    """

    def __init__(self, impl, preset, precision, jit, vocab_size, data, step, strategy, workdir):
        self.impl, self.preset, self.precision, self.jit = impl, preset, precision, jit
        self.data = data
        self.times = []
        self.compile_s = None
        self.losses = []
        self.error = None
        if step == "trainer":
            from keras_transformer.precision import DTYPE_POLICIES
            from keras_transformer.trainer import Trainer, TrainingConfig

            mixed = {policy: name for name, policy in DTYPE_POLICIES.items()}[precision]
            import dataclasses

            fields = {f.name for f in dataclasses.fields(TrainingConfig)}
            options = dict(train_steps=10**9, jit_compile=jit, mixed_precision=mixed, seed=0)
            config = TrainingConfig(**{k: v for k, v in options.items() if k in fields})
            keras.utils.set_random_seed(0)
            trainer = Trainer(
                strategy,
                # Trainer builds the model itself (and fails on a built one).
                lambda policy: _build_under_policy(impl, preset, vocab_size, policy, build=False),
                workdir,
                config,
            )
            self.model, self.optimizer = trainer.model, trainer.optimizer
            source, decoder_inputs, labels = data
            dataset = tf.data.Dataset.from_tensors(((source, decoder_inputs), labels)).repeat()
            iterator = iter(strategy.experimental_distribute_dataset(dataset))
            trainer_step = trainer._train_step(False)  # the step fit() runs on unlogged steps
            self._trainer = trainer  # keeps the strategy objects alive
            self.step_fn = lambda: trainer_step(iterator)
            self._loss = lambda out: float(out["loss_sum"]) / max(float(out["tokens"]), 1.0)
        else:
            keras.utils.set_random_seed(0)
            if precision == "mixed_float16":
                distribution.prepare_for_float16(strategy)
            with strategy.scope():
                self.model = _build_under_policy(impl, preset, vocab_size, precision)
                self.optimizer = make_optimizer_compat(get_preset(preset)["d_model"])
                self.optimizer.build(self.model.trainable_variables)
            fn = make_train_step(self.model, self.optimizer, jit)
            self.step_fn = lambda: fn(*data)
            self._loss = float

    @property
    def name(self):
        return f"{self.preset}/{self.precision}/{'xla' if self.jit else 'graph'}/{self.impl}"

    def warm_up(self, steps):
        start = time.perf_counter()
        out = self.step_fn()
        common.sync(out)
        self.compile_s = time.perf_counter() - start
        for _ in range(steps):
            out = self.step_fn()
        self.losses.append(self._loss(out))

    def timed_repeat(self, steps):
        start = time.perf_counter()
        out = None
        for _ in range(steps):
            out = self.step_fn()
        common.sync(out)
        self.times.append((time.perf_counter() - start) / steps)
        self.losses.append(self._loss(out))


def make_optimizer_compat(d_model):
    """Adam(0.9, 0.98, 1e-9) with the paper's schedule, via `keras_transformer.schedule`."""
    from keras_transformer.schedule import TransformerSchedule

    return make_optimizer(TransformerSchedule(d_model))


def run_group(preset, precision, jit, impls, args, peaks, strategy):
    """Times the implementations of one (preset, precision, XLA) side by side, interleaved."""
    config = get_preset(preset)
    batch = args.batch or DEFAULT_BATCH[preset]
    data = synthetic_batch(batch, args.src_len, args.tgt_len, args.vocab_size)
    tokens = batch * (args.src_len + args.tgt_len)
    flops = model_flops_per_step(config, args.vocab_size, batch, args.src_len, args.tgt_len)
    runners = []
    for impl in impls:
        try:
            workdir = tempfile.mkdtemp(prefix="bench-train-")
            runners.append(
                Runner(impl, preset, precision, jit, args.vocab_size, data, args.step, strategy, workdir)
            )
        except Exception as e:  # a configuration the device or library cannot build
            print(f"[train] {preset}/{precision}/{impl}: build failed: {e!r}", flush=True)
            runners.append(None)
    live = [r for r in runners if r is not None]
    for r in live:
        try:
            r.warm_up(args.warmup)
            print(f"[train] {r.name}: first step (trace/compile) {r.compile_s:.1f} s", flush=True)
        except Exception as e:
            r.error = repr(e)[:500]
            print(f"[train] {r.name}: FAILED: {r.error}", flush=True)
    live = [r for r in live if r.error is None]
    # The same number of steps for every implementation, enough to fill --min-repeat-seconds
    # (a GPU step can take milliseconds): at least --steps.
    steps = max([args.steps] + [common.calls_to_fill(r.step_fn, args.min_repeat_seconds) for r in live])
    # Interleave: ours, peer, ours, peer, ... so neighbours' load drifts affect both alike.
    for _ in range(args.repeats):
        for r in live:
            r.timed_repeat(steps)
    results = []
    peak_key = PEAK_DTYPES[precision]
    for impl, r in zip(impls, runners):
        entry = {
            "preset": preset,
            "impl": impl,
            "step": args.step,
            "precision": precision,
            "jit_compile": jit,
            "batch": batch,
            "src_len": args.src_len,
            "tgt_len": args.tgt_len,
            "tokens_per_step": tokens,
            "steps_per_repeat": steps,
            "model_flops_per_step": flops["train"],
            "model_flops_per_token": flops["train_per_token"],
        }
        if r is None or r.error is not None:
            entry["error"] = "build failed" if r is None else r.error
            results.append(entry)
            continue
        step = statistics.median(r.times)
        entry.update(
            {
                "params": int(sum(np.prod(v.shape) for v in r.model.trainable_variables)),
                "first_step_s": round(r.compile_s, 3),
                "step_time": common.summarize(r.times),
                "tokens_per_s": tokens / step,
                "model_flops_per_s": flops["train"] / step,
                "mfu": flops["train"] / step / peaks[peak_key]["best_flops"],
                "mfu_vs_float32_peak": flops["train"] / step / peaks["float32"]["best_flops"],
                "loss_first_last": [round(r.losses[0], 4), round(r.losses[-1], 4)],
            }
        )
        print(
            f"[train] {r.name}: {entry['tokens_per_s']:.0f} tokens/s, step {step * 1e3:.0f} ms, "
            f"MFU {entry['mfu']:.1%}",
            flush=True,
        )
        results.append(entry)
    del runners, live
    gc.collect()
    keras.backend.clear_session()
    return results


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["small", "base"])
    parser.add_argument(
        "--precisions",
        nargs="+",
        default=None,
        help="float32, mixed_bfloat16 and/or mixed_float16 (default: float32 and the mixed precision "
        "the device runs natively: bf16 on a CPU with AVX512_BF16/AMX or an Ampere+ GPU, fp16 on older "
        "GPUs). mixed_float16 runs last: on a CPU it turns off Grappler's MatMul+BiasAdd fusion",
    )
    parser.add_argument("--jit", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["ours", "peer_noattndrop"],
        choices=["ours", "peer", "peer_noattndrop"],
        help="peer_noattndrop: KerasHub with our exact architecture (the comparison we report); "
        "peer: KerasHub's standard dropout, which also drops attention weights (extra work)",
    )
    parser.add_argument(
        "--step",
        choices=["trainer", "standalone"],
        default="trainer",
        help="trainer: the project's Trainer step (XLA on forward+backward); standalone: "
        "loss + gradients + Adam in one function (XLA on all of it)",
    )
    parser.add_argument("--batch", type=int, default=None, help="sentences per batch (default per preset)")
    parser.add_argument("--src-len", type=int, default=24)
    parser.add_argument("--tgt-len", type=int, default=24)
    parser.add_argument(
        "--vocab-size", type=int, default=8000,
        help="shared vocabulary (the corpus default of train.py; its small and medium presets learn 4000)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    parser.add_argument("--steps", type=int, default=2, help="least steps per timed repeat")
    parser.add_argument(
        "--min-repeat-seconds",
        type=float,
        default=1.0,
        help="more steps per repeat when --steps take less than this (on a GPU)",
    )
    parser.add_argument("--repeats", type=int, default=4, help="timed repeats (the median is reported)")
    parser.add_argument(
        "--peak-sizes", type=int, nargs="+", default=list(common.PEAK_SIZES),
        help="sizes n of the [n, n] matmuls the peak FLOP/s is the best of",
    )
    parser.add_argument("--output-name", default="train_throughput")
    common.add_load_args(parser)
    common.add_results_dir_arg(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    strategy = single_device_strategy()  # before any other TensorFlow op
    precisions = args.precisions or common.default_precisions()
    load = common.quiet(args)
    payload = common.header("train_throughput", args)
    # Every step's MFU is over the peak of its own precision, and also over the float32 peak.
    dtypes = ["float32", "bfloat16"] + (["float16"] if "mixed_float16" in precisions else [])
    peaks = {dtype: common.peak_matmul_flops(dtype, args.peak_sizes) for dtype in dtypes}
    print(
        "[train] peak matmul: "
        + ", ".join(
            f"{dtype} {peak['best_flops'] / 1e9:.0f} GFLOP/s ({peak['best_shape']['n']}², "
            f"{'XLA' if peak['best_shape']['xla'] else 'no XLA'})"
            for dtype, peak in peaks.items()
        ),
        flush=True,
    )
    results = []
    for preset, precision, jit in configurations(args.presets, precisions, args.jit):
        results += run_group(preset, precision, jit == "on", args.impls, args, peaks, strategy)
        payload.update({"load": common.finish_load(dict(load)), "peak_matmul": peaks, "results": results})
        common.write_json(args.output_name, payload, args.results_dir)  # partial results survive an interruption
    # Peaks again at the end: a drift between the two says the machine's speed changed.
    peaks_end = common.peak_matmul_flops("float32", args.peak_sizes)
    payload["peak_matmul_float32_end"] = peaks_end
    payload["ratios_ours_over_peer"] = ratios(results)
    payload["load"] = common.finish_load(load)
    common.write_json(args.output_name, payload, args.results_dir)
    for key, value in payload["ratios_ours_over_peer"].items():
        print(f"[train] ours/peer {key}: {value:.2f}x", flush=True)


def configurations(presets, precisions, jits):
    """(preset, precision, jit) in the order of the arguments, but float16 last.

    On a CPU a float16 step turns Grappler's remapper off for the whole process
    (`keras_transformer.distribution.prepare_for_float16`), so float16 runs after every
    other precision, whose steps keep their fusions.
    """
    groups = [(preset, precision, jit) for preset in presets for precision in precisions for jit in jits]
    return sorted(groups, key=lambda group: group[1] == "mixed_float16")  # stable: order kept otherwise


def ratios(results):
    """tokens/s of ours over each peer, per (preset, precision, XLA)."""
    out = {}
    by_key = {}
    for r in results:
        if "tokens_per_s" in r:
            key = f"{r['preset']}/{r['precision']}/{'xla' if r['jit_compile'] else 'graph'}"
            by_key.setdefault(key, {})[r["impl"]] = r["tokens_per_s"]
    for key, impls in by_key.items():
        for peer in ("peer", "peer_noattndrop"):
            if "ours" in impls and peer in impls:
                out[f"{key} vs {peer}"] = impls["ours"] / impls[peer]
    return out


if __name__ == "__main__":
    main()
