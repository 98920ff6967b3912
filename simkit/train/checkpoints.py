"""Checkpoints and chunks of a training run written to a directory: atomic writes, resume,
damage found and named.

A run's directory holds ``run.json`` (its config, seed and environment fingerprint), the table
in parquet chunks and the last two checkpoints (θ, optimizer state, RNG states, the policy
versions kept for the lag, the in-flight rollout); :func:`recover_state` resumes from the last
checkpoint whose chunks are intact, warning about every damaged file it passes over.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd

from simkit.shards import atomic_write
from simkit.train.records import records_table
from simkit.train.rollout import Rollout, TrainState
from simkit.train.worlds import as_prompts

_FORMAT = 3  # checkpoint format (2: the rollout's prompts; 3: version steps, lag in updates)
_RUN_FILE = "run.json"
CHECKPOINT_FILE = "checkpoint.npz"
#: the checkpoint before the last one, kept so that a damaged checkpoint costs one chunk
PREVIOUS_CHECKPOINT_FILE = "checkpoint-previous.npz"
_CHUNKS_DIR = "chunks"


class TrainError(ValueError):
    """An output directory cannot be used as asked (another run's directory, corrupt…)."""


def env_fingerprint(env) -> str:
    """sha256 of the environment's arrays (initial logits, automaton, reward, EOS; every
    prompt's, in order, for :class:`~simkit.train.worlds.Prompts`)."""
    h = hashlib.sha256()
    for e in as_prompts(env):
        for arr in (e.logits, e.transition, e.policy_index, e.reward):
            a = np.ascontiguousarray(arr)
            h.update(str((a.dtype.str, a.shape)).encode())
            h.update(a.tobytes())
        h.update(repr((e.eos, e.initial_state)).encode())
    return h.hexdigest()


def save_checkpoint(out_dir: Path, state: TrainState) -> None:
    """Write ``state`` as ``checkpoint.npz`` (atomically), the previous one renamed
    ``checkpoint-previous.npz``."""
    arrays = {"theta": state.theta}
    for key, value in state.opt_state.items():
        if isinstance(value, np.ndarray):
            arrays[f"opt_{key}"] = value
    if state.versions:
        arrays["versions"] = np.stack(state.versions)
    meta = {
        "format": _FORMAT,
        "step": state.step,
        "version_steps": [int(v) for v in state.version_steps],
        "opt_scalars": {k: v for k, v in state.opt_state.items() if not isinstance(v, np.ndarray)},
        "rng_sample": state.rng_sample.bit_generator.state,
        "rng_mismatch": state.rng_mismatch.bit_generator.state,
        "rollout": None,
    }
    if state.rollout is not None:
        ro = state.rollout
        meta["rollout"] = {"index": ro.index, "behind": ro.behind}
        for name in Rollout._ARRAYS:
            arrays[f"rollout_{name}"] = getattr(ro, name)
        if ro.token_age is not None:  # an asynchronous run's rollout
            meta["rollout"].update(dropped=ro.dropped, waited=ro.waited)
            for name in Rollout._OPTIONAL_ARRAYS:
                arrays[f"rollout_{name}"] = getattr(ro, name)
    arrays["meta"] = np.array(json.dumps(meta))

    def write(fh):
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        fh.write(buffer.getvalue())

    current = out_dir / CHECKPOINT_FILE
    if current.exists():  # keep the previous one: a damaged checkpoint then costs one chunk
        os.replace(current, out_dir / PREVIOUS_CHECKPOINT_FILE)
    atomic_write(current, write)


def _restore_generator(state: dict) -> np.random.Generator:
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    return np.random.Generator(bit_generator)


class DamagedCheckpointError(TrainError):
    """A checkpoint or chunk of a training directory cannot be read (torn, truncated…)."""


def _damaged(path: Path, exc: BaseException) -> DamagedCheckpointError:
    return DamagedCheckpointError(
        f"{path} is damaged and cannot be read ({type(exc).__name__}: {exc}); re-run the same "
        "'simkit train … --out DIR' command (or train(…, out_dir=DIR)): it resumes from the "
        "last intact checkpoint, or restarts the run if there is none"
    )


def _load_state(out_dir: Path, name: str = CHECKPOINT_FILE) -> TrainState:
    path = out_dir / name
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
        meta = json.loads(str(arrays.pop("meta")))
    except Exception as exc:  # BadZipFile, EOFError, OSError, ValueError, KeyError, JSON…
        raise _damaged(path, exc) from None
    if meta.get("format") != _FORMAT:
        raise TrainError(f"{path} has checkpoint format {meta.get('format')}, expected {_FORMAT}")
    opt_state = dict(meta["opt_scalars"])
    opt_state.update({k[4:]: v for k, v in arrays.items() if k.startswith("opt_")})
    versions = list(arrays["versions"]) if "versions" in arrays else []
    rollout = None
    if meta["rollout"] is not None:
        optional = {
            n: arrays[f"rollout_{n}"] for n in Rollout._OPTIONAL_ARRAYS if f"rollout_{n}" in arrays
        }
        rollout = Rollout(
            **meta["rollout"], **{n: arrays[f"rollout_{n}"] for n in Rollout._ARRAYS}, **optional
        )
    return TrainState(
        step=int(meta["step"]),
        theta=arrays["theta"],
        opt_state=opt_state,
        versions=versions,
        version_steps=list(meta["version_steps"]),
        rollout=rollout,
        rng_sample=_restore_generator(meta["rng_sample"]),
        rng_mismatch=_restore_generator(meta["rng_mismatch"]),
    )


def _chunk_damage(out_dir: Path, before: int) -> tuple[int, Path, str] | None:
    """The first chunk starting before step ``before`` whose parquet footer cannot be read."""
    import pyarrow.parquet as pq

    for first, path in chunk_files(out_dir):
        if first >= before:
            break
        try:
            pq.read_metadata(path)
        except Exception as exc:
            return first, path, f"{type(exc).__name__}: {exc}"
    return None


def recover_state(out_dir: Path) -> TrainState | None:
    """The state to resume from: the last checkpoint whose chunks are intact (None: restart).

    A damaged checkpoint falls back to the previous one; a damaged chunk to a checkpoint
    taken before it. Every fallback is reported with a ``RuntimeWarning`` naming the file.
    """
    import warnings

    def warn(message: str) -> None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    candidates: list[tuple[str, TrainState]] = []
    for name in (CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE):
        if (out_dir / name).exists():
            try:
                candidates.append((name, _load_state(out_dir, name)))
            except DamagedCheckpointError as err:
                warn(str(err).split("; re-run")[0] + "; it is not used")
    for name, state in sorted(candidates, key=lambda c: -c[1].step):
        damage = _chunk_damage(out_dir, state.step)
        if damage is None:
            if name != CHECKPOINT_FILE:
                warn(f"{out_dir}: resuming from the previous checkpoint (step {state.step})")
            return state
        warn(
            f"chunk {damage[1]} is damaged ({damage[2]}): the checkpoint of step {state.step} "
            "cannot be used"
        )
    names = (CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE)
    if chunk_files(out_dir) or any((out_dir / n).exists() for n in names):
        warn(f"{out_dir}: no intact checkpoint, the run restarts from step 0")
    return None


def checkpoint_step(out_dir) -> int:
    """Steps completed by the run in ``out_dir`` (0 if it has no checkpoint yet)."""
    path = Path(out_dir) / CHECKPOINT_FILE
    if not path.exists():
        return 0
    return _load_state(Path(out_dir)).step


def load_checkpoint(out_dir) -> tuple[int, np.ndarray]:
    """``(step, θ)`` of the last checkpoint of the run in ``out_dir``: θ is the policy's
    parameters *after* ``step`` updates, i.e. π_step of the table's row ``step`` (if any);
    (T, P, V) logits for the tabular parameterisation, else see :func:`policy_logits`."""
    path = Path(out_dir) / CHECKPOINT_FILE
    if not path.exists():
        raise TrainError(f"{out_dir} has no checkpoint ({CHECKPOINT_FILE})")
    state = _load_state(Path(out_dir))
    return state.step, state.theta


def _chunk_path(out_dir: Path, first_step: int) -> Path:
    return out_dir / _CHUNKS_DIR / f"steps-{first_step:09d}.parquet"


def chunk_files(out_dir: Path) -> list[tuple[int, Path]]:
    """``(first step, path)`` of every chunk of ``out_dir``, in step order."""
    folder = out_dir / _CHUNKS_DIR
    if not folder.is_dir():
        return []
    out = []
    for p in folder.glob("steps-*.parquet"):
        with contextlib.suppress(ValueError):
            out.append((int(p.stem.split("-", 1)[1]), p))
    return sorted(out)


def write_chunk(out_dir: Path, rows: list[dict]) -> None:
    """Write ``rows`` as one parquet chunk, named by its first step (atomically)."""
    table = records_table(rows)
    atomic_write(
        _chunk_path(out_dir, int(table["step"].iloc[0])),
        lambda fh: table.to_parquet(fh, index=False, engine="pyarrow"),
    )


def load_run(out_dir) -> pd.DataFrame:
    """The table of the run in ``out_dir``: its chunks up to the last checkpoint, in step order
    (rows a killed run wrote after its last checkpoint are not part of it)."""
    out_dir = Path(out_dir)
    if not (out_dir / _RUN_FILE).exists():
        raise TrainError(f"{out_dir} is not a simkit training directory (no {_RUN_FILE})")
    done = checkpoint_step(out_dir)
    frames = [_read_chunk(p) for first, p in chunk_files(out_dir) if first < done]
    if not frames:
        return records_table([])
    table = pd.concat(frames, ignore_index=True)
    return table[table["step"] < done].reset_index(drop=True)


def _read_chunk(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except Exception as exc:
        raise _damaged(path, exc) from None


def prepare_run_dir(out_dir: Path, description: dict) -> bool:
    """Create ``out_dir`` with ``run.json`` or check it is this run's; True if resuming."""
    stored = out_dir / _RUN_FILE
    text = json.dumps(description, sort_keys=True, indent=1, default=str)
    if stored.exists():
        previous = json.loads(stored.read_text(encoding="utf-8"))
        if previous != json.loads(text):
            diff = sorted(
                k
                for k in set(previous) | set(description)
                if previous.get(k) != json.loads(text).get(k)
            )
            raise TrainError(
                f"{out_dir} holds another training run (different {', '.join(diff)}); resume "
                "it with its own settings or choose another output directory"
            )
        return True
    if out_dir.exists() and any(out_dir.iterdir()):
        raise TrainError(
            f"{out_dir} is not empty and has no {_RUN_FILE}: choose a new or empty directory"
        )
    (out_dir / _CHUNKS_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write(stored, lambda fh: fh.write(text.encode("utf-8")))
    return False


def check_out_dir(out: Path) -> None:
    """:class:`TrainError` if ``out`` cannot be a run directory (a file, under a file…)."""
    from simkit._validation import check_output_dir

    try:
        check_output_dir(out, "out_dir")
    except ValueError as err:
        raise TrainError(str(err)) from None
