"""``simkit diagnose`` on the command line (:func:`register` adds the subcommand)."""

from __future__ import annotations

from simkit.diagnose.readers import ROLES, RolloutError
from simkit.diagnose.report import diagnose


def register(subparsers) -> None:
    """Add ``simkit diagnose``."""
    from simkit.cli_common import add_command

    p = add_command(
        subparsers,
        "diagnose",
        help="how off-policy are logged rollouts (chi2, KL, ESS, k-hat) and which mapping fits",
        description=(
            "Read rollouts with per-token trainer (pi) and rollout-engine (mu) log-probs,\n"
            "response mask and rewards (parquet or JSONL; verl and TRL column names are\n"
            "recognised, a long per-token format too) and write a report directory:\n"
            "report.md, diagnose.png, metrics.json (chi2, KL k1/k3, ESS, k-hat, length\n"
            "profile, heavy tails, and the distribution-matched twin's predicted bias,\n"
            "variance and MSE of every weight mapping relative to naive, ranked)."
        ),
        epilog=(
            "examples:\n"
            "  simkit diagnose rollouts.parquet --out report/\n"
            "  simkit diagnose steps.jsonl --log-pi logp_train --log-mu logp_vllm --reward acc\n"
            "  simkit lm dump -b precision:bf16 --out dump.parquet\n"
            "  simkit diagnose dump.parquet --out dump-report\n"
        ),
    )
    p.add_argument("rollouts", metavar="ROLLOUTS", help="a .parquet or .jsonl file")
    p.add_argument("--out", default=None, help="report directory (default: <ROLLOUTS>.report)")
    for role in ROLES:
        p.add_argument(
            f"--{role.replace('_', '-')}",
            dest=f"col_{role}",
            metavar="COLUMN",
            help=f"column of {role} (default: {', '.join(ROLES[role][:3])}, ...)",
        )
    p.add_argument("--n", type=int, default=8, help="batch size of the twin's estimators (8)")
    p.add_argument("--boot", type=int, default=20, help="bootstrap refits of the twin (20)")
    p.add_argument("--mappings", default=None, metavar="A,B,...", help="mappings (default all)")
    p.add_argument("--force", action="store_true", help="replace an existing report directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args) -> int:
    import sys

    from simkit.cli_common import usage_errors
    from simkit.cli_errors import CLIError

    if args.n < 1 or args.boot < 2:
        raise CLIError(f"--n must be >= 1 and --boot >= 2, got {args.n} and {args.boot}")
    names = None
    if args.mappings:
        from simkit import mappings

        names = [s.strip() for s in args.mappings.split(",") if s.strip()]
        bad = [x for x in names if x not in mappings.available()]
        if bad:
            raise CLIError(
                f"--mappings: unknown {bad}; available: {', '.join(mappings.available())}"
            )
    columns = {r: getattr(args, f"col_{r}") for r in ROLES if getattr(args, f"col_{r}")}
    out = args.out or f"{args.rollouts}.report"
    with usage_errors(RolloutError):
        path = diagnose(
            args.rollouts,
            out,
            columns=columns,
            n=args.n,
            n_boot=args.boot,
            seed=args.seed,
            mappings_=names,
            force=args.force,
        )
    print(f"wrote {path}/report.md, diagnose.png, metrics.json", file=sys.stderr)
    return 0
