"""Regenerate ``tests/data/dumps/``: one small synthetic batch saved by each trainer's *own*
saving code, for the readers of :mod:`simkit.diagnose.readers`.

The upstream files are read from bare git mirrors at the commits below (``git show``), written
to a temporary directory with the minimum of stand-ins for what cannot be imported here, and
run; no upstream code is committed.

- SkyRL a9564572eb8e91076be43c1bd5e4615e3de17265,
  skyrl/backends/skyrl_train/training_batch.py: ``TrainingInputBatch(...).save(path)`` as
  ``RayPPOTrainer.dump_data`` does (skyrl/train/trainer.py) after the advantages, with
  ``rewards`` and ``metadata["uids"]`` already popped. Stand-ins: ``jaxtyping`` (type hints)
  and ``make_replay_padding_indices`` (unused on this path).
- verl 1dda039b9c6311889a9c9a26040677e1254814f9, verl/protocol.py: ``DataProto.__getstate__``,
  ``serialize_single_tensor``, ``serialize_tensordict`` and ``save_to_disk`` (extracted with
  ``ast``: the module imports ray and tensordict), run with ``VERL_DATAPROTO_SERIALIZATION_
  METHOD=numpy`` (``verl_dataproto_numpy.pkl``) and with the default (``verl_dataproto_
  tensordict.pkl``: the batch is ``torch.save`` bytes of a TensorDict stand-in, which the
  reader refuses without ``tensordict``). Stand-ins: a TensorDict with ``items``,
  ``batch_size``, ``device``, ``contiguous``, ``consolidate``.
  ``verl_batch_tensors.pt``: ``torch.save({**batch.batch, "uid": ...})``, the documented hook.
- slime 624b824a898ab0ec1fcb4d373004c7f3852bf515, slime/observability/rollout_data_utils.py
  ``save_debug_rollout_data`` with slime/utils/types.py ``Sample``. Stand-in:
  ``slime.utils.misc.decode_int32_meta_array`` (unused on this path).
- NeMo-RL 7ea279abfbeb698b092856d0dab61e7cf39bc909, nemo_rl/utils/logger.py
  ``Logger.log_batched_dict_as_jsonl`` on the keys ``grpo_train`` logs (nemo_rl/algorithms/
  grpo.py: rewards, input_lengths, token_ids, token_loss_mask, sample_loss_mask, advantages,
  generation_logprobs, prev_logprobs, content). Stand-in: ``BatchedDataDict`` with
  ``make_microbatch_iterator(1)`` (slices of one).

``truth.npz`` holds the synthetic arrays (float32 as the trainers store them).

    git fetch mirrors, then:
    PYTHONPATH=. python tests/data/make_dump_fixtures.py SKYRL_GIT VERL_GIT SLIME_GIT NEMO_GIT
"""

import ast
import importlib
import os
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent / "dumps"
COMMITS = {
    "skyrl": "a9564572eb8e91076be43c1bd5e4615e3de17265",
    "verl": "1dda039b9c6311889a9c9a26040677e1254814f9",
    "slime": "624b824a898ab0ec1fcb4d373004c7f3852bf515",
    "nemo": "7ea279abfbeb698b092856d0dab61e7cf39bc909",
}


def upstream(git_dir, name, path):
    return subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", f"{COMMITS[name]}:{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def synthetic(seed=0, groups=4, per=4, T=8, prompt=3):
    """16 responses (4 prompts × 4), lengths 3..8, float32 log-probs with a small mismatch."""
    rng = np.random.default_rng(seed)
    N = groups * per
    lengths = rng.integers(3, T + 1, size=N)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
    log_mu = np.log(rng.uniform(0.05, 1.0, size=(N, T))).astype(np.float32)
    log_pi = (log_mu + 0.05 * rng.standard_normal((N, T))).astype(np.float32)
    log_mu, log_pi = log_mu * mask, log_pi * mask  # padded with 0 as trainers do
    rewards = rng.integers(0, 2, size=N).astype(np.float32)
    g = np.repeat(np.arange(groups), per)
    adv = np.zeros(N, np.float32)
    for k in range(groups):
        r = rewards[g == k]
        adv[g == k] = (r - r.mean()) / (r.std() + 1e-6)
    return {
        "log_pi": log_pi,
        "log_mu": log_mu,
        "mask": mask,
        "rewards": rewards,
        "advantages": adv,
        "group": g,
        "prompt": prompt,
    }


def write_tree(root, files):
    for rel, text in files.items():
        p = Path(root) / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def skyrl(git_dir, d, tmp):
    write_tree(
        tmp,
        {
            "skyrl/__init__.py": "",
            "skyrl/backends/__init__.py": "",
            "skyrl/backends/skyrl_train/__init__.py": "",
            "skyrl/backends/skyrl_train/utils/__init__.py": "",
            "skyrl/backends/skyrl_train/utils/replay_utils.py": (
                "def make_replay_padding_indices(*a, **k):\n    raise NotImplementedError\n"
            ),
            "skyrl/backends/skyrl_train/training_batch.py": upstream(
                git_dir, "skyrl", "skyrl/backends/skyrl_train/training_batch.py"
            ),
        },
    )
    if importlib.util.find_spec("jaxtyping") is None:
        jt = types.ModuleType("jaxtyping")
        for n in ("Bool", "Float", "Integer"):
            setattr(jt, n, type(n, (), {"__class_getitem__": classmethod(lambda c, k: c)}))
        sys.modules["jaxtyping"] = jt
    tb = importlib.import_module("skyrl.backends.skyrl_train.training_batch")
    N, T = d["mask"].shape
    adv = d["advantages"][:, None] * d["mask"]
    batch = tb.TrainingInputBatch(
        {
            "sequences": torch.zeros((N, d["prompt"] + T), dtype=torch.long),
            "attention_mask": torch.ones((N, d["prompt"] + T), dtype=torch.long),
            "loss_mask": torch.from_numpy(d["mask"].astype(np.float32)),
            "response_mask": torch.from_numpy(d["mask"]),
            "action_log_probs": torch.from_numpy(d["log_pi"]),
            "base_action_log_probs": torch.from_numpy(d["log_pi"]),
            "values": None,
            "returns": torch.from_numpy(adv.astype(np.float32)),
            "advantages": torch.from_numpy(adv.astype(np.float32)),
            "rollout_logprobs": torch.from_numpy(d["log_mu"]),
        }
    )
    batch.metadata = {"response_length": T}
    batch.save(HERE / "skyrl_global_step_1_training_input.pkl")
    # bfloat16 log-probs: TensorBatch stores them with torch.save (numpy has no bfloat16)
    batch["action_log_probs"] = torch.from_numpy(d["log_pi"]).to(torch.bfloat16)
    batch.save(HERE / "skyrl_bf16_training_input.pkl")


def verl_tensordict_stand_in():
    class TensorDict(dict):
        def __init__(self, source, batch_size):
            super().__init__(source)
            self.batch_size = torch.Size(batch_size)
            self.device = None

        def contiguous(self):
            return self

        def consolidate(self):
            return self

    TensorDict.__module__, TensorDict.__qualname__ = "tensordict._td", "TensorDict"
    sys.modules.setdefault("tensordict", types.ModuleType("tensordict"))
    sys.modules.setdefault(
        "tensordict._td", types.ModuleType("tensordict._td")
    ).TensorDict = TensorDict
    return TensorDict


def verl(git_dir, d, tmp):
    src = upstream(git_dir, "verl", "verl/protocol.py")
    tree = ast.parse(src)
    wanted = {"serialize_single_tensor", "serialize_tensordict"}
    funcs = [ast.get_source_segment(src, n) for n in tree.body if getattr(n, "name", "") in wanted]
    cls = next(n for n in tree.body if getattr(n, "name", "") == "DataProto")
    methods = [
        textwrap.dedent(ast.get_source_segment(src, n))
        for n in cls.body
        if getattr(n, "name", "") in ("__getstate__", "save_to_disk")
    ]
    TensorDict = verl_tensordict_stand_in()
    ns = {
        "torch": torch,
        "os": os,
        "pickle": __import__("pickle"),
        "Optional": __import__("typing").Optional,
        "Any": __import__("typing").Any,
        "TensorDict": TensorDict,
        "tensordict": types.SimpleNamespace(__version__="0.10.0"),
        "version": importlib.import_module("packaging.version"),
    }
    for f in funcs + methods:
        exec(f, ns)

    class DataProto:
        def __init__(self, batch, non_tensor_batch, meta_info):
            self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor_batch, meta_info

        __getstate__ = ns["__getstate__"]
        save_to_disk = ns["save_to_disk"]

    DataProto.__module__, DataProto.__qualname__ = "verl.protocol", "DataProto"
    sys.modules.setdefault("verl", types.ModuleType("verl"))
    mod = sys.modules.setdefault("verl.protocol", types.ModuleType("verl.protocol"))
    mod.DataProto = DataProto
    N, T = d["mask"].shape
    scores = np.zeros((N, T), np.float32)
    scores[np.arange(N), d["mask"].sum(1) - 1] = d["rewards"]
    tensors = {
        "responses": torch.zeros((N, T), dtype=torch.long),
        "attention_mask": torch.ones((N, d["prompt"] + T), dtype=torch.long),
        "response_mask": torch.from_numpy(d["mask"]),
        "old_log_probs": torch.from_numpy(d["log_pi"]),
        "rollout_log_probs": torch.from_numpy(d["log_mu"]),
        "token_level_scores": torch.from_numpy(scores),
        "advantages": torch.from_numpy((d["advantages"][:, None] * d["mask"]).astype(np.float32)),
    }
    uid = np.array([f"prompt-{k}" for k in d["group"]], dtype=object)
    proto = DataProto(TensorDict(tensors, [N]), {"uid": uid}, {"global_steps": 1})
    os.environ["VERL_DATAPROTO_SERIALIZATION_METHOD"] = "numpy"
    proto.save_to_disk(HERE / "verl_dataproto_numpy.pkl")
    del os.environ["VERL_DATAPROTO_SERIALIZATION_METHOD"]
    proto.save_to_disk(HERE / "verl_dataproto_tensordict.pkl")
    torch.save({**tensors, "uid": list(uid)}, HERE / "verl_batch_tensors.pt")


def slime(git_dir, d, tmp):
    write_tree(
        tmp,
        {
            "slime/__init__.py": "",
            "slime/utils/__init__.py": "",
            "slime/utils/misc.py": (
                "def decode_int32_meta_array(*a, **k):\n    raise NotImplementedError\n"
            ),
            "slime/utils/types.py": upstream(git_dir, "slime", "slime/utils/types.py"),
            "slime/observability/__init__.py": "",
            "slime/observability/rollout_data_utils.py": upstream(
                git_dir, "slime", "slime/observability/rollout_data_utils.py"
            ),
        },
    )
    Sample = importlib.import_module("slime.utils.types").Sample
    save = importlib.import_module("slime.observability.rollout_data_utils")
    samples = []
    for i, m in enumerate(d["mask"]):
        L = int(m.sum())
        samples.append(
            Sample(
                group_index=int(d["group"][i]),
                index=i,
                tokens=list(range(d["prompt"] + L)),
                response_length=L,
                reward=float(d["rewards"][i]),
                loss_mask=[1] * L,
                rollout_log_probs=[float(x) for x in d["log_mu"][i, :L]],
                status=Sample.Status.COMPLETED,
            )
        )
    save.save_debug_rollout_data(
        str(HERE / "slime_rollout_{rollout_id}.pt"), samples, rollout_id=0, evaluation=False
    )


def nemo(git_dir, d, tmp):
    src = upstream(git_dir, "nemo", "nemo_rl/utils/logger.py")
    tree = ast.parse(src)
    cls = next(n for n in tree.body if getattr(n, "name", "") == "Logger")
    meth = next(n for n in cls.body if getattr(n, "name", "") == "log_batched_dict_as_jsonl")

    class BatchedDataDict(dict):
        def make_microbatch_iterator(self, size):
            n = len(next(iter(self.values())))
            for i in range(0, n, size):
                yield BatchedDataDict({k: v[i : i + size] for k, v in self.items()})

    ns = {"BatchedDataDict": BatchedDataDict, "Any": object, "os": os, "json": __import__("json")}
    ns.update({"torch": torch, "np": np})
    exec(textwrap.dedent(ast.get_source_segment(src, meth)), ns)
    N, T = d["mask"].shape
    P = d["prompt"]
    full = np.zeros((N, P + T), np.int64)
    full[:, P:] = d["mask"]
    gen = np.zeros((N, P + T), np.float32)
    gen[:, P:] = d["log_mu"]
    prev = np.zeros((N, P + T), np.float32)
    prev[:, P:] = d["log_pi"]
    prev[:, :P] = -1.5  # the trainer's forward covers the prompt too
    log_data = {
        "content": [f"response {i}" for i in range(N)],
        "rewards": torch.from_numpy(d["rewards"]).tolist(),
        "input_lengths": torch.full((N,), P + T).tolist(),
        "token_ids": torch.zeros((N, P + T), dtype=torch.long).tolist(),
        "token_loss_mask": torch.from_numpy(full).tolist(),
        "sample_loss_mask": torch.ones(N).tolist(),
        "advantages": torch.from_numpy(d["advantages"][:, None] * full).tolist(),
        "generation_logprobs": torch.from_numpy(gen).tolist(),
        "prev_logprobs": torch.from_numpy(prev).tolist(),
    }
    logger = types.SimpleNamespace(base_log_dir=str(HERE))
    ns["log_batched_dict_as_jsonl"](logger, log_data, "nemo_rl_train_data_step1.jsonl")


def main(skyrl_git, verl_git, slime_git, nemo_git):
    HERE.mkdir(exist_ok=True)
    d = synthetic()
    np.savez(HERE / "truth.npz", **{k: v for k, v in d.items() if k != "prompt"})
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, tmp)
        skyrl(skyrl_git, d, tmp)
        verl(verl_git, d, tmp)
        slime(slime_git, d, tmp)
        nemo(nemo_git, d, tmp)


if __name__ == "__main__":
    main(*sys.argv[1:5])
    for name in ("tensordict", "tensordict._td"):  # stand-ins only while writing
        sys.modules.pop(name, None)
