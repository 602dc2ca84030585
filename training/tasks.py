"""Synthetic verifiable tasks: prompts with one exact answer, checked by exact match (no download)."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """prompt: the text the policy continues; answer: the exact expected response text."""

    prompt: str
    answer: str


class AdditionTask:
    """``"07+85="`` -> ``"092"``: the sum of two random ``digits``-digit integers, zero-padded.

    The fixed width (operands ``digits`` wide, answer ``digits + 1``) keeps every digit at a fixed
    position, which a tiny model learns far faster than variable-width numbers.

    The eval set (``eval_size`` problems, drawn with a fixed seed so every run scores the same
    problems) is held out: ``sample`` never returns an eval problem.
    """

    name = "addition"

    def __init__(self, digits: int = 2, eval_size: int = 200) -> None:
        if digits < 1:
            raise ValueError(f"`digits` must be >= 1, got {digits}")
        self.digits = digits
        self.max_value = 10**digits - 1
        n_problems = (self.max_value + 1) ** 2
        if not 0 <= eval_size <= n_problems // 2:
            raise ValueError(f"`eval_size` must be in [0, {n_problems // 2}] for {digits} digits, got {eval_size}")
        held_out: set[tuple[int, int]] = set()
        eval_rng = random.Random(12345)
        while len(held_out) < eval_size:
            held_out.add(self._draw(eval_rng))
        self._held_out = held_out
        self.eval_set = [self._problem(a, b) for a, b in sorted(held_out)]

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` training problems drawn with ``rng`` (never from the eval set)."""
        out = []
        while len(out) < n:
            pair = self._draw(rng)
            if pair not in self._held_out:
                out.append(self._problem(*pair))
        return out

    @staticmethod
    def is_correct(response: str, problem: Problem) -> bool:
        """Exact match of the decoded response (surrounding whitespace ignored)."""
        return response.strip() == problem.answer

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(0, self.max_value), rng.randint(0, self.max_value)

    def _problem(self, a: int, b: int) -> Problem:
        d = self.digits
        return Problem(prompt=f"{a:0{d}d}+{b:0{d}d}=", answer=f"{a + b:0{d + 1}d}")


TASKS = {AdditionTask.name: AdditionTask}
