"""Launch OpenRLHF's ``train_ppo_ray`` with KTAE: ``python examples/openrlhf/train_ktae_ray.py [KTAE flags] -- <OpenRLHF flags>``.

    python examples/openrlhf/train_ktae_ray.py --ktae '{"ignore_token_ids": [151643]}' -- \\
        --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 16 ...   # see run_ktae.sh

What it does: starts Ray (or joins ``RAY_ADDRESS``) with ``worker_process_setup_hook`` set to
``ktae_kernels.integrations.openrlhf.setup_hook(KTAEConfig(...), backend, metrics)``, a callable Ray
pickles to every worker, so the ``PPOTrainer`` actor builds a KTAE experience maker with the full
``KTAEConfig`` (``ignore_token_ids`` included), then runs OpenRLHF's own CLI module, which reuses the
initialised Ray. KTAE adds ``weight * score`` to OpenRLHF's group advantage (``group_norm``,
``dr_grpo``, ``rloo``, ``reinforce_baseline`` or ``reinforce``; ``gae`` is refused), labels rollouts by
the reward function's ``scores`` and logs ``ktae/*`` through ``experience.info``.

Without this launcher (e.g. ``ray job submit``), set the string hook and the settings as environment:
``--runtime-env-json '{"worker_process_setup_hook": "ktae_kernels.integrations.openrlhf.install",
"env_vars": {"KTAE_OPENRLHF": "{\\"ignore_token_ids\\": [151643]}"}}'``.

OpenRLHF (>= 0.10.2, dotted ``--group.flag`` CLI) needs CUDA and flash-attn to install; this launcher is
tested here against OpenRLHF's documented contract, not a running OpenRLHF.
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys
from typing import Any

from ktae_kernels.integrations import settings_from_mapping
from ktae_kernels.integrations.openrlhf import ESTIMATORS, setup_hook

OPENRLHF_MODULE = "openrlhf.cli.train_ppo_ray"


def runtime_env(ktae: dict[str, Any] | None = None, env_vars: dict[str, str] | None = None) -> dict[str, Any]:
    """Ray ``runtime_env`` that installs KTAE in every worker: ``ktae`` holds KTAEConfig fields plus
    optional ``backend`` and ``metrics`` (validated here, before Ray starts)."""
    settings = settings_from_mapping(ktae or {}, where="--ktae")
    return {
        "worker_process_setup_hook": setup_hook(settings.config, backend=settings.backend, metrics=settings.metrics),
        "env_vars": {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", **(env_vars or {})},
    }


def check_estimator(openrlhf_args: list[str]) -> str:
    """The ``--algo.advantage.estimator`` among OpenRLHF's flags; KTAE needs a group estimator."""
    estimator = "gae"  # OpenRLHF's default (PPO with a critic)
    for i, arg in enumerate(openrlhf_args):
        if arg == "--algo.advantage.estimator" and i + 1 < len(openrlhf_args):
            estimator = openrlhf_args[i + 1]
        elif arg.startswith("--algo.advantage.estimator="):
            estimator = arg.split("=", 1)[1]
    if estimator not in ESTIMATORS:
        raise SystemExit(f"KTAE refines a group outcome advantage: pass --algo.advantage.estimator one of "
                         f"{ESTIMATORS} (got {estimator!r})")
    return estimator


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description="OpenRLHF train_ppo_ray with KTAE", epilog="OpenRLHF flags follow --")
    parser.add_argument("--ktae", default="{}", help="JSON object of KTAEConfig fields, 'backend' and 'metrics'")
    args = parser.parse_args(ours)
    try:
        ktae = json.loads(args.ktae)
    except json.JSONDecodeError as err:
        raise SystemExit(f"--ktae must be a JSON object: {err}") from None
    env = runtime_env(ktae)
    check_estimator(theirs)

    import ray

    ray.init(runtime_env=env)  # OpenRLHF's train() reuses an initialised Ray
    sys.argv = [OPENRLHF_MODULE, *theirs]
    runpy.run_module(OPENRLHF_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
