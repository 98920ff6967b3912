"""Policy-gradient estimators: weight mapping × aggregation × advantage → per-token weights λ.

Every estimator of the notation page (``docs/reference.md``, the website) is

    ĝ = Σ_i Σ_t λ_{i,t} ∇θ log πθ(y_{i,t} | s_{i,t}),     λ_{i,t} = c_{i,t} · A_i / Z_i,

with c the mapping's effective coefficient (:mod:`simkit.mappings`), A_i the sequence advantage
(section E) and 1/Z_i the aggregation weight (section D). An :class:`Estimator` produces λ
(:meth:`Estimator.token_weights`); the environment turns λ into a gradient
(``env.accumulate(actions, λ)``) without materialising per-sample gradients.

Shapes: ``N`` samples (sequences) per batch, ``T`` tokens per sample; every function also
accepts leading batch axes ``L...`` (independent batches, e.g. Monte Carlo repetitions), so
``rewards`` is (L..., N) and ``log_ratio``/``mask`` are (L..., N, T).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simkit import composition
from simkit._validation import int_at_least, like_log_ratio, positive_int
from simkit.kl import KLPenalty
from simkit.mappings import Mapping, as_mapping
from simkit.score_baselines import opob_advantages, otb_advantages  # the score-norm baselines

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)
ADVANTAGES = ("oracle", "oracle_pi", "grpo", "dr_grpo", "rloo", "maxrl", "otb", "opob", "raw")
GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "maxrl", "otb", "opob")
#: advantages with one value per token (A_{i,t}), not per sequence
TOKEN_ADVANTAGES = ("otb",)
#: advantages whose baseline reads the tokens' squared score norms (``score_sq``)
SCORE_ADVANTAGES = ("otb", "opob")
#: the spread that divides GRPO's centred rewards: the group's std (DeepSeekMath, verl) or the
#: whole batch's (TRL ``scale_rewards="batch"``)
REWARD_SCALES = ("group", "batch")
#: advantages A = R − b with an exact baseline b: J(μ) for ``oracle``, J(π) for ``oracle_pi``
ORACLE_ADVANTAGES = ("oracle", "oracle_pi")
#: advantages that are a function of one sample's reward only (no coupling inside a batch)
PER_SAMPLE_ADVANTAGES = ("oracle", "oracle_pi", "raw")
#: GRPO's ε in A = (R − mean)/(std + ε): verl's default (TRL adds 1e-4 instead)
DEFAULT_ADV_EPS = 1e-6


# --- advantages -----------------------------------------------------------------------------


def advantages(
    rewards,
    kind: str,
    J=None,
    group_size: int | None = None,
    eps: float = DEFAULT_ADV_EPS,
    scale_rewards: str = "group",
) -> np.ndarray:
    """Sequence advantages A of shape (L..., N) from rewards R of shape (L..., N).

    Notation page (``docs/reference.md``, the website) §E. Groups are ``group_size`` = G
    *consecutive* samples along the last axis (the G responses to one prompt); N must be a
    multiple of G.

    - ``"oracle"``: A = R − J(μ), the exact expected reward of the *behaviour* μ that drew the
      samples (``J`` required: the caller passes J(μ), a scalar or broadcastable to (L..., N);
      :meth:`Estimator.baseline` picks it). This is the value that the baselines of real
      trainers estimate: a group mean (GRPO, Dr. GRPO, RLOO) or a batch mean of rewards drawn
      from μ has expectation J(μ), not J(π). It makes the advantage centred under the sampling
      law, E_μ[A] = 0, so a mapping's bias is not confounded with the term
      (J(μ) − J(π))·E_μ[c·score], which a J(π) baseline adds to every mapping whose
      coefficient c is not a ratio (E_μ[W·score] = 0 for the sequence ratio W and
      E_μ[r_t·score_t | prefix] = 0 for the token ratio, so is_seq and is_token do not depend
      on any constant baseline; naive, clipping, truncation… do).
    - ``"oracle_pi"``: A = R − J(π) (``J`` = J(π) of the target): centred under π, not under μ.
      Kept for comparison with the earlier convention: E_μ[A] = J(μ) − J(π) ≠ 0 under a
      mismatch, and that non-zero mean leaks into the bias of non-ratio mappings.
    - ``"raw"``: A = R (no baseline).
    - ``"grpo"``: A = (R − mean_G) / (std_G + ε) (DeepSeekMath, Shao et al. 2024, eq. in §4.1.2),
      std_G the *unbiased* group standard deviation (ddof = 1), as ``torch.std`` computes it in
      both verl (``compute_grpo_outcome_advantage``, ε = 1e-6) and TRL (``GRPOTrainer``,
      ε = 1e-4). G ≥ 2.
    - ``"dr_grpo"``: A = R − mean_G (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-like
      training": the std normalisation removed).
    - ``"rloo"``: A = R − (1/(G−1)) Σ_{j≠i} R_j (leave-one-out baseline, Ahmadian et al. 2024),
      i.e. G/(G−1) · (R − mean_G).
    - ``"maxrl"``: A = (R − mean_G) / (mean_G + ε) (MaxRL, SkyRL ``compute_maxrl_advantage``,
      ``skyrl/backends/skyrl_train/utils/ppo_utils.py`` at NovaSky-AI/SkyRL a956457, ε = 1e-6
      there as here): the centred reward relative to the group's mean, so a group that rarely
      succeeds gets large advantages (0 for a group of zeros).

    ``scale_rewards`` (``grpo`` only): ``"group"`` (default) divides by the group's std;
    ``"batch"`` by the std of every reward of the batch (the last axis, ddof = 1), the group
    mean still subtracted — TRL's ``scale_rewards="batch"`` (``GRPOTrainer``,
    ``trl/trainer/grpo_trainer.py`` at f2cd577, ``nanstd`` with Bessel's correction, ε = 1e-4
    there: pass ``eps=1e-4`` to match). TRL's ``"none"`` is ``dr_grpo``.
    """
    R = np.asarray(rewards, dtype=np.float64)
    if R.ndim < 1:
        raise ValueError("rewards must have shape (..., N), got a scalar")
    if not np.all(np.isfinite(R)):
        raise ValueError("rewards contains non-finite entries")
    if kind not in ADVANTAGES:
        raise ValueError(f"unknown advantage {kind!r}; valid advantages: {', '.join(ADVANTAGES)}")
    _check_scale_rewards(scale_rewards, kind)
    if kind in TOKEN_ADVANTAGES:
        raise ValueError(
            f"advantage {kind!r} has one value per token: use otb_advantages (it needs the "
            "mask and the tokens' score norms)"
        )
    if kind == "opob":
        raise ValueError(
            "advantage 'opob' weights the group by the samples' IS ratios and score norms: use "
            "opob_advantages (it needs the mask, the log-ratios and the tokens' score norms)"
        )
    if kind in GROUP_ADVANTAGES:
        G = _check_group_size(group_size, kind)
        N = R.shape[-1]
        if N % G:
            raise ValueError(
                f"the number of samples N = {N} is not divisible by group_size G = {G} "
                f"(advantage {kind!r} needs whole groups)"
            )
        grouped = R.reshape((*R.shape[:-1], N // G, G))
        centred = grouped - grouped.mean(axis=-1, keepdims=True)
        if kind in ("grpo", "maxrl") and not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if kind == "grpo":
            if scale_rewards == "batch":
                if N < 2:
                    raise ValueError("scale_rewards='batch' needs N >= 2 rewards")
                std = R.std(axis=-1, ddof=1)[..., None, None]
            else:
                std = grouped.std(axis=-1, ddof=1, keepdims=True)
            if eps == 0 and np.any(std == 0):
                raise ValueError("eps = 0 with a group of identical rewards divides by zero")
            out = centred / (std + eps)
        elif kind == "maxrl":
            mean = grouped.mean(axis=-1, keepdims=True)
            if eps == 0 and np.any(mean == 0):
                raise ValueError("eps = 0 with a group of mean 0 divides by zero")
            out = centred / (mean + eps)
        elif kind == "dr_grpo":
            out = centred
        else:
            out = centred * (G / (G - 1))
        return out.reshape(R.shape)
    if group_size is not None:
        raise ValueError(
            f"group_size applies to the group advantages {GROUP_ADVANTAGES} only, not to {kind!r}"
        )
    if kind == "raw":
        return R.copy()
    if J is None:
        which = "J(mu)" if kind == "oracle" else "J(pi)"
        raise ValueError(f"advantage {kind!r} (A = R - {which}) needs the exact {which} as J")
    J_arr = np.asarray(J, dtype=np.float64)
    if not np.all(np.isfinite(J_arr)):
        raise ValueError(f"J must be finite, got {J}")
    try:
        return R - J_arr
    except ValueError:
        raise ValueError(
            f"J of shape {J_arr.shape} does not broadcast against rewards of shape {R.shape}"
        ) from None


def _check_scale_rewards(scale_rewards, kind: str) -> str:
    if scale_rewards not in REWARD_SCALES:
        raise ValueError(f"scale_rewards must be one of {REWARD_SCALES}, got {scale_rewards!r}")
    if scale_rewards != "group" and kind != "grpo":
        raise ValueError(
            f"scale_rewards={scale_rewards!r} applies to advantage 'grpo' only, not {kind!r}"
        )
    return scale_rewards


def _check_group_size(group_size, kind: str) -> int:
    if group_size is None:
        raise ValueError(f"advantage {kind!r} needs a group_size G (>= 2)")
    return int_at_least(group_size, "group_size", 2)


# --- aggregation ----------------------------------------------------------------------------


def aggregation_weights(mask, mode: str, max_length: int | None = None) -> np.ndarray:
    """Per-token aggregation weights 1/Z_i, shape (L..., N, T), 0 on padding.

    Notation page (``docs/reference.md``) §D, for one batch of N sequences (each leading index of
    ``mask`` (L..., N, T) is a separate batch):

    - ``"token-mean"``: Z = Σ_{i,t} mask (valid tokens of the batch; DAPO, verl default);
    - ``"seq-mean-token-mean"``: Z_i = N·|y_i| (mean of per-sequence means; GRPO paper, GSPO);
    - ``"seq-mean-token-sum"``: Z = N (REINFORCE, unbiased for the sequence objective);
    - ``"seq-mean-token-sum-norm"``: Z = N·L_max (Dr. GRPO) with L_max = ``max_length`` if given,
      else the batch's T dimension; ``max_length`` must be at least the longest valid length;
    - ``"token-sum"``: Z = 1, the plain sum over every valid token of the batch (verl
      ``agg_loss``'s ``token-sum``, verl-project/verl PR #7197, at 1dda039: the gradient grows
      with the batch, E ĝ = N·E[one sequence's term]).

    A batch or sequence without valid tokens gets weight 0 (nothing to aggregate).
    """
    m = np.asarray(mask)
    if m.ndim < 2:
        raise ValueError(f"mask must have shape (..., N, T), got shape {m.shape}")
    if m.dtype != bool:
        if not np.all((m == 0) | (m == 1)):
            raise ValueError("mask must be boolean (or 0/1)")
        m = m.astype(bool)
    if mode not in AGGREGATIONS:
        raise ValueError(
            f"unknown aggregation {mode!r}; valid aggregations: {', '.join(AGGREGATIONS)}"
        )
    if max_length is not None and mode != "seq-mean-token-sum-norm":
        raise ValueError(
            f"max_length applies to aggregation 'seq-mean-token-sum-norm' only, not {mode!r}"
        )
    N, T = m.shape[-2], m.shape[-1]
    lengths = m.sum(axis=-1)  # (L..., N)
    if mode == "token-mean":
        total = lengths.sum(axis=-1, keepdims=True)[..., None]  # (L..., 1, 1)
        inv_z = np.divide(1.0, total, out=np.zeros(total.shape), where=total > 0)
    elif mode == "seq-mean-token-mean":
        per_seq = (N * lengths)[..., None]
        inv_z = np.divide(1.0, per_seq, out=np.zeros(per_seq.shape), where=per_seq > 0)
    elif mode == "seq-mean-token-sum":
        inv_z = np.array(1.0 / N)
    elif mode == "token-sum":
        inv_z = np.array(1.0)
    else:
        L_max = T if max_length is None else positive_int(max_length, "max_length")
        longest = int(lengths.max()) if lengths.size else 0
        if longest > L_max:
            raise ValueError(
                f"max_length = {L_max} is shorter than the longest sequence ({longest} valid "
                f"tokens)"
            )
        inv_z = np.array(1.0 / (N * L_max))
    return np.where(m, inv_z, 0.0)


# --- the estimator --------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimator:
    """A policy-gradient estimator: ``mapping`` × ``aggregation`` × ``advantage``.

    Parameters
    ----------
    mapping : Mapping or str
        The weight mapping (a name is built with ``simkit.mappings.get(name)`` defaults).
    aggregation : str
        One of :data:`AGGREGATIONS` (default ``"token-mean"``).
    advantage : str
        One of :data:`ADVANTAGES` (default ``"oracle"``).
    group_size : int, optional
        G for the group advantages ``grpo``/``dr_grpo``/``rloo`` (required there, >= 2, and
        rejected for the others). The batch size must be a multiple of G.
    adv_eps : float
        ε of GRPO's (R − mean)/(std + ε) (default 1e-6 as verl; TRL uses 1e-4).
    max_length : int, optional
        L_max of ``seq-mean-token-sum-norm`` (default: the batch's T); rejected for the other
        aggregations.
    name : str
        Row label in experiment tables; default ``"<mapping label> [<aggregation>, <advantage>]"``,
        where the label names only non-default hyperparameters and the bracket lists only a
        non-default aggregation (default ``token-mean``) or advantage (default ``oracle``);
        with a correction ``"<mapping> × <correction>"`` (and the mode if not decoupled).
    correction : Mapping or str, optional
        A detached-weight mapping on π_old/μ (:mod:`simkit.composition`): ``mode``
        ``"decoupled"`` (c = c_mapping(π/π_old)·c_correction(π_old/μ): verl's decoupled
        mode, TRL's vLLM importance-sampling correction), ``"bypass"`` (π_old := μ: both on
        π/μ, verl's bypass mode) or ``"trl_vespo"`` (TRL's VESPO: the token correction folded
        into W). ``None`` (default): the single-ratio estimator c = c_mapping(π/μ), bit for bit
        the estimator without this field.
    denominator : str
        ``"valid"`` (default: Z counts every valid token) or ``"kept"`` (Z counts the tokens the
        mapping's and the correction's rejections keep: verl's legacy path).
    seed : int
        Seed of the Generator of a stochastic mapping (``clip_cov``) when none is passed.
    allow_same_ratio : bool
        Compose in ``mode="bypass"`` a mapping and a correction that both carry the ratio
        (:func:`simkit.composition.carries_ratio`: PPO clip × TIS, c = r·min(r, C)), which is
        refused by default: the ratio π/μ would be counted twice.
    scale_rewards : str
        ``grpo`` only: ``"group"`` (default, the group's std) or ``"batch"`` (TRL's
        ``scale_rewards="batch"``: the std of the whole batch); see :func:`advantages`.
    otb_is_cap : float, optional
        ``otb`` only: the rollout-IS variant of the optimal token baseline with ρ̄_t =
        min(π/μ, C), C = ``otb_is_cap`` (verl's token-level truncated rollout IS weights);
        None (default): no IS weights in the baseline (:func:`otb_advantages`).
    kl : KLPenalty, optional
        A penalty β·KL(π‖π_ref) (:class:`simkit.kl.KLPenalty`): ``where="loss"`` adds the
        per-token weight λ^KL_t = −β·(1/Z_i)·∂(w_t k_t)/∂log π to λ; ``where="reward"``
        replaces R by R − β·Σ_t w_t k_t before the advantage. ``None`` (default): no penalty,
        bit for bit the estimator without this field. The per-token x = log π − log π_ref comes
        with the data (``ref_log_ratio``; :func:`simkit.experiment.run` with ``ref=``).
    """

    mapping: Mapping | str
    aggregation: str = "token-mean"
    advantage: str = "oracle"
    group_size: int | None = None
    adv_eps: float = DEFAULT_ADV_EPS
    max_length: int | None = None
    name: str = ""
    correction: Mapping | str | None = None
    mode: str = "decoupled"
    denominator: str = "valid"
    seed: int = 0
    allow_same_ratio: bool = False
    kl: KLPenalty | None = None
    scale_rewards: str = "group"
    otb_is_cap: float | None = None

    def __post_init__(self):
        if self.kl is not None and not isinstance(self.kl, KLPenalty):
            raise TypeError(f"kl must be a KLPenalty or None, got {type(self.kl).__name__}")
        mapping = as_mapping(self.mapping)
        object.__setattr__(self, "mapping", mapping)
        correction = composition.check_correction(
            mapping, self.correction, self.mode, self.denominator, self.allow_same_ratio
        )
        object.__setattr__(self, "correction", correction)
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"unknown aggregation {self.aggregation!r}; valid aggregations: "
                f"{', '.join(AGGREGATIONS)}"
            )
        if self.advantage not in ADVANTAGES:
            raise ValueError(
                f"unknown advantage {self.advantage!r}; valid advantages: {', '.join(ADVANTAGES)}"
            )
        if self.advantage in GROUP_ADVANTAGES:
            object.__setattr__(
                self, "group_size", _check_group_size(self.group_size, self.advantage)
            )
        elif self.group_size is not None:
            raise ValueError(
                f"group_size applies to the group advantages {GROUP_ADVANTAGES} only, "
                f"not to advantage {self.advantage!r}"
            )
        if not (np.isfinite(self.adv_eps) and self.adv_eps >= 0):
            raise ValueError(f"adv_eps must be finite and >= 0, got {self.adv_eps}")
        _check_scale_rewards(self.scale_rewards, self.advantage)
        if self.otb_is_cap is not None:
            if self.advantage != "otb":
                raise ValueError(
                    f"otb_is_cap applies to advantage 'otb' only, not {self.advantage!r}"
                )
            if not (np.isfinite(self.otb_is_cap) and self.otb_is_cap > 0):
                raise ValueError(f"otb_is_cap must be finite and > 0, got {self.otb_is_cap}")
            object.__setattr__(self, "otb_is_cap", float(self.otb_is_cap))
        if self.advantage == "otb":
            batch = mapping.batch_dependent or (
                correction is not None and correction.batch_dependent
            )
            if batch or self.denominator != "valid":
                raise ValueError(
                    "advantage 'otb' (one advantage per token) needs a mapping and correction "
                    "that are not batch dependent and denominator 'valid'"
                )
        if self.max_length is not None:
            if self.aggregation != "seq-mean-token-sum-norm":
                raise ValueError(
                    "max_length applies to aggregation 'seq-mean-token-sum-norm' only, "
                    f"not {self.aggregation!r}"
                )
            object.__setattr__(self, "max_length", positive_int(self.max_length, "max_length"))
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a string, got {type(self.name).__name__}")
        if not self.name:
            parts = []
            if self.aggregation != "token-mean":
                parts.append(self.aggregation)
            if self.advantage != "oracle" or self.group_size is not None:
                adv = self.advantage
                if self.group_size is not None:
                    adv = f"{adv}, G={self.group_size}"
                if self.scale_rewards != "group":
                    adv = f"{adv}, {self.scale_rewards} std"
                if self.otb_is_cap is not None:
                    adv = f"{adv}, IS cap {self.otb_is_cap:g}"
                parts.append(adv)
            if self.denominator != "valid":
                parts.append(f"denominator={self.denominator}")
            suffix = f" [{', '.join(parts)}]" if parts else ""
            label = mapping.label
            if correction is not None:
                label = f"{label} × {correction.label}"
                if self.mode != "decoupled":
                    label = f"{label} ({self.mode})"
            if self.kl is not None:
                label = f"{label} + {self.kl.label}"
            object.__setattr__(self, "name", f"{label}{suffix}")

    @property
    def batch_dependent(self) -> bool:
        """True iff c of a row depends on other rows (the mapping's or the correction's)."""
        corr = self.correction
        return self.mapping.batch_dependent or (corr is not None and corr.batch_dependent)

    def exact_obstacles(self) -> list[str]:
        """Reasons beyond the mapping and the advantage why the exact path does not apply."""
        out = []
        corr = self.correction
        if corr is not None and corr.batch_dependent:
            out.append(f"correction {corr.name!r} is batch dependent")
        if self.denominator == "kept" and self.aggregation == "token-mean":
            out.append(
                "denominator 'kept' with 'token-mean' divides by the batch's number of kept "
                "tokens, which is random"
            )
        return out

    @property
    def per_sample(self) -> bool:
        """True iff ĝ is a sum of one independent term per sample (the exact path applies).

        That holds when the mapping is not batch dependent and the advantage depends on the
        sample's own reward only (``oracle``, ``oracle_pi`` or ``raw``). The exact path also needs a
        deterministic Z (``token-mean`` on variable lengths has a random Z) and an enumerable
        environment: :func:`simkit.experiment.has_exact_path` makes that final decision.
        """
        return (not self.batch_dependent) and self.advantage in PER_SAMPLE_ADVANTAGES

    def baseline(self, J_pi=None, J_mu=None) -> float | None:
        """The exact baseline b of this estimator's advantage A = R − b, or None (no oracle).

        ``oracle``: b = J(μ) (``J_mu``, the expected reward of the behaviour that drew the
        batch); ``oracle_pi``: b = J(π) (``J_pi``); the other advantages take no J (None).
        See :func:`advantages` for why J(μ) is the default.
        """
        if self.advantage == "oracle":
            if J_mu is None:
                raise ValueError("advantage 'oracle' (A = R - J(mu)) needs J_mu = J(mu)")
            return float(J_mu)
        if self.advantage == "oracle_pi":
            if J_pi is None:
                raise ValueError("advantage 'oracle_pi' (A = R - J(pi)) needs J_pi = J(pi)")
            return float(J_pi)
        return None

    def check_batch_size(self, n: int) -> None:
        """Raise ``ValueError`` if a batch of ``n`` samples cannot be split into groups."""
        if self.group_size is not None and n % self.group_size:
            raise ValueError(
                f"estimator {self.name!r}: the batch size n = {n} is not divisible by "
                f"group_size G = {self.group_size}"
            )

    def advantages(self, rewards, J=None) -> np.ndarray:
        """This estimator's advantages A (L..., N) (see :func:`advantages`)."""
        return advantages(
            rewards,
            self.advantage,
            J=J,
            group_size=self.group_size,
            eps=self.adv_eps,
            scale_rewards=self.scale_rewards,
        )

    def aggregation_weights(self, mask) -> np.ndarray:
        """This estimator's 1/Z per token (L..., N, T) (see :func:`aggregation_weights`)."""
        return aggregation_weights(mask, self.aggregation, self.max_length)

    def kept_weights(self, log_ratio, mask, advantages, old_log_ratio=None) -> np.ndarray:
        """1/Z per token (L..., N, T) with the ``denominator`` option: for ``"kept"`` the
        aggregation mask is the tokens the rejections keep (:func:`composition.kept_tokens`)."""
        if self.denominator == "valid":
            return self.aggregation_weights(mask)
        lr = np.asarray(log_ratio, dtype=np.float64)
        T = lr.shape[-1]
        m = np.asarray(mask, dtype=bool)
        adv = np.asarray(advantages, dtype=np.float64)
        old = None if old_log_ratio is None else np.asarray(old_log_ratio).reshape(-1, T)
        kept = composition.kept_tokens(
            self.mapping,
            self.correction,
            self.mode,
            lr.reshape(-1, T),
            m.reshape(-1, T),
            adv.reshape(-1),
            old,
        )
        return self.aggregation_weights(kept.reshape(m.shape))

    def _coefficients_2d(self, lr, m, adv, old, rng, log_prob=None) -> np.ndarray:
        if self.correction is None:
            return composition.call(self.mapping, lr, m, adv, rng, log_prob)
        return composition.composed_coefficients(
            self.mapping, self.correction, self.mode, lr, m, adv, old, rng, log_prob
        )

    def coefficients(
        self, log_ratio, mask, advantages, old_log_ratio=None, rng=None, log_prob=None
    ):
        """The coefficients c (L..., N, T), with leading batch axes.

        Each leading index is one batch. A mapping that is not batch dependent sees all the
        batches at once (its rows are independent); a batch-dependent one is called per batch.
        ``old_log_ratio`` (L..., N, T) = log π_old − log μ (None: π_old = π) feeds a
        ``correction`` (:mod:`simkit.composition`; ignored without one). ``rng``: the Generator
        of a stochastic mapping (default ``default_rng(seed)``, one per call). ``log_prob``
        (L..., N, T) = log π, for mappings that read it (clip_cov, kl_cov; without it they use
        the log-ratio, see :mod:`simkit.mappings.covariance`) or need it (``requires_log_prob``:
        dppo_tv, dppo_kl, gepo).
        """
        stochastic = self.mapping.stochastic or (
            self.correction is not None and self.correction.stochastic
        )
        if stochastic and rng is None:
            rng = np.random.default_rng(self.seed)
        if self.correction is None:
            old_log_ratio = None
        lr = np.asarray(log_ratio, dtype=np.float64)
        m = np.asarray(mask)
        adv = np.asarray(advantages, dtype=np.float64)
        if lr.ndim < 2:
            raise ValueError(f"log_ratio must have shape (..., N, T), got shape {lr.shape}")
        if m.shape != lr.shape:
            raise ValueError(f"shape mismatch: log_ratio has shape {lr.shape}, mask has {m.shape}")
        if adv.shape != lr.shape[:-1]:
            raise ValueError(
                f"advantages must have shape log_ratio.shape[:-1] = {lr.shape[:-1]}, "
                f"got {adv.shape}"
            )
        N, T = lr.shape[-2:]
        lead = lr.shape[:-2]
        lp = None if log_prob is None else like_log_ratio(log_prob, lr, "log_prob")
        old = None
        if old_log_ratio is not None:
            old = like_log_ratio(old_log_ratio, lr, "old_log_ratio")
        if not lead:
            return self._coefficients_2d(lr, m, adv, old, rng, lp)
        if not self.batch_dependent:
            flat_old = None if old is None else old.reshape(-1, T)
            flat_lp = None if lp is None else lp.reshape(-1, T)
            c = self._coefficients_2d(
                lr.reshape(-1, T), m.reshape(-1, T), adv.reshape(-1), flat_old, rng, flat_lp
            )
            return c.reshape(lr.shape)
        B = int(np.prod(lead))
        lr_b, m_b, adv_b = lr.reshape(B, N, T), m.reshape(B, N, T), adv.reshape(B, N)
        old_b = None if old is None else old.reshape(B, N, T)
        lp_b = None if lp is None else lp.reshape(B, N, T)
        c = np.stack(
            [
                self._coefficients_2d(
                    lr_b[b],
                    m_b[b],
                    adv_b[b],
                    None if old_b is None else old_b[b],
                    rng,
                    None if lp_b is None else lp_b[b],
                )
                for b in range(B)
            ]
        )
        return c.reshape(lr.shape)

    def additive_terms(self, log_ratio, mask, log_prob=None) -> np.ndarray | None:
        """The mapping's additive per-token term b (L..., N, T) (DRO's −β·log r_t; see
        :mod:`simkit.mappings.base`), or None when it has none. A composed estimator with such
        a mapping is refused (:func:`simkit.composition.check_correction`)."""
        if not self.mapping.has_additive:
            return None
        lr = np.asarray(log_ratio, dtype=np.float64)
        m = np.asarray(mask, dtype=bool)
        T = lr.shape[-1]
        lp = None if log_prob is None else np.asarray(log_prob, dtype=np.float64).reshape(-1, T)
        b = self.mapping.additive(lr.reshape(-1, T), m.reshape(-1, T), log_prob=lp)
        return b.reshape(lr.shape)

    def token_weights(
        self,
        log_ratio,
        mask,
        rewards,
        J=None,
        return_coefficients=False,
        old_log_ratio=None,
        rng=None,
        ref_log_ratio=None,
        score_sq=None,
        log_prob=None,
    ):
        """Per-token weights λ = (c · A + b) / Z (+ λ^KL) of shape (L..., N, T).

        ``log_ratio``, ``mask`` (L..., N, T); ``rewards`` (L..., N); ``J`` the exact baseline of
        the oracle advantages (J(μ) for ``oracle``, J(π) for ``oracle_pi``, see
        :meth:`baseline`; ignored by the others; with a ``kl`` penalty in the reward, the
        baseline of the penalised reward, :func:`simkit.experiment.exact.oracle_baseline`).
        The gradient estimate is then ``env.accumulate(actions, λ)``. With
        ``return_coefficients=True`` returns ``(λ, c)``. ``old_log_ratio``, ``rng``,
        ``log_prob``: see :meth:`coefficients`; b is the mapping's additive term
        (:meth:`additive_terms`; 0 for most mappings). ``ref_log_ratio`` (L..., N, T) =
        log π − log π_ref of the tokens, required with a ``kl`` penalty (ignored without one).
        ``score_sq`` (L..., N, T) = 1 − 2π(y_t|s_t) + Σ_v π(v|s_t)², required by the ``otb``
        advantage (per-token A_{i,t}, :func:`otb_advantages`; c then takes the sign of each
        token's A) and by ``opob`` (:func:`opob_advantages`, with the sequence IS ratio
        exp Σ_t ``log_ratio``).
        """
        lr = np.asarray(log_ratio, dtype=np.float64)
        R = np.asarray(rewards, dtype=np.float64)
        if lr.ndim < 2 or R.shape != lr.shape[:-1]:
            raise ValueError(
                f"rewards must have shape log_ratio.shape[:-1]; got rewards {R.shape}, "
                f"log_ratio {lr.shape}"
            )
        self.check_batch_size(lr.shape[-2])
        x = penalty = None
        if self.kl is not None:
            if ref_log_ratio is None:
                raise ValueError(
                    f"estimator {self.name!r} has a KL penalty: pass ref_log_ratio = "
                    "log pi - log pi_ref of the tokens (run(..., ref=pi_ref))"
                )
            x = like_log_ratio(ref_log_ratio, lr, "ref_log_ratio")
            if self.kl.where == "reward":
                if self.advantage == "otb":  # reward-to-go of the token-level rewards
                    penalty = self.kl.beta * self.kl.values(x, lr, mask)
                else:
                    R = R - self.kl.beta * self.kl.values(x, lr, mask).sum(axis=-1)
        if self.advantage == "otb":
            lam, c = self._otb_weights(lr, mask, R, score_sq, old_log_ratio, rng, penalty, log_prob)
            b = self.additive_terms(lr, mask, log_prob)
            if b is not None:
                lam = lam + b * self.aggregation_weights(mask)
            if x is not None and self.kl.where == "loss":
                lam = lam + self.kl_loss_weights(x, lr, mask)
            return (lam, c) if return_coefficients else lam
        if self.advantage == "opob":
            if score_sq is None:
                raise ValueError(
                    f"estimator {self.name!r} (advantage 'opob') needs score_sq = 1 - 2 "
                    "pi(y_t|s_t) + sum_v pi(v|s_t)^2 of the tokens"
                )
            adv = opob_advantages(R, mask, score_sq, lr, self.group_size)
        else:
            adv = self.advantages(R, J)
        if self.correction is None:
            old_log_ratio = None
        c = self.coefficients(
            lr, mask, adv, old_log_ratio=old_log_ratio, rng=rng, log_prob=log_prob
        )
        weights = self.kept_weights(lr, mask, adv, old_log_ratio)
        lam = c * adv[..., None] * weights
        b = self.additive_terms(lr, mask, log_prob)
        if b is not None:
            lam = lam + b * weights
        if x is not None and self.kl.where == "loss":
            lam = lam + self.kl_loss_weights(x, lr, mask)
        return (lam, c) if return_coefficients else lam

    def _otb_weights(self, lr, mask, R, score_sq, old_log_ratio, rng, penalty, log_prob=None):
        """λ = c·A_{i,t}/Z and c for the per-token ``otb`` advantage (c by each token's sign)."""
        if score_sq is None:
            raise ValueError(
                f"estimator {self.name!r} (advantage 'otb') needs score_sq = 1 - 2 pi(y_t|s_t) "
                "+ sum_v pi(v|s_t)^2 of the tokens"
            )
        m = np.asarray(mask, dtype=bool)
        rho = None if self.otb_is_cap is None else np.minimum(np.exp(lr), self.otb_is_cap)
        A = otb_advantages(R, m, score_sq, self.group_size, rho, penalty)
        if self.correction is None:
            old_log_ratio = None
        ones = np.ones(lr.shape[:-1])
        kw = dict(old_log_ratio=old_log_ratio, rng=rng, log_prob=log_prob)
        c_pos = self.coefficients(lr, m, ones, **kw)
        c_neg = self.coefficients(lr, m, -ones, **kw)
        c = np.where(A >= 0, c_pos, c_neg) * m
        return c * A * self.aggregation_weights(m), c

    def kl_loss_weights(self, ref_log_ratio, log_ratio, mask) -> np.ndarray:
        """λ^KL = −β·(1/Z)·∂(w k)/∂log π per token (L..., N, T) of a ``kl`` penalty in the loss
        (zeros without one or in the reward); 1/Z the estimator's aggregation over valid tokens
        (verl aggregates the KL loss with the policy loss's ``loss_agg_mode``)."""
        x = np.asarray(ref_log_ratio, dtype=np.float64)
        if self.kl is None or self.kl.where != "loss":
            return np.zeros(x.shape)
        slopes = self.kl.slopes(x, log_ratio, mask)
        return -self.kl.beta * slopes * self.aggregation_weights(mask)

    def gradient(self, env, batch) -> np.ndarray:
        """ĝ = ``env.accumulate(batch.actions, λ)`` for a sampled batch, shape (L..., D).

        The oracle baselines come from the batch: ``batch.J_mu`` = J(μ), ``batch.J`` = J(π).
        """
        b = self.baseline(batch.J, batch.J_mu) if self.advantage in ORACLE_ADVANTAGES else None
        lam = self.token_weights(batch.log_ratio, batch.mask, batch.rewards, b)
        return env.accumulate(batch.actions, lam)


def as_estimators(estimators) -> list[Estimator]:
    """A non-empty list of estimators with distinct names from one estimator spec (an
    :class:`Estimator`, a mapping or a mapping name) or an iterable of them (each coerced with
    :func:`as_estimator`); ``ValueError`` naming the repeated names otherwise."""
    if isinstance(estimators, Estimator | str) or not hasattr(estimators, "__iter__"):
        estimators = [estimators]
    ests = [as_estimator(e) for e in estimators]
    if not ests:
        raise ValueError("estimators is empty")
    names = [e.name for e in ests]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise ValueError(f"estimator names must be distinct; repeated: {dup} (set name=...)")
    return ests


def as_estimator(spec) -> Estimator:
    """Coerce an :class:`Estimator`, a :class:`~simkit.mappings.Mapping` or a mapping name."""
    if isinstance(spec, Estimator):
        return spec
    if isinstance(spec, Mapping | str):
        return Estimator(spec)
    raise TypeError(
        f"an estimator must be an Estimator, a Mapping or a mapping name, got {type(spec).__name__}"
    )
