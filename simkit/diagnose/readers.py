"""Reading rollouts dumped by RL trainers, without importing the trainers.

:func:`read_rollouts` turns a dump into :class:`LoadedRollouts`: per-token arrays (N, T) of
the trainer's log-probabilities at rollout time (π_old), the rollout engine's (μ), optionally
the trainer's at update time (π, the stale leg), the valid-token mask, a sequence reward (or
advantage) and per-prompt group ids. Each response is left-aligned at its first valid token
(NeMo-RL logs prompt and response together; the prompt is masked out).

Formats (chosen by the file's suffix):

- ``.parquet``, ``.jsonl``/``.json``: a table. *Wide*: one row per response with list-valued
  per-token columns. *Long*: one row per token with ``sample_id`` and ``position`` columns.
  NeMo-RL's ``train_data_step*.jsonl`` (``Logger.log_batched_dict_as_jsonl``: every value is a
  batch of one, ``[[...]]``) is unwrapped.
- ``.pkl``: a pickled batch, unpickled with stand-ins for the trainer's classes (only numpy,
  and torch for bfloat16 tensors, are imported; any other class is refused):

  * SkyRL's ``trainer.dump_data_batch=True`` file ``dumped_data/global_step_K_training_input.pkl``
    (``TensorBatch.save`` = ``pickle.dump`` of a ``TrainingInputBatch`` whose ``__getstate__``
    stores every tensor as numpy bytes, or ``torch.save`` bytes for bfloat16:
    skyrl/backends/skyrl_train/training_batch.py at SkyRL a956457);
  * verl's ``DataProto.save_to_disk`` (``pickle.dump`` of a ``DataProto``; its
    ``__getstate__`` returns ``(batch, non_tensor_batch, meta_info)`` with ``batch`` the
    numpy encoding of ``serialize_tensordict`` under ``VERL_DATAPROTO_SERIALIZATION_METHOD=
    numpy``, else ``torch.save`` bytes of a ``TensorDict``, which need the ``tensordict``
    package to read: verl/protocol.py at verl 1dda039).
- ``.pt``: a ``torch.save`` file (needs torch): slime's ``--save-debug-rollout-data`` file
  (``{"rollout_id", "samples": [Sample.to_dict(), ...]}``: slime/observability/
  rollout_data_utils.py at slime 624b824; rollout log-probs only) or a dict of tensors / lists
  (e.g. verl's ``batch.batch`` and ``batch.non_tensor_batch`` saved with ``torch.save``).

Column names recognised for each role (``ROLES``; override with ``columns``): verl, TRL,
SkyRL, NeMo-RL (``nemo_rl/algorithms/grpo.py`` at NeMo-RL 7ea279a: ``prev_logprobs``,
``generation_logprobs``, ``token_loss_mask``), prime-rl (``inference_logprobs``,
``loss_mask``: src/prime_rl/trainer/batch.py at prime-rl 559b447), slime and simkit's own.

Every error is a :class:`RolloutError` whose message starts with the file and names the field:
missing or misspelt columns (the columns found are listed, with the closest name), ragged
per-token lengths, NaN/inf on valid tokens, an empty file, an all-masked batch, and a dump
with one leg only (engine log-probs without the trainer's). numpy / pandas; torch only for
``.pt`` files and bfloat16 tensors.
"""

from __future__ import annotations

import difflib
import io
import math
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

#: accepted names of each role, in order of preference
ROLES = {
    # trainer at rollout time (π_old): verl, TRL, SkyRL, NeMo-RL, simkit
    "log_pi": (
        "old_log_probs",
        "old_per_token_logps",
        "action_log_probs",
        "prev_logprobs",
        "log_pi",
        "trainer_log_probs",
    ),
    # rollout engine (μ): verl/slime, TRL, SkyRL, NeMo-RL, prime-rl, simkit
    "log_mu": (
        "rollout_log_probs",
        "sampling_per_token_logps",
        "rollout_logprobs",
        "generation_logprobs",
        "inference_logprobs",
        "log_mu",
        "behaviour_log_probs",
    ),
    # trainer at update time (π; present when the dump has the stale leg)
    "log_pi_update": ("per_token_logps", "log_pi_update", "current_log_probs"),
    # valid tokens: SkyRL/prime-rl, NeMo-RL, verl, TRL, slime, simkit
    "mask": (
        "loss_mask",
        "token_loss_mask",
        "response_mask",
        "completion_mask",
        "loss_masks",
        "mask",
        "attention_mask",
    ),
    "reward": ("token_level_scores", "rewards", "reward", "score", "scores"),
    "advantage": ("advantages", "advantage"),
    "group": ("uid", "group_index", "prompt_index", "prompt_id", "group"),
    "id": ("sample_id", "sequence_id", "seq_id", "row"),
    "position": ("position", "token_index", "t", "pos"),
}


class RolloutError(ValueError):
    """Bad rollout input (the message names the file and the field, and what is expected)."""


@dataclass(frozen=True)
class LoadedRollouts:
    """Per-token arrays (N, T), each response left-aligned and padded after its end.

    ``log_pi``: trainer at rollout time (π_old); ``log_mu``: rollout engine (μ);
    ``log_pi_update``: trainer at update time (π) or None; ``mask``: valid tokens;
    ``rewards`` (N,): the sequence reward, or the sequence advantage when the dump has no
    reward (``reward_kind`` says which); ``groups`` (N,): per-prompt group codes 0..G−1 or
    None; ``sources``: role → column name; ``layout``: ``"wide"``, ``"long"`` or the dump's
    kind (``"skyrl"``, ``"verl"``, ``"slime"``, ``"torch"``); ``path``: the file."""

    log_pi: np.ndarray
    log_mu: np.ndarray
    mask: np.ndarray
    rewards: np.ndarray
    sources: dict
    layout: str
    log_pi_update: np.ndarray | None = None
    groups: np.ndarray | None = None
    reward_kind: str = "reward"
    path: str = ""


# --- unpickling without the trainers ----------------------------------------------------------


class _Captured:
    """Stand-in for a trainer's batch class: keeps the pickled state (``__setstate__``)."""

    def __init__(self, *args, **kwargs):
        self.state = None

    def __setstate__(self, state):
        self.state = state


def _rebuild_captured(cls, state):
    obj = _Captured()
    obj.state = state
    obj.kind = getattr(cls, "kind", "skyrl")
    return obj


def _stand_in(kind: str):
    return type(f"_{kind}_batch", (_Captured,), {"kind": kind})


def _torch_size(*args):
    return tuple(args[0]) if args else ()


class _Unpickler(pickle.Unpickler):
    """Unpickles SkyRL / verl batches into :class:`_Captured` stand-ins; refuses other code."""

    def find_class(self, module, name):
        if module.startswith("skyrl") and name.endswith("Batch"):
            return _stand_in("skyrl")
        if module.startswith("skyrl") and name == "_rebuild_tensor_batch":
            return _rebuild_captured
        if module == "verl.protocol" and name in ("DataProto", "DataProtoItem"):
            return _stand_in("verl")
        if module == "torch" and name == "Size":
            return _torch_size
        if module == "torch" and name == "device":
            return str
        if module.split(".")[0] == "numpy" or (
            module in ("builtins", "collections", "copyreg", "_codecs")
            and name
            in (
                "dict",
                "list",
                "tuple",
                "set",
                "OrderedDict",
                "defaultdict",
                "encode",
                "_reconstructor",
                "object",
                "bytearray",
                "complex",
                "slice",
                "range",
            )
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _tensor_to_numpy(x):
    """A torch tensor (any dtype, bfloat16 included) or array-like → float/int numpy array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def _skyrl_tensor(value: dict, key: str, where: str):
    fmt = value.get("format", "numpy")
    if fmt == "tensor_list":
        return None  # per-sample multimodal tensors: not needed
    if fmt == "torch":
        try:
            import torch
        except ImportError:
            raise RolloutError(
                f"{where}: {key} is stored with torch.save (bfloat16); install torch to read it"
            ) from None
        return _tensor_to_numpy(torch.load(io.BytesIO(value["data"]), weights_only=True))
    arr = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"]))
    return arr.reshape(tuple(value["shape"])).copy()


def _verl_tensor(enc, key: str, where: str):
    if len(enc) == 2:
        raise RolloutError(f"{where}: {key} is a nested (ragged) tensor; pad it before saving")
    dtype, shape, data = enc
    raw = np.frombuffer(bytes(data), dtype=np.uint8)
    if dtype == "bfloat16":  # the upper 16 bits of a float32
        u16 = raw.view(np.uint16).astype(np.uint32) << 16
        return u16.view(np.float32).reshape(tuple(shape))
    return raw.view(np.dtype(dtype)).reshape(tuple(shape)).copy()


def _batch_to_columns(path: Path) -> tuple[dict, str]:
    """A ``.pkl`` dump → (column name → array with the batch first, kind)."""
    where = str(path)
    try:
        with open(path, "rb") as f:
            obj = _Unpickler(f).load()
    except pickle.UnpicklingError as err:
        raise RolloutError(f"{where}: not a SkyRL or verl batch pickle ({err})") from None
    except Exception as err:
        raise RolloutError(f"{where}: cannot unpickle ({type(err).__name__}: {err})") from None
    kind = getattr(obj, "kind", None)
    if kind == "skyrl":
        state = obj.state or {}
        batch = state.get("batch_dict")
        if not isinstance(batch, dict):
            raise RolloutError(f"{where}: SkyRL batch without batch_dict")
        cols = {}
        for key, value in batch.items():
            if isinstance(value, dict):
                arr = _skyrl_tensor(value, key, where)
                if arr is not None:
                    cols[key] = arr
        meta = state.get("metadata") or {}
        if "uids" in meta:
            cols["uid"] = np.asarray(meta["uids"], dtype=object)
        return cols, "skyrl"
    if kind == "verl":
        state = obj.state
        if not (isinstance(state, tuple) and len(state) == 3):
            raise RolloutError(f"{where}: verl DataProto state is not (batch, non_tensor, meta)")
        batch, non_tensor, _meta = state
        cols = {}
        if isinstance(batch, bytes | bytearray):
            try:
                import tensordict  # noqa: F401
                import torch
            except ImportError:
                raise RolloutError(
                    f"{where}: this DataProto's batch is a torch.save'd TensorDict, which needs "
                    "the tensordict package to read; install it, or save with "
                    "VERL_DATAPROTO_SERIALIZATION_METHOD=numpy, or torch.save a dict of tensors"
                ) from None
            td = torch.load(io.BytesIO(bytes(batch)), weights_only=False, map_location="cpu")
            cols.update({k: _tensor_to_numpy(v) for k, v in td.items()})
        elif batch is not None:
            _size, _device, items = batch
            for key, enc in items.items():
                cols[key] = _verl_tensor(enc, key, where)
        for key, value in (non_tensor or {}).items():
            cols[key] = np.asarray(value)
        return cols, "verl"
    raise RolloutError(
        f"{where}: a pickle of {type(obj).__name__}; expected SkyRL's dump_data_batch "
        "TrainingInputBatch or verl's DataProto.save_to_disk"
    )


def _torch_file_to_columns(path: Path) -> tuple[dict, str]:
    """A ``.pt`` file: slime's debug rollout data or a dict of tensors / lists."""
    where = str(path)
    if not zipfile.is_zipfile(path):
        raise RolloutError(f"{where}: not a torch.save file")
    try:
        import torch
    except ImportError:
        raise RolloutError(f"{where}: reading .pt files needs torch") from None
    try:
        obj = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:
        raise RolloutError(f"{where}: cannot torch.load ({type(err).__name__}: {err})") from None
    if not isinstance(obj, dict):
        raise RolloutError(f"{where}: expected a dict, got {type(obj).__name__}")
    if "samples" in obj and isinstance(obj["samples"], list):
        samples = obj["samples"]
        if not samples:
            raise RolloutError(f"{where}: samples is empty")
        cols: dict = {}
        for key in ("rollout_log_probs", "loss_mask", "reward", "group_index", "index"):
            vals = [s.get(key) if isinstance(s, dict) else None for s in samples]
            if any(v is not None for v in vals):
                cols[key] = (
                    [
                        np.asarray(_tensor_to_numpy(v), dtype=float) if v is not None else None
                        for v in vals
                    ]
                    if key in ("rollout_log_probs", "loss_mask")
                    else vals
                )
        for key in ("log_pi", "old_log_probs", "trainer_log_probs"):
            vals = [s.get(key) if isinstance(s, dict) else None for s in samples]
            if any(v is not None for v in vals):
                cols[key] = [None if v is None else np.asarray(v, dtype=float) for v in vals]
        return cols, "slime"
    cols = {}
    for key, value in obj.items():
        if hasattr(value, "detach") or isinstance(value, np.ndarray):
            cols[key] = _tensor_to_numpy(value)
        elif isinstance(value, list | tuple):
            cols[key] = list(value)
    return cols, "torch"


def _columns_to_frame(cols: dict, where: str) -> pd.DataFrame:
    """Per-batch arrays → one row per response (2-D arrays become per-row lists)."""
    n = None
    for key, value in cols.items():
        if isinstance(value, list):
            size = len(value)
        else:
            size = np.shape(value)[0] if np.ndim(value) else 0
        if n is None:
            n = size
        elif size != n:
            raise RolloutError(f"{where}: {key} has {size} rows, the others {n}")
    if not n:
        raise RolloutError(f"{where}: the batch is empty")
    data = {}
    for key, value in cols.items():
        if isinstance(value, list):
            data[key] = value
        elif value.ndim == 1:
            data[key] = list(value)
        elif value.ndim == 2:
            data[key] = [np.asarray(row) for row in value]
    return pd.DataFrame(data)


def _read_table(path: Path) -> tuple[pd.DataFrame, str]:
    where = str(path)
    if not path.exists():
        raise RolloutError(f"rollout file {where!r} does not exist")
    if path.stat().st_size == 0:
        raise RolloutError(f"rollout file {where!r} is empty")
    suffix = path.suffix.lower()
    if suffix == ".pkl":
        cols, kind = _batch_to_columns(path)
        return _columns_to_frame(cols, where), kind
    if suffix == ".pt":
        cols, kind = _torch_file_to_columns(path)
        return _columns_to_frame(cols, where), kind
    try:
        if suffix == ".parquet":
            df = pd.read_parquet(path)
        elif suffix in (".jsonl", ".json"):
            df = pd.read_json(path, lines=True)
        else:
            raise RolloutError(
                f"rollout file {where!r}: expected .parquet, .jsonl, .json, .pkl or .pt, "
                f"got {suffix!r}"
            )
    except RolloutError:
        raise
    except Exception as err:  # any reader failure is a bad file
        raise RolloutError(f"cannot read {where!r}: {err}") from None
    if df.empty:
        raise RolloutError(f"rollout file {where!r} has no rows")
    return df, "table"


# --- roles ------------------------------------------------------------------------------------


def _pick(df: pd.DataFrame, role: str, override: str | None, where: str, required: bool = True):
    found = ", ".join(map(str, df.columns))
    if override is not None:
        if override not in df.columns:
            close = difflib.get_close_matches(override, list(map(str, df.columns)), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RolloutError(
                f"{where}: column {override!r} (given for {role}) is not in the file{hint}; "
                f"columns found: {found}"
            )
        return override
    for name in ROLES[role]:
        if name in df.columns:
            return name
    if required:
        close = (
            difflib.get_close_matches(ROLES[role][0], list(map(str, df.columns)), n=1, cutoff=0.75)
            or [c for c in map(str, df.columns) for r in ROLES[role] if _near(c, r)][:1]
        )
        hint = (
            f" ({close[0]!r} looks like a misspelling; name it with --{flag(role)})"
            if close
            else ""
        )
        raise RolloutError(
            f"{where}: no {role} column: expected one of {', '.join(ROLES[role])} (or name it "
            f"with --{flag(role)}){hint}; columns found: {found}"
        )
    return None


def _near(a: str, b: str) -> bool:
    return difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio() >= 0.85


def flag(role: str) -> str:
    """The CLI flag naming the column of ``role`` (``--adv-column`` for the advantage column,
    ``--advantage`` being the estimator's advantage)."""
    return "adv-column" if role == "advantage" else role.replace("_", "-")


def _as_list(value, row: int, col: str, where: str) -> np.ndarray:
    if hasattr(value, "detach"):
        value = _tensor_to_numpy(value)
    if isinstance(value, np.ndarray | list | tuple):
        try:
            arr = np.asarray(value, dtype=np.float64)
        except ValueError:
            raise RolloutError(
                f"{where}: row {row}: {col} is ragged (nested lists of different lengths)"
            ) from None
    elif value is None or (isinstance(value, float) and math.isnan(value)):
        raise RolloutError(f"{where}: row {row}: {col} is missing")
    else:
        raise RolloutError(
            f"{where}: row {row}: {col} must be a list of per-token values, got {value!r}"
        )
    if arr.ndim == 2 and arr.shape[0] == 1:  # NeMo-RL: a batch of one
        arr = arr[0]
    if arr.ndim != 1:
        raise RolloutError(f"{where}: row {row}: {col} must be a flat list, got shape {arr.shape}")
    return arr


def _scalar(value, row: int, col: str, where: str, per_token_mask=None) -> float:
    """A per-response value: a scalar, a batch of one, or per-token values (summed for
    ``token_level_scores``, the first valid token's for a repeated sequence advantage)."""
    if hasattr(value, "detach"):
        value = _tensor_to_numpy(value)
    if isinstance(value, np.ndarray | list | tuple):
        arr = np.asarray(value, dtype=float).ravel()
        if arr.size == 1:
            return float(arr[0])
        if per_token_mask is not None and arr.size == per_token_mask.size:
            if col in ROLES["advantage"]:
                vals = arr[per_token_mask]
                return float(vals[0]) if vals.size else 0.0
            return float(arr[per_token_mask].sum())
        return float(arr.sum())
    if value is None:
        raise RolloutError(f"{where}: row {row}: {col} is missing")
    return float(value)


def read_rollouts(path, columns: dict | None = None) -> LoadedRollouts:
    """Rollouts from ``path`` (module docstring: formats, names, errors). ``columns``: role →
    column name overrides (roles: the keys of :data:`ROLES`)."""
    columns = dict(columns or {})
    unknown = sorted(set(columns) - set(ROLES))
    if unknown:
        raise RolloutError(f"unknown column roles {unknown}; roles: {', '.join(ROLES)}")
    path = Path(path)
    where = str(path)
    df, kind = _read_table(path)
    lq_col = _pick(df, "log_mu", columns.get("log_mu"), where, required=False)
    lp_col = _pick(df, "log_pi", columns.get("log_pi"), where, required=False)
    if lp_col is None or lq_col is None:
        if lp_col is None and lq_col is None:
            _pick(df, "log_pi", None, where)  # the usual "no log_pi column" message
        have, miss = ("log_mu", "log_pi") if lp_col is None else ("log_pi", "log_mu")
        cols = list(map(str, df.columns))
        close = [c for c in cols for r in ROLES[miss] if _near(c, r)][:1]
        hint = (
            f" ({close[0]!r} looks like a misspelling: name it with --{flag(miss)})"
            if close
            else ""
        )
        raise RolloutError(
            f"{where}: one leg only: no {miss} column (expected one of "
            f"{', '.join(ROLES[miss])}, or name it with --{flag(miss)}){hint}, but {have} = "
            f"{lp_col or lq_col!r}; the trainer–engine mismatch needs both"
            + (
                " (slime's --save-debug-rollout-data holds the engine's log-probs only)"
                if kind == "slime"
                else ""
            )
            + f"; columns found: {', '.join(cols)}"
        )
    lu_col = _pick(df, "log_pi_update", columns.get("log_pi_update"), where, required=False)
    m_col = _pick(df, "mask", columns.get("mask"), where, required=False)
    r_col = _pick(df, "reward", columns.get("reward"), where, required=False)
    a_col = _pick(df, "advantage", columns.get("advantage"), where, required=False)
    if r_col is None and a_col is None:
        _pick(df, "reward", None, where)
    g_col = _pick(df, "group", columns.get("group"), where, required=False)
    id_col = _pick(df, "id", columns.get("id"), where, required=False)
    pos_col = _pick(df, "position", columns.get("position"), where, required=False)
    v_col = r_col or a_col
    sample = df[lp_col].iloc[0]
    wide = isinstance(sample, np.ndarray | list | tuple) or hasattr(sample, "detach")
    sources = {
        "log_pi": lp_col,
        "log_mu": lq_col,
        "log_pi_update": lu_col,
        "mask": m_col,
        "reward": v_col,
        "group": g_col,
    }
    groups_raw = None
    if wide:
        rows = []
        for i in range(len(df)):
            lp = _as_list(df[lp_col].iloc[i], i, lp_col, where)
            lq = _as_list(df[lq_col].iloc[i], i, lq_col, where)
            lu = None if lu_col is None else _as_list(df[lu_col].iloc[i], i, lu_col, where)
            m = (
                np.ones(lp.shape, dtype=bool)
                if m_col is None
                else _as_list(df[m_col].iloc[i], i, m_col, where) != 0
            )
            sizes = [(lp_col, lp.size), (lq_col, lq.size)]
            sizes += [] if m_col is None else [(m_col, m.size)]
            sizes += [] if lu is None else [(lu_col, lu.size)]
            if len({s for _, s in sizes}) > 1:
                raise RolloutError(
                    f"{where}: row {i}: per-token lengths differ: "
                    + ", ".join(
                        f"{c} has {s}" if j == 0 else f"{c} {s}" for j, (c, s) in enumerate(sizes)
                    )
                )
            r = _scalar(df[v_col].iloc[i], i, v_col, where, m)
            if m.any():  # left-align at the first valid token
                start = int(np.argmax(m))
                lp, lq, m = lp[start:], lq[start:], m[start:]
                lu = None if lu is None else lu[start:]
            rows.append((lp, lq, m, r, lu))
        T = max(x[0].size for x in rows)
        N = len(rows)
        log_pi, log_mu = np.zeros((N, T)), np.zeros((N, T))
        log_up = None if lu_col is None else np.zeros((N, T))
        mask = np.zeros((N, T), dtype=bool)
        rewards = np.empty(N)
        for i, (lp, lq, m, r, lu) in enumerate(rows):
            log_pi[i, : lp.size], log_mu[i, : lq.size], mask[i, : m.size] = lp, lq, m
            if lu is not None:
                log_up[i, : lu.size] = lu
            rewards[i] = r
        if g_col is not None:
            groups_raw = df[g_col].to_numpy()
        layout = "wide" if kind == "table" else kind
    else:
        if id_col is None or pos_col is None:
            raise RolloutError(
                f"{where}: per-token columns hold scalars (long format) but no sample id / "
                f"position column was found: expected {', '.join(ROLES['id'])} and "
                f"{', '.join(ROLES['position'])} (or --id / --position); columns found: "
                f"{', '.join(map(str, df.columns))}"
            )
        ids, inv = np.unique(df[id_col].to_numpy(), return_inverse=True)
        pos = df[pos_col].to_numpy()
        if not np.issubdtype(pos.dtype, np.integer) or pos.min() < 0:
            raise RolloutError(f"{where}: {pos_col} must hold non-negative integer positions")
        N, T = len(ids), int(pos.max()) + 1
        if pd.DataFrame({"i": inv, "p": pos}).duplicated().any():
            raise RolloutError(f"{where}: two rows share a ({id_col}, {pos_col}) pair")
        log_pi, log_mu = np.zeros((N, T)), np.zeros((N, T))
        mask = np.zeros((N, T), dtype=bool)
        log_pi[inv, pos] = df[lp_col].to_numpy(dtype=np.float64)
        log_mu[inv, pos] = df[lq_col].to_numpy(dtype=np.float64)
        log_up = None
        if lu_col is not None:
            log_up = np.zeros((N, T))
            log_up[inv, pos] = df[lu_col].to_numpy(dtype=np.float64)
        mask[inv, pos] = True if m_col is None else df[m_col].to_numpy() != 0
        per = df.groupby(inv)[v_col]
        if (per.nunique() > 1).any() and v_col != "token_level_scores":
            raise RolloutError(
                f"{where}: {v_col} differs between the tokens of one sample (long format)"
            )
        rewards = (per.sum() if v_col == "token_level_scores" else per.first()).to_numpy(float)
        if g_col is not None:
            groups_raw = df.groupby(inv)[g_col].first().to_numpy()
        layout = "long"
    for name, x in (("log_pi", log_pi), ("log_mu", log_mu), ("log_pi_update", log_up)):
        if x is None:
            continue
        bad = ~np.isfinite(x) & mask
        if bad.any():
            i, t = np.argwhere(bad)[0]
            raise RolloutError(
                f"{where}: {sources[name]} has {int(bad.sum())} NaN/inf values on valid tokens "
                f"(first: response {i}, token {t})"
            )
    if not np.all(np.isfinite(rewards)):
        i = int(np.argmax(~np.isfinite(rewards)))
        raise RolloutError(f"{where}: {v_col} has NaN/inf values (first: response {i})")
    empty = ~mask.any(axis=1)
    if empty.all():
        raise RolloutError(f"{where}: no response has a valid token ({m_col or 'mask'} is all 0)")
    keep = ~empty
    groups = None
    if groups_raw is not None:
        try:
            _, codes = np.unique(np.asarray([str(g) for g in groups_raw]), return_inverse=True)
        except TypeError as err:
            raise RolloutError(f"{where}: {g_col} cannot serve as group ids ({err})") from None
        groups = codes[keep]
    return LoadedRollouts(
        log_pi[keep],
        log_mu[keep],
        mask[keep],
        rewards[keep],
        sources,
        layout,
        log_pi_update=None if log_up is None else log_up[keep],
        groups=groups,
        reward_kind="reward" if r_col is not None else "advantage",
        path=where,
    )
