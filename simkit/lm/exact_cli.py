"""``simkit lm exact`` and ``simkit lm dump``: the exact top-k tree study and a rollout writer.

- ``simkit lm exact -b temperature:1.3 -b precision:bf16 -k 4 -T 6 --model smollm2``: one
  :func:`simkit.lm.exact.exact_study` per behaviour (exact mean and variance of every
  per-sample mapping on the top-k-truncated LM; batch-dependent mappings by Monte Carlo over
  exact leaf draws), printed and optionally written with ``--out``.
- ``simkit lm dump``: responses sampled from μ with per-token log-probabilities under π and μ,
  mask and rewards, written as a rollout file that ``simkit diagnose`` reads
  (:mod:`simkit.lm.dump`).

Registered by :func:`simkit.lm.cli.register`; torch is imported only when a command runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from simkit.cli_common import add_command, at_least, usage_errors
from simkit.cli_errors import CLIError
from simkit.lm import cli_options as options

EXACT_COLUMNS = (
    "estimator",
    "exact",
    "bias",
    "bias_lo",
    "bias_hi",
    "variance",
    "mse",
    "cosine",
    "ess",
    "chi2_tok",
    "chi2_seq",
)


def _load_with_target(args, k: int):
    auto = args.target is None
    if auto:
        args.target = 0
    model, tokenizer, task, eos = options.load(args)
    if auto and task.name == "token":
        from simkit.lm import exact, tasks

        target = exact.auto_target(model, task.prompt_ids(tokenizer), k)
        task = tasks.get_task(
            "token", n_prompts=task.n_prompts, vocab_size=task.vocab_size, target=target
        )
        print(f"token task: --target {target} (rank 2 of the first prompt's root)", file=sys.stderr)
    return model, tokenizer, task, eos


def add_exact(sub) -> None:
    """Add ``simkit lm exact`` to the ``lm`` subparsers ``sub``."""
    p = add_command(
        sub,
        "exact",
        help="exact bias / variance of every mapping on the top-k-truncated LM (tree)",
        description=(
            "Enumerate every response of pi restricted to its top-k tokens at each prefix\n"
            "(k^T leaves, one forward position per node, batched by depth with a KV cache),\n"
            "with mu restricted to the same support, and compute each mapping's exact mean and\n"
            "variance against the exact policy gradient (batch-dependent mappings: Monte Carlo\n"
            "over exact leaf draws, exact = False). One study per -b.\n\n" + options.BEHAVIOUR_HELP
        ),
        epilog=(
            "examples:\n"
            "  simkit lm exact -b temperature:1.3 -k 3 -T 4\n"
            "  simkit lm exact -b temperature:1.3 -b precision:bf16 -k 4 -T 6 --model smollm2\n"
            "  simkit lm exact --model smollm2 --device cuda -k 8 -T 8 --out exact.parquet\n"
        ),
    )
    options.add_model_options(p)
    p.set_defaults(target=None, max_new_tokens=6, prompts=2, func=run_exact)
    g = p.add_argument_group("tree")
    g.add_argument("-k", type=int, default=4, help="top-k support per prefix (4)")
    options.add_estimator_options(
        g, reps=400, reps_help="Monte Carlo batches for batch-dependent mappings"
    )
    g.add_argument("--batch-size", type=int, default=256, help="tree nodes per forward call")
    options.add_behaviour_option(p, help="a behaviour mu (repeatable; default: temperature:1.3)")
    p.add_argument("--out", metavar="FILE", help="write the tables (.csv or .parquet)")


def run_exact(args) -> int:
    options.check_out(args.out)
    k = at_least(args.k, "-k")
    at_least(args.n, "--n")
    at_least(args.reps, "--reps", 2)
    at_least(args.batch_size, "--batch-size")
    specs = args.behaviour or ["temperature:1.3"]
    gens = [options.parse_behaviour(s) for s in specs]
    names = options.mapping_names(args.mappings)
    model, tokenizer, task, eos = _load_with_target(args, k)
    import pandas as pd

    from simkit.lm import exact
    from simkit.lm import study as X

    tables = []
    for spec, gen in zip(specs, gens):
        with usage_errors(ValueError, MemoryError, prefix=f"-b {spec}: "):
            res = exact.exact_study(
                model,
                task,
                gen,
                X.default_estimators(names),
                k=k,
                T=args.max_new_tokens,
                n=args.n,
                params=args.params,
                tokenizer=tokenizer,
                eos_token_id=eos,
                reps=args.reps,
                seed=args.seed,
                batch_size=args.batch_size,
            )
        leaves = sum(t.n_leaves for t in res.trees)
        nodes = sum(t.n_nodes for t in res.trees)
        print(
            f"-b {spec}: {len(res.trees)} prompt(s), {nodes} forward positions, {leaves} leaves; "
            f"J(pi_k) = {res.J:.4f}, |grad J| = {float(res.table.grad_norm.iloc[0]):.4g}, "
            f"D = {res.env.D}, chi2_seq = {float(res.table.chi2_seq.iloc[0]):.4g}",
            file=sys.stderr,
        )
        if not 0 < res.J < 1:
            print(
                f"warning: J(pi_k) = {res.J}: the reward is constant on the tree, so grad J = 0 "
                "(choose another --target or task)",
                file=sys.stderr,
            )
        table = res.table.assign(behaviour=spec)
        options.print_table(table, EXACT_COLUMNS)
        tables.append(table)
    options.write_out(pd.concat(tables, ignore_index=True), args.out)
    return 0


def add_dump(sub) -> None:
    """Add ``simkit lm dump`` to the ``lm`` subparsers ``sub``."""
    p = add_command(
        sub,
        "dump",
        help="write rollouts with known mismatch in verl / TRL / long format (for diagnose)",
        description=(
            "Sample responses from mu, score them under pi and mu, and write the per-token\n"
            "log-probs, mask and rewards as a trainer logs them (verl or TRL column names, or\n"
            "a long per-token table), with <out>.meta.json holding the exact per-token chi2,\n"
            "KL and TV (over the vocabulary) that simkit diagnose should recover.\n\n"
            + options.BEHAVIOUR_HELP
        ),
        epilog=(
            "examples:\n"
            "  simkit lm dump -b temperature:1.3 --out dump.parquet\n"
            "  simkit lm dump --model smollm2 -b precision:bf16 -T 32 --format trl --out d.jsonl\n"
            "  simkit diagnose dump.parquet\n"
        ),
    )
    options.add_model_options(p)
    options.add_behaviour_option(
        p, default="temperature:1.3", help="the behaviour mu (default: %(default)s)"
    )
    p.add_argument("--n", type=int, default=256, help="responses (256)")
    p.add_argument(
        "--format",
        choices=("verl", "trl", "long"),
        default="verl",
        help="column names (default: %(default)s)",
    )
    p.add_argument("--out", required=True, metavar="FILE", help=".parquet or .jsonl")
    p.set_defaults(func=run_dump)


def run_dump(args) -> int:
    if Path(args.out).suffix not in (".parquet", ".jsonl", ".json"):
        raise CLIError(f"--out must end in .parquet or .jsonl, got {args.out!r}")
    at_least(args.n, "--n")
    gen = options.parse_behaviour(args.behaviour)
    model, tokenizer, task, eos = options.load(args)
    from simkit.lm import dump

    with usage_errors(ValueError):
        table, meta = dump.dump_table(
            model,
            task,
            gen,
            n=args.n,
            T=args.max_new_tokens,
            tokenizer=tokenizer,
            eos_token_id=eos,
            seed=args.seed,
            fmt=args.format,
        )
    path, side = dump.write(table, meta, args.out)
    print(
        f"wrote {path} ({len(table)} rows) and {side}: chi2_tok = {meta['chi2_tok']:.4g}, "
        f"kl_tok = {meta['kl_tok']:.4g} (exact over the vocabulary)",
        file=sys.stderr,
    )
    return 0
