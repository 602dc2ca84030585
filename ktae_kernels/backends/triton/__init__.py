"""Triton backend: a whole batch in a few kernels, on CUDA (or on CPU under ``TRITON_INTERPRET=1``).

One pipeline (``pipeline``) builds every group's hash table on the device from one read of the ids,
sized from ``B``, ``L`` and the number of groups, with one read of a flag vector after the last launch.
``token_advantage`` (exact Fisher) scores the tables against the device grid of per-table statistics
(``statistics``) and writes the advantages; it can be captured in a CUDA graph (``capture``). Where the
size of the result depends on the data (``key_token_scores``, and ``fisher="upstream"``, whose float32
p-values come from the published code on the CPU), the same tables' rows are read back.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from ...config import KTAEConfig
from ...options import ExecutionOptions
from ...types import Batch, KeyTokenScores
from ..base import CapturedCall
from ..device import on_device
from . import pipeline

__all__ = ["key_token_scores", "token_advantage", "capture"]


@contextlib.contextmanager
def _launching(device: torch.device) -> Iterator[None]:
    """``on_device``; under Triton's interpreter also without numpy's floating-point warnings: it runs
    every lane in numpy, masked-off ones too (0 / 0 there is never stored), and its warnings would
    surface in the caller's code."""
    with on_device(device), np.errstate(all="ignore") if pipeline.interpreting() else contextlib.nullcontext():
        yield


def key_token_scores(batch: Batch, config: KTAEConfig, options: ExecutionOptions) -> KeyTokenScores:
    with _launching(batch.device):
        return pipeline.key_token_scores(batch, config, options.triton)


def token_advantage(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None,
                    options: ExecutionOptions) -> Tensor:
    with _launching(batch.device):
        return pipeline.token_advantage(batch, config, given, out, options.triton)


def capture(batch: Batch, config: KTAEConfig, given: Tensor | None, out: Tensor | None,
            options: ExecutionOptions) -> tuple[Tensor, CapturedCall]:
    with _launching(batch.device):
        return pipeline.capture(batch, config, given, out, options.triton)
