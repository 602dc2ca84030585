"""`python -m ktae_kernels`: KTAE explained on a small built-in batch, its advantages, and a timing.

``python -m ktae_kernels --report demo.html`` also writes the batch's coloured key-token report, and
``--png demo.png`` its matplotlib summary (the ``viz`` extra). ``python -m ktae_kernels --check`` prints
the backends this machine runs and why each missing one is missing, with the fix. Every line printed
fits in ``WIDTH``.
"""
from __future__ import annotations

import argparse
import platform
import sys
import textwrap
import time

import torch

from . import KTAEConfig, __version__, available_backends, key_token_scores, token_advantage
from .registry import availability, device_problem

#: the demo's lines are shorter than this, so a terminal never wraps one.
WIDTH = 99
#: the command the demo suggests next (its duration: docs/benchmarks.md).
NEXT_BENCH = "python -m bench --quick"

#: the tokens ``demo_batch`` plants first in every correct / every wrong rollout.
PLANTED_CORRECT, PLANTED_WRONG = 7, 13


def demo_batch(seed: int = 0, groups: int = 2, rollouts: int = 8, length: int = 12, vocab: int = 20):
    """A toy batch where token 7 appears mostly in correct rollouts and token 13 in wrong ones.

    Returns ``responses`` int64 ``[groups * rollouts, length]`` (random ids in ``[0, vocab)``, then token
    7 at position 0 of the correct rollouts and 13 of the wrong ones), ``mask`` bool (the last 3
    positions randomly padded), ``rewards`` float ``[B]`` (the first half of each group 1, the rest 0)
    and ``index`` int64 ``[B]`` (group ids).
    """
    gen = torch.Generator().manual_seed(seed)
    responses = torch.randint(0, vocab, (groups * rollouts, length), generator=gen)
    rewards = (torch.arange(groups * rollouts) % rollouts < rollouts // 2).float()
    responses[:, 0] = torch.where(rewards > 0, PLANTED_CORRECT, PLANTED_WRONG)
    mask = torch.ones_like(responses, dtype=torch.bool)
    mask[:, length - 3:] = torch.rand(groups * rollouts, 3, generator=gen) > 0.5
    index = torch.arange(groups * rollouts) // rollouts
    return responses, mask, rewards, index


EXPLAIN = """\
KTAE scores every (group, token id) from a 2x2 table of the group's rollouts:
  a, b    correct / wrong rollouts that contain the token (here out of 4 / 4)
  p       Fisher exact test of the table: small = the token separates correct from wrong rollouts
  F, IG   exp(-2p) (0 when p = 1) and the information gain in bits: how strongly it separates them
  x       direction: Cohen's h of a/4 against b/4, plus (use_tf) a BM25 ratio of its frequencies
  score   2 sigmoid((F + IG) / 2 * x) - 1, in (-1, 1): + goes with correct rollouts, - with wrong
A token's advantage = its rollout's advantage A (GRPO: the group z-score of the reward)
                      + weight * score."""


def _key_table(scores, group: int, shown: int) -> list[str]:
    rows = scores.key_rows(group)
    lines = [f"Group {group}: {len(rows)} token ids; the {shown} with the smallest p (ties: largest |score|):",
             "  token  a  b       p      F     IG         x    score"]
    for i in rows[:shown]:
        token, a, b = int(scores.token[i]), int(scores.a[i]), int(scores.b[i])
        note = {PLANTED_CORRECT: "planted in the correct rollouts", PLANTED_WRONG: "planted in the wrong rollouts"}
        why = note.get(token, "one-sided: in wrong rollouts only" if a == 0 and b else
                       "one-sided: in correct rollouts only" if b == 0 and a else "")
        lines.append(f"  {token:5d} {a:2d} {b:2d}  {scores.p_value[i]:.4f}  {scores.F[i]:.3f}  {scores.IG[i]:.3f}  "
                     f"{scores.x[i]:+8.1f}  {scores.score[i]:+.4f}  {why}".rstrip())
    return lines


def _aligned(responses, mask, adv, rollout: int, label: str) -> list[str]:
    ids = [f"{t:>7d}" if m else "    pad" for t, m in zip(responses[rollout].tolist(), mask[rollout].tolist())]
    vals = [f"{v:>+7.3f}" if m else "      ." for v, m in zip(adv[rollout].tolist(), mask[rollout].tolist())]
    return [f"  rollout {rollout} ({label})", "    token id " + "".join(ids), "    advantage" + "".join(vals)]


#: the device types whose backends ``--check`` reports.
DEVICE_TYPES = {"cpu": "CPU", "cuda": "CUDA"}


def _wrapped(text: str, indent: int) -> list[str]:
    return textwrap.wrap(text, WIDTH - 1, initial_indent=" " * indent, subsequent_indent=" " * (indent + 2))


def check() -> tuple[list[str], bool]:
    """What ``--check`` prints: per device type this machine has, each backend and, where it cannot run,
    the registry's reason and fix; and whether "auto" runs its first choice on every such device type."""
    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    lines = [f"ktae_kernels {__version__}: torch {torch.__version__}{cuda}, Python {platform.python_version()}, "
             f"{platform.system()} {platform.machine()}"]
    fastest = True
    for kind, label in DEVICE_TYPES.items():
        problem = device_problem(kind)
        if problem is not None:
            lines += _wrapped(f"{label} tensors: none on this machine: {problem}", 0)
            continue
        statuses = availability(kind)
        runs = [s.name for s in statuses if s.auto and s.problem is None]
        first = next(s for s in statuses if s.auto)
        picked = f"runs {runs[0]!r}" if runs else "has no backend"
        fallback = f" instead of {first.name!r}, which is missing" if not runs or runs[0] != first.name else ""
        fastest = fastest and not fallback
        lines.append(f"{label} tensors: backend='auto' {picked}{fallback}")
        for s in statuses:
            lines += [f"  {s.name:<10} yes"] if s.problem is None else _wrapped(f"{s.name:<10} no: {s.problem}", 2)
    lines.append("Every backend 'auto' prefers on this machine is there." if fastest else
                 "backend='auto' runs a slower backend here: the fix is above.")
    return lines, fastest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ktae_kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="print the backends this machine runs and why each missing one is missing, with the "
                             "fix; exit 1 when backend='auto' runs a slower one than it prefers")
    parser.add_argument("--report", metavar="FILE.html", help="also write the demo batch's key-token HTML report")
    parser.add_argument("--png", metavar="FILE.png", help="also write its PNG summary (needs matplotlib: the viz extra)")
    args = parser.parse_args(argv)
    if args.check:
        lines, fastest = check()
        print("\n".join(lines))
        return 0 if fastest else 1

    responses, mask, rewards, index = demo_batch()
    config = KTAEConfig()
    scores = key_token_scores(responses, mask, rewards, index, config=config)
    adv = token_advantage(responses, mask, rewards, index, config=config)
    plain = key_token_scores(responses, mask, rewards, index, config=KTAEConfig(use_tf=False))
    print("ktae_kernels demo (backends here: " + ", ".join(available_backends()) + ")\n")
    print(f"The batch: 2 groups (prompts) x 8 rollouts x 12 token ids in 0..19. In each group rollouts 0-3 are\n"
          f"correct (reward 1) and 4-7 wrong (reward 0); token {PLANTED_CORRECT} is planted first in every correct "
          f"rollout,\ntoken {PLANTED_WRONG} first in every wrong one; the rest is random.\n")
    print(EXPLAIN + "\n")
    print("\n".join(_key_table(scores, 0, shown=6)))

    def plain_score(token: int) -> float:
        return plain.lookup(0, token)["score"]

    x2 = float(scores.x[torch.nonzero((scores.group == 0) & (scores.token == 2)).flatten()[0]])
    print(textwrap.fill(
        f"Why one-sided tokens (a or b = 0) score +-1 whatever their p: their BM25 ratio tf_c/tf_w is huge "
        f"(token 2: x = {x2:.0f}) and the sigmoid saturates; KTAEConfig(use_tf=False) drops the ratio (then "
        f"{PLANTED_CORRECT}: {plain_score(PLANTED_CORRECT):+.2f}, {PLANTED_WRONG}: {plain_score(PLANTED_WRONG):+.2f}, "
        f"2: {plain_score(2):+.2f}), and top / weight cap how far any token moves the advantage.", width=WIDTH) + "\n")

    base = token_advantage(responses, mask, rewards, index, config=KTAEConfig(weight=0.0))[:, 0]  # A alone
    print("Advantages (A + score of each token), aligned with the token ids ('.': padding, mask 0):")
    for rollout in (0, 4):
        kind = "correct" if rewards[rollout] > 0 else "wrong"
        print("\n".join(_aligned(responses, mask, adv, rollout, f"{kind}, A = {base[rollout]:+.3f}")))

    print("\nTime of one token_advantage call on this batch (after a warm-up call):")
    for backend in (b for b in ("reference", "torch", "cpu") if b in available_backends()):
        token_advantage(responses, mask, rewards, index, config=config, backend=backend)
        start = time.perf_counter()
        token_advantage(responses, mask, rewards, index, config=config, backend=backend)
        print(f"{backend:>10}: {1e3 * (time.perf_counter() - start):.2f} ms")

    print()
    title = "KTAE key tokens: the python -m ktae_kernels demo batch"
    if args.report:
        from .viz import write_report
        path = write_report(args.report, responses, mask, rewards, index, config=config, title=title)
        print(f"Wrote {path}\n  open it in a browser: tokens coloured by score; hover one for its table.")
    if args.png:
        from .viz import write_png
        print(f"Wrote {write_png(args.png, responses, mask, rewards, index, config=config, title=title)}")
    if not (args.report or args.png):
        print("See these key tokens coloured: python -m ktae_kernels --report demo.html --png demo.png")
    print(f"Next: `{NEXT_BENCH}` (under a minute) times every backend against the scipy\n"
          "reference, the upstream-style loop and the memory floor; `python -m bench` runs the full grid.\n"
          "`python -m ktae_kernels --check`: the backends this machine runs, and why any other is missing.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
