"""``simkit diagnose`` on the command line (:func:`register` adds the subcommand)."""

from __future__ import annotations

from simkit.diagnose.readers import ROLES, RolloutError, flag
from simkit.diagnose.report import diagnose


def register(subparsers) -> None:
    """Add ``simkit diagnose``."""
    from simkit.cli_common import LAZY_HELP, add_command

    p = add_command(
        subparsers,
        "diagnose",
        help=LAZY_HELP["diagnose"],
        description=(
            "Read a trainer's dump with per-token log-probs of the trainer at rollout time\n"
            "(pi_old), the rollout engine (mu) and, when present, the trainer at update time\n"
            "(pi): parquet/JSONL tables (verl, TRL, NeMo-RL, prime-rl names), SkyRL's\n"
            "dump_data_batch .pkl, verl's DataProto.save_to_disk .pkl, torch.save'd .pt.\n"
            "Writes report.md, diagnose.png, metrics.json: per leg (pi_old||mu mismatch,\n"
            "pi||pi_old staleness) chi2, KL, ESS, k-hat, length profile, heavy tails, and\n"
            "the distribution-matched twin's ranking of the mappings that act on that leg\n"
            "by the scale-free error (refused when ESS < 30, k-hat > 0.7 or all rewards\n"
            "are equal), top-p/top-k\n"
            "detection, the threshold per correction family (vs --current), dashboard\n"
            "definitions of verl / TRL / ms-swift, and the validation on exact twins."
        ),
        epilog=(
            "examples:\n"
            "  simkit diagnose rollouts.parquet --out report/\n"
            "  simkit diagnose steps.jsonl --log-pi logp_train --log-mu logp_vllm --reward acc\n"
            "  simkit lm dump -b precision:bf16 --out dump.parquet\n"
            "  simkit diagnose dump.parquet --out dump-report\n"
        ),
    )
    p.add_argument(
        "rollouts",
        metavar="ROLLOUTS",
        help="a dump: .parquet, .jsonl/.json, .pkl (SkyRL, verl) or .pt (torch.save)",
    )
    p.add_argument("--out", default=None, help="report directory (default: <ROLLOUTS>.report)")
    for role in ROLES:
        p.add_argument(
            f"--{flag(role)}",
            dest=f"col_{role}",
            metavar="COLUMN",
            help=f"column of {role} (default: {', '.join(ROLES[role][:3])}, ...)",
        )
    p.add_argument(
        "--n",
        type=int,
        default=None,
        help="responses per gradient (default: the dump's group size, else 8)",
    )
    p.add_argument(
        "--aggregation",
        default="seq-mean-token-sum",
        help="loss aggregation of your trainer (default seq-mean-token-sum)",
    )
    p.add_argument(
        "--advantage",
        default=None,
        help="advantage of your trainer (default: grpo when the dump has groups, else oracle_pi)",
    )
    p.add_argument(
        "--current",
        default=None,
        metavar="SPEC",
        help="the correction you run, compared with the recommendation (e.g. tis_token:c_high=2)",
    )
    p.add_argument("--boot", type=int, default=20, help="bootstrap refits of the twin (20)")
    p.add_argument("--mappings", default=None, metavar="A,B,...", help="mappings (default all)")
    p.add_argument("--force", action="store_true", help="replace an existing report directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args) -> int:
    import sys

    from simkit.cli_common import usage_errors
    from simkit.cli_errors import CLIError

    if (args.n is not None and args.n < 1) or args.boot < 2:
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
            aggregation=args.aggregation,
            advantage=args.advantage,
            current=args.current,
            force=args.force,
        )
    print(f"wrote {path}/report.md, diagnose.png, metrics.json", file=sys.stderr)
    return 0
