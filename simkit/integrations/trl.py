"""Getting rollouts out of TRL's ``GRPOTrainer`` for ``simkit diagnose``.

:class:`DumpingGRPOTrainer` is a ``trl.GRPOTrainer`` (trl 1.16; the optional extra ``trl``)
that records every generation and writes one parquet row per completion at the end of
``train()`` (to a temporary file renamed at the end: never half-written):

- ``old_per_token_logps``: the trainer's log-probabilities at rollout time (π_old), as TRL
  computes them in ``_generate_and_score_completions`` (computed when ``num_iterations > 1``,
  when gradient accumulation does not align with generation, or with vLLM's IS correction);
- ``sampling_per_token_logps``: the rollout engine's (μ). With vLLM, TRL's own column. With
  transformers' ``generate`` TRL has none; the trainer then records the log-probabilities of
  the distribution ``generate`` samples from: the same model's logits divided by the
  temperature, restricted to the top-k / top-p set and renormalised (so a top-p run shows the
  kept-mass offset, as an engine's would);
- ``per_token_logps``: the trainer's log-probabilities at the last optimisation pass over the
  completion (π at update time: the staleness leg, present when ``num_iterations > 1``);
- ``completion_mask``, ``advantages`` (TRL's, one per completion), ``rewards`` (the weighted
  sum of the reward functions, as TRL computes it before normalising), ``prompt_id`` (the
  prompt's token ids: the group of the completions of one prompt), ``generation`` (the
  generation batch index).

Usage::

    trainer = DumpingGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                                 train_dataset=..., processing_class=tok,
                                 dump_path="rollouts.parquet")
    trainer.train()
    # simkit diagnose rollouts.parquet --out report/

Single process only (the records are the local batch). Needs ``trl`` and ``pyarrow``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

try:
    from trl import GRPOTrainer
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "simkit.integrations.trl needs TRL: pip install 'simkit[trl]' (trl==1.16.0)"
    ) from err

__all__ = ["DumpingGRPOTrainer", "sampler_log_probs"]


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float | None):
    """−inf outside the top-k set and outside the smallest set of most probable tokens whose
    mass reaches ``top_p`` (the most probable token is always kept), as transformers'
    ``TopKLogitsWarper`` / ``TopPLogitsWarper`` do."""
    if top_k is not None and 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def sampler_log_probs(model, prompt_ids, prompt_mask, completion_ids, temperature, top_k, top_p):
    """log μ(y_t | …) (B, T_c) of the completions under the distribution transformers'
    ``generate`` samples from: softmax of the filtered logits/temperature (one forward)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention).logits
    P = prompt_ids.size(1)
    logits = logits[:, P - 1 : -1, :].float() / temperature
    logits = _filter_top_k_top_p(logits, top_k, top_p)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


class DumpingGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` that writes its rollouts to ``dump_path`` (module docstring)."""

    def __init__(self, *args, dump_path, **kwargs):
        self.dump_path = Path(dump_path)
        if self.dump_path.suffix != ".parquet":
            raise ValueError(f"dump_path must end in .parquet, got {str(dump_path)!r}")
        self._records: dict[int, dict] = {}
        self._generation = 0
        self._last_rewards = None
        self._capture_update = False
        self._last_update_logps = None
        super().__init__(*args, **kwargs)

    # --- recording ---------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        w = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        self._last_rewards = (rewards_per_func * w).nansum(dim=1).detach().cpu()
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        B = out["completion_ids"].size(0)
        start = len(self._records)
        mask = out["completion_mask"].detach().cpu()
        old = out.get("old_per_token_logps")
        samp = out.get("sampling_per_token_logps")
        if samp is None:
            samp = sampler_log_probs(
                self.model,
                out["prompt_ids"],
                out["prompt_mask"],
                out["completion_ids"],
                self.temperature,
                self.top_k,
                self.top_p,
            )
        rewards = self._last_rewards
        prompts = out["prompt_ids"].detach().cpu()
        pmask = out["prompt_mask"].detach().cpu().bool()
        for i in range(B):
            m = mask[i].bool()
            self._records[start + i] = {
                "generation": self._generation,
                "prompt_id": " ".join(map(str, prompts[i][pmask[i]].tolist())),
                "completion_mask": mask[i][m].tolist(),
                "old_per_token_logps": None if old is None else old[i].detach().cpu()[m].tolist(),
                "sampling_per_token_logps": samp[i].detach().cpu()[m].tolist(),
                "advantages": float(out["advantages"][i].reshape(-1)[0]),
                "rewards": float("nan")
                if rewards is None or len(rewards) != B
                else float(rewards[i]),
                "per_token_logps": None,
            }
        out["simkit_row"] = torch.arange(start, start + B, device=out["completion_ids"].device)
        self._generation += 1
        return out

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        res = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._capture_update:
            self._last_update_logps = res[0].detach().cpu()
        return res

    def _compute_loss(self, model, inputs):
        self._capture_update = True
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._capture_update = False
        rows = inputs.get("simkit_row")
        if rows is not None and self._last_update_logps is not None:
            mask = inputs["completion_mask"].detach().cpu().bool()
            for j, r in enumerate(rows.tolist()):  # the last pass over a completion wins
                self._records[r]["per_token_logps"] = self._last_update_logps[j][mask[j]].tolist()
        return loss

    # --- writing -----------------------------------------------------------------------------

    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        self.write_dump()
        return result

    def write_dump(self) -> Path:
        """Write the recorded rows to ``dump_path`` (temporary file, then renamed)."""
        import pandas as pd

        if not self._records:
            raise RuntimeError("no generation was recorded: nothing to write")
        rows = [self._records[k] for k in sorted(self._records)]
        df = pd.DataFrame(rows)
        for col in ("old_per_token_logps", "per_token_logps"):
            if df[col].isna().all():
                df = df.drop(columns=col)
        self.dump_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.dump_path.with_name(f".{self.dump_path.name}.{os.getpid()}.tmp")
        try:
            df.to_parquet(tmp, index=False)
            tmp.replace(self.dump_path)
        finally:
            if tmp.exists():
                tmp.unlink()
        return self.dump_path
