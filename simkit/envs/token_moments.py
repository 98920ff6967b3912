"""Exact mean **and second moment** of per-sample estimators on a token MDP, by DP at any T.

One sample y ~ μ contributes (untied parameters θ[t, p, :], one block per position)

    h = a · A · Σ_t c_t ∇θ log π(y_t | t, s_t),     A = R − b,  a = 1/Z (deterministic),

and an n-sample estimator with a deterministic per-sample Z is ĝ = (1/n) Σ_i h_i, so
E ĝ = E h and Var ĝ = (E‖h‖² − ‖E h‖²)/n. Because the blocks of different positions are
disjoint and position t holds one token, the squared norm has no cross terms:

    ‖h‖² = a² A² Σ_t c_t² N_t(s_t, y_t),
    N_t(s, v) = ‖e_v − π_t(·|s)‖² = 1 − 2π_t(v|s) + Σ_u π_t(u|s)²

(the softmax score). Two families of coefficients have a dynamic programme:

- **token level**, c_t = φ(r_t, sign A) (:func:`token_level_moments`): expectations are under μ,
  with the forward occupancy d^μ_t(s) and backward values of the terminal functions
  A^k·1{±A ≥ 0} (k = 0, 1, 2; the sign split is exact because A is a function of the final state):

      E h block (t, p)  = a Σ_{s∈p} Σ_v d_t(s) μ_t(v|s) (φ₊ Q¹⁺ + φ₋ Q¹⁻)(s, v) (e_v − π_t(·|s))
      E‖h‖²            = a² Σ_t Σ_{s,v} d_t(s) μ_t(v|s) N_t(s, v) (φ₊² Q²⁺ + φ₋² Q²⁻)(s, v)

  with Q^{k±}_t(s, v) = E_μ[A^k 1{±} | prefix in s at t, y_t = v].
- **product form**, c_t = φ(W) = Π_u κ_u for every t with κ = r^α (:func:`sequence_moments`:
  sequence IS, α = 1, and ``power``, α ∈ [0, 1]): the coefficient is a product over positions,
  so μ·c and μ·c² are again products of per-token kernels K¹ = μ·r^α (= π for IS) and
  K² = μ·r^{2α} (= π²/μ for IS, the *W²-weighted* kernel). Forward F^{(j)} and backward
  values with kernel K^j replace d^μ and the μ-values:

      E h block (t, p) = a Σ_{s∈p} Σ_v F¹_t(s) K¹_t(s, v) Q¹_t(s, v) (e_v − π_t(·|s)),  terminal A
      E‖h‖²           = a² Σ_t Σ_{s,v} F²_t(s) K²_t(s, v) N_t(s, v) Q²_t(s, v),         terminal A²

  (E_μ[W²·f] = Σ_y π(y)²/μ(y)·f(y) grows like (1 + χ²)^T: every forward and backward vector is
  rescaled at each step and the scales are kept as logarithms, so T = 4096 neither overflows
  nor underflows unless the moment itself exceeds the float range, where it is inf.)

- **composed** (three policies, :func:`composed_moments`): c_t = g_t·Π_u κ_u where g_t is a
  product of per-token factors (token-level mappings on π/π_old, corrections on π_old/μ) and κ
  a product form (is_seq, power on either leg): the product-form sweeps with K¹ = μ·κ,
  K² = μ·κ² and the token-level sign split of g. Sequence truncations/masks (tis_seq, mis_seq),
  geometric ratios, VESPO and TRL's VESPO composition have no such form (Monte Carlo there).

The ESS columns need E Σ_t |c_t|, E Σ_t c_t² (the same sweeps with terminals 1{±}) and E|y|.
Tokens with μ = 0 are never drawn (their kernels are 0). ``phi`` is the exact formula: the
``max_log_ratio`` clamp of ``Mapping.coefficients`` (log W ≤ 80) is not applied — on the
enumeration path it only matters for sequences with W > e^80.

Cost: O(T·S·V) per sweep, a few sweeps (no T·S·V array is stored beyond π and μ themselves).
Checked against enumeration to 1e-10 in ``tests/test_token_moments.py``; timed at S = V = 64,
T = 4096 in ``benchmarks/bench_token_dp.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simkit.envs._checks import baseline_and_scale

#: aggregations with a deterministic per-sample Z: 1/Z per token for one sample
DP_AGGREGATIONS = ("seq-mean-token-sum", "token-mean", "seq-mean-token-sum-norm")
#: sequence-level mappings whose coefficient is a product of per-token factors
PRODUCT_MAPPINGS = ("is_seq", "power")


@dataclass(frozen=True)
class TokenMoments:
    """Exact moments of one sample's term h (module docstring).

    ``mean`` (D,) E h; ``second`` E‖h‖² (may be inf); ``abs_sum`` E Σ_t |c_t|; ``sq_sum``
    E Σ_t c_t²; ``mean_length`` E|y| (all under μ).
    """

    mean: np.ndarray
    second: float
    abs_sum: float
    sq_sum: float
    mean_length: float

    def variance(self, n: int) -> float:
        """Var ĝ of the n-sample mean: (E‖h‖² − ‖E h‖²)/n (clipped at 0)."""
        return max(self.second - float(self.mean @ self.mean), 0.0) / n

    def ess(self, n: int) -> float:
        """n·(E Σ|c|)² / (E Σ c² · E|y|): the exact path's ESS (0 when every c is 0)."""
        denom = self.sq_sum * self.mean_length
        return n * self.abs_sum**2 / denom if denom > 0 else 0.0

    @classmethod
    def of_sums(cls, inv_z: float, mean, second, abs_sum, sq_sum, mean_length) -> TokenMoments:
        """The moments of h = a·A·Σ_t c_t ∇θ log π (a = ``inv_z`` = 1/Z) from the sweeps' a = 1
        sums: ``mean`` (flattened to (D,)) times a, ``second`` times a²; the ESS sums as given."""
        return cls(
            mean=inv_z * mean.ravel(),
            second=inv_z**2 * float(second),
            abs_sum=abs_sum,
            sq_sum=sq_sum,
            mean_length=mean_length,
        )


def dp_applies(env, mapping, aggregation: str, allow_additive: bool = False) -> str:
    """'' if :func:`moments` applies to ``mapping`` × ``aggregation`` on ``env``, else why not.
    ``allow_additive``: a token-level mapping's additive per-token term b is accepted (the
    sweep of :func:`additive_moments` carries it)."""
    from simkit.envs.token_mdp import TokenMDP
    from simkit.mappings.base import ScalarMapping

    if not isinstance(env, TokenMDP):
        return "the moment DP is for token MDPs"
    if aggregation not in DP_AGGREGATIONS:
        return f"aggregation {aggregation!r} has a random per-sample Z"
    if aggregation == "token-mean" and not env.fixed_length:
        return "aggregation 'token-mean' has a random Z when lengths vary (eos)"
    if mapping.has_additive and not (allow_additive and mapping.level == "token"):
        return (
            f"mapping {mapping.name!r} has an additive per-token term (−β·log r): no moment "
            "DP for it here (additive_moments carries it for untied parameters; the "
            "enumeration path is exact)"
        )
    if has_probability_phi(mapping):  # c_t from π(y_t|s_t) and μ(y_t|s_t): still per token
        return ""
    if mapping.batch_dependent or not isinstance(mapping, ScalarMapping):
        return f"mapping {mapping.name!r} has no per-token or product-form coefficient"
    if mapping.level == "token" and mapping.ratio_kind == "token":
        return ""
    if mapping.name in PRODUCT_MAPPINGS:
        return ""
    return f"mapping {mapping.name!r} has no per-token or product-form coefficient"


def has_probability_phi(mapping) -> bool:
    """True for a token-level mapping whose coefficient is a function of the token's own π and
    μ probabilities (``phi_probs(p, q, positive)``: DPPO), which the token-level DP evaluates
    on its probability tables."""
    return (
        mapping.level == "token"
        and not mapping.batch_dependent
        and callable(getattr(mapping, "phi_probs", None))
    )


def token_phi_tables(mapping, P: np.ndarray, M: np.ndarray):
    """(c⁺, c⁻): the coefficient at A ≥ 0 and A < 0 on probability tables P = π, M = μ (same
    shape), 0 where μ = 0: ``phi_probs`` where the mapping has one, else φ(π/μ)."""
    if has_probability_phi(mapping):
        c_pos, c_neg = mapping.phi_probs(P, M, True), mapping.phi_probs(P, M, False)
    else:
        R = _ratio(P, M, 1.0)
        c_pos, c_neg = mapping.phi(R, True), mapping.phi(R, False)
    if not M.all():
        c_pos, c_neg = np.where(M > 0, c_pos, 0.0), np.where(M > 0, c_neg, 0.0)
    return c_pos, c_neg


def moments(env, mu, mapping, baseline: float, aggregation="seq-mean-token-sum", max_length=None):
    """:class:`TokenMoments` of ``mapping`` (token level or product form) by DP, exact."""
    why = dp_applies(env, mapping, aggregation)
    if why:
        raise ValueError(f"no moment DP: {why}")
    mu = env.check_policy(mu)
    b, inv_z = baseline_and_scale(env.T, baseline, aggregation, max_length)
    if mapping.level == "token":
        return token_level_moments(env, mu, mapping, b, inv_z)
    return sequence_moments(env, mu, mapping, b, inv_z)


# --- the sweeps -----------------------------------------------------------------------------


def _forward(env, kernel_of_t):
    """Forward weights F_t(s) of a kernel K_t(s, v) ≥ 0, rescaled: ``(F (T, S), log_F (T,))``.

    F_0 = e_{s0}, F_{t+1}[s'] = Σ_{s, v ≠ eos: trans[s, v] = s'} F_t(s) K_t(s, v); each row is
    stored divided by its maximum, the true row being F_t·exp(log_F[t]) (log_F = −inf once every
    sequence has ended).
    """
    S, T = env.S, env.T
    trans = env.transition.ravel()
    a = np.zeros(S)
    a[env.initial_state] = 1.0
    F = np.zeros((T, S))
    log_F = np.full(T, -np.inf)
    log_scale = 0.0
    for t in range(T):
        F[t] = a
        log_F[t] = log_scale
        if t == T - 1:
            break
        flow = kernel_of_t(t) * a[:, None]
        if env.eos is not None:
            flow[:, env.eos] = 0.0
        a = np.bincount(trans, weights=flow.ravel(), minlength=S)
        top = a.max()
        if not top > 0:  # every sequence has ended: later positions carry no mass
            break
        a /= top
        log_scale += math.log(top)
    return F, log_F


class _Backward:
    """Backward values of m terminal functions (m, S) under per-terminal kernels, rescaled.

    Q_t(s, v) = term[trans[s, v]] if v = eos or t = T − 1, else V_{t+1}[trans[s, v]], and
    V_t(s) = Σ_v K_t(s, v) Q_t(s, v); :meth:`step` takes V_t (already formed by the caller from
    its kernels) and rescales it. ``Q`` (m, S, V) and ``log_q`` (m,) hold position t, the true Q
    being Q·exp(log_q).
    """

    def __init__(self, env, terminals):
        self.env = env
        self.trans = env.transition.ravel()
        self.shape = (-1, env.S, env.V)
        self.term = np.asarray(terminals, dtype=np.float64)
        self.nxt = self.term
        self.log_nxt = np.zeros(self.term.shape[0])
        self.first = True

    def at(self, t: int):
        Q, log_q = self.q_of(self.snapshot())
        self.first = False
        return Q, log_q

    def snapshot(self):
        """The state that :meth:`at` reads, ``(nxt, log_nxt, first)``: kept by a caller that
        needs Q of position t again later (:meth:`q_of`) without storing the (m, S, V) table."""
        return self.nxt, self.log_nxt, self.first

    def q_of(self, snapshot):
        """``(Q (m, S, V), log_q (m,))`` of the position whose :meth:`snapshot` is given."""
        nxt, log_q, first = snapshot
        env = self.env
        Q = nxt.take(self.trans, axis=1).reshape(self.shape)  # nxt[:, trans], faster
        if env.eos is not None and not first:
            with np.errstate(over="ignore"):
                ended = self.term[:, env.transition[:, env.eos]]
                Q[:, :, env.eos] = ended * np.exp(-log_q)[:, None]
        return Q, log_q

    def step(self, value: np.ndarray, log_q: np.ndarray) -> None:
        top = np.abs(value).max(axis=1)
        ok = top > 0
        safe = np.where(ok, top, 1.0)
        self.nxt = value / safe[:, None]
        self.log_nxt = log_q + np.log(safe)


def _store_blocks(env, mean, t0: int, t1: int, lam: np.ndarray, pi_b: np.ndarray) -> None:
    """mean[t0:t1] from lam (b, S, V) of a block of positions (see :func:`_store_block`)."""
    block = lam - pi_b * lam.sum(axis=-1, keepdims=True)
    if env._identity_classes:
        mean[t0:t1] = block
    else:
        for i in range(t1 - t0):
            mean[t0 + i] = env._class_sum(block[i])


def _store_block(env, mean: np.ndarray, t: int, lam: np.ndarray, pi_t: np.ndarray) -> None:
    """mean[t] = Σ_{s,v} lam(s, v)(e_v − π_t(·|s)) summed into policy classes (P, V)."""
    block = lam - pi_t * lam.sum(axis=1, keepdims=True)
    mean[t] = block if env._identity_classes else env._class_sum(block)


def _ratio(p: np.ndarray, m: np.ndarray, fill: float) -> np.ndarray:
    """p/m where m > 0, ``fill`` where m = 0 (tokens μ never emits)."""
    if m.all():
        return p / m
    ok = m > 0
    return np.where(ok, p / np.where(ok, m, 1.0), fill)


#: positions whose per-token tables (ratios, coefficients, kernels) are formed at once
_BLOCK = 64


def _position_blocks(env, T: int):
    """(t0, t1) blocks of :data:`_BLOCK` positions, last block first (for backward sweeps)."""
    for t1 in range(T, 0, -_BLOCK):
        yield max(0, t1 - _BLOCK), t1


def _rows(env, policy: np.ndarray, t0: int, t1: int) -> np.ndarray:
    """(t1 − t0, S, V): policy rows of every automaton state at positions t0..t1 − 1."""
    blk = policy[t0:t1]
    return blk if env._identity_classes else blk[:, env.policy_index]


def _terminal_rows(adv: np.ndarray):
    """Terminal functions of the token-level sweep and how to combine them.

    With u distinct advantage values a_j (u ≤ 6; binary rewards: u = 2) the rows are the
    indicators 1{A = a_j} and every needed function is a combination: A^k·1{±} =
    Σ_{j: sign a_j = ±} a_j^k 1{A = a_j}. Otherwise the six rows A·1{±}, A²·1{±}, 1{±}.
    Returns ``(rows (m, S), spec)``; ``spec`` lists per row (sign ≥ 0, weight of A, weight of A²,
    weight of 1) — for the six-row form one weight per row is 1, the others 0.
    """
    pos = adv >= 0
    values = np.unique(adv)
    if values.size <= 6:
        rows = np.stack([(adv == a).astype(np.float64) for a in values])
        spec = [(a >= 0, a, a * a, 1.0) for a in values]
        return rows, spec
    rows = np.stack(
        [
            np.where(pos, adv, 0.0),
            np.where(pos, 0.0, adv),
            np.where(pos, adv**2, 0.0),
            np.where(pos, 0.0, adv**2),
            pos.astype(np.float64),
            (~pos).astype(np.float64),
        ]
    )
    spec = [
        (True, 1.0, 0.0, 0.0),
        (False, 1.0, 0.0, 0.0),
        (True, 0.0, 1.0, 0.0),
        (False, 0.0, 1.0, 0.0),
        (True, 0.0, 0.0, 1.0),
        (False, 0.0, 0.0, 1.0),
    ]
    return rows, spec


def token_level_moments(
    env, mu, mapping, b: float, inv_z: float = 1.0, additive=None
) -> TokenMoments:
    """Moments of c_t = φ(r_t, sign A) (module docstring, token level). ``mu`` validated.

    ``additive``: None, or a callable ``(t0, t1, P, M) -> β`` giving the additive per-token
    weight β_t(s, v) (b, S, V) of positions t0..t1 − 1 from the π and μ rows P, M (a = 1
    units; :func:`additive_moments`), so that h = a·Σ_t (c_t·A + β_t)·∇log π(y_t|s_t)."""
    rows, spec = _terminal_rows(env.reward - b)
    m = rows.shape[0]
    d = env.occupancy(mu)  # d_t(s) ≤ 1: no rescaling needed
    back = _Backward(env, rows)
    mean = np.zeros(env.logits.shape)
    second = abs_sum = sq_sum = 0.0
    for t0, t1 in _position_blocks(env, env.T):
        P, M = _rows(env, env.pi, t0, t1), _rows(env, mu, t0, t1)
        c_pos, c_neg = token_phi_tables(mapping, P, M)
        beta = None if additive is None else additive(t0, t1, P, M)
        # sequential part: the backward values (Q of every position of the block is kept)
        Qb = np.empty((t1 - t0, m, env.S, env.V))
        log_qb = np.empty((t1 - t0, m))
        for t in range(t1 - 1, t0 - 1, -1):
            Q, log_q = back.at(t)
            Qb[t - t0], log_qb[t - t0] = Q, log_q
            back.step(np.einsum("sv,msv->ms", M[t - t0], Q), log_q)
        # vectorised over the block, one terminal row at a time
        d_b = d[t0:t1][..., None]  # (b, S, 1)
        w = d_b * M  # d_t(s) μ_t(v|s), (b, S, V)
        wN = w * ((1.0 + np.einsum("bsv,bsv->bs", P, P))[..., None] - 2.0 * P)  # d·μ·N
        lam = np.zeros_like(w)
        for j, (positive, k1, k2, k0) in enumerate(spec):
            c = c_pos if positive else c_neg
            Y = Qb[:, j] * np.exp(log_qb[:, j])[:, None, None]  # true Q of row j
            cY = c * Y
            if k1:
                lam += k1 * cY
            c2Y = c * cY
            if k2:
                second += k2 * float(np.einsum("bsv,bsv->", wN, c2Y))
            if beta is not None:  # (cA + β)² = c²A² + 2cβ·A + β²
                bY = beta * Y
                if k1:
                    second += 2.0 * k1 * float(np.einsum("bsv,bsv->", wN, c * bY))
                if k0:
                    lam += k0 * bY
                    second += k0 * float(np.einsum("bsv,bsv->", wN, beta * bY))
            if k0:
                abs_sum += k0 * float(np.einsum("bsv,bsv->", w, np.abs(cY)))
                sq_sum += k0 * float(np.einsum("bsv,bsv->", w, c2Y))
        _store_blocks(env, mean, t0, t1, w * lam, P)
    return TokenMoments.of_sums(inv_z, mean, second, abs_sum, sq_sum, float(d.sum()))


def additive_dp_applies(
    env, mapping, correction, aggregation: str, denominator: str = "valid", kl=None
) -> str:
    """'' if :func:`additive_moments` applies (a per-token additive term: a KL penalty in the
    loss, a mapping's b), else why not."""
    if kl is not None and kl.where != "loss":
        return (
            "a KL penalty in the reward makes the advantage a sum over the path's tokens, not a "
            "function of the final state (no moment DP; enumeration is exact)"
        )
    if correction is not None:
        return (
            "a composed estimator with an additive per-token term (a KL penalty in the loss) "
            "has no moment DP here (its coefficient's product factor meets the additive term "
            "in the cross moment)"
        )
    if denominator != "valid":
        return f"denominator {denominator!r} divides by the kept tokens (a random Z)"
    why = dp_applies(env, mapping, aggregation, allow_additive=True)
    if why:
        return why
    if mapping.level != "token":
        return (
            f"mapping {mapping.name!r} is sequence level: with an additive per-token term "
            "(a KL penalty in the loss) the cross moment has no DP here"
        )
    return ""


def additive_tables(mapping, kl=None, log_ref=None):
    """The additive per-token weight β(P, M, t0, t1) of :func:`additive_moments` in a = 1 units:
    the mapping's b (DRO's −β·log r, DPPO's penalty; ``mapping.additive`` on the tables) plus
    −β_KL·∂(w·k)/∂log π of a KL penalty in the loss (``kl.slopes`` at x = log π − log π_ref,
    ``log_ref`` the (T, S, V) rows of log π_ref); 0 where μ = 0 (never drawn)."""

    def beta(t0: int, t1: int, P: np.ndarray, M: np.ndarray) -> np.ndarray:
        ok = M > 0
        with np.errstate(divide="ignore"):
            log_p = np.log(P)
            lr = np.where(ok, log_p - np.log(np.where(ok, M, 1.0)), 0.0)
        out = np.zeros(P.shape)
        if mapping.has_additive:
            flat = lr.reshape(-1, 1)
            b = mapping.additive(flat, np.ones(flat.shape, bool), log_prob=log_p.reshape(-1, 1))
            out += b.reshape(P.shape)
        if kl is not None:
            x = log_p - log_ref[t0:t1]
            out -= kl.beta * kl.slopes(x, lr)
        return np.where(ok, out, 0.0)

    return beta


def additive_moments(
    env,
    mu,
    mapping,
    baseline: float,
    aggregation="seq-mean-token-sum",
    max_length=None,
    kl=None,
    ref=None,
) -> TokenMoments:
    """:class:`TokenMoments` of h = a·Σ_t (c_t·A + β_t)·∇θ log π(y_t|s_t) by DP, exact at any T,
    for a token-level c_t = φ(π_t, μ_t, sign A) and an additive weight β_t(s_t, y_t) that reads
    the token's own probabilities only (untied parameters): a mapping's b and/or a KL penalty
    in the loss (``kl`` a :class:`simkit.kl.KLPenalty` with ``where="loss"``, ``ref`` = π_ref).

    Position t's block holds one token, so ‖h‖² = a² Σ_t (c_t A + β_t)² N_t(s_t, y_t) and

        E h block (t, p) = a Σ_{s∈p,v} d_t(s) μ_t(v|s) [c± Q¹± + β_t] (e_v − π_t(·|s)),
        E‖h‖²           = a² Σ_t Σ_{s,v} d_t μ_t N_t [c±² Q²± + 2 c± β_t Q¹± + β_t² Q⁰±]

    with the token-level sweep's Q^{k±} (module docstring; Q⁰⁺ + Q⁰⁻ = 1). Checked against
    enumeration to 1e-10 and against Monte Carlo at T = 64 in
    ``tests/test_token_moments_additive.py``.
    """
    why = additive_dp_applies(env, mapping, None, aggregation, kl=kl)
    if why:
        raise ValueError(f"no moment DP: {why}")
    mu = env.check_policy(mu)
    b, inv_z = baseline_and_scale(env.T, baseline, aggregation, max_length)
    log_ref = None
    if kl is not None:
        if ref is None:
            raise ValueError("a KL penalty needs ref = pi_ref")
        ref_p = env.check_policy(ref, "ref")
        with np.errstate(divide="ignore"):
            log_ref = np.log(_rows(env, ref_p, 0, env.T))
    return token_level_moments(env, mu, mapping, b, inv_z, additive_tables(mapping, kl, log_ref))


def _product_kernels(env, mu, alpha: float, t0: int, t1: int):
    """(π rows, K¹ = μ·r^α, K² = μ·r^{2α}) at positions t0..t1 − 1, each (b, S, V)."""
    P, M = _rows(env, env.pi, t0, t1), _rows(env, mu, t0, t1)
    R = _ratio(P, M, 0.0)
    if alpha == 1.0:
        k1 = P if M.all() else np.where(M > 0, P, 0.0)
        return P, k1, k1 * R
    ra = np.power(R, alpha)
    k1 = M * ra
    return P, k1, k1 * ra


def _product_forward(env, mu, alpha: float):
    """Forward weights of K¹ and K² together (two :func:`_forward` recursions in one loop,
    kernels formed a block at a time): ``((F1, log_F1), (F2, log_F2))``."""
    return _two_kernel_forward(env, lambda t0, t1: _product_kernels(env, mu, alpha, t0, t1)[1:])


def _two_kernel_forward(env, kernels):
    """Forward weights of two kernels ``kernels(t0, t1) -> (K1, K2)`` (each (b, S, V)) in one
    loop: ``((F1, log_F1), (F2, log_F2))`` (:func:`_forward`'s rescaling)."""
    S, T = env.S, env.T
    trans = env.transition.ravel()
    a = np.zeros((2, S))
    a[:, env.initial_state] = 1.0
    F = np.zeros((2, T, S))
    log_F = np.full((2, T), -np.inf)
    log_scale = np.zeros(2)
    alive = np.ones(2, dtype=bool)
    offsets = (np.arange(2) * S)[:, None]
    flat = (trans[None, :] + offsets).ravel()  # both recursions in one bincount
    for t0, t1 in ((t0, min(t0 + _BLOCK, T)) for t0 in range(0, T, _BLOCK)):
        K1, K2 = kernels(t0, t1)
        for t in range(t0, t1):
            F[:, t] = a
            log_F[alive, t] = log_scale[alive]
            if t == T - 1:
                break
            flow = np.stack([K1[t - t0], K2[t - t0]]) * a[:, :, None]
            if env.eos is not None:
                flow[:, :, env.eos] = 0.0
            a = np.bincount(flat, weights=flow.ravel(), minlength=2 * S).reshape(2, S)
            top = a.max(axis=1)
            ended = ~(top > 0)
            if ended.any():  # every sequence has ended: later positions carry no mass
                alive &= ~ended
                a[ended] = 0.0
            safe = np.where(top > 0, top, 1.0)
            a /= safe[:, None]
            log_scale += np.log(safe)
    return (F[0], log_F[0]), (F[1], log_F[1])


def sequence_moments(env, mu, mapping, b: float, inv_z: float = 1.0) -> TokenMoments:
    """Moments of c = W^α on every token (sequence IS: α = 1; ``power``) by W-weighted sweeps.

    Kernels K¹ = μ·r^α (π for sequence IS) and K² = μ·r^{2α} (π²/μ), both 0 where μ = 0.
    """
    alpha = 1.0 if mapping.name == "is_seq" else float(mapping.alpha)
    (F1, log_F1), (F2, log_F2) = _product_forward(env, mu, alpha)
    adv = env.reward - b
    ones = np.ones_like(adv)
    back = _Backward(env, np.stack([adv, ones, adv**2, ones]))
    mean = np.zeros(env.logits.shape)
    second = abs_sum = sq_sum = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for t0, t1 in _position_blocks(env, env.T):
            P, K1, K2 = _product_kernels(env, mu, alpha, t0, t1)
            # Σ_v K² N Q = (1 + Σπ²)·Σ_v K² Q − 2 Σ_v K²·π·Q  (N = 1 + Σπ² − 2π)
            sp1 = 1.0 + np.einsum("bsv,bsv->bs", P, P)
            b_len = t1 - t0
            Qb = np.empty((b_len, 4, env.S, env.V))
            log_qb = np.empty((b_len, 4))
            values = np.empty((b_len, 4, env.S))
            for t in range(t1 - 1, t0 - 1, -1):
                i = t - t0
                Q, log_q = back.at(t)
                Qb[i], log_qb[i] = Q, log_q
                value = values[i]
                value[:2] = np.einsum("sv,msv->ms", K1[i], Q[:2])
                value[2:] = np.einsum("sv,msv->ms", K2[i], Q[2:])
                back.step(value, log_q)
            # vectorised over the block (F = 0 rows, log_F = −inf, give a zero scale)
            s1 = np.exp(log_F1[t0:t1, None] + log_qb[:, :2])  # (b, 2)
            s2 = np.exp(log_F2[t0:t1, None] + log_qb[:, 2:])
            s1 = np.where(np.isfinite(log_F1[t0:t1, None]), s1, 0.0)
            s2 = np.where(np.isfinite(log_F2[t0:t1, None]), s2, 0.0)
            lam = (F1[t0:t1] * s1[:, :1])[..., None] * K1 * Qb[:, 0]
            _store_blocks(env, mean, t0, t1, lam, P)
            abs_sum += float(np.einsum("bs,bs,b->", F1[t0:t1], values[:, 1], s1[:, 1]))
            # Σ_v K² N Q = (1 + Σπ²)·Σ_v K² Q − 2 Σ_v K²·π·Q  (N = 1 + Σπ² − 2π)
            kpq = np.einsum("bsv,bsv,bsv->bs", K2, P, Qb[:, 2])
            inner = sp1 * values[:, 2] - 2.0 * kpq
            second += float(np.einsum("bs,bs,b->", F2[t0:t1], inner, s2[:, 0]))
            sq_sum += float(np.einsum("bs,bs,b->", F2[t0:t1], values[:, 3], s2[:, 1]))
    return TokenMoments.of_sums(inv_z, mean, second, abs_sum, sq_sum, _mean_length(env, mu))


# --- three policies: composed coefficients, c_t = g_t · Π_u κ_u --------------------------------


def _factor(mapping):
    """How ``mapping`` enters a composed coefficient: ``("token", None)`` (a per-token factor
    g_t = φ(r_t, sign A)), ``("product", α)`` (a product factor Π_u r_u^α: is_seq, power) or
    None (no such form: sequence truncations and masks, geometric ratios, batch mappings)."""
    from simkit.mappings.base import ScalarMapping

    if mapping.batch_dependent or mapping.stochastic or not isinstance(mapping, ScalarMapping):
        return None
    if mapping.level == "token" and mapping.ratio_kind == "token":
        return ("token", None)
    if mapping.name in PRODUCT_MAPPINGS:
        return ("product", 1.0 if mapping.name == "is_seq" else float(mapping.alpha))
    return None


def composed_dp_applies(
    env, mapping, correction, mode: str, aggregation: str, denominator: str = "valid"
) -> str:
    """'' if :func:`composed_moments` applies (a composed estimator of
    :mod:`simkit.composition` on ``env``), else why not."""
    if denominator != "valid":
        return f"denominator {denominator!r} divides by the kept tokens (a random Z)"
    if correction is None:
        return dp_applies(env, mapping, aggregation)
    if mode == "trl_vespo":
        return "mode 'trl_vespo' folds the correction into VESPO's W (no product form)"
    why = dp_applies(env, mapping, aggregation)
    if why:
        return why
    if has_probability_phi(mapping):
        return (
            f"mapping {mapping.name!r} reads π and π_old themselves (no composed moment DP for "
            "it yet)"
        )
    if _factor(correction) is None:
        return (
            f"correction {correction.name!r} is not a per-token or product-form factor "
            "(a truncation or mask of a sequence-level ratio)"
        )
    return ""


def composed_moments(
    env,
    mu,
    old,
    mapping,
    correction,
    mode: str,
    baseline: float,
    aggregation: str = "seq-mean-token-sum",
    max_length=None,
) -> TokenMoments:
    """:class:`TokenMoments` of a composed estimator (three policies) by DP, exact at any T.

    With ``mode="decoupled"`` the coefficient is c_t = c_mapping(π/π_old)_t ·
    c_correction(π_old/μ)_t; ``"bypass"``: both on π/μ (π_old := μ). When each part is either a
    per-token factor (a token-level φ(r_t, sign A): ppo_clip, dapo, tis_token, mis_token,
    icepop, ...) or a product over positions (is_seq: Π r_u; power: Π r_u^α), c_t = g_t·Π_u κ_u
    with g_t the product of the per-token factors at t and κ_u that of the product factors, and
    the moments are the sweeps of the module docstring with kernels K¹ = μ·κ, K² = μ·κ²
    (π_old's per-token ratios enter through κ and g only; forward and backward vectors rescaled
    as in :func:`sequence_moments`):

        E h block (t, p) = a Σ_{s∈p} Σ_v F¹_t(s) K¹_t(s, v) [g⁺ Q¹(A·1⁺) + g⁻ Q¹(A·1⁻)] (e_v − π_t)
        E‖h‖²           = a² Σ_t Σ_{s,v} F²_t(s) K²_t(s, v) N_t(s, v) [g⁺² Q²(A²1⁺) + g⁻² Q²(A²1⁻)]

    (g^± = g at sign A = ±). No DP — the caller falls back to Monte Carlo — for sequence-level
    truncations or masks of a ratio (tis_seq, mis_seq: min(W, C) is not a product), geometric
    ratios (gspo, geo_mask), VESPO's φ(W) and ``mode="trl_vespo"`` (W folds the truncated token
    weights: not a product of factors with a closed kernel), batch mappings, and
    ``denominator="kept"`` (:func:`composed_dp_applies` says which). ``old`` None: π_old = π.
    ``phi`` is the exact formula (no ``max_log_ratio`` clamp, as in the single-ratio sweeps).
    Checked against enumeration to 1e-10 in ``tests/test_token_moments_old.py``.
    """
    why = composed_dp_applies(env, mapping, correction, mode, aggregation)
    if why:
        raise ValueError(f"no moment DP: {why}")
    mu = env.check_policy(mu)
    old = env.pi if old is None else env.check_policy(old, "old")
    b, inv_z = baseline_and_scale(env.T, baseline, aggregation, max_length)
    legs = composed_legs(mapping, correction, mode)
    factors = _composed_factors(env, mu, old, legs)
    return _factored_moments(env, mu, factors, b, inv_z)


def composed_legs(mapping, correction, mode: str):
    """The ratio legs of a composed coefficient: ``[(mapping, numerator, denominator), …]`` with
    policies named ``"pi"``, ``"old"``, ``"mu"`` (:func:`composed_moments`)."""
    if correction is None:  # the single-ratio estimator on π/μ, whatever π_old is
        return [(mapping, "pi", "mu")]
    if mode == "bypass":
        return [(mapping, "pi", "mu"), (correction, "pi", "mu")]
    return [(mapping, "pi", "old"), (correction, "old", "mu")]


def _composed_factors(env, mu, old, legs):
    """``factors(t0, t1)``: the block tables of a composed coefficient c_t = g_t·Π_u κ_u over the
    ratio ``legs`` (:func:`composed_legs`; ``mu``, ``old`` validated)."""
    policies = {"pi": env.pi, "old": old, "mu": mu}
    parts = [(m, _factor(m), policies[num], policies[den]) for m, num, den in legs]

    def factors(t0: int, t1: int):
        """(π rows, μ rows, g⁺, g⁻, κ) at positions t0..t1 − 1, each (b, S, V); κ None ≡ 1."""
        P, M = _rows(env, env.pi, t0, t1), _rows(env, mu, t0, t1)
        g_pos = g_neg = kappa = None
        for m, (kind, alpha), num, den in parts:
            R = _ratio(_rows(env, num, t0, t1), _rows(env, den, t0, t1), 0.0)
            if kind == "token":
                fp, fn = m.phi(R, True), m.phi(R, False)
                g_pos = fp if g_pos is None else g_pos * fp
                g_neg = fn if g_neg is None else g_neg * fn
            else:
                k = R if alpha == 1.0 else np.power(R, alpha)
                kappa = k if kappa is None else kappa * k
        ones = np.ones_like(P)
        g_pos = ones if g_pos is None else g_pos
        g_neg = ones if g_neg is None else g_neg
        drawn = M > 0
        if not drawn.all():  # tokens μ never emits carry no weight
            g_pos, g_neg = np.where(drawn, g_pos, 0.0), np.where(drawn, g_neg, 0.0)
        return P, M, g_pos, g_neg, kappa

    return factors


def _kernels_of(factor_tables):
    """(K¹, K²) = (μ·κ, μ·κ²) from the tables of a block (κ None ≡ 1)."""
    _, M, _, _, kappa = factor_tables
    if kappa is None:
        return M, M
    k1 = M * kappa
    return k1, k1 * kappa


def _factored_moments(env, mu, factors, b: float, inv_z: float) -> TokenMoments:
    """The sweeps of :func:`composed_moments` (``factors(t0, t1)``: its block tables)."""
    (F1, log_F1), (F2, log_F2) = _two_kernel_forward(
        env, lambda t0, t1: _kernels_of(factors(t0, t1))
    )
    rows, spec = _terminal_rows(env.reward - b)
    m = rows.shape[0]
    back = _Backward(env, np.concatenate([rows, rows]))  # rows under K¹, then under K²
    mean = np.zeros(env.logits.shape)
    second = abs_sum = sq_sum = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for t0, t1 in _position_blocks(env, env.T):
            tables = factors(t0, t1)
            P, _, g_pos, g_neg, _ = tables
            K1, K2 = _kernels_of(tables)
            b_len = t1 - t0
            Qb = np.empty((b_len, 2 * m, env.S, env.V))
            log_qb = np.empty((b_len, 2 * m))
            for t in range(t1 - 1, t0 - 1, -1):
                i = t - t0
                Q, log_q = back.at(t)
                Qb[i], log_qb[i] = Q, log_q
                value = np.empty((2 * m, env.S))
                value[:m] = np.einsum("sv,msv->ms", K1[i], Q[:m])
                value[m:] = np.einsum("sv,msv->ms", K2[i], Q[m:])
                back.step(value, log_q)
            alive1 = np.isfinite(log_F1[t0:t1])[:, None]
            alive2 = np.isfinite(log_F2[t0:t1])[:, None]
            s1 = np.where(alive1, np.exp(log_F1[t0:t1, None] + log_qb[:, :m]), 0.0)  # (b, m)
            s2 = np.where(alive2, np.exp(log_F2[t0:t1, None] + log_qb[:, m:]), 0.0)
            w1 = F1[t0:t1][..., None] * K1  # F¹_t(s) K¹_t(s, v), (b, S, V)
            w2 = F2[t0:t1][..., None] * K2
            w2N = w2 * ((1.0 + np.einsum("bsv,bsv->bs", P, P))[..., None] - 2.0 * P)
            lam = np.zeros_like(w1)
            for j, (positive, k1, k2, k0) in enumerate(spec):
                g = g_pos if positive else g_neg
                Y1 = Qb[:, j] * s1[:, j, None, None]  # true Q¹ of row j (scaled by F¹'s)
                Y2 = Qb[:, m + j] * s2[:, j, None, None]
                gY2 = g * g * Y2
                if k1:
                    lam += k1 * g * Y1
                if k2:
                    second += k2 * float(np.einsum("bsv,bsv->", w2N, gY2))
                if k0:
                    abs_sum += k0 * float(np.einsum("bsv,bsv->", w1, np.abs(g) * Y1))
                    sq_sum += k0 * float(np.einsum("bsv,bsv->", w2, gY2))
            _store_blocks(env, mean, t0, t1, w1 * lam, P)
    return TokenMoments.of_sums(inv_z, mean, second, abs_sum, sq_sum, _mean_length(env, mu))


def _mean_length(env, mu) -> float:
    """E_μ|y| = Σ_t P_μ(running at t)."""
    return float(env.occupancy(mu).sum())


def weight_moment(env, mu, q: float, log: bool = False) -> float:
    """E_μ[W^q] of the sequence weight W = π(y)/μ(y), exact by a product-form forward sweep.

    Kernel μ·r^q (0 where μ = 0: those tokens are never drawn), rescaled at every step
    (:meth:`TokenMDP._forward` with ``normalise``). q = 2 gives 1 + χ²_seq. With ``log`` the
    logarithm is returned (E W⁴ overflows long before its logarithm does).
    """
    mu = env.check_policy(mu)
    step = env._step_probs

    def kernel(t):
        p, m = step(env.pi, t), step(mu, t)
        r = _ratio(p, m, 0.0)
        return np.where(m > 0, m * np.power(r, q), 0.0)

    _, final, log_scale = env._forward(kernel, normalise=True)
    total = float(final.sum())
    if log:
        return math.log(total) + log_scale if total > 0 else -math.inf
    return total * math.exp(log_scale)
