"""ktae_kernels: fast, exact Key-token Advantage Estimation (KTAE) for GRPO/DAPO.

Public API: ``token_advantage``, ``key_token_scores``, ``plan_token_advantage``, ``KTAEConfig`` (the
method), ``ExecutionOptions`` (how a call runs), ``fisher_exact_pvalue``, ``KeyTokenScores``,
``available_backends``, ``clear_caches``.
"""
from .api import key_token_scores, token_advantage
from .backends.base import BackendUnavailableError, GraphCaptureError
from .caches import clear_caches
from .config import KTAEConfig
from .fisher import fisher_exact_pvalue
from .options import CudaTuning, ExecutionOptions, KernelVariant, TritonTuning
from .plan import TokenAdvantagePlan, plan_token_advantage
from .registry import available_backends
from .types import KeyTokenScores

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "CudaTuning",
    "ExecutionOptions",
    "GraphCaptureError",
    "KTAEConfig",
    "KernelVariant",
    "KeyTokenScores",
    "TokenAdvantagePlan",
    "TritonTuning",
    "available_backends",
    "clear_caches",
    "fisher_exact_pvalue",
    "key_token_scores",
    "plan_token_advantage",
    "token_advantage",
]
