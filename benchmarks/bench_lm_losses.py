"""Speed of the torch policy losses (``simkit.lm.losses``) for every mapping, CPU.

    python benchmarks/bench_lm_losses.py [--small] [--n 256 --t 2048 --repeats 30 --ragged
                                          --only a,b --threads 1,2 --device cpu --clock auto
                                          --malloc keep|default]

Input: N×T float32 log-probabilities (log μ ~ −Exp(1), log π = log μ + N(0, 0.05²), a realistic
train/inference mismatch scale) with ``requires_grad``, a mask of all ones (``--ragged``: each
row keeps a random prefix of length in [T/2, T]) and advantages ±1. Baseline measured in the same
run: the bare ``(log_prob - old_log_prob).exp().mul(advantages[:, None]).mean()``, forward +
backward. For each mapping, ``--repeats`` interleaved rounds (baseline, forward, forward +
backward, forward + backward without metrics) of ``policy_loss`` (validation, loss and every
metric included), and the ratio of the best forward + backward time to the best baseline time
of the same rounds (target: <= 3x; best-of timings, as the other benchmarks, because a loaded
machine only adds time; the median of the per-round ratios is recorded too). The whole table
is measured once per thread count of ``--threads`` (default 1 and 2).

Trustworthy baseline (issue 28):

- page faults: glibc returns freed blocks of >= 128 KiB to the system at once (they are
  ``mmap``-ed), so every call would fault its (N, T) temporaries in again (1.5–1.7 ms of a
  2 MB buffer on the development machine, more than the baseline itself). ``--malloc keep``
  (the default) sets ``M_MMAP_THRESHOLD`` to 32 MiB and ``M_TRIM_THRESHOLD`` to 1 GiB with
  ``mallopt`` before any tensor is made, so freed buffers stay in the heap and are reused warm
  (the same as running with ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824``);
  ``--malloc default`` leaves glibc's settings. Every case also runs once before timing.
- spread: the baseline is timed in every round of every mapping, each timed call right after
  an untimed one (so that it does not pay for the cache the previous mapping's calls left
  cold: without it its best-of rose with the weight of the mapping timed with it, 0.75 ms
  next to dual_clip, 0.90 ms next to kl_rs). 30 rounds of one mapping still leave its
  best-of 17–18 % apart between mappings on the shared machine, so a mapping's ratio divides
  by the best of the baseline timings of its group of :data:`BASELINE_GROUP` consecutive
  mappings (5 × ``--repeats`` timings, its own rounds included); the spread of these group
  baselines, (max − min) / median, is reported per thread count (target < 10 %), with the
  per-mapping spread and the ratio to the mapping's own rounds' baseline (JSON).
- clock: ``--clock auto`` (default) times one thread by its CPU time (``time.thread_time``:
  on a shared machine the wall time of a call also counts other processes' time slices, more
  often the longer the call) and two threads by wall time; ``wall`` / ``cpu`` force one
  (``cpu`` needs one thread).

``--small`` is 32×256 (a smoke run). Every ratio is printed with its target and a ``[target]``
line (``make bench`` repeats them in its summary). Results are written as JSON to
``benchmarks/results/bench_lm_losses.json`` (git-ignored).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from timing import report_target

from simkit.lm import losses
from simkit.mappings import mapping_class

TARGET_RATIO = 3.0
#: largest spread of the baseline's best-of between the groups of one table
TARGET_SPREAD = 0.10
#: consecutive mappings whose rounds' baseline timings make one baseline (best of them all)
BASELINE_GROUP = 5
#: glibc mallopt parameters (malloc.h) and the values ``--malloc keep`` sets
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 1 << 30


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks in the heap (no ``mmap`` per large allocation, no trim), so
    that a loss's temporaries are reused warm instead of page-faulted in on every call. True
    when both ``mallopt`` calls succeeded (False off glibc)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


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
    cases: dict, repeats: int, device: torch.device, clock=time.perf_counter, warm=()
) -> dict[str, list]:
    """Time every case once per round, ``repeats`` rounds (after one warm-up round): the cases
    see the same machine load, so per-round ratios are robust to drift. ``clock``: wall time
    (``time.perf_counter``) or the thread's CPU time (``time.thread_time``). The cases in
    ``warm`` run once untimed right before their timed call."""
    times = {k: [] for k in cases}
    for round_ in range(repeats + 1):
        for key, fn in cases.items():
            if key in warm:
                fn()  # untimed: the timed call finds its buffers and code in cache
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
    parser.add_argument("--repeats", type=int, default=30, help="rounds per mapping (best of)")
    parser.add_argument("--ragged", action="store_true", help="ragged mask instead of all ones")
    parser.add_argument("--only", default="", help="comma-separated mapping names")
    parser.add_argument(
        "--threads", default="1,2", help="comma-separated torch thread counts (default 1,2)"
    )
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock",
        choices=("auto", "wall", "cpu"),
        default="auto",
        help="auto: CPU time on one thread, wall time otherwise; cpu needs one thread",
    )
    parser.add_argument(
        "--malloc",
        choices=("keep", "default"),
        default="keep",
        help="keep: glibc keeps freed memory (no page faults per call); default: untouched",
    )
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_lm_losses.json")
    )
    args, _ = parser.parse_known_args(argv)  # run_all.py passes every script the same flags
    if args.small:
        args.n, args.t = 32, 256
    malloc_kept = keep_freed_memory() if args.malloc == "keep" else False
    device = torch.device(args.device)
    threads = [int(k) for k in args.threads.split(",") if k]
    if args.clock == "cpu" and (threads != [1] or device.type != "cpu"):
        parser.error("--clock cpu needs --threads 1 and --device cpu (one thread's CPU time)")

    log_prob, old, advantages, mask = make_batch(args.n, args.t, args.ragged, args.seed, device)
    names = [s for s in args.only.split(",") if s] or losses.available()
    tables = []
    for k in threads:
        torch.set_num_threads(k)
        cpu_clock = args.clock == "cpu" or (
            args.clock == "auto" and k == 1 and device.type == "cpu"
        )
        tables.append(
            measure(
                names, log_prob, old, advantages, mask, args.repeats, device, cpu_clock, malloc_kept
            )
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
                "malloc_keep_freed": malloc_kept,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "machine": platform.processor() or platform.machine(),
                "target_ratio": TARGET_RATIO,
                "target_baseline_spread": TARGET_SPREAD,
                "tables": tables,
            },
            indent=2,
        )
    )
    print(f"written {out}")
    for table in tables:
        k = table["threads"]
        report_target(
            f"baseline spread between mappings, {k} thread(s)",
            100 * table["baseline_spread"],
            100 * TARGET_SPREAD,
            "%",
        )
        for row in table["results"]:
            report_target(
                f"{row['mapping']} fwd+bwd+metrics / bare ratio, {k} thread(s)",
                row["ratio_to_baseline"],
                TARGET_RATIO,
            )
    return 0


def measure(names, log_prob, old, advantages, mask, repeats, device, cpu_clock, malloc_kept):
    """One table: every mapping's interleaved rounds at the current torch thread count."""
    clock = time.thread_time if cpu_clock else time.perf_counter
    tokens = log_prob.numel()

    def baseline():
        log_prob.grad = None
        (log_prob - old).exp().mul(advantages[:, None]).mean().backward()

    def baseline_forward():
        (log_prob - old).exp().mul(advantages[:, None]).mean()

    print(
        f"\nN={log_prob.shape[0]} T={log_prob.shape[1]} ({tokens / 1e6:.2f}M tokens, float32, "
        f"{device}, {torch.get_num_threads()} threads), mask "
        f"{'all ones' if bool(mask.all()) else 'ragged'}, best of {repeats} interleaved rounds, "
        f"{'CPU' if cpu_clock else 'wall'} clock, freed memory "
        f"{'kept by malloc' if malloc_kept else 'returned to the system (glibc default)'}"
    )
    base_fwd = median_time(baseline_forward, repeats, device)
    print(f"baseline forward only: {base_fwd * 1e3:.2f} ms")
    measured = []
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
        measured.append((name, interleaved_times(cases, repeats, device, clock, warm=("base",))))

    # the baseline of a mapping: best of the baseline timings of its group of BASELINE_GROUP
    # consecutive mappings (BASELINE_GROUP x repeats timings, its own rounds included)
    groups = [measured[i : i + BASELINE_GROUP] for i in range(0, len(measured), BASELINE_GROUP)]
    group_base = [min(b for _, t in g for b in t["base"]) for g in groups]
    print(
        f"{'mapping':<12} {'form':<10} {'level':<9} {'base ms':>8} {'fwd ms':>8} "
        f"{'fwd+bwd ms':>11} {'x base':>7} {'no-metrics ms':>14} {'x base':>7}  ok"
    )
    rows, failures = [], []
    for i, (name, t) in enumerate(measured):
        med = {k: min(v) for k, v in t.items()}  # best of the rounds
        base = group_base[i // BASELINE_GROUP]
        ratio = med["full"] / base
        ratio_loss = med["loss"] / base
        median_ratio = statistics.median(f / b for f, b in zip(t["full"], t["base"], strict=True))
        ok = ratio <= TARGET_RATIO
        if not ok:
            failures.append(name)
        level = mapping_class(name).level
        form = losses.loss_form(name)
        print(
            f"{name:<12} {form:<10} {level:<9} {base * 1e3:8.3f} {med['fwd'] * 1e3:8.2f} "
            f"{med['full'] * 1e3:11.2f} {ratio:7.2f} {med['loss'] * 1e3:14.2f} "
            f"{ratio_loss:7.2f}  {'yes' if ok else 'NO'}"
        )
        rows.append(
            {
                "mapping": name,
                "form": form,
                "level": level,
                "baseline_seconds": base,
                "baseline_own_rounds_seconds": med["base"],
                "forward_seconds": med["fwd"],
                "seconds": med["full"],
                "seconds_without_metrics": med["loss"],
                "tokens_per_second": tokens / med["full"],
                "ratio_to_baseline": ratio,
                "ratio_to_own_rounds_baseline": med["full"] / med["base"],
                "ratio_to_baseline_without_metrics": ratio_loss,
                "median_of_round_ratios": median_ratio,
                "within_target": ok,
            }
        )
    own = [row["baseline_own_rounds_seconds"] for row in rows]
    median_base = statistics.median(group_base) if group_base else float("nan")
    spread = (max(group_base) - min(group_base)) / median_base if group_base else float("nan")
    own_spread = (max(own) - min(own)) / statistics.median(own) if own else float("nan")
    print(
        f"baseline best-of per group of {BASELINE_GROUP} mappings ({BASELINE_GROUP * repeats} "
        f"timings each, {len(group_base)} groups): median {median_base * 1e3:.3f} ms, range "
        f"{min(group_base) * 1e3:.3f}-{max(group_base) * 1e3:.3f} ms, spread {100 * spread:.1f} %"
        f" (target < {100 * TARGET_SPREAD:.0f} %); per mapping ({repeats} timings each): "
        f"{min(own) * 1e3:.3f}-{max(own) * 1e3:.3f} ms, spread {100 * own_spread:.1f} %"
    )
    if failures:
        print(f"above {TARGET_RATIO:g}x the baseline: {', '.join(failures)}")
    return {
        "threads": torch.get_num_threads(),
        "clock": "cpu" if cpu_clock else "wall",
        "baseline_forward_seconds": base_fwd,
        "baseline_group": BASELINE_GROUP,
        "baseline_median_seconds": median_base,
        "baseline_spread": spread,
        "baseline_spread_per_mapping": own_spread,
        "results": rows,
    }


if __name__ == "__main__":
    raise SystemExit(main())
