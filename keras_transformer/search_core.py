"""The model-independent beam search: one `tf.while_loop`, for `tf.function`, SavedModels and XLA.

The length penalty is GNMT's `((5 + length) / 6) ** alpha` (Wu et al., 2016, eq. 14), where
`length` counts the generated tokens, EOS included. The paper's beam size, alpha and
extra length are `keras_transformer.decoding_settings.DecodingSettings`' defaults;
`keras_transformer.decoding.beam_search` runs this search over a `Transformer`.

Design (after TF Model Garden's `official/nlp/modeling/ops/beam_search.py`):

* `search` is the model-independent core: one `tf.while_loop` over one explicit state
  (`BeamState`) holding the alive hypotheses (sequences, summed log-probs, decoding
  cache) and, kept apart, the finished ones (sequences, length-penalized scores,
  lengths, flags). Each step expands every alive beam by every token, keeps the best
  `2 * beam_size` candidates, sends those that end in EOS (or reach the row's maximum
  length) to the finished set and the best `beam_size` others to the alive set. Keeping
  twice the beam as candidates keeps the alive set full when some candidates finish.
* `beam_size=1` is greedy decoding through the same code: one candidate per step, the
  argmax; decoding stops when it is EOS.
* Scores are float32 whatever the model's dtype (logits are cast before the
  log-softmax). "Minus infinity" is the finite `NEG_INF`: real -inf would make
  `-inf - -inf` NaN, and `-dtype.max` would overflow to -inf when two are added.
  Candidates scoring below `NEG_INF / 2` are impossible ones (beams not yet opened,
  or rows that are done) and never become hypotheses.
* Every row of a batch has its own maximum length (for a translation, its source
  length + `max_extra_length`), and a row's result does not depend on the other rows
  or on padding. The loop stops when every row is done: a row is done when it reached
  its maximum length, or when no alive beam can beat its `n_best`-th finished
  hypothesis (the early stop, per row). A done row's finished hypotheses are frozen
  while other rows go on.
* Done rows leave the batch (as in CTranslate2): the step that finishes a row moves its
  hypotheses to the result and gathers the rows still searched, with their cache and
  their `row_state` (per-row inputs of the scoring function that never change, such as
  the encoder memory), so that no step scores a row that is done: a batch costs about
  what its rows cost one by one, not its longest row's steps for every row. Under XLA,
  whose shapes are fixed, the batch halves instead: once at most half of its rows are
  open, the open ones move to a batch of half the size (`XLA_HALVINGS` times at most
  per cache length, but the first; each size compiles one more loop per cache length).
  Results are the same either way (`drop_done_rows`).
* A minimum length (`min_length`, fairseq's `--min-len`): EOS is not generated before
  that many other tokens. `DecodingSettings` defaults to 1, so that a sentence never
  translates to an empty output (a blank one is the caller's to handle), as with fairseq
  and CTranslate2: end-of-sentence as the first token could otherwise win the beam.
* Two early stops (`decoding_settings.EARLY_STOPPING`). `"exact"`, the default, is
  tensor2tensor's and Model Garden's: no alive beam can win even with the most
  favourable length penalty it could still reach (at the row's maximum length, for
  `alpha > 0`), so the search returns what it would have returned running to the
  maximum length.
  `"current_length"`, a heuristic (as Hugging Face's default stop, which scores alive
  beams at their current length), scores them as if they finished at the next step:
  a row stops as soon as its best finished hypothesis beats them there. It skips the
  steps that only prove the finished one wins, but an alive beam could still have won
  by growing longer under the penalty. It looks at the best finished hypothesis alone,
  whatever `n_best`, so the best result does not depend on how many are asked for;
  the other `n_best` slots hold what had finished by then (possibly none).
* Shapes are fixed inside the loop: sequences live in a `[batch, beam, max_decode_length + 1]`
  buffer and the model's self-attention cache has a fixed size written in place, so
  the cached search runs under `tf.function(jit_compile=True)` (as long as `beam_size`
  is a Python int or a constant). The cache still grows with the output: the search runs as a few
  loops, one per cache size (e.g. 16, 32, 64 positions, then the whole buffer), and grows
  the cache between them, so that the per-step reorder and attention work on a buffer
  close to the output's length; under XLA, once every row is done, the larger sizes
  are skipped.
  The uncached path recomputes the growing prefix every step (a reference for tests and
  benchmarks, not for use).
* A step is one `tf.function` that every loop calls, so the scoring function (a
  model's decoder) is traced once per search, not once per loop (a loop per cache
  size, two under XLA's halving): tracing those copies was a quarter to half of a
  translator's time to its first translation. Cache buffers of static
  lengths (a Transformer's are not) trace it a second time, with relaxed shapes.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf

from keras_transformer.attention import compiling_with_xla
from keras_transformer.decoding_settings import check_early_stopping
from keras_transformer.tokenizer import PAD_ID

# Score of impossible candidates and of empty n-best slots; see the module docstring.
NEG_INF = -1e9
_IMPOSSIBLE = NEG_INF / 2
# Under XLA, how many times a batch may halve as its rows finish (see the module docstring):
# a second halving sped batches of 32 up by a tenth or more; more added compilation, not speed.
XLA_HALVINGS = 2
# Ids per chunk of a beam's vocabulary in the candidates' top-k (`_best_candidates`): of
# 16, 32 and 80, 16 was fastest under XLA and 80 in graph mode; 32 is near both.
CANDIDATE_CHUNK = 32

SymbolsToLogitsFn = Callable[..., tuple[tf.Tensor, Any]]


class Hypotheses(NamedTuple):
    """Decoded hypotheses, best first.

    Attributes:
        tokens: int32 `[batch, n_best, length]`: the generated ids, without the start
            token, ending with EOS when one was generated, then padding. `length` is
            the size of the decoding buffer (the batch's largest maximum length).
        lengths: int32 `[batch, n_best]`: generated tokens, EOS included.
        scores: float32 `[batch, n_best]`: summed token log-probabilities divided by
            the length penalty `((5 + lengths) / 6) ** alpha`.

    Slots without a hypothesis (only when `n_best` exceeds the number of possible
    outputs) hold padding, length 0 and score `NEG_INF`. Without `n_best`, the `n_best`
    axis is dropped: `tokens [batch, length]`, `lengths [batch]`, `scores [batch]`.
    """

    tokens: tf.Tensor
    lengths: tf.Tensor
    scores: tf.Tensor


class BeamState(NamedTuple):
    """The `tf.while_loop` state of `search`; `K` is the beam size, `T` the buffer length.

    `batch` counts the rows still searched (see `Rows`).

    Attributes:
        step: int32 scalar, position of the newest token in the sequences (0: the
            start token only), which is also the number of tokens generated so far.
        alive_seq: int32 `[batch, K, T + 1]`, start token first, padding after `step`.
        alive_log_probs: float32 `[batch, K]`, summed log-probs, best first.
        alive_cache: The decoding cache of the alive beams, tensors `[batch * K, ...]`.
        finished_seq: int32 `[batch, K, T + 1]`, finished hypotheses, best first.
        finished_scores: float32 `[batch, K]`, length-penalized, `NEG_INF` if empty.
        finished_lengths: int32 `[batch, K]`, generated tokens, EOS included.
        finished_flags: bool `[batch, K]`, whether the slot holds a hypothesis.
        rows_done: bool `[batch]`, rows whose search is over: their finished
            hypotheses no longer change.
    """

    step: tf.Tensor
    alive_seq: tf.Tensor
    alive_log_probs: tf.Tensor
    alive_cache: Any
    finished_seq: tf.Tensor
    finished_scores: tf.Tensor
    finished_lengths: tf.Tensor
    finished_flags: tf.Tensor
    rows_done: tf.Tensor


class Rows(NamedTuple):
    """The rows of the batch still searched, and what the search keeps of each.

    Attributes:
        ids: int32 `[rows]`, each row's index in the batch, increasing.
        max_lengths: int32 `[rows]`, most tokens each row may generate.
        state: `search`'s `row_state`, tensors `[rows, ...]` (or an empty nest).
    """

    ids: tf.Tensor
    max_lengths: tf.Tensor
    state: Any


class Finished(NamedTuple):
    """Finished hypotheses `[batch, K, ...]`, best first (`BeamState`'s `finished_*` fields)."""

    seq: tf.Tensor
    scores: tf.Tensor
    lengths: tf.Tensor
    flags: tf.Tensor


def length_penalty(length, alpha):
    """GNMT's length penalty `((5 + length) / 6) ** alpha`, float32.

    Args:
        length: Number of generated tokens (EOS included), int or tensor.
        alpha: Strength; 0 disables the penalty, larger values favour longer outputs.

    Returns:
        float32 tensor of the shape of `length`.
    """
    length = tf.cast(length, tf.float32)
    return tf.pow((5.0 + length) / 6.0, tf.cast(alpha, tf.float32))


def expand_to_beams(tensor, beam_size):
    """Repeats each batch row `beam_size` times: `[batch, ...]` -> `[batch * beam_size, ...]`.

    Rows of one input are adjacent, the layout `search` uses for caches and for the
    flat ids it passes to `symbols_to_logits_fn`.
    """
    return tf.repeat(tensor, beam_size, axis=0)


def expand_to_beams_nest(nest, beam_size):
    """`expand_to_beams` applied to every tensor of a nest."""
    return tf.nest.map_structure(lambda t: expand_to_beams(t, beam_size), nest)


def search(
    symbols_to_logits_fn: SymbolsToLogitsFn,
    initial_ids,
    initial_cache,
    max_decode_length,
    *,
    eos_id: int,
    beam_size,
    alpha,
    row_max_lengths=None,
    n_best=None,
    pad_id: int = PAD_ID,
    never_emit_ids=(),
    cache_lengths=None,
    extend_cache_fn=None,
    early_stopping="exact",
    min_length=0,
    row_state=None,
    drop_done_rows=True,
) -> Hypotheses:
    """Beam search with any scoring function (greedy decoding for `beam_size=1`).

    Args:
        symbols_to_logits_fn: `(ids, step, cache) -> (logits, new_cache)`, or
            `(ids, step, cache, row_state)` when `row_state` is given. `ids` is
            int32 `[rows * beam_size, max_decode_length + 1]` (beams of one row
            adjacent), holding each beam's sequence up to position `step` (the newest
            token; position 0 is the start token) and padding after it. `logits` are
            the scores of the next token, `[rows * beam_size, vocab_size]` (any float
            dtype; log-softmaxed here in float32). `cache` is `initial_cache` expanded
            per beam and reordered to follow the beams; `new_cache` must have its
            structure and shapes. `rows` is the number of rows still searched (done
            rows leave the batch, see `drop_done_rows`), so the function must take
            whatever it knows per row from its arguments, never from a tensor of the
            whole batch it closes over.
        initial_ids: int32 `[batch]` start token of each row.
        initial_cache: Nest of tensors `[batch, ...]`, or an empty nest.
        max_decode_length: Most tokens any row may generate (the buffer length);
            int or int32 scalar.
        eos_id: The end-of-sequence id.
        beam_size: Beams per row, int or int32 scalar (`>= 1`). With a tensor whose
            value is known only when run, shapes become dynamic (fine in graph mode,
            not under XLA); a constant one is read as its value.
        alpha: Length penalty strength, float or float32 scalar.
        row_max_lengths: int32 `[batch]`, most tokens each row may generate (at most
            `max_decode_length`); defaults to `max_decode_length` for every row. A
            hypothesis reaching it without EOS is finished as it is.
        n_best: Hypotheses to return per row (`<= beam_size`), int or int32 scalar;
            `None` returns the best one without the `n_best` axis.
        pad_id: Id written after the end of each sequence.
        never_emit_ids: Ids that are never generated (for a translation model: padding
            and the start token, which get a little probability mass from label
            smoothing). Their log-probs are set to `NEG_INF` after the log-softmax, so
            the other tokens keep the model's log-probs (fairseq does the same).
        cache_lengths: For a cache with a time axis that grows with the output:
            its increasing lengths (ints or int32 scalars, at most
            `max_decode_length`), after which it grows to `max_decode_length`.
            `initial_cache` then holds `cache_lengths[0]` positions; the steps
            writing positions below `cache_lengths[i]` run with that length, and
            `extend_cache_fn(cache, length)` grows the (per-beam) cache between them.
            `None`: `initial_cache` is already what every step needs.
        extend_cache_fn: `(cache, length) -> cache`, needed with `cache_lengths`.
        early_stopping: When a row stops before its maximum length, one of
            `EARLY_STOPPING`: `"exact"` once no alive beam can win at any length it
            could reach, `"current_length"` once none beats the best finished
            hypothesis at the next length (fewer steps, not always the exact result;
            an n-best list may have empty slots). See the module docstring.
        min_length: EOS is not generated before this many other tokens (int or int32
            scalar; 0: EOS may come first). A row whose maximum length is reached
            first finishes there, without EOS.
        row_state: Optional nest of tensors `[batch, ...]`, one row per input row
            (not per beam: a row's beams share it), passed to `symbols_to_logits_fn`
            as they are and gathered with the rows when done rows leave the batch:
            the encoder memory and source mask of a translation.
        drop_done_rows: Whether the rows that are done leave the batch: one by one in
            graph mode, by halving the batch under XLA (see the module docstring).

    Returns:
        `Hypotheses(tokens, lengths, scores)`, see there.
    """
    initial_ids = tf.cast(initial_ids, tf.int32)
    batch_size = tf.shape(initial_ids)[0]
    max_decode_length = tf.cast(max_decode_length, tf.int32)
    if row_max_lengths is None:
        row_max_lengths = tf.fill([batch_size], max_decode_length)
    row_max_lengths = tf.cast(row_max_lengths, tf.int32)
    beam_size, n_best = _known_int(beam_size), _known_int(n_best)
    if isinstance(beam_size, int) and isinstance(n_best, int) and not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be between 1 and beam_size ({beam_size}), got {n_best}.")
    check_early_stopping(early_stopping)
    halve_batch = drop_done_rows and compiling_with_xla()
    num_candidates = _num_candidates(beam_size)

    def with_rows_done(state: BeamState, rows: Rows) -> BeamState:
        """`state` with the rows whose search is over marked (see the module docstring).

        Sticky: under "current_length", the best alive beam can pass the finished one
        again at a later length.
        """
        best_alive = state.alive_log_probs[:, 0]
        # Alive beams finish at a length in [step + 1, row max]. The penalty is
        # monotonic in the length, so its most favourable value is at an end.
        best_penalty = length_penalty(state.step + 1, alpha)
        if early_stopping == "exact":
            best_penalty = tf.maximum(best_penalty, length_penalty(rows.max_lengths, alpha))
        # "exact" waits until the n_best-th finished hypothesis is settled (the whole
        # n-best list is exact). "current_length" stops on the best one, whatever
        # n_best: waiting for more would let alive beams pass the best one, so asking
        # for an n-best list would change the best translation.
        settled_rank = 1 if n_best is None or early_stopping == "current_length" else n_best
        worst_kept = state.finished_scores[:, settled_rank - 1]
        rows_done = tf.reduce_any(
            tf.stack(
                [
                    state.rows_done,
                    state.step >= rows.max_lengths,
                    best_alive <= _IMPOSSIBLE,
                    worst_kept > best_alive / best_penalty,
                ]
            ),
            axis=0,
        )
        return state._replace(rows_done=rows_done)

    def grow(state: BeamState, rows: Rows) -> BeamState:
        extra = () if row_state is None else (rows.state,)
        logits, cache = symbols_to_logits_fn(
            _merge_beams(state.alive_seq), state.step, state.alive_cache, *extra
        )
        log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))
        vocab_size = tf.shape(log_probs)[-1]
        too_early = False if isinstance(min_length, int) and min_length <= 0 else state.step < min_length
        blocked = _blocked_ids(vocab_size, never_emit_ids, eos_id, too_early)
        if blocked is not None:  # One pass over the log-probs for all the blocked ids.
            log_probs = tf.where(blocked, NEG_INF, log_probs)
        rows_searched = tf.shape(state.alive_log_probs)[0]
        log_probs = tf.reshape(log_probs, [rows_searched, -1, logits.shape[-1] or vocab_size])  # [rows, beam, vocab]
        top_log_probs, top_beams, top_tokens = _best_candidates(log_probs, state.alive_log_probs, num_candidates)
        length = state.step + 1
        top_seq = _write_tokens(
            tf.gather(state.alive_seq, top_beams, batch_dims=1), top_tokens, length
        )

        possible = top_log_probs > _IMPOSSIBLE
        complete = tf.logical_or(tf.equal(top_tokens, eos_id), (length >= rows.max_lengths)[:, None])
        alive = _select_alive(top_seq, top_log_probs, top_beams, complete, cache, beam_size)
        # A done row keeps its hypotheses while other rows go on: under
        # "current_length" an alive beam could still beat them later.
        open_rows = tf.logical_not(state.rows_done)[:, None]
        newly_finished = tf.logical_and(tf.logical_and(complete, possible), open_rows)
        new_scores = tf.where(newly_finished, top_log_probs / length_penalty(length, alpha), NEG_INF)
        finished = _merge_finished(state, top_seq, new_scores, length, beam_size)
        return with_rows_done(BeamState(length, *alive, *finished, state.rows_done), rows)

    # One trace for all the loops below (see the module docstring).
    grow = tf.function(grow, autograph=False, reduce_retracing=True)

    def step(state: BeamState, rows: Rows, results: Finished):
        state = grow(state, rows)
        return tf.cond(
            tf.reduce_any(state.rows_done),
            lambda: _without_done_rows(state, rows, results, beam_size),
            lambda: (state, rows, results),
        )

    def should_continue(state: BeamState, end):
        # The step at `state.step` writes cache position `state.step`: below `end`.
        return tf.reduce_all(
            [state.step < max_decode_length, state.step < end, tf.logical_not(tf.reduce_all(state.rows_done))]
        )

    def halving_loops(state: BeamState, rows: Rows, results: Finished, end, halvings, halved=False):
        """XLA: steps until `end`, the batch halving while it may; returns a batch of `batch_size` rows.

        Each call is one loop over a fixed batch (`halved`: smaller than `batch_size`).
        It stops early once at most half of its rows are open; they then move to a batch
        half its size, searched by the next call. At the end, a halved batch is padded
        back to the full one, so that the next cache segment starts from a size known
        when compiling.
        """

        def full_batch(state, rows, results):
            return (*_padded_rows(state, rows, batch_size, beam_size), results) if halved else (state, rows, results)

        size = tf.shape(state.rows_done)[0]
        half = (size + 1) // 2
        may_halve = halvings > 0

        def keep_going(state):
            if not may_halve:
                return should_continue(state, end)
            many_open = tf.logical_or(_open_rows(state) > half, half >= size)
            return tf.logical_and(should_continue(state, end), many_open)

        (state,) = tf.while_loop(
            keep_going,
            lambda state: (grow(state, rows),),
            (state,),
            shape_invariants=(tf.nest.map_structure(_any_batch_size, state),),
        )
        if not may_halve:
            return full_batch(state, rows, results)
        # `half < size` is a constant once XLA knows the batch size: it drops the branch
        # that a batch of one row never takes (no loop of it to compile).
        return tf.cond(
            tf.logical_and(half < size, should_continue(state, end)),  # stopped to halve
            lambda: halving_loops(*_halved(state, rows, results, half, beam_size), end, halvings - 1, halved=True),
            lambda: full_batch(state, rows, results),
        )

    def segment(state: BeamState, rows: Rows, results: Finished, end, first_of_several):
        """The steps writing cache positions below `end`."""
        if halve_batch:
            # Few rows finish within the first cache size: halving there would compile
            # two more loops for little.
            return halving_loops(state, rows, results, end, 0 if first_of_several else XLA_HALVINGS)
        if drop_done_rows:
            return tf.while_loop(
                lambda state, rows, results: should_continue(state, end),
                step,
                (state, rows, results),
                shape_invariants=tf.nest.map_structure(_any_batch_size, (state, rows, results)),
            )
        # Only the state varies: loop variables that never change broke XLA's lowering here.
        (state,) = tf.while_loop(
            lambda state: should_continue(state, end),
            lambda state: (grow(state, rows),),
            (state,),
            shape_invariants=(tf.nest.map_structure(_any_batch_size, state),),
        )
        return state, rows, results

    ends = [*(cache_lengths or []), max_decode_length]

    def segments_from(index, state: BeamState, rows: Rows, results: Finished) -> Finished:
        """Searches the cache segments from `ends[index]` on; returns every row's hypotheses.

        Under XLA the later segments are skipped once every row is done: growing a
        fixed-shape batch's cache for steps no row takes cost as much as a few steps. In
        graph mode done rows have left the batch, and a branch would only add tracing.
        """
        if index:
            state = state._replace(alive_cache=extend_cache_fn(state.alive_cache, ends[index]))
        state, rows, results = segment(state, rows, results, ends[index], index == 0 and len(ends) > 1)

        def searched():
            return _with_rows(results, rows.ids, _finished(state))

        if index == len(ends) - 1:
            return searched()
        if not compiling_with_xla():
            return segments_from(index + 1, state, rows, results)
        return tf.cond(
            tf.reduce_all(state.rows_done), searched, lambda: segments_from(index + 1, state, rows, results)
        )

    if cache_lengths and extend_cache_fn is None:
        raise ValueError("cache_lengths needs an extend_cache_fn to grow the cache.")
    state = _initial_state(initial_ids, initial_cache, max_decode_length, beam_size, pad_id)
    rows = Rows(tf.range(batch_size), row_max_lengths, () if row_state is None else row_state)
    results = _finished(state)
    if halve_batch:  # One more row, where the padding rows' results go (see `_padded_rows`).
        results = Finished(*(tf.concat([r, r[:1]], axis=0) for r in results))
    results = segments_from(0, with_rows_done(state, rows), rows, results)
    if halve_batch:
        results = Finished(*(r[:batch_size] for r in results))
    return _hypotheses(results, n_best, pad_id)


def doubling_cache_lengths(max_decode_length, first=16, doublings=2):
    """Cache lengths for `search(cache_lengths=...)`: `first`, twice that, ... (`doublings` times).

    Each is capped at `max_decode_length` (a segment whose length repeats the
    previous one runs no step), so each step works on a buffer under twice the
    output's length (past `first` and up to `first * 2 ** doublings`), and growing
    copies the cache about twice over a whole search. The count is fixed so that it
    does not depend on a traced `max_decode_length`.
    """
    return [tf.minimum(first * 2**i, max_decode_length) for i in range(doublings + 1)]


def _blocked_ids(vocab_size, never_emit_ids, eos_id, too_early):
    """bool `[vocab_size]`: the ids this step may not generate (`None`: none).

    Those of `never_emit_ids`, and EOS while `too_early` (before the minimum length).
    """
    ids = tf.range(vocab_size)
    blocked = []
    if never_emit_ids:
        blocked.append(tf.reduce_any(tf.equal(ids[:, None], list(never_emit_ids)), axis=1))
    if too_early is not False:
        blocked.append(tf.logical_and(tf.equal(ids, eos_id), too_early))
    return tf.reduce_any(tf.stack(blocked), axis=0) if blocked else None


def _known_int(value):
    """`value` as a Python int when it is a tensor whose value is known when tracing (a constant), else as it is.

    A graph's constant beam size made the first beams' shape static (the start of the
    search's loops) and their later shape not: the loop refused to run.
    """
    if isinstance(value, tf.Tensor):
        known = tf.get_static_value(value)
        if known is not None:
            return int(known)
    return value


def _num_candidates(beam_size):
    """Candidates kept per step: twice the beam, so finishing ones leave it full; 1 for greedy."""
    if isinstance(beam_size, int):
        if beam_size < 1:
            raise ValueError(f"beam_size must be at least 1, got {beam_size}.")
        return 1 if beam_size == 1 else 2 * beam_size
    return tf.where(tf.equal(beam_size, 1), 1, 2 * beam_size)


def _best_candidates(log_probs, alive_log_probs, k):
    """The `k` best expansions of the alive beams: `top_k` over every beam's every token.

    Args:
        log_probs: float32 `[rows, beam, vocab]`, each beam's next-token log-probs.
        alive_log_probs: float32 `[rows, beam]`, each beam's summed log-probs.
        k: Candidates per row (at most `beam * vocab`).

    Returns:
        `(scores, beams, tokens)`, each `[rows, k]`, best first: the scores
        `alive_log_probs[beam] + log_probs[beam, token]` and where they come from. Ties
        go to the lower beam, then the lower token, as with `tf.math.top_k` over the
        `[rows, beam * vocab]` scores.

    That top-k is a step's slowest op on a CPU, so it runs in two small ones. Each
    beam's vocabulary is cut into chunks of `CANDIDATE_CHUNK` ids, each scored by its
    best id. The `k` best chunks hold the `k` best candidates: a candidate outside them
    would have `k` better chunk bests above it. Those chunks, taken in index order so
    that ties resolve as in the full top-k, are the only ones searched.
    """
    rows = tf.shape(log_probs)[0]
    beam_size = log_probs.shape[1] or tf.shape(log_probs)[1]
    vocab_size = log_probs.shape[2] or tf.shape(log_probs)[2]
    chunk = _at_most(CANDIDATE_CHUNK, vocab_size)
    padding = (-vocab_size) % chunk
    if not isinstance(padding, int) or padding:  # with -inf, below any score, so never a candidate
        log_probs = tf.pad(log_probs, [[0, 0], [0, 0], [0, padding]], constant_values=float("-inf"))
    chunks_per_beam = (vocab_size + padding) // chunk
    per_beam = tf.reshape(log_probs, [rows, beam_size, chunks_per_beam, chunk])
    # Adding a beam's score after the max gives the max of the sums: rounding is monotonic.
    chunk_bests = tf.reduce_max(per_beam, axis=-1) + alive_log_probs[:, :, None]
    chunk_bests = tf.reshape(chunk_bests, [rows, -1])
    _, best_chunks = tf.math.top_k(chunk_bests, k=_at_most(k, beam_size * chunks_per_beam))
    best_chunks = tf.sort(best_chunks, axis=1)
    chunk_beam_scores = tf.gather(alive_log_probs, best_chunks // chunks_per_beam, batch_dims=1)
    chunks = tf.reshape(per_beam, [rows, -1, chunk])
    candidates = tf.gather(chunks, best_chunks, batch_dims=1) + chunk_beam_scores[:, :, None]
    scores, picked = tf.math.top_k(tf.reshape(candidates, [rows, -1]), k=k)
    picked_chunks = tf.gather(best_chunks, picked // chunk, batch_dims=1)
    tokens = picked_chunks % chunks_per_beam * chunk + picked % chunk
    return scores, picked_chunks // chunks_per_beam, tokens


def _at_most(k, n):
    """`min(k, n)`, a Python int when both are (XLA needs a static top-k size)."""
    if isinstance(k, int) and isinstance(n, int):
        return min(k, n)
    return tf.minimum(k, n)


def _initial_state(initial_ids, initial_cache, max_decode_length, beam_size, pad_id) -> BeamState:
    batch_size = tf.shape(initial_ids)[0]
    positions = tf.range(max_decode_length + 1)
    first = tf.equal(positions, 0)[None, None, :]
    sequences = tf.where(first, initial_ids[:, None, None], pad_id)
    sequences = tf.tile(sequences, [1, beam_size, 1])
    if isinstance(beam_size, int):
        sequences = tf.ensure_shape(sequences, [None, beam_size, None])
    zeros = tf.zeros([batch_size, beam_size], tf.float32)
    # Only the first beam is open: the others would duplicate it.
    alive_log_probs = zeros + tf.where(tf.range(beam_size) == 0, 0.0, NEG_INF)[None, :]
    return BeamState(
        step=tf.constant(0, tf.int32),
        alive_seq=sequences,
        alive_log_probs=alive_log_probs,
        alive_cache=expand_to_beams_nest(initial_cache, beam_size),
        finished_seq=sequences,
        finished_scores=zeros + NEG_INF,
        finished_lengths=tf.zeros([batch_size, beam_size], tf.int32),
        finished_flags=tf.zeros([batch_size, beam_size], tf.bool),
        rows_done=tf.zeros([batch_size], tf.bool),
    )


def _any_batch_size(tensor):
    """The shape of `tensor` with the leading (batch or batch * beam) dimension unknown.

    The body's reshapes do not always carry a static batch size through.
    """
    shape = tensor.shape
    return shape if shape.rank == 0 else tf.TensorShape([None]).concatenate(shape[1:])


def _merge_beams(tensor):
    """`[batch, beam, ...]` -> `[batch * beam, ...]`."""
    return tf.reshape(tensor, tf.concat([[-1], tf.shape(tensor)[2:]], axis=0))


def _write_tokens(sequences, tokens, position):
    """Writes `tokens [batch, n]` at `position` of `sequences [batch, n, T + 1]`."""
    at_position = tf.equal(tf.range(tf.shape(sequences)[-1]), position)
    return tf.where(at_position, tokens[:, :, None], sequences)


def _gather_beams(flat, beam_indices, beam_size):
    """Reorders a cache tensor `[batch * beam, ...]` to follow `beam_indices [batch, beam]`."""
    per_row = tf.reshape(flat, tf.concat([[-1, beam_size], tf.shape(flat)[1:]], axis=0))
    gathered = tf.gather(per_row, beam_indices, batch_dims=1)
    return tf.ensure_shape(tf.reshape(gathered, tf.shape(flat)), flat.shape)


def _select_alive(top_seq, top_log_probs, top_beams, complete, cache, beam_size):
    """The best `beam_size` candidates that did not finish, with their reordered cache."""
    open_log_probs = tf.where(complete, NEG_INF, top_log_probs)
    alive_log_probs, chosen = tf.math.top_k(open_log_probs, k=beam_size)
    alive_seq = tf.gather(top_seq, chosen, batch_dims=1)
    parents = tf.gather(top_beams, chosen, batch_dims=1)
    alive_cache = tf.nest.map_structure(lambda t: _gather_beams(t, parents, beam_size), cache)
    return alive_seq, alive_log_probs, alive_cache


def _merge_finished(state, top_seq, new_scores, length, beam_size):
    """The best `beam_size` of the finished hypotheses and the newly finished candidates.

    Older hypotheses come first, so on equal scores they are kept (`top_k` is stable).
    """
    scores = tf.concat([state.finished_scores, new_scores], axis=1)
    flags = tf.concat([state.finished_flags, new_scores > _IMPOSSIBLE], axis=1)
    sequences = tf.concat([state.finished_seq, top_seq], axis=1)
    lengths = tf.concat([state.finished_lengths, tf.fill(tf.shape(new_scores), length)], axis=1)
    finished_scores, chosen = tf.math.top_k(scores, k=beam_size)
    return (
        tf.gather(sequences, chosen, batch_dims=1),
        finished_scores,
        tf.gather(lengths, chosen, batch_dims=1),
        tf.gather(flags, chosen, batch_dims=1),
    )


def _finished(state: BeamState) -> Finished:
    return Finished(state.finished_seq, state.finished_scores, state.finished_lengths, state.finished_flags)


def _with_rows(results: Finished, row_ids, finished: Finished) -> Finished:
    """`results` with its rows `row_ids` replaced by `finished`'s rows."""
    indices = row_ids[:, None]
    return Finished(*(tf.tensor_scatter_nd_update(r, indices, f) for r, f in zip(results, finished, strict=True)))


def _gather_rows(flat, kept, beam_size):
    """The rows `kept` of a tensor `[rows * beam, ...]`, each with its beams."""
    per_row = tf.reshape(flat, tf.concat([[-1, beam_size], tf.shape(flat)[1:]], axis=0))
    kept_rows = tf.gather(per_row, kept)
    return tf.reshape(kept_rows, tf.concat([[-1], tf.shape(flat)[1:]], axis=0))


def _without_done_rows(state: BeamState, rows: Rows, results: Finished, beam_size):
    """Moves the done rows' hypotheses to `results` and drops those rows from the search."""
    done = tf.where(state.rows_done)[:, 0]
    results = _with_rows(
        results, tf.gather(rows.ids, done), Finished(*(tf.gather(t, done) for t in _finished(state)))
    )
    kept = tf.where(tf.logical_not(state.rows_done))[:, 0]
    return (*_gather_state(state, rows, kept, beam_size), results)


def _open_rows(state: BeamState):
    """int32 scalar: how many rows are still searched."""
    return tf.reduce_sum(tf.cast(tf.logical_not(state.rows_done), tf.int32))


def _gather_state(state: BeamState, rows: Rows, indices, beam_size) -> tuple[BeamState, Rows]:
    """The rows `indices` of the search's state and rows (the cache with each row's beams)."""
    alive_cache = tf.nest.map_structure(lambda t: _gather_rows(t, indices, beam_size), state.alive_cache)
    per_row = {
        name: tf.gather(getattr(state, name), indices)
        for name in BeamState._fields
        if name not in ("step", "alive_cache")
    }
    rows = Rows(*(tf.nest.map_structure(lambda t: tf.gather(t, indices), field) for field in rows))
    return state._replace(alive_cache=alive_cache, **per_row), rows


def _halved(state: BeamState, rows: Rows, results: Finished, size, beam_size):
    """XLA: the state of `size` rows, the open ones first; every row's hypotheses saved to `results`.

    The open rows must fit. Done rows fill the rest: their hypotheses no longer
    change, so saving them again at the end changes nothing.
    """
    results = _with_rows(results, rows.ids, _finished(state))
    kept = tf.argsort(tf.cast(state.rows_done, tf.int32), stable=True)[:size]
    return (*_gather_state(state, rows, kept, beam_size), results)


def _padded_rows(state: BeamState, rows: Rows, batch_size, beam_size) -> tuple[BeamState, Rows]:
    """XLA: the state padded to `batch_size` rows with done copies of its first row.

    The padding rows' results go to the row after the batch's last (`batch_size`),
    which the search drops.
    """
    size = tf.shape(state.rows_done)[0]
    indices = tf.concat([tf.range(size), tf.zeros([batch_size - size], tf.int32)], axis=0)
    state, rows = _gather_state(state, rows, indices, beam_size)
    padding = tf.range(batch_size) >= size
    state = state._replace(rows_done=tf.logical_or(state.rows_done, padding))
    return state, rows._replace(ids=tf.where(padding, batch_size, rows.ids))


def _hypotheses(finished: Finished, n_best, pad_id) -> Hypotheses:
    """The `n_best` finished hypotheses, empty slots blanked; squeezed for `n_best=None`."""
    count = 1 if n_best is None else n_best
    flags = finished.flags[:, :count]
    tokens = tf.where(flags[:, :, None], finished.seq[:, :count, 1:], pad_id)
    lengths = tf.where(flags, finished.lengths[:, :count], 0)
    scores = tf.where(flags, finished.scores[:, :count], NEG_INF)
    if n_best is None:
        return Hypotheses(tokens[:, 0], lengths[:, 0], scores[:, 0])
    return Hypotheses(tokens, lengths, scores)
