"""Speed of the torch policy losses (``simkit.lm.losses``) for every mapping, CPU.

    python benchmarks/bench_lm_losses.py [--small] [--n 256 --t 2048 --repeats 7 --ragged
                                          --only a,b --threads K --device cpu --clock cpu]

Input: N×T float32 log-probabilities (log μ ~ −Exp(1), log π = log μ + N(0, 0.05²), a realistic
train/inference mismatch scale) with ``requires_grad``, a mask of all ones (``--ragged``: each
row keeps a random prefix of length in [T/2, T]) and advantages ±1. Baseline measured in the same
run: the bare ``(log_prob - old_log_prob).exp().mul(advantages[:, None]).mean()``, forward +
backward. For each mapping, ``--repeats`` interleaved rounds (baseline, forward, forward +
backward, forward + backward without metrics) of ``policy_loss`` (validation, loss and every
metric included), and the ratio of the best forward + backward time to the best baseline time
(target: <= 3x; best-of timings, as the other benchmarks, because a loaded machine only adds
time; the median of the per-round ratios is recorded too). ``--small`` is 32×256 (a smoke run).
``--clock cpu`` (with ``--threads 1``, CPU only) times each call by the calling thread's CPU
time (``time.thread_time``) instead of wall time: on a machine shared with other jobs the wall
time of a call also counts the other processes' time slices — more often the longer the call,
which inflates the ratios of the slower losses — while its CPU time does not (cache sharing
with the other jobs still adds some).
Results are printed as a table and written as JSON to ``benchmarks/results/bench_lm_losses.json``
(git-ignored).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from simkit.lm import losses
from simkit.mappings import mapping_class

TARGET_RATIO = 3.0


def median_time(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up (allocator, lazy imports)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_times(
    cases: dict, repeats: int, device: torch.device, clock=time.perf_counter
) -> dict[str, list]:
    """Time every case once per round, ``repeats`` rounds (after one warm-up round): the cases
    see the same machine load, so per-round ratios are robust to drift. ``clock``: wall time
    (``time.perf_counter``) or the thread's CPU time (``time.thread_time``)."""
    times = {k: [] for k in cases}
    for round_ in range(repeats + 1):
        for key, fn in cases.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = clock()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if round_:
                times[key].append(clock() - start)
    return times


def make_batch(n: int, t: int, ragged: bool, seed: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.empty(n, t).exponential_(1.0, generator=gen)
    log_prob = old + 0.05 * torch.randn(n, t, generator=gen)
    if ragged:
        lengths = torch.randint(t // 2, t + 1, (n,), generator=gen)
        mask = torch.arange(t)[None, :] < lengths[:, None]
    else:
        mask = torch.ones(n, t, dtype=torch.bool)
    advantages = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    log_prob = log_prob.to(device).requires_grad_(True)
    return log_prob, old.to(device), advantages.to(device), mask.to(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256, help="sequences N (default 256)")
    parser.add_argument("--t", type=int, default=2048, help="tokens per sequence T (2048)")
    parser.add_argument("--small", action="store_true", help="32x256 smoke run")
    parser.add_argument("--repeats", type=int, default=7, help="timings per case (median)")
    parser.add_argument("--ragged", action="store_true", help="ragged mask instead of all ones")
    parser.add_argument("--only", default="", help="comma-separated mapping names")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or the thread's CPU time (needs --threads 1 on the CPU)",
    )
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_lm_losses.json")
    )
    args, _ = parser.parse_known_args(argv)  # run_all.py passes every script the same flags
    if args.small:
        args.n, args.t = 32, 256
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.clock == "cpu" and (torch.get_num_threads() != 1 or device.type != "cpu"):
        parser.error("--clock cpu needs --threads 1 and --device cpu (one thread's CPU time)")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    log_prob, old, advantages, mask = make_batch(args.n, args.t, args.ragged, args.seed, device)
    tokens = log_prob.numel()

    def baseline():
        log_prob.grad = None
        (log_prob - old).exp().mul(advantages[:, None]).mean().backward()

    def baseline_forward():
        (log_prob - old).exp().mul(advantages[:, None]).mean()

    names = [s for s in args.only.split(",") if s] or losses.available()
    print(
        f"N={args.n} T={args.t} ({tokens / 1e6:.2f}M tokens, float32, {device}, "
        f"{torch.get_num_threads()} threads), mask {'ragged' if args.ragged else 'all ones'}, "
        f"best of {args.repeats} interleaved rounds, {args.clock} clock"
    )
    base_fwd = median_time(baseline_forward, args.repeats, device)
    print(f"baseline forward only: {base_fwd * 1e3:.2f} ms")
    print(
        f"{'mapping':<12} {'form':<10} {'level':<9} {'base ms':>8} {'fwd ms':>8} "
        f"{'fwd+bwd ms':>11} {'x base':>7} {'no-metrics ms':>14} {'x base':>7}  ok"
    )
    rows, failures = [], []
    for name in names:

        def forward(name=name):
            return losses.policy_loss(name, log_prob, old, advantages, mask)

        def forward_backward(name=name, metrics=True):
            log_prob.grad = None
            loss, _ = losses.policy_loss(
                name, log_prob, old, advantages, mask, compute_metrics=metrics
            )
            loss.backward()

        cases = {
            "base": baseline,
            "fwd": forward,
            "full": forward_backward,
            "loss": lambda name=name: forward_backward(name, metrics=False),
        }
        t = interleaved_times(cases, args.repeats, device, clock)
        med = {k: min(v) for k, v in t.items()}  # best of the rounds
        ratio = med["full"] / med["base"]
        ratio_loss = med["loss"] / med["base"]
        median_ratio = statistics.median(f / b for f, b in zip(t["full"], t["base"], strict=True))
        ok = ratio <= TARGET_RATIO
        if not ok:
            failures.append(name)
        level = mapping_class(name).level
        form = losses.loss_form(name)
        print(
            f"{name:<12} {form:<10} {level:<9} {med['base'] * 1e3:8.2f} {med['fwd'] * 1e3:8.2f} "
            f"{med['full'] * 1e3:11.2f} {ratio:7.2f} {med['loss'] * 1e3:14.2f} "
            f"{ratio_loss:7.2f}  {'yes' if ok else 'NO'}"
        )
        rows.append(
            {
                "mapping": name,
                "form": form,
                "level": level,
                "baseline_seconds": med["base"],
                "forward_seconds": med["fwd"],
                "seconds": med["full"],
                "seconds_without_metrics": med["loss"],
                "tokens_per_second": tokens / med["full"],
                "ratio_to_baseline": ratio,
                "ratio_to_baseline_without_metrics": ratio_loss,
                "median_of_round_ratios": median_ratio,
                "within_target": ok,
            }
        )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "bench_lm_losses",
                "n": args.n,
                "t": args.t,
                "ragged": args.ragged,
                "repeats": args.repeats,
                "device": str(device),
                "threads": torch.get_num_threads(),
                "clock": args.clock,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "machine": platform.processor() or platform.machine(),
                "baseline_forward_seconds": base_fwd,
                "target_ratio": TARGET_RATIO,
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"written {out}")
    if failures:
        print(f"above {TARGET_RATIO:g}x the baseline: {', '.join(failures)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
