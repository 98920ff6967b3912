"""Per-sample policy gradients on the tiny Llama: ``torch.func`` (vmap of grad) vs a Python loop.

    python benchmarks/bench_lm_grads.py [--small] [--n 64 --prompt 8 --t 24 --repeats 5
                                         --params all,norm,lm_head --threads K]

Setting: ``simkit.lm.models.tiny_llama`` (vocabulary 64, hidden 32, 2 layers, 4 query / 2
key-value heads; 22 688 parameters) in float32, ``--n`` rows of ``--prompt`` + ``--t`` random
tokens, random token weights λ (N, T). Measured: h_i = ∇θ Σ_t λ_{i,t} log π(y_{i,t} | …) for every
row i (what ``simkit.lm.experiment`` needs for per-sample gradients) with
``simkit.lm.experiment.per_sample_gradients`` — ``method="vmap"`` (``torch.func.vmap`` of
``grad`` over rows, ``functional_call``) against ``method="loop"`` (one forward + backward per
row), median of ``--repeats`` interleaved timings, for each parameter subset θ of ``--params``
(``all`` parameters, the final ``norm`` weight, the ``lm_head``). The two results are compared
(max |vmap − loop|). Also timed: building the tiny model (``tiny_llama()``, after the first
import of transformers), median of 20 builds.

``--small`` is 8 rows of 4 + 8 tokens (a smoke run). Results are printed and written as JSON to
``benchmarks/results/bench_lm_grads.json`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from simkit.lm import experiment, models

PARAM_SETS = {
    "all": lambda model: [n for n, _ in model.named_parameters()],
    "norm": lambda model: ["model.norm.weight"],
    "lm_head": lambda model: ["lm_head.weight"],
}


def interleaved_times(cases: dict, repeats: int) -> dict[str, list[float]]:
    """Time every case once per round, ``repeats`` rounds after one warm-up round."""
    times = {k: [] for k in cases}
    for round_ in range(repeats + 1):
        for key, fn in cases.items():
            start = time.perf_counter()
            fn()
            if round_:
                times[key].append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="rows N (default 64)")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens (default 8)")
    parser.add_argument("--t", type=int, default=24, help="response tokens T (default 24)")
    parser.add_argument("--small", action="store_true", help="8 rows of 4 + 8 tokens")
    parser.add_argument("--repeats", type=int, default=5, help="timings per case (median)")
    parser.add_argument("--params", default="all,norm,lm_head", help="parameter subsets")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_lm_grads.json")
    )
    args, _ = parser.parse_known_args(argv)  # run_all.py passes every script the same flags
    if args.small:
        args.n, args.prompt, args.t = 8, 4, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    subsets = [s for s in args.params.split(",") if s]
    unknown = set(subsets) - set(PARAM_SETS)
    if unknown:
        parser.error(f"unknown --params {sorted(unknown)}; choose from {sorted(PARAM_SETS)}")

    models.tiny_llama()  # import transformers once
    builds = []
    for seed in range(20):
        start = time.perf_counter()
        models.tiny_llama(seed=seed)
        builds.append(time.perf_counter() - start)
    build_ms = statistics.median(builds) * 1e3

    model = models.tiny_llama(seed=args.seed, init_std=0.5)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.n, args.prompt + args.t), generator=gen)
    weights = torch.randn(args.n, args.t, generator=gen)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"tiny_llama: {n_params} parameters, built in {build_ms:.2f} ms (median of 20); "
        f"N={args.n} rows of {args.prompt}+{args.t} tokens, float32, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} interleaved rounds"
    )
    print(
        f"{'params':<8} {'D':>7} {'vmap ms':>9} {'loop ms':>9} {'speed-up':>9} {'max |diff|':>11}"
    )
    rows = []
    for subset in subsets:
        names = PARAM_SETS[subset](model)
        D = experiment.parameter_dim(model, names)

        def run(method, names=names):
            return experiment.per_sample_gradients(
                model, names, ids, args.prompt, weights, method=method
            )

        diff = float((run("vmap") - run("loop")).abs().max())
        t = interleaved_times(
            {"vmap": lambda: run("vmap"), "loop": lambda: run("loop")}, args.repeats
        )
        speedup = statistics.median(lo / v for lo, v in zip(t["loop"], t["vmap"], strict=True))
        med = {k: statistics.median(v) for k, v in t.items()}
        print(
            f"{subset:<8} {D:>7} {med['vmap'] * 1e3:9.2f} {med['loop'] * 1e3:9.2f} "
            f"{speedup:9.2f} {diff:11.2e}"
        )
        rows.append(
            {
                "params": subset,
                "dim": D,
                "vmap_seconds": med["vmap"],
                "loop_seconds": med["loop"],
                "speedup_vmap_over_loop": speedup,
                "rows_per_second_vmap": args.n / med["vmap"],
                "rows_per_second_loop": args.n / med["loop"],
                "max_abs_difference": diff,
            }
        )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "bench_lm_grads",
                "n": args.n,
                "prompt": args.prompt,
                "t": args.t,
                "repeats": args.repeats,
                "threads": torch.get_num_threads(),
                "parameters": n_params,
                "tiny_llama_build_ms": build_ms,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "machine": platform.processor() or platform.machine(),
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
