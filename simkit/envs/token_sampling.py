"""Monte Carlo for the token MDP at scale: vectorised sampling and streaming gradient accumulation.

The environment is a :class:`simkit.envs.token_mdp.TokenMDP` (or anything with the same data
model: ``logits`` (T, P, V), ``transition`` (S, V), ``policy_index`` (S,), ``reward`` (S,),
``eos``, ``initial_state``, ``pi`` and ``J()``). Two functions do the heavy lifting of every
Monte Carlo experiment on it.

:func:`sample_tokens` draws N = n·reps sequences y ~ μ at once. The only Python loop is over the
T positions; at position t every sequence is advanced together:

1. its policy class p = ``policy_index[s_t]`` (s_t the automaton state, shape (N,));
2. one uniform u ~ U[0, 1) per sequence, turned into a token by inverse-CDF sampling,
   y_t = #{v : F_{t,p}(v) ≤ u} with F_{t,p} the cumulative distribution of μ[t, p, :]. The count
   is a branchless binary search run on all N sequences at once: log₂V levels, each one gather
   from the CDF entries that level reads (stored level by level, so the next index is twice
   the current one plus the comparison bit), one comparison and two additions. No N×V array is
   ever built, and a token of μ-probability 0 can never be drawn (its CDF step is flat);
3. the log-ratio log π(y_t|t, p) − log μ(y_t|t, p) gathered from the (P, V) table of position t
   (log π is the log-softmax of the logits, computed in log space);
4. the automaton update s_{t+1} = ``transition[s_t, y_t]``; with ``eos`` set, a sequence that has
   emitted it is finished: its later positions are padding (action 0, log-ratio 0, mask False,
   state frozen at the final state).

The reward is ``reward[s_L]``, of the final automaton state. Memory: the batch itself, O(N·T),
plus O(B·(N + S·V)) of buffers for blocks of B = 16 positions (tables of a block are built at
once, one row per automaton state while B·S·V stays under 4 Mi entries, else one per policy
class, P·V; sampled positions are written to the (N, T) outputs a block at a time). Uniforms
come from ``rng`` (N per position, in order), so the same seed gives the same batch.

:func:`accumulate_tokens` forms Σ_{i,t} λ_{i,t} ∇θ log π(y_{i,t}|t, s_{i,t}) without per-sequence
gradient vectors. For softmax logits θ_{t,p,:}, ∇ log π(v|t, p) = e_v − π[t, p, :] in the block
(t, p) and 0 elsewhere (softmax score function; e.g. Sutton & Barto 2018, eq. 13.9), so

    G[t, p, v] = Σ_{i,t: (t, p_{i,t}, y_{i,t}) = (t, p, v)} λ_{i,t}  −  π[t, p, v] · Λ[t, p],
    Λ[t, p]    = Σ_{i: p_{i,t} = p} λ_{i,t} = Σ_v (first term)[t, p, v],

one weighted ``np.bincount`` over the flat indices (t·P + p)·V + y plus a (T, P, V) correction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from simkit._validation import as_prob, positive_int

__all__ = ["TokenBatch", "accumulate_tokens", "padding_mask", "sample_tokens", "token_states"]

#: positions sampled between two writes into the (N, T) outputs
_BLOCK_POSITIONS = 16
#: CDF value that pads a vocabulary row up to a power of two (never ≤ a uniform in [0, 1))
_CDF_PAD = 2.0
#: rows per vocabulary entry above which CDFs are summed column by column (see _cdf_tables)
_COLUMN_CUMSUM_ROWS_PER_TOKEN = 16
#: largest (block, S, V_pad) table for which sampling uses per-state rather than per-class rows
_STATE_TABLE_BYTES = 1 << 25


@dataclass(frozen=True, eq=False)
class TokenBatch:
    """One or ``reps`` batches of ``n`` sequences y ~ μ from a token MDP, with oracle values.

    Shapes (``L`` = ``()`` for one batch, ``(reps,)`` for independent batches):

    - ``actions`` (L..., n, T) int32 tokens, 0 on padding (after EOS);
    - ``mask`` (L..., n, T) bool, True on the tokens of the sequence (EOS included);
    - ``log_ratio`` (L..., n, T) float64 = log π(y_t|t, s_t) − log μ(y_t|t, s_t), 0 on padding;
    - ``states`` (L..., n, T) int32, the automaton state s_t at which token t was emitted (the
      final state on padding);
    - ``lengths`` (L..., n) int, number of tokens (= ``mask.sum(-1)``);
    - ``rewards`` (L..., n) float64, R = ``reward[final state]``;
    - ``J`` the exact J(π), computed on first access (``env.J()``; the trainer never reads it,
      so a draw does not pay a DP over (T, S, V)); ``mu`` (T, P, V) the behaviour policy;
      ``grad_J`` (D,) the exact
      ∇θ J(π), computed on first access (``env.grad_J()``); ``J_mu`` the exact J(μ) (baseline
      of the ``oracle`` advantage), computed on first access (``env.J(mu)``).
    """

    actions: np.ndarray
    mask: np.ndarray
    rewards: np.ndarray
    log_ratio: np.ndarray
    lengths: np.ndarray
    states: np.ndarray
    mu: np.ndarray = field(repr=False)
    env: object = field(repr=False)

    @property
    def n(self) -> int:
        """Sequences per batch."""
        return int(self.actions.shape[-2])

    @property
    def reps(self) -> int | None:
        """Number of independent batches (``None`` for a single unbatched draw)."""
        return int(self.actions.shape[0]) if self.actions.ndim == 3 else None

    @property
    def T(self) -> int:
        """Maximum sequence length (positions per row)."""
        return int(self.actions.shape[-1])

    @cached_property
    def J(self) -> float:
        """Exact J(π) of the environment (``env.J()``, computed once, on first access)."""
        return float(self.env.J())

    @cached_property
    def grad_J(self) -> np.ndarray:
        """Exact ∇θ J(π) of the environment, shape (D,) (computed once, on first access)."""
        return self.env.grad_J()

    @cached_property
    def J_mu(self) -> float:
        """Exact J(μ) of the behaviour that drew the batch (computed once, on first access)."""
        return float(self.env.J(self.mu))


# --- helpers --------------------------------------------------------------------------------


def _model(env):
    """(logits (T, P, V), transition (S, V), policy_index (S,), reward (S,), eos, s0)."""
    logits = np.asarray(env.logits, dtype=np.float64)
    transition = np.asarray(env.transition)
    policy_index = np.asarray(env.policy_index)
    reward = np.asarray(env.reward, dtype=np.float64)
    if logits.ndim != 3:
        raise ValueError(f"env.logits must have shape (T, P, V), got {logits.shape}")
    return logits, transition, policy_index, reward, env.eos, int(env.initial_state)


def _check_behaviour(mu, shape: tuple[int, ...], name: str = "mu") -> np.ndarray:
    arr = as_prob(mu, name)
    if arr.shape != shape:
        raise ValueError(
            f"{name} must have the shape (T, P, V) = {shape} of env.logits, got {arr.shape}"
        )
    return arr


def _cdf_tables(mu_block: np.ndarray, V_pad: int) -> np.ndarray:
    """CDFs of the rows of ``mu_block`` (B, P, V), last entry exactly 1, padded: (B, P·V_pad).

    Each row is renormalised by its total (so F(V−1) = 1 exactly even when the row sums to
    1 ± 1e-9) and padded with :data:`_CDF_PAD` up to ``V_pad`` (a power of two).
    """
    B, P, V = mu_block.shape
    table = np.full((B, P, V_pad), _CDF_PAD)
    if B * P >= _COLUMN_CUMSUM_ROWS_PER_TOKEN * V:
        # many short rows: V − 1 additions of whole columns (vocabulary-major copy) beat a
        # per-row cumsum; the same left-to-right sums F(v) = F(v−1) + μ(v), so the same bits
        cols = np.ascontiguousarray(np.moveaxis(mu_block, -1, 0))  # (V, B, P)
        for v in range(1, V):
            np.add(cols[v - 1], cols[v], out=cols[v])
        table[..., :V] = np.moveaxis(cols, 0, -1)
    else:
        np.cumsum(mu_block, axis=-1, out=table[..., :V])
    table[..., :V] /= table[..., V - 1 : V]
    return table.reshape(B, P * V_pad)


def _search_levels(cdf_rows: np.ndarray, V_pad: int) -> list[np.ndarray]:
    """The CDF values a binary search reads, one array per level: (..., R, V_pad) -> K arrays.

    A search over a row of V_pad = 2^K entries reads, at level ℓ = 0 … K−1, the entry
    F(r, (2i + 1)·h − 1) with h = V_pad / 2^(ℓ+1) and i < 2^ℓ the bits found so far. Level ℓ
    stores these entries as (..., R·2^ℓ) with index r·2^ℓ + i (row-major), so that the index of
    the next level is twice the current one plus the comparison bit (:func:`_inverse_cdf`).
    Together the levels are a permutation of the entries of ``cdf_rows`` but the last of each
    row (never read: F(V−1) = 1 or padding). The early levels are small (R, 2R, …), so most
    gathers of a search hit a few cache lines.
    """
    lead = cdf_rows.shape[:-1]
    levels = []
    h = V_pad // 2
    while h:
        width = V_pad // (2 * h)  # 2^ℓ
        level = cdf_rows.reshape(*lead, width, 2 * h)[..., h - 1]  # (..., R, 2^ℓ)
        levels.append(np.ascontiguousarray(level).reshape(*lead[:-1], -1))
        h //= 2
    return levels


def _inverse_cdf(levels, rows: np.ndarray, u: np.ndarray, work=None) -> np.ndarray:
    """Flat indices r·V_pad + #{v : F(r, v) ≤ u} by a branchless binary search (all at once).

    ``levels`` the K = log₂V_pad arrays of :func:`_search_levels` for one position (each 1-D);
    ``rows`` (N,) intp, the CDF row r of each sequence; ``u`` (N,) uniforms in [0, 1). At
    level ℓ the index g = r·2^ℓ + i reads the entry that splits the remaining 2h tokens in
    half; g ← 2g + [F ≤ u]. After K levels g = r·2^K + i with i the count of entries ≤ u.
    These are the comparisons, in the same order, of a binary search with steps V_pad/2, …, 1
    on the row (this module's search before the level layout), so the draws are the same;
    the layout only saves the row-offset arithmetic and keeps early gathers in a few cache
    lines. Since F(V−1) = 1 > u the
    count never passes the last real token, and a token with μ = 0 (a flat step,
    F(v) = F(v−1)) is never returned. Every index read lies in its level (g < R·2^ℓ), so the
    gathers use ``mode="clip"`` (no bounds check; it never clips). ``work`` = (float (N,),
    bool (N,), intp (N,)) scratch buffers, so that the search allocates nothing; the result is
    the third (a new array when ``work`` is None).
    """
    if work is None:
        work = (np.empty(u.shape), np.empty(u.shape, dtype=bool), np.empty(u.shape, dtype=np.intp))
    f, le, g = work
    if not levels:  # V_pad = 1: the only token
        np.copyto(g, rows)
        return g
    levels[0].take(rows, out=f, mode="clip")  # in range: see above
    np.less_equal(f, u, out=le)
    np.add(rows, rows, out=g)
    np.add(g, le, out=g)
    for level in levels[1:]:
        level.take(g, out=f, mode="clip")
        np.less_equal(f, u, out=le)
        np.add(g, g, out=g)
        np.add(g, le, out=g)
    return g


# --- sampling -------------------------------------------------------------------------------


def sample_tokens(env, mu, n: int, rng: np.random.Generator, reps: int | None = None) -> TokenBatch:
    """Draw ``reps`` independent batches (or one if ``reps`` is None) of ``n`` sequences y ~ μ.

    Vectorised over the N = n·reps sequences, looping over positions only (module docstring):
    per position one uniform per sequence, inverse-CDF sampling from μ[t, policy_index[s_t], :]
    by binary search, the log-ratio log π − log μ gathered from a (P, V) table, the automaton
    update ``transition[s, y]`` and EOS handling. Nothing of size N×V or N×T×V is built.

    Parameters
    ----------
    env : TokenMDP (its data model: ``logits``, ``transition``, ``policy_index``, ``reward``,
        ``eos``, ``initial_state``, ``J()``, ``grad_J()``).
    mu : (T, P, V) behaviour probabilities (validated: non-negative, rows sum to one).
    n : sequences per batch; ``reps``: number of independent batches (None: one batch).
    rng : ``numpy.random.Generator``; the same seed gives the same batch.

    Returns a :class:`TokenBatch` with arrays of shape (n, T) or (reps, n, T).
    """
    logits, transition, policy_index, reward, eos, s0 = _model(env)
    T, P, V = logits.shape
    mu = _check_behaviour(mu, (T, P, V))
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    n = positive_int(n, "n")
    lead = () if reps is None else (positive_int(reps, "reps"),)
    N = n * (lead[0] if lead else 1)

    V_pad = 1 << max(V - 1, 0).bit_length()  # smallest power of two >= V
    S = policy_index.shape[0]
    # Per-state tables (rows copied from the state's policy class, so values are identical):
    # the CDF row of a sequence is then its state s (no gather) and the next state is one
    # gather at the sampled flat index. Used when the (block, S, V_pad) tables stay small;
    # otherwise per-class tables with the row policy_index[s] and next state transition[s, y].
    block = min(T, _BLOCK_POSITIONS)
    per_state = S * V_pad * block * 8 <= _STATE_TABLE_BYTES
    identity = S == P and np.array_equal(policy_index, np.arange(S))  # rows are already per state
    if per_state:
        next_pad = np.zeros((S, V_pad), dtype=np.intp)
        next_pad[:, :V] = transition
        next_pad = next_pad.ravel()
    else:
        row_of_state = policy_index.astype(np.intp)
        next_state = transition.astype(np.intp).ravel()

    fixed_length = eos is None
    alloc = np.empty if fixed_length else np.zeros  # with EOS, padding stays 0 / False
    actions = alloc((N, T), dtype=np.int32)
    states = np.empty((N, T), dtype=np.int32)
    log_ratio = alloc((N, T), dtype=np.float64)
    mask = np.ones((N, T), dtype=bool) if fixed_length else np.zeros((N, T), dtype=bool)
    lengths = np.full(N, T, dtype=np.intp)
    s = np.full(N, s0, dtype=np.intp)
    s_next = np.empty(N, dtype=np.intp)  # fixed length: the next states, swapped with s
    alive = np.ones(N, dtype=bool)
    # fixed length: every position draws its N uniforms, so a block draws them at once (the
    # same stream, in the same order); with EOS, drawing stops when every sequence has ended
    u_block = np.empty((block if fixed_length else 1, N))
    rows = np.empty(N, dtype=np.intp)
    work = (np.empty(N), np.empty(N, dtype=bool), np.empty(N, dtype=np.intp))
    token_bits = V_pad - 1  # the token is the low log₂V_pad bits of the flat index
    # positions are produced time-major into (block, N) buffers, then written block by block
    # into the (N, T) outputs (contiguous runs per row instead of one strided column per step)
    buf_y = np.empty((block, N), dtype=np.int32)
    buf_s = np.empty((block, N), dtype=np.int32)
    buf_lr = np.empty((block, N))
    buf_m = np.empty((block, N), dtype=bool)

    done = T
    with np.errstate(divide="ignore"):
        for t0 in range(0, T, block):
            t1 = min(t0 + block, T)
            cdf = _cdf_tables(mu[t0:t1], V_pad)
            lr_tables = (np.empty if V == V_pad else np.zeros)((t1 - t0, P, V_pad))
            # log π − log μ, +inf where μ = 0 (such tokens are never drawn); log π is the
            # log-softmax (logits − max) − log Σ exp(logits − max), computed in place
            lr = lr_tables[..., :V]
            lg = logits[t0:t1]
            np.subtract(lg, lg.max(axis=-1, keepdims=True), out=lr)
            lr -= np.log(np.exp(lr).sum(axis=-1, keepdims=True))
            lr -= np.log(mu[t0:t1])
            if per_state and not identity:
                cdf = cdf.reshape(t1 - t0, P, V_pad)[:, policy_index]
                lr_tables = lr_tables[:, policy_index].reshape(t1 - t0, -1)
            else:
                lr_tables = lr_tables.reshape(t1 - t0, P * V_pad)
            levels = _search_levels(cdf.reshape(t1 - t0, -1, V_pad), V_pad)
            if fixed_length:
                rng.random(out=u_block[: t1 - t0])
            for j in range(t1 - t0):
                if fixed_length:
                    u = u_block[j]
                else:
                    u = u_block[0]
                    rng.random(out=u)
                if per_state:
                    row = s
                else:
                    row = row_of_state.take(s, out=rows)
                k = _inverse_cdf([level[j] for level in levels], row, u, work)
                buf_s[j] = s
                if fixed_length:
                    y = buf_y[j]
                    np.bitwise_and(k, token_bits, out=y, casting="unsafe")  # token < V: int32
                    lr_tables[j].take(k, out=buf_lr[j], mode="clip")
                    if per_state:
                        s, s_next = next_pad.take(k, out=s_next, mode="clip"), s
                    else:
                        s = next_state.take(s * V + y)
                    continue
                y = k & token_bits
                buf_m[j] = alive
                y *= alive
                buf_y[j] = y
                np.multiply(lr_tables[j].take(k), alive, out=buf_lr[j])
                nxt = next_pad.take(k, mode="clip") if per_state else next_state.take(s * V + y)
                s = np.where(alive, nxt, s)
                ended = alive & (y == eos)
                lengths[ended] = t0 + j + 1
                alive &= ~ended
                if not alive.any():
                    done = t0 + j + 1
                    break
            t_end = min(t1, done)
            actions[:, t0:t_end] = buf_y[: t_end - t0].T
            states[:, t0:t_end] = buf_s[: t_end - t0].T
            log_ratio[:, t0:t_end] = buf_lr[: t_end - t0].T
            if not fixed_length:
                mask[:, t0:t_end] = buf_m[: t_end - t0].T
            if done < T:
                states[:, done:] = s[:, None]  # padding: the final state
                break
    rewards = reward.take(s)
    shape = (*lead, n)
    return TokenBatch(
        actions=actions.reshape(*shape, T),
        mask=mask.reshape(*shape, T),
        rewards=rewards.reshape(shape),
        log_ratio=log_ratio.reshape(*shape, T),
        lengths=lengths.reshape(shape),
        states=states.reshape(*shape, T),
        mu=mu,
        env=env,
    )


# --- states, padding and accumulation -------------------------------------------------------


def _check_actions(actions, T: int, V: int) -> np.ndarray:
    y = np.asarray(actions)
    if y.ndim < 2 or y.shape[-1] != T:
        raise ValueError(f"actions must have shape (..., n, T) with T = {T}, got {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"actions must be integer token indices, got dtype {y.dtype}")
    if y.size and (y.min() < 0 or y.max() >= V):
        raise ValueError(f"actions must lie in [0, V) = [0, {V}), got min {y.min()}, max {y.max()}")
    return y


def token_states(env, actions) -> np.ndarray:
    """Automaton state s_t at which each token of ``actions`` (..., n, T) was emitted.

    s_0 = ``initial_state``, s_{t+1} = ``transition[s_t, y_t]``; after a sequence's EOS the
    state is frozen (its final state), as in :func:`sample_tokens`. Loops over the T positions,
    vectorised over sequences. Returns int32 (..., n, T).
    """
    logits, transition, _, _, eos, s0 = _model(env)
    T, _, V = logits.shape
    y = _check_actions(actions, T, V)
    flat = y.reshape(-1, T)
    N = flat.shape[0]
    next_state = transition.astype(np.intp).ravel()
    out = np.empty(flat.shape, dtype=np.int32)
    s = np.full(N, s0, dtype=np.intp)
    alive = np.ones(N, dtype=bool)
    block = min(T, _BLOCK_POSITIONS)
    buf = np.empty((block, N), dtype=np.int32)
    for t0 in range(0, T, block):
        t1 = min(t0 + block, T)
        y_block = np.ascontiguousarray(flat[:, t0:t1].T, dtype=np.intp)  # (t1 − t0, N)
        for j in range(t1 - t0):
            buf[j] = s
            if eos is None:
                s = next_state.take(s * V + y_block[j])
            else:
                s = np.where(alive, next_state.take(s * V + y_block[j]), s)
                alive &= y_block[j] != eos
        out[:, t0:t1] = buf[: t1 - t0].T
    return out.reshape(y.shape)


def padding_mask(env, actions) -> np.ndarray:
    """True on the tokens of each sequence: every position up to and including the first EOS.

    All True when ``env.eos`` is None (fixed length T). ``actions`` (..., T) -> bool (..., T).
    """
    y = np.asarray(actions)
    if env.eos is None:
        return np.ones(y.shape, dtype=bool)
    is_eos = y == env.eos
    before = np.cumsum(is_eos, axis=-1, dtype=np.int32) - is_eos  # EOS strictly before t
    return before == 0


def accumulate_tokens(env, actions, token_weights, states=None, mask=None) -> np.ndarray:
    """Σ_{i,t} λ_{i,t} ∇θ log π(y_{i,t} | t, s_{i,t}), shape (L..., D), D = T·P·V (C order).

    With softmax logits, ∇ log π(v | t, p) w.r.t. ``logits[t, p, :]`` is e_v − π[t, p, :]
    (softmax score function, Sutton & Barto 2018 eq. 13.9), hence

        G[t, p, v] = Σ λ over the tokens emitted at (t, p) equal to v − π[t, p, v]·Λ[t, p],

    with Λ[t, p] the sum of λ over every token emitted at (t, p): one weighted bincount over
    the flat indices (t·P + p_{i,t})·V + y_{i,t} (plus an offset per leading batch) and a
    (L..., T, P, V) correction. No per-sequence gradient vector is formed.

    Parameters
    ----------
    env : TokenMDP.
    actions : (L..., n, T) integer tokens; leading axes L are independent batches.
    token_weights : (L..., n, T) weights λ (e.g. ``Estimator.token_weights``).
    states : (L..., n, T) automaton states s_{i,t} (e.g. ``TokenBatch.states``); recomputed
        from the actions (:func:`token_states`, a loop over T) when None.
    mask : (L..., n, T) bool, the tokens to include. Default: :func:`padding_mask` (positions
        after a sequence's EOS are padding and never contribute, whatever λ is there).
    """
    logits, _, policy_index, _, eos, _ = _model(env)
    T, P, V = logits.shape
    y = _check_actions(actions, T, V)
    lam = np.asarray(token_weights, dtype=np.float64)
    if lam.shape != y.shape:
        raise ValueError(f"token_weights must have the shape of actions {y.shape}, got {lam.shape}")
    if states is None:
        states = token_states(env, y)
    else:
        states = np.asarray(states)
        if states.shape != y.shape or not np.issubdtype(states.dtype, np.integer):
            raise ValueError(
                f"states must be integer automaton states of the shape of actions {y.shape}, "
                f"got {states.dtype} {states.shape}"
            )
    if mask is None and eos is not None:
        mask = padding_mask(env, y)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.shape != y.shape:
            raise ValueError(f"mask must have the shape of actions {y.shape}, got {mask.shape}")
        lam = np.where(mask, lam, 0.0)

    D = T * P * V
    lead = y.shape[:-2]
    B = math.prod(lead)
    # flat index (b·T + t)·P·V + p·V + y, built in place in one int array
    idx = (policy_index.astype(np.intp) * V).take(states)
    idx += y
    idx += np.arange(T, dtype=np.intp) * (P * V)
    if B > 1:
        idx = idx.reshape(B, -1)
        idx += (np.arange(B, dtype=np.intp) * D)[:, None]
    counts = np.bincount(idx.ravel(), weights=lam.ravel(), minlength=B * D)
    grad = counts.reshape(B, T, P, V)
    pi = np.asarray(env.pi, dtype=np.float64).reshape(T, P, V)
    grad -= pi * grad.sum(axis=-1, keepdims=True)
    return grad.reshape(*lead, D)
