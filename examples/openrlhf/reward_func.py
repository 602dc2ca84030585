"""OpenRLHF reward function (``--reward.remote_url examples/openrlhf/reward_func.py``) for MATH-style data.

OpenRLHF calls ``reward_func(queries, prompts, labels, **kwargs)`` and reads ``rewards`` (the advantage's
input, which OpenRLHF may shape further), ``scores`` (the binary task score: KTAE's correct / wrong
labels and OpenRLHF's dynamic filtering) and ``extra_logs``. Correct = the last ``\\boxed{...}`` of the
response equals the label after light normalisation (install ``math-verify`` for a stricter checker).
"""
from __future__ import annotations

import torch


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _normalise(answer: str) -> str:
    return answer.replace(" ", "").replace("\\!", "").replace("dfrac", "frac").replace("tfrac", "frac").rstrip(".")


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs) -> dict:
    correct = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if query.startswith(prompt) else query
        answer = last_boxed(response)
        correct.append(float(answer is not None and _normalise(answer) == _normalise(str(label))))
    scores = torch.tensor(correct)
    return {"rewards": scores.clone(), "scores": scores, "extra_logs": {"accuracy": scores}}
