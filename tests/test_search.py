"""The model-independent beam search (`keras_transformer.search_core`, re-exported by `decoding`).

It is tested with a fixed scoring function whose next-token log-probs depend on the row,
the step and a hash of the whole prefix, carried in the decoding cache: beam search must
reorder the cache with the beams to get the scores right. Brute-force enumeration of
every output scores each with the same length penalty; with a beam as large as the
number of unfinished prefixes, beam search is exact, and with small beams it is not
(checked, so the comparison is not vacuous). Also: a cache grown in segments, ids never
emitted, minimum lengths, the early stops against a plain Python beam search, greedy
decoding, tensor settings, XLA, edge cases (empty slots, an empty batch, bad settings), and
the chunked top-k of a step's candidates against a full top-k.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import decoding, search_core
from keras_transformer.tokenizer import PAD_ID
from length_penalty import penalty

VOCAB = 5
EOS = 1
START = 0
HASH_MODULUS = 97
MAX_STEPS = 4
# Unfinished prefixes at the last step: (VOCAB - 1) ** (MAX_STEPS - 1) = 64; with that
# many beams, no prefix is ever pruned, so beam search must return the exact best.
EXACT_BEAM = (VOCAB - 1) ** (MAX_STEPS - 1)
ROW_MAX_LENGTHS = [4, 4, 4, 4, 3, 2, 1]
ALPHAS = [0.0, 0.6, 2.0, -0.5]


# ---------------------------------------------------------------------------
# A fixed scoring function and its brute-force reference
# ---------------------------------------------------------------------------


def make_tables(seed):
    """Logits `[row, step, prefix hash, token]`."""
    return make_tables_of(ROW_MAX_LENGTHS, seed)


def make_tables_of(row_max_lengths, seed):
    """Logits `[row, step, prefix hash, token]` for rows of up to `row_max_lengths` steps."""
    rng = np.random.default_rng(seed)
    shape = (len(row_max_lengths), max(row_max_lengths), HASH_MODULUS, VOCAB)
    return rng.normal(size=shape).astype("float32")


def next_hash(prefix_hash, token):
    return (prefix_hash * 31 + token + 1) % HASH_MODULUS


def table_logits(tables, rows, step, prefix_hash):
    """The logits `tables[row, step, prefix_hash]` of each flat beam."""
    steps = tf.fill(tf.shape(prefix_hash), step)
    return tf.gather_nd(tables, tf.stack([rows, steps, prefix_hash], axis=-1))


def make_scorer(tables, counter=None, scored=None):
    """`symbols_to_logits_fn` reading `tables` by row, step and prefix hash (kept in the cache).

    `counter` counts its calls (steps), `scored` the beams it scores.
    """
    tables = tf.constant(tables)

    def symbols_to_logits_fn(ids, step, cache):
        prefix_hash = next_hash(cache["hash"], ids[:, step])
        logits = table_logits(tables, cache["row"], step, prefix_hash)
        if counter is not None:
            counter.assign_add(1)
        if scored is not None:
            scored.assign_add(tf.shape(ids)[0])
        return logits, {"hash": prefix_hash, "row": cache["row"]}

    return symbols_to_logits_fn


def make_history_scorer(tables):
    """`make_scorer` with a growing cache: a token buffer `[rows, length]` written in place.

    Like a self-attention cache, position `i` of the buffer holds the token fed at
    step `i`, and each step reads the whole prefix back from it (the prefix hash
    `sum((token_i + 1) * 31 ** (step - i)) mod 97`, `next_hash` unrolled). A cache
    too short for a step fails; a lost position or a wrong reorder changes the scores.
    """
    tables = tf.constant(tables)
    powers_of_31 = tf.constant([31**k % HASH_MODULUS for k in range(MAX_STEPS)])

    def symbols_to_logits_fn(ids, step, cache):
        history = cache["history"]
        positions = tf.range(tf.shape(history)[1])
        check = tf.debugging.assert_less(step, tf.shape(history)[1], message="cache too short")
        with tf.control_dependencies([check]):
            written = tf.where(positions == step, ids[:, step][:, None], history)
        history = tf.ensure_shape(written, history.shape)
        weights = tf.gather(powers_of_31, tf.maximum(step - positions, 0))
        weights *= tf.cast(positions <= step, tf.int32)
        prefix_hash = tf.reduce_sum((history + 1) * weights, axis=1) % HASH_MODULUS
        logits = table_logits(tables, cache["row"], step, prefix_hash)
        return logits, {"history": history, "row": cache["row"]}

    return symbols_to_logits_fn


def extend_history(cache, length):
    history = cache["history"]
    grown = tf.pad(history, [[0, 0], [0, length - tf.shape(history)[1]]])
    return {"history": grown, "row": cache["row"]}


def run_search(
    tables,
    beam_size,
    alpha,
    n_best=None,
    counter=None,
    jit_compile=False,
    row_max_lengths=None,
    cache_lengths=None,
    never_emit_ids=(),
    early_stopping="exact",
    min_length=0,
    scored=None,
    drop_done_rows=True,
):
    """`decoding.search` over `tables`; with `cache_lengths`, the history scorer's growing cache."""
    rows = len(tables)
    row_max_lengths = ROW_MAX_LENGTHS[:rows] if row_max_lengths is None else row_max_lengths
    if cache_lengths is None:
        scorer = make_scorer(tables, counter, scored)
        initial_cache = {"hash": tf.zeros([rows], tf.int32), "row": tf.range(rows)}
        growth = {}
    else:
        scorer = make_history_scorer(tables)
        initial_cache = {"history": tf.zeros([rows, cache_lengths[0]], tf.int32), "row": tf.range(rows)}
        growth = dict(cache_lengths=cache_lengths, extend_cache_fn=extend_history)

    @tf.function(jit_compile=jit_compile, autograph=False)
    def run(beam_size, alpha):
        return decoding.search(
            scorer,
            tf.fill([rows], START),
            initial_cache,
            max(row_max_lengths, default=MAX_STEPS),
            eos_id=EOS,
            beam_size=beam_size,
            alpha=alpha,
            row_max_lengths=tf.constant(row_max_lengths, tf.int32),
            n_best=n_best,
            never_emit_ids=never_emit_ids,
            early_stopping=early_stopping,
            min_length=min_length,
            drop_done_rows=drop_done_rows,
            **growth,
        )

    return tf.nest.map_structure(np.asarray, run(beam_size, alpha))


def log_softmax(logits):
    logits = logits.astype("float64")
    shifted = logits - logits.max()
    return shifted - math.log(np.exp(shifted).sum())


def all_hypotheses(table, max_length, alpha, never_emit=(), min_length=0):
    """Every output of a row as `(score, tokens)`, best first: ending in EOS or at `max_length`.

    Tokens in `never_emit`, and EOS after fewer than `min_length` tokens, are skipped; the
    others keep their log-probs over the whole vocabulary.
    """
    hypotheses = []

    def extend(prefix, prefix_hash, log_prob):
        newest = prefix[-1] if prefix else START
        prefix_hash = next_hash(prefix_hash, newest)
        log_probs = log_softmax(table[len(prefix), prefix_hash])
        for token in sorted(set(range(VOCAB)) - set(never_emit)):
            if token == EOS and len(prefix) < min_length:
                continue
            tokens, total = prefix + [token], log_prob + log_probs[token]
            if token == EOS or len(tokens) == max_length:
                hypotheses.append((total / penalty(len(tokens), alpha), tokens))
            else:
                extend(tokens, prefix_hash, total)

    extend([], 0, 0.0)
    return sorted(hypotheses, key=lambda hypothesis: -hypothesis[0])


def greedy(table, max_length, alpha):
    """Argmax decoding of one row: `(score, tokens)`."""
    tokens, prefix_hash, log_prob = [], 0, 0.0
    while True:
        prefix_hash = next_hash(prefix_hash, tokens[-1] if tokens else START)
        log_probs = log_softmax(table[len(tokens), prefix_hash])
        token = int(np.argmax(log_probs))
        tokens.append(token)
        log_prob += log_probs[token]
        if token == EOS or len(tokens) == max_length:
            return log_prob / penalty(len(tokens), alpha), tokens


def reference_beam_search(table, beam_size, alpha, max_length, early_stopping):
    """One row's beam search in plain Python: `((score, tokens), steps run)` of the best hypothesis.

    The algorithm as `decoding`'s docstring states it: each step keeps the best
    `2 * beam_size` expansions of the alive beams; those ending in EOS or at `max_length`
    finish, the best `beam_size` others stay alive. Before each step, the search stops
    once the best finished score beats the best alive log-prob divided by the length
    penalty at the next length ("current_length"), or at the most favourable length it
    could still reach ("exact").
    """
    alive = [(0.0, [], 0)]  # (summed log-prob, tokens, prefix hash), best first
    finished = []  # (score, tokens)
    step = 0
    while step < max_length and alive:
        if finished:
            reachable = [step + 1] if early_stopping == "current_length" else [step + 1, max_length]
            if max(finished)[0] > alive[0][0] / max(penalty(n, alpha) for n in reachable):
                break
        candidates = []
        for log_prob, tokens, prefix_hash in alive:
            prefix_hash = next_hash(prefix_hash, tokens[-1] if tokens else START)
            log_probs = log_softmax(table[step, prefix_hash])
            candidates += [(log_prob + log_probs[t], tokens + [t], prefix_hash) for t in range(VOCAB)]
        candidates = sorted(candidates, key=lambda candidate: -candidate[0])[: 2 * beam_size]
        step += 1
        ends = [candidate[1][-1] == EOS or step == max_length for candidate in candidates]
        finished += [(c[0] / penalty(step, alpha), c[1]) for c, end in zip(candidates, ends) if end]
        alive = [c for c, end in zip(candidates, ends) if not end][:beam_size]
    return max(finished), step


def as_hypotheses(result, row):
    """`(score, tokens)` of each hypothesis of `row` in a `run_search` result with `n_best`."""
    return [
        (score, list(tokens[:length]))
        for tokens, length, score in zip(
            result.tokens[row], result.lengths[row], result.scores[row], strict=True
        )
    ]


# ---------------------------------------------------------------------------
# The core against brute force
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", ALPHAS)
def test_large_beam_returns_the_exact_n_best_of_brute_force(alpha):
    tables = make_tables(seed=0)
    n_best = 10
    result = run_search(tables, EXACT_BEAM, alpha, n_best=n_best)
    for row, max_length in enumerate(ROW_MAX_LENGTHS):
        expected = all_hypotheses(tables[row], max_length, alpha)[:n_best]
        found = as_hypotheses(result, row)[: len(expected)]
        assert [tokens for _, tokens in found] == [tokens for _, tokens in expected], (row, alpha)
        np.testing.assert_allclose(
            [s for s, _ in found], [s for s, _ in expected], rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("cache_lengths", [[1, 2, 3], [1, 3, 3], [2], [4]])
def test_a_cache_grown_in_segments_gives_the_exact_n_best_of_brute_force(cache_lengths):
    tables = make_tables(seed=5)
    for jit_compile in (False, True):
        result = run_search(
            tables, EXACT_BEAM, 0.6, n_best=10, jit_compile=jit_compile, cache_lengths=cache_lengths
        )
        for row, max_length in enumerate(ROW_MAX_LENGTHS):
            expected = all_hypotheses(tables[row], max_length, 0.6)[:10]
            found = as_hypotheses(result, row)[: len(expected)]
            assert [tokens for _, tokens in found] == [tokens for _, tokens in expected], row
            np.testing.assert_allclose(
                [s for s, _ in found], [s for s, _ in expected], rtol=1e-5, atol=1e-5
            )


def test_never_emitted_ids_are_left_out_of_the_exact_n_best_with_unchanged_scores():
    tables = make_tables(seed=6)
    never_emit = (START, 3)
    result = run_search(tables, EXACT_BEAM, 0.6, n_best=10, never_emit_ids=never_emit)
    for row, max_length in enumerate(ROW_MAX_LENGTHS):
        expected = all_hypotheses(tables[row], max_length, 0.6, never_emit)[:10]
        found = as_hypotheses(result, row)[: len(expected)]
        assert [tokens for _, tokens in found] == [tokens for _, tokens in expected], row
        np.testing.assert_allclose([s for s, _ in found], [s for s, _ in expected], rtol=1e-5, atol=1e-5)
        # Without the exclusion the best outputs of this table do use those ids.
        assert any(set(tokens) & set(never_emit) for _, tokens in all_hypotheses(tables[row], max_length, 0.6)[:10])


@pytest.mark.parametrize("min_length", [1, 2, tf.constant(2)])
def test_a_minimum_length_gives_the_exact_n_best_of_brute_force_without_an_early_eos(min_length):
    tables = make_tables(seed=8)
    result = run_search(tables, EXACT_BEAM, 0.6, n_best=10, min_length=min_length)
    min_length = int(min_length)
    for row, max_length in enumerate(ROW_MAX_LENGTHS):
        expected = all_hypotheses(tables[row], max_length, 0.6, min_length=min_length)[:10]
        found = as_hypotheses(result, row)[: len(expected)]
        assert [tokens for _, tokens in found] == [tokens for _, tokens in expected], row
        np.testing.assert_allclose([s for s, _ in found], [s for s, _ in expected], rtol=1e-5, atol=1e-5)
    # Without it, outputs that end too soon are among the best of these tables.
    unconstrained = [all_hypotheses(tables[row], n, 0.6)[:10] for row, n in enumerate(ROW_MAX_LENGTHS)]
    assert any(tokens[-1] == EOS and len(tokens) <= min_length for best in unconstrained for _, tokens in best)


def test_a_minimum_length_of_one_keeps_a_likely_first_eos_from_winning():
    # EOS is nearly certain at every step: the best output is EOS alone, and with
    # min_length=1 one token and then EOS; a row of maximum length 1 ends without EOS.
    tables = np.zeros((2, 40, HASH_MODULUS, VOCAB), "float32")
    tables[..., EOS] = 20.0
    unconstrained = run_search(tables, 4, 0.6, row_max_lengths=[40, 1])
    assert list(unconstrained.lengths) == [1, 1] and list(unconstrained.tokens[:, 0]) == [EOS, EOS]
    for jit_compile in (False, True):
        result = run_search(tables, 4, 0.6, row_max_lengths=[40, 1], min_length=1, jit_compile=jit_compile)
        assert list(result.lengths) == [2, 1]
        assert result.tokens[0, 0] != EOS and result.tokens[0, 1] == EOS and result.tokens[1, 0] != EOS


def test_a_cache_that_does_not_grow_is_too_short_for_the_history_scorer():
    # So the test above needs the growth: the scorer does not clamp a short cache.
    def search(**growth):
        return decoding.search(
            make_history_scorer(make_tables(seed=5)),
            tf.fill([1], START),
            {"history": tf.zeros([1, 1], tf.int32), "row": tf.range(1)},
            MAX_STEPS,
            eos_id=EOS,
            beam_size=4,
            alpha=0.6,
            **growth,
        )

    with pytest.raises(tf.errors.InvalidArgumentError, match="cache too short"):
        search()
    with pytest.raises(ValueError, match="extend_cache_fn"):
        search(cache_lengths=[1])


def test_an_xla_search_whose_rows_are_all_done_grows_its_cache_no_further():
    # Rows of at most 1 and 2 tokens in a buffer of 8: after the second step every row is
    # done, so of the segments [1, 2, 4, then 8] only the second needs its cache grown.
    # (In graph mode the done rows have left the batch: growing it costs nothing.)
    tables = make_tables_of([1, 2], seed=5)
    grown = tf.Variable(0)

    def counted_extend(cache, length):
        with tf.control_dependencies([grown.assign_add(1)]):
            return tf.nest.map_structure(tf.identity, extend_history(cache, length))

    @tf.function(jit_compile=True, autograph=False)
    def run():
        return decoding.search(
            make_history_scorer(tables),
            tf.fill([2], START),
            {"history": tf.zeros([2, 1], tf.int32), "row": tf.range(2)},
            8,
            eos_id=EOS,
            beam_size=4,
            alpha=0.6,
            row_max_lengths=tf.constant([1, 2]),
            n_best=4,
            cache_lengths=[1, 2, 4],
            extend_cache_fn=counted_extend,
        )

    result = tf.nest.map_structure(np.asarray, run())
    assert int(grown.numpy()) == 1
    for row, max_length in enumerate([1, 2]):
        expected = all_hypotheses(tables[row], max_length, 0.6)[:4]
        assert [tokens for _, tokens in as_hypotheses(result, row)] == [tokens for _, tokens in expected]


def test_doubling_cache_lengths_double_up_to_the_buffer_length():
    lengths = decoding.doubling_cache_lengths(tf.constant(100), first=8, doublings=5)
    assert [int(n) for n in lengths] == [8, 16, 32, 64, 100, 100]
    lengths = decoding.doubling_cache_lengths(tf.constant(1000), first=8, doublings=2)
    assert [int(n) for n in lengths] == [8, 16, 32]


def test_small_beams_are_not_exact_so_the_exact_test_means_something():
    tables = make_tables(seed=1)
    misses = 0
    for alpha in ALPHAS:
        result = run_search(tables, 2, alpha, n_best=1)
        for row, max_length in enumerate(ROW_MAX_LENGTHS):
            best_score, best_tokens = all_hypotheses(tables[row], max_length, alpha)[0]
            found_score, found_tokens = as_hypotheses(result, row)[0]
            assert found_score <= best_score + 1e-5  # never better than the optimum
            misses += found_tokens != best_tokens
    assert misses > 0


# Rows long enough for the early stops to differ; with these tables their results
# differ in some rows (checked below).
LONG_ROW_MAX_LENGTHS = [12, 12, 12, 8, 5]
EARLY_STOP_SEED = 23


@pytest.mark.parametrize("alpha", ALPHAS)
def test_each_early_stop_gives_the_steps_and_result_of_a_plain_python_beam_search(alpha):
    tables = make_tables_of(LONG_ROW_MAX_LENGTHS, seed=EARLY_STOP_SEED)
    for early_stopping in decoding.EARLY_STOPPING:
        batch = run_search(
            tables, 2, alpha, row_max_lengths=LONG_ROW_MAX_LENGTHS, early_stopping=early_stopping
        )
        for row, max_length in enumerate(LONG_ROW_MAX_LENGTHS):
            (score, tokens), steps = reference_beam_search(tables[row], 2, alpha, max_length, early_stopping)
            found_steps = tf.Variable(0)
            alone = run_search(
                tables[row : row + 1], 2, alpha, counter=found_steps,
                row_max_lengths=[max_length], early_stopping=early_stopping,
            )
            assert int(found_steps.numpy()) == steps, (early_stopping, row)
            # A row stopped early keeps its result while the batch's other rows go on.
            for result, index in ((alone, 0), (batch, row)):
                assert list(result.tokens[index, : result.lengths[index]]) == tokens, (early_stopping, row)
                np.testing.assert_allclose(result.scores[index], score, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("alpha", [0.6, 2.0])
def test_a_row_stops_as_early_beside_longer_rows_as_alone(alpha):
    """The exact stop bounds a row's alive beams by the penalty at its own maximum length, not at the batch's
    longest: a batch scores as many beams as its rows searched alone (each alone, as the test above checks
    against plain Python), and a short row stops before its maximum length, so the bound is what decides."""
    tables = make_tables_of(LONG_ROW_MAX_LENGTHS, seed=EARLY_STOP_SEED)
    scored_in_batch = tf.Variable(0)
    run_search(tables, 2, alpha, row_max_lengths=LONG_ROW_MAX_LENGTHS, scored=scored_in_batch)
    scored_alone, short_rows_stopped_early = 0, 0
    for row, max_length in enumerate(LONG_ROW_MAX_LENGTHS):
        scored, steps = tf.Variable(0), tf.Variable(0)
        run_search(tables[row : row + 1], 2, alpha, row_max_lengths=[max_length], scored=scored, counter=steps)
        scored_alone += int(scored.numpy())
        short_rows_stopped_early += max_length < max(LONG_ROW_MAX_LENGTHS) and int(steps.numpy()) < max_length
    assert short_rows_stopped_early
    assert int(scored_in_batch.numpy()) == scored_alone


@pytest.mark.parametrize("alpha", ALPHAS)
def test_the_current_length_stop_gives_the_same_best_and_steps_for_an_n_best_list(alpha):
    """Asking for 2 hypotheses must not change the best one (an export's two signatures)."""
    tables = make_tables_of(LONG_ROW_MAX_LENGTHS, seed=EARLY_STOP_SEED)
    for row, max_length in enumerate(LONG_ROW_MAX_LENGTHS):
        (score, tokens), steps = reference_beam_search(tables[row], 2, alpha, max_length, "current_length")
        found_steps = tf.Variable(0)
        result = run_search(
            tables[row : row + 1], 2, alpha, n_best=2, counter=found_steps,
            row_max_lengths=[max_length], early_stopping="current_length",
        )
        assert int(found_steps.numpy()) == steps, row
        best_score, best_tokens = as_hypotheses(result, 0)[0]
        assert best_tokens == tokens, row
        np.testing.assert_allclose(best_score, score, rtol=1e-5, atol=1e-5)


def test_the_current_length_stop_takes_fewer_steps_and_is_not_always_exact():
    # So that the test above compares two different rules.
    tables = make_tables_of(LONG_ROW_MAX_LENGTHS, seed=EARLY_STOP_SEED)
    fewer_steps = other_results = 0
    for alpha in ALPHAS:
        for row, max_length in enumerate(LONG_ROW_MAX_LENGTHS):
            exact, exact_steps = reference_beam_search(tables[row], 2, alpha, max_length, "exact")
            current, current_steps = reference_beam_search(tables[row], 2, alpha, max_length, "current_length")
            assert current_steps <= exact_steps
            fewer_steps += current_steps < exact_steps
            other_results += current[1] != exact[1]
    assert fewer_steps > 0 and other_results > 0


def test_an_unknown_early_stop_is_rejected():
    with pytest.raises(ValueError, match="early_stopping must be one of"):
        run_search(make_tables(0), 2, 0.6, early_stopping="never")


@pytest.mark.parametrize("alpha", ALPHAS)
def test_beam_of_one_is_greedy_argmax_decoding(alpha):
    tables = make_tables(seed=1)
    result = run_search(tables, 1, alpha)
    differs_from_optimum = 0
    for row, max_length in enumerate(ROW_MAX_LENGTHS):
        score, tokens = greedy(tables[row], max_length, alpha)
        assert list(result.tokens[row, : result.lengths[row]]) == tokens
        assert result.lengths[row] == len(tokens)
        np.testing.assert_allclose(result.scores[row], score, rtol=1e-5, atol=1e-5)
        differs_from_optimum += tokens != all_hypotheses(tables[row], max_length, alpha)[0][1]
    if alpha == 0.6:
        assert differs_from_optimum > 0


def test_beam_size_as_a_tensor_gives_the_same_hypotheses():
    tables = make_tables(seed=2)
    for beam_size in (1, 3, EXACT_BEAM):
        expected = run_search(tables, beam_size, 0.6, n_best=1)
        found = run_search(tables, tf.constant(beam_size), tf.constant(0.6), n_best=tf.constant(1))
        for name in ("tokens", "lengths", "scores"):
            np.testing.assert_array_equal(getattr(found, name), getattr(expected, name))


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_constant_beam_size_made_in_the_graph_searches_as_its_value(jit_compile):
    # Its value is known when tracing: the first beams' shape was static and the loop's
    # next one not, and the loop refused to run (a ValueError about shape invariants).
    tables = make_tables(seed=2)
    rows = len(tables)

    @tf.function(jit_compile=jit_compile, autograph=False)
    def run(beam_size, n_best):
        return decoding.search(
            make_scorer(tables), tf.fill([rows], START),
            {"hash": tf.zeros([rows], tf.int32), "row": tf.range(rows)}, MAX_STEPS,
            eos_id=EOS, beam_size=tf.constant(beam_size), alpha=0.6,
            row_max_lengths=tf.constant(ROW_MAX_LENGTHS), n_best=tf.constant(n_best),
        )

    exact = tf.nest.map_structure(np.asarray, run(EXACT_BEAM, 10))
    greedy_result = tf.nest.map_structure(np.asarray, run(1, 1))
    for row, max_length in enumerate(ROW_MAX_LENGTHS):
        expected = all_hypotheses(tables[row], max_length, 0.6)[:10]
        found = as_hypotheses(exact, row)[: len(expected)]
        assert [tokens for _, tokens in found] == [tokens for _, tokens in expected], row
        np.testing.assert_allclose([s for s, _ in found], [s for s, _ in expected], rtol=1e-5, atol=1e-5)
        score, tokens = greedy(tables[row], max_length, 0.6)
        assert as_hypotheses(greedy_result, row)[0][1] == tokens, row
        np.testing.assert_allclose(greedy_result.scores[row, 0], score, rtol=1e-5, atol=1e-5)


def test_xla_compiled_search_gives_the_same_hypotheses():
    tables = make_tables(seed=3)
    for beam_size in (1, 4):
        expected = run_search(tables, beam_size, 0.6, n_best=beam_size)
        compiled = run_search(tables, beam_size, 0.6, n_best=beam_size, jit_compile=True)
        np.testing.assert_array_equal(compiled.tokens, expected.tokens)
        np.testing.assert_allclose(compiled.scores, expected.scores, rtol=1e-6)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_batch_scores_each_row_only_until_its_search_is_over(beam_size):
    # Done rows leave the batch: a batch scores as many beams as its rows searched alone,
    # not every row for as many steps as its longest one.
    tables = make_tables(seed=6)
    scored_in_batch, scored_without_dropping = tf.Variable(0), tf.Variable(0)
    batch = run_search(tables, beam_size, 0.6, n_best=1, scored=scored_in_batch)
    kept = run_search(tables, beam_size, 0.6, n_best=1, scored=scored_without_dropping, drop_done_rows=False)
    scored_alone = 0
    for row, max_length in enumerate(ROW_MAX_LENGTHS):
        scored = tf.Variable(0)
        alone = run_search(tables[row : row + 1], beam_size, 0.6, n_best=1, row_max_lengths=[max_length], scored=scored)
        scored_alone += int(scored.numpy())
        for result in (batch, kept):
            np.testing.assert_array_equal(result.tokens[row, :, :max_length], alone.tokens[0, :, :max_length])
            np.testing.assert_allclose(result.scores[row], alone.scores[0], rtol=1e-6)
    assert int(scored_in_batch.numpy()) == scored_alone
    assert int(scored_without_dropping.numpy()) > scored_alone  # so the count means something


@pytest.mark.parametrize("halvings", [search_core.XLA_HALVINGS, 3])
@pytest.mark.parametrize("beam_size", [1, 3])
def test_under_xla_a_batch_halves_as_its_rows_finish(beam_size, halvings, monkeypatch):
    # XLA's shapes are fixed, so the batch halves (7 -> 4 -> 2 -> 1 rows with 3 halvings)
    # once at most half its rows are open; the hypotheses are the graph-mode search's.
    monkeypatch.setattr(search_core, "XLA_HALVINGS", halvings)
    tables = make_tables(seed=6)
    scored_halving, scored_kept, scored_alone = tf.Variable(0), tf.Variable(0), tf.Variable(0)
    expected = run_search(tables, beam_size, 0.6, n_best=1, scored=scored_alone)  # graph mode: rows leave one by one
    halving = run_search(tables, beam_size, 0.6, n_best=1, scored=scored_halving, jit_compile=True)
    kept = run_search(tables, beam_size, 0.6, n_best=1, scored=scored_kept, jit_compile=True, drop_done_rows=False)
    for result in (halving, kept):
        np.testing.assert_array_equal(result.tokens, expected.tokens)
        np.testing.assert_allclose(result.scores, expected.scores, rtol=1e-6)
    assert int(scored_alone.numpy()) < int(scored_halving.numpy()) < int(scored_kept.numpy())
    if halvings == 3:  # down to one row: every step scores fewer than twice the open rows' beams
        assert int(scored_halving.numpy()) < 2 * int(scored_alone.numpy())


def full_top_k(log_probs, alive_log_probs, k):
    """The definition `_best_candidates` must meet: one top-k over every beam's every token."""
    vocab_size = log_probs.shape[-1]
    scores = alive_log_probs[:, :, None] + log_probs
    best, index = tf.math.top_k(tf.reshape(scores, [scores.shape[0], -1]), k=k)
    return best, index // vocab_size, index % vocab_size


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize(
    "beam_size, vocab_size", [(4, 4000), (4, 100), (1, 37), (16, 64), (3, VOCAB), (4, 33)]
)
def test_the_chunked_candidate_top_k_is_a_full_top_k_ties_included(beam_size, vocab_size, jit_compile):
    # Ties from rounded scores and repeated beams, blocked ids, beams not yet opened,
    # vocabularies smaller than a chunk, not a multiple of it, and one chunk plus one id.
    rng = np.random.default_rng(vocab_size + beam_size)
    rows, k = 6, search_core._num_candidates(beam_size)
    log_probs = np.round(rng.normal(size=(rows, beam_size, vocab_size)), 1).astype("float32")
    log_probs[1] = log_probs[1, :1]  # every beam of row 1 alike
    log_probs[2, :, :: max(2, vocab_size // 5)] = search_core.NEG_INF
    log_probs[3] = 0.0  # all tied
    alive = np.round(rng.normal(size=(rows, beam_size)), 1).astype("float32")
    alive[1] = alive[1, 0]
    alive[4, 1:] = search_core.NEG_INF  # only the first beam open, as at the first step
    args = (tf.constant(log_probs), tf.constant(alive))
    found = tf.function(lambda lp, a: search_core._best_candidates(lp, a, k), jit_compile=jit_compile)(*args)
    for name, got, expected in zip(("scores", "beams", "tokens"), found, full_top_k(*args, k), strict=True):
        np.testing.assert_array_equal(got, expected, err_msg=name)


def test_the_chunked_candidate_top_k_takes_shapes_known_only_when_run():
    rng = np.random.default_rng(0)
    log_probs = tf.constant(np.round(rng.normal(size=(3, 4, 70)), 1).astype("float32"))
    alive = tf.constant(np.round(rng.normal(size=(3, 4)), 1).astype("float32"))
    unknown = tf.TensorSpec([None, None, None], tf.float32), tf.TensorSpec([None, None], tf.float32)
    found = tf.function(
        lambda lp, a: search_core._best_candidates(lp, a, tf.constant(8)), input_signature=unknown
    )(log_probs, alive)
    for got, expected in zip(found, full_top_k(log_probs, alive, 8), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_search_stops_once_no_alive_beam_can_win():
    # EOS is nearly certain first: the 1-token output wins against anything longer,
    # even with the length penalty of the longest output the alive beams could reach.
    tables = np.zeros((1, 40, HASH_MODULUS, VOCAB), "float32")
    tables[..., EOS] = 20.0
    steps = tf.Variable(0)
    result = run_search(tables, 4, 0.6, counter=steps, row_max_lengths=[40])
    assert list(result.tokens[0, : result.lengths[0]]) == [EOS]
    assert int(steps.numpy()) == 1

    # Without a likely EOS, the search runs to the maximum length.
    steps.assign(0)
    tables[..., EOS] = -20.0
    result = run_search(tables, 4, 0.6, counter=steps, row_max_lengths=[40])
    assert int(steps.numpy()) == 40
    assert result.lengths[0] == 40


def test_on_an_exact_tie_the_hypothesis_that_finished_first_comes_first():
    """P(EOS) = 1/4 at step 1 and P(2) * P(EOS | 2) = 1/2 * 1/2 at step 2: with alpha 0 the two outputs score
    exactly alike, and the older one is kept ahead (documented: the merge lists older hypotheses first)."""
    tables = np.full((1, 3, HASH_MODULUS, VOCAB), -1e9, "float32")
    tables[0, 0, :, [2, EOS, 3]] = np.log([2.0, 1.0, 1.0])[:, None]
    tables[0, 1, :, [EOS, 4]] = 0.0
    tables[0, 2, :, EOS] = 0.0
    both = run_search(tables, 2, 0.0, n_best=2, row_max_lengths=[3])
    assert both.scores[0, 0] == both.scores[0, 1] == np.float32(np.log(0.25))  # the tie is exact
    assert [list(both.tokens[0, k, : both.lengths[0, k]]) for k in range(2)] == [[EOS], [2, EOS]]
    best = run_search(tables, 2, 0.0, n_best=1, row_max_lengths=[3])
    assert list(best.tokens[0, 0, : best.lengths[0, 0]]) == [EOS]


def test_more_slots_than_outputs_leaves_empty_slots_and_no_nan():
    tables = make_tables(seed=4)[:1]
    result = run_search(tables, 8, 0.6, n_best=8, row_max_lengths=[1])  # only VOCAB outputs exist
    expected = all_hypotheses(tables[0], 1, 0.6)
    assert [tokens for _, tokens in as_hypotheses(result, 0)[:VOCAB]] == [t for _, t in expected]
    assert not np.isnan(result.scores).any()
    np.testing.assert_array_equal(result.scores[0, VOCAB:], decoding.NEG_INF)
    np.testing.assert_array_equal(result.lengths[0, VOCAB:], 0)
    np.testing.assert_array_equal(result.tokens[0, VOCAB:], PAD_ID)


def test_an_empty_batch_decodes_to_nothing():
    result = run_search(
        np.zeros((0, MAX_STEPS, HASH_MODULUS, VOCAB), "float32"), 4, 0.6, row_max_lengths=[]
    )
    assert result.tokens.shape[0] == 0 and result.scores.shape == (0,)


def test_invalid_beam_settings_are_rejected():
    with pytest.raises(ValueError, match="beam_size"):
        run_search(make_tables(0), 0, 0.6)
    with pytest.raises(ValueError, match="n_best"):
        run_search(make_tables(0), 2, 0.6, n_best=3)
