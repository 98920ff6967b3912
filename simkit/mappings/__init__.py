"""The weight-mapping registry: ``get(name, **hyperparams)``, ``available()``.

One module per family of the notation page (sections A–C); importing this package registers
every mapping, in this order of ``available()``:

- :mod:`~simkit.mappings.classic` (A): naive, is_token, is_seq, power, snis, psis, soft_shrink
- :mod:`~simkit.mappings.clipping` (B): ppo_clip, dual_clip, dapo, gspo, gmpo
- :mod:`~simkit.mappings.soft` (B): sapo, luffy, aspo
- :mod:`~simkit.mappings.truncation` (C): cispo, tis_token, tis_seq, mis_token, mis_seq, icepop
- :mod:`~simkit.mappings.masking` (C): geo_mask, opsm, token_veto, m2po, topr
- :mod:`~simkit.mappings.vespo` (C): vespo (and the pure kernels ``vespo_phi``, ``vespo_f``)
- :mod:`~simkit.mappings.rejection` (C): kl_rs (verl's divergence rejection, k2/k3 criteria)
- :mod:`~simkit.mappings.covariance` (B): clip_cov, kl_cov (covariance-targeted PPO)
- :mod:`~simkit.mappings.dro` (B): dro (REINFORCE + β/2·(log r)², an additive per-token term)
- :mod:`~simkit.mappings.dppo` (B): dppo_tv, dppo_kl (trust region on the token probability)
- :mod:`~simkit.mappings.luspo` (B): luspo (GSPO scaled by |y|)
- :mod:`~simkit.mappings.rollout` (C): rollout_is (SkyRL), segment_is (ROLL)
- :mod:`~simkit.mappings.gepo` (C): gepo (group-expectation weight, batch dependent)

:mod:`~simkit.mappings.psis` holds the Pareto smoothing (``psis_smooth``, ``psis_khat``).
"""

# isort: off
# Registration order is the order of ``available()``: keep these imports in this order.
from simkit.mappings import classic  # noqa: F401
from simkit.mappings import clipping  # noqa: F401
from simkit.mappings import soft  # noqa: F401
from simkit.mappings import truncation  # noqa: F401
from simkit.mappings import masking  # noqa: F401
from simkit.mappings import vespo  # noqa: F401
from simkit.mappings import rejection  # noqa: F401
from simkit.mappings import covariance  # noqa: F401
from simkit.mappings import dro  # noqa: F401
from simkit.mappings import dppo  # noqa: F401
from simkit.mappings import luspo  # noqa: F401
from simkit.mappings import rollout  # noqa: F401
from simkit.mappings import gepo  # noqa: F401

# isort: on
from simkit.mappings.base import (
    Mapping,
    ScalarMapping,
    as_mapping,
    available,
    get,
    mapping_class,
    register,
)
from simkit.mappings.psis import psis_khat, psis_smooth
from simkit.mappings.vespo import vespo_f, vespo_phi

__all__ = [
    "Mapping",
    "ScalarMapping",
    "as_mapping",
    "available",
    "get",
    "mapping_class",
    "psis_khat",
    "psis_smooth",
    "register",
    "vespo_f",
    "vespo_phi",
]
