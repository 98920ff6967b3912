"""Exact top-k tree enumeration (simkit.lm.exact.tree): nodes/s batched by depth vs one node
at a time, in the same run, for the tiny Llama and SmolLM2.

    python benchmarks/bench_lm_tree.py                 # tiny k=4,T=5 and SmolLM2 k=4,T=4
    python benchmarks/bench_lm_tree.py --skip smollm2  # tiny only (seconds)

"Batched by depth" is :func:`simkit.lm.exact.tree` with ``batch_size=256`` (each depth's
frontier in one forward call over the shared KV cache); "one node at a time" is the same code
with ``batch_size=1`` (one forward call per node, the KV cache still shared). Both compute the
closed-form final-norm scores. Reported: forward positions (nodes) per second and the speed-up,
best of ``--repeats`` runs, with ``--threads`` torch threads. The two trees are checked to be
identical (max |Δ log π_k|).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import best_time, report_target

from simkit.lm import exact, models


def bench(name, model, prompt, k, T, repeats, eos=None) -> dict:
    out = {"model": name, "k": k, "T": T}
    trees = {}
    for label, bs in (("batched", 256), ("one_node", 1)):
        holder = {}

        def run(bs=bs, holder=holder):
            holder["tree"] = exact.tree(
                model, prompt, k, T, "temperature:1.3", eos, params="norm", batch_size=bs
            )

        seconds = best_time(run, repeats)
        trees[label] = holder["tree"]
        nodes = holder["tree"].n_nodes
        out[f"{label}_seconds"] = seconds
        out[f"{label}_nodes_per_s"] = nodes / seconds
        out["nodes"] = nodes
    out["speedup"] = out["batched_nodes_per_s"] / out["one_node_nodes_per_s"]
    out["max_abs_diff"] = float(
        np.abs(trees["batched"].token_log_pi - trees["one_node"].token_log_pi).max()
    )
    print(
        f"{name} k={k} T={T}: {out['nodes']} nodes; batched {out['batched_nodes_per_s']:.0f} "
        f"nodes/s, one node at a time {out['one_node_nodes_per_s']:.1f} nodes/s: "
        f"{out['speedup']:.1f}x (max |Δ log π| {out['max_abs_diff']:.1e})",
        flush=True,
    )
    report_target(f"{name} k={k} T={T} tree batched / one node", out["speedup"], 10.0, above=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip", default="", help="comma-separated: tiny, smollm2")
    p.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "lm_tree.json")
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    results = []
    if "tiny" not in skip:
        model = models.tiny_llama(init_std=1.0)
        results.append(bench("tiny", model, [3, 17, 41, 8], 4, 5, args.repeats))
    if "smollm2" not in skip:
        from simkit.lm import tasks

        model, tok = models.load_smollm2(dtype=torch.float32)
        prompt = tasks.get_task("keyword", n_prompts=1, chat=False).prompt_ids(tok)[0]
        results.append(bench("smollm2", model, prompt, 4, 4, 1, tok.eos_token_id))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"benchmark": "lm_tree", "threads": args.threads, "results": results}, indent=2)
    )
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
