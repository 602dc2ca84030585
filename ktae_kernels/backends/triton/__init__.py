"""Triton backend: a whole batch in a few kernels, on CUDA (or on CPU under ``TRITON_INTERPRET=1``).

One pipeline (``pipeline``) builds every group's hash table on the device from one read of the ids,
sized from ``B``, ``L`` and the number of groups, with one read of a flag vector after the last launch.
``token_advantage`` (exact Fisher) scores the tables against the device grid of per-table statistics
(``statistics``) and writes the advantages; it can be captured in a CUDA graph (``capture``). Where the
size of the result depends on the data (``key_token_scores``, and ``fisher="upstream"``, whose float32
p-values come from the published code on the CPU), the same tables' rows are read back.
"""
from __future__ import annotations

from torch import Tensor

from ...config import KTAEConfig
from ...options import ExecutionOptions
from ...types import Batch, KeyTokenScores
from ..base import CapturedCall
from ..device import on_device
from . import pipeline

__all__ = ["key_token_scores", "token_advantage", "capture"]


def key_token_scores(batch: Batch, config: KTAEConfig, options: ExecutionOptions) -> KeyTokenScores:
    with on_device(batch.device):
        return pipeline.key_token_scores(batch, config, options.triton)


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None,
                    options: ExecutionOptions) -> Tensor:
    with on_device(batch.device):
        return pipeline.token_advantage(batch, config, given, out, options.triton)


def capture(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None,
            options: ExecutionOptions) -> tuple[Tensor, CapturedCall]:
    with on_device(batch.device):
        return pipeline.capture(batch, config, given, out, options.triton)
