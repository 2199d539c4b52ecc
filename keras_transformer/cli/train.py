"""`kt-train` (`python train.py`): train a Transformer translation model with the recipe of "Attention Is All You Need".

    MULTI30K_DIR=../shared/data/multi30k kt-train         # small preset: 1600 steps, 5-20 min on 2 CPU cores
    kt-train --preset medium                               # best Multi30k BLEU in ~1 hour on CPU
    kt-train --preset base --dataset wmt14                 # the paper's base model (GPUs)
    kt-train --run-dir RUN                                 # resume RUN, or evaluate it again if done
    kt-train --config RUN/config.json --run-dir NEW        # RUN's settings again, in NEW
    kt-train --run-dir NEW --eval-every 100 --patience 3   # a new run that stops once validation BLEU does not improve
    kt-train --run-dir RUN --average-last 5 --average-only

Every setting comes from its flag, else the `--config` file, else the run directory's
saved config.json (when resuming), else the preset's recipe and the corpus's defaults;
settings that fix the model, the vocabulary or the data stream cannot change in an
existing run. See `keras_transformer.run_settings` for the rules and the config file's
keys, and `keras_transformer.training_run` for what a run does.
"""

import argparse
import logging
import sys
from pathlib import Path

from keras_transformer import cpu_kernels

# The command's name in its messages: kt-train when run so, else the repository's script.
PROG = Path(sys.argv[0]).name if Path(sys.argv[0]).name == "kt-train" else "train.py"


def build_parser():
    from keras_transformer.corpora import CORPORA, DEFAULT_CORPUS
    from keras_transformer.recipes import DEFAULT_PRESET, RECIPES
    from keras_transformer.run_settings import defaults, flag_options as checked, timeout_minutes

    def per_preset(name):
        """'tiny 200, small 1600, ...': the recipes' defaults of setting `name`, for help texts."""
        values = {preset: defaults(preset, DEFAULT_CORPUS)[name] for preset in RECIPES}
        shown = {preset: _shown_default(value) for preset, value in values.items()}
        return ", ".join(f"{preset} {value}" for preset, value in shown.items())

    general = defaults(DEFAULT_PRESET, DEFAULT_CORPUS)  # The settings no recipe or corpus sets.

    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Train a Transformer (Vaswani et al., 2017) for translation: Adam with the paper's "
            "warm-up schedule, label smoothing, token-budget batches, data-parallel over all local "
            "GPUs (or the workers of TF_CONFIG), checkpoints, TensorBoard (RUN/logs), validation "
            "BLEU, and a final test BLEU with beam search. Unset flags come from the run "
            "directory's config.json when resuming, else from the preset's recipe."
        ),
        epilog=(
            "Resume: run the same command again (or just --run-dir RUN); training continues "
            "from the last checkpoint with the same data order. A finished run is evaluated "
            "again. TensorBoard: tensorboard --logdir RUN/logs"
        ),
    )
    what = parser.add_argument_group("model and data")
    what.add_argument("--preset", **checked("preset"), default=None,
                      help="Model size and training recipe: "
                           + ", ".join(f"{name} ({recipe.summary})" for name, recipe in RECIPES.items())
                           + f". [{DEFAULT_PRESET}]")
    what.add_argument("--dataset", **checked("dataset"), default=None,
                      help="Corpus: " + ", ".join(f"{name} ({entry.summary})" for name, entry in CORPORA.items())
                           + f". [{DEFAULT_CORPUS}]")
    what.add_argument("--data-dir", default=None,
                      help="Where the corpus is: " + "; ".join(f"{name}: {entry.data_dir}" for name, entry in
                                                               CORPORA.items()) + ".")

    def usual(side):
        """'multi30k en, wmt14 en, ...': each corpus's usual language on `side` (0: source, 1: target)."""
        return ", ".join(f"{name} {entry.languages[side] if entry.languages else 'required'}"
                         for name, entry in CORPORA.items())

    what.add_argument("--source-lang", default=None, help=f"Source language code. [the corpus's usual: {usual(0)}]")
    what.add_argument("--target-lang", default=None, help=f"Target language code. [the corpus's usual: {usual(1)}]")
    what.add_argument("--vocab-size", **checked("vocab_size"), default=None,
                      help="Size of the shared BPE vocabulary learned on the training data. [the corpus's: "
                           + ", ".join(f"{name} {entry.vocab_size}" for name, entry in CORPORA.items())
                           + "".join(f"; the {name} preset's: {recipe.training['vocab_size']}"
                                     for name, recipe in RECIPES.items() if "vocab_size" in recipe.training) + "]")
    what.add_argument("--max-length", **checked("max_length"), default=None,
                      help="Longest training sequence in tokens; longer training pairs are dropped or cut "
                           "(--long-sentences); also where evaluation cuts sources. "
                           f"[{', '.join(f'{name}: {entry.max_length}' for name, entry in CORPORA.items())}]")
    what.add_argument("--long-sentences", **checked("long_sentences"), default=None,
                      help="Training pairs with a side longer than --max-length: dropped (filter) or cut "
                           f"to fit (truncate). [{general['long_sentences']}]")
    what.add_argument("--dropout", **checked("dropout"), default=None,
                      help="Dropout rate P_drop (residual and embedding dropout). [the preset's]")
    what.add_argument("--attention-dropout", **checked("attention_dropout"), default=None,
                      help="Dropout rate on the attention weights (the paper has none). "
                           f"[the preset's: {per_preset('attention_dropout')}]")
    what.add_argument("--activation-dropout", **checked("activation_dropout"), default=None,
                      help="Dropout rate on the feed-forward networks' inner (ReLU) activations (the paper has "
                           f"none). [the preset's: {per_preset('activation_dropout')}]")
    what.add_argument("--attention-init", **checked("attention_init"), default=None,
                      help="How the attention kernels start: independent draws (the paper's), tied (each "
                           "position attends to itself at first) or mimetic (Trockman and Kolter, 2023). "
                           f"[the preset's: {per_preset('attention_init')}]")
    what.add_argument("--norm-first", **checked("norm_first"), default=None,
                      help="Pre-LN blocks (each sub-layer normalises its input, a LayerNorm ends each stack) "
                           f"instead of the paper's post-LN. [the preset's: {per_preset('norm_first')}]")

    how = parser.add_argument_group("optimization")
    length = how.add_mutually_exclusive_group()
    length.add_argument("--train-steps", **checked("train_steps"), default=None,
                        help=f"Total steps (global batches) of the run. [the preset's: {per_preset('train_steps')}]")
    length.add_argument("--epochs", **checked("epochs"), default=None,
                        help="Train this many passes over the training data instead of --train-steps.")
    how.add_argument("--max-minutes", **checked("max_minutes"), default=None,
                     help="Time budget of this command's training loop: when exceeded, training stops "
                          "cleanly after a checkpoint and goes on to the final evaluation. 0: no budget. "
                          f"[the preset's: {per_preset('max_minutes')}]")
    how.add_argument("--token-budget", **checked("token_budget"), default=None,
                     help="Padded tokens per batch and side, PER REPLICA (the global batch is this "
                          f"times the number of replicas). [the preset's: {per_preset('token_budget')}] "
                          "The paper's 25k = 8 GPUs x ~3k real.")
    how.add_argument("--warmup-steps", **checked("warmup_steps"), default=None,
                     help="Linear warm-up steps of the learning rate, then inverse square-root decay. "
                          f"[the preset's: {per_preset('warmup_steps')}] The paper: 4000.")
    how.add_argument("--learning-rate-scale", **checked("learning_rate_scale"), default=None,
                     help="Multiplier of the paper's rate d_model^-0.5 * min(step^-0.5, step * warmup^-1.5). "
                          f"[the preset's: {per_preset('learning_rate_scale')}] The paper: 1.")
    how.add_argument("--cooldown", **checked("cooldown"), default=None,
                     help="Fraction of the run's budget, at its end, over which the learning rate falls linearly "
                          "to zero: of --train-steps, or of --max-minutes when that runs out first. "
                          f"[the preset's: {per_preset('cooldown')}] The paper: 0.")
    how.add_argument("--label-smoothing", **checked("label_smoothing"), default=None,
                     help=f"Label smoothing eps. [{general['label_smoothing']:g}]")
    how.add_argument("--seed", **checked("seed"), default=None,
                     help=f"Seed of weights, dropout and data order. [{general['seed']}]")
    how.add_argument("--mixed-precision", **checked("mixed_precision"), default=None,
                     help="Compute in bfloat16 or float16 with float32 weights (fp16 adds loss scaling), or "
                          "float32 (none). auto: bf16 on GPUs of compute capability 8.0+ and on CPUs with AMX or "
                          "AVX512_BF16 (float32 there with --jit-compile), fp16 on older GPUs, else none; the "
                          f"choice and why are logged and saved. [{general['mixed_precision']}]")
    how.add_argument("--jit-compile", **checked("jit_compile"), default=None,
                     help="Compile the forward/backward pass with XLA (recompiles for every new batch "
                          "shape). [off]")
    how.add_argument("--devices", default=None,
                     help="Comma-separated devices to replicate over, e.g. GPU:0,GPU:1 (CPU:0,CPU:1 "
                          "splits the CPU). [all local GPUs, else --cpu-replicas on the CPU; with a "
                          "multi-worker TF_CONFIG, MultiWorkerMirroredStrategy]")
    how.add_argument("--cpu-replicas", **checked("cpu_replicas"), default=None,
                     help="Without --devices or GPUs: replicas that split the CPU, each on its share of "
                          "the cores (faster than one replica on all of them where the ops are small, "
                          "see docs/performance.md); --token-budget is per replica. "
                          f"[the preset's: {per_preset('cpu_replicas')}]")
    how.add_argument("--connect-timeout-minutes", type=timeout_minutes, default=15.0,
                     help="Multi-worker: how long a worker waits for every worker of TF_CONFIG to "
                          "start; then it exits with status 1. [15]")

    run = parser.add_argument_group("run directory, logging and evaluation")
    run.add_argument("--run-dir", default=None, help="Where the run lives. [runs/DATASET-PRESET]")
    run.add_argument("--config", default=None, metavar="FILE",
                     help="Settings from a JSON or YAML file with the keys and layout of a run's config.json "
                          "(a run's config.json given back trains the same run): flags override it, it "
                          "overrides the run directory's saved settings and the recipe. Keys: see "
                          "keras_transformer/run_settings.py.")
    run.add_argument("--log-every", **checked("log_every"), default=None,
                     help="Steps between progress lines and TensorBoard training summaries. "
                          f"[the preset's: {per_preset('log_every')}]")
    run.add_argument("--checkpoint-every", **checked("checkpoint_every"), default=None,
                     help="Steps between checkpoints (one is also written at the end and on Ctrl-C). "
                          f"[the preset's: {per_preset('checkpoint_every')}]")
    run.add_argument("--keep-checkpoints", **checked("keep_checkpoints"), default=None,
                     help=f"Checkpoints to keep. [the preset's: {per_preset('keep_checkpoints')}]")
    run.add_argument("--eval-every", **checked("eval_every"), default=None,
                     help="Steps between validations (loss, perplexity, accuracy, BLEU on the first "
                          "--bleu-sentences validation sentences, attention images); 0: only at the end. "
                          "With N, the run keeps the checkpoint of its best validation BLEU in RUN/best. "
                          f"[the preset's: {per_preset('eval_every')}]")
    run.add_argument("--patience", **checked("patience"), default=None,
                     help="Stop training once N validations in a row (--eval-every) have not improved on the "
                          "best validation BLEU; the run's model is then its best checkpoint (or the average "
                          "of --average-last or the last checkpoint, if it translates better). 0: train all steps. "
                          f"[{general['patience']}]")
    run.add_argument("--bleu-sentences", **checked("bleu_sentences"), default=None,
                     help="Validation sentences translated for each validation BLEU (0: none); the final choice "
                          "of --average-last translates the whole validation split. "
                          f"[the preset's: {per_preset('bleu_sentences')}]")
    run.add_argument("--average-last", **checked("average_last"), default=None,
                     help="Average the last N checkpoints into RUN/averaged for the final evaluation "
                          "(paper: 5 for base, 20 for big), kept only if its BLEU on the whole validation split "
                          "is at least that of the last checkpoint and of the best one in a run that keeps it "
                          "(--eval-every N), else the better of those is the run's model; kept unchecked when "
                          "there is no validation BLEU (--bleu-sentences 0). "
                          "At most --keep-checkpoints. 0: use the last checkpoint (or the best one). "
                          f"[the preset's: {per_preset('average_last')}]")
    run.add_argument("--average-only", action="store_true",
                     help="Only average the last --average-last checkpoints of --run-dir, then exit.")
    run.add_argument("--beam-size", **checked("beam_size"), default=None,
                     help=f"Beam size of the translations. [the preset's: {per_preset('beam_size')}]")
    run.add_argument("--alpha", **checked("alpha"), default=None,
                     help=f"Length penalty alpha. [the preset's: {per_preset('alpha')}]")
    return parser


def _shown_default(value):
    """A setting's default as a help text shows it: 'none', 'yes'/'no', a string, or a number in %g."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return value if isinstance(value, str) else f"{value:g}"


def configure_logging():
    """Progress lines on stderr: the library's at INFO, other libraries' warnings only."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("keras_transformer").setLevel(logging.INFO)


def resolve_settings(args):
    """`(RunSettings, run directory, saved config.json or None)` of the parsed flags `args`."""
    from keras_transformer import run_settings

    return run_settings.resolve(
        vars(args), config_file=args.config, run=args.run_dir, data_dir=args.data_dir, average_only=args.average_only
    )


def run(args):
    """Resolves the settings of `args`, then averages only, or trains and evaluates."""
    from keras_transformer import run_settings, training_run

    settings, run_dir, saved_config = resolve_settings(args)
    configure_logging()
    training_run.stop_on_sigterm()
    if args.average_only:
        training_run.average_only(run_dir, settings)
        return 0
    devices = None if args.devices is None else [name.strip() for name in args.devices.split(",") if name.strip()]
    if devices == []:
        raise run_settings.SettingsError(f"--devices {args.devices!r} names no device; leave it out for the default.")
    training_run.train(
        settings, run_dir, saved_config, data_dir=args.data_dir, devices=devices,
        connect_timeout_minutes=args.connect_timeout_minutes,
    )
    return 0


def main(argv=None):
    """Runs the command line `argv`; returns the exit code (2 for bad flags or data, 1 for a lost worker or a
    file that cannot be written)."""
    cpu_kernels.configure()  # Before TensorFlow loads.
    args = build_parser().parse_args(argv)
    from keras_transformer import distribution
    from keras_transformer.corpora import CorpusError, DatasetUnavailableError, MissingPackageError
    from keras_transformer.run_dir import RunDirError
    from keras_transformer.run_settings import SettingsError

    try:
        return run(args)
    except (SettingsError, RunDirError, DatasetUnavailableError, CorpusError, MissingPackageError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except distribution.PEER_FAILURES as error:  # Training itself raises WorkerLostError instead.
        if distribution.cluster_task_count() < 2:
            raise
        lost = distribution.worker_lost_error(
            error, "while the workers were setting up", "Start every worker again with the same command."
        )
        print(f"{PROG}: error: {lost}", file=sys.stderr)
        return 1
    except distribution.WorkerLostError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # A full disk, a read-only run directory: what the system said is what to fix.
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; run the same command to resume.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
