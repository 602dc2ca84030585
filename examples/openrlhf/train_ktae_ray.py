"""Launch OpenRLHF's ``train_ppo_ray`` with KTAE: ``python examples/openrlhf/train_ktae_ray.py [--ktae JSON] -- <OpenRLHF flags>``.

    python examples/openrlhf/train_ktae_ray.py --ktae '{"ignore_token_ids": [151643]}' -- \\
        --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 16 ...   # see run_ktae.sh

Checks the settings, the estimator, OpenRLHF's version and the trainer module KTAE extends, then starts
Ray (or joins ``RAY_ADDRESS``) with ``ktae_kernels.integrations.openrlhf.runtime_env(...)``: the named
setup hook ``worker_setup`` plus the settings as JSON in ``$KTAE_OPENRLHF``, merged with OpenRLHF's own
environment defaults (a value set in this shell wins). Only the process that imports OpenRLHF's trainer
module (the ``PPOTrainer`` actor) is patched. Then it runs OpenRLHF's own CLI module, which reuses the
initialised Ray. OpenRLHF (>= 0.10.2, < 0.12) needs CUDA and flash-attn.
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys

from ktae_kernels.integrations import openrlhf as ktae_openrlhf
from ktae_kernels.integrations.shared import AdapterSettings, FrameworkMismatchError, settings_from_mapping

OPENRLHF_MODULE = "openrlhf.cli.train_ppo_ray"


def check_estimator(openrlhf_args: list[str]) -> str:
    """The ``--algo.advantage.estimator`` among OpenRLHF's flags; KTAE needs a group estimator."""
    flag = ktae_openrlhf.ESTIMATOR_FLAG
    estimator = "gae"  # OpenRLHF's default (PPO with a critic)
    for i, arg in enumerate(openrlhf_args):
        if arg == flag and i + 1 < len(openrlhf_args):
            estimator = openrlhf_args[i + 1]
        elif arg.startswith(flag + "="):
            estimator = arg.split("=", 1)[1]
    try:
        return ktae_openrlhf.check_estimator(estimator)
    except ValueError as err:
        raise SystemExit(str(err)) from None


def parse(argv: list[str]) -> tuple[AdapterSettings, list[str]]:
    """``(settings, OpenRLHF flags)`` of the command line ``[--ktae JSON] -- <OpenRLHF flags>``."""
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description="OpenRLHF train_ppo_ray with KTAE", epilog="OpenRLHF flags follow --")
    parser.add_argument("--ktae", default="{}",
                        help="JSON object of KTAEConfig fields, backend, metrics, correct_key, threads")
    args = parser.parse_args(ours)
    try:
        ktae = json.loads(args.ktae)
    except json.JSONDecodeError as err:
        raise SystemExit(f"--ktae must be a JSON object: {err}") from None
    try:
        settings = settings_from_mapping(ktae, where="--ktae")
    except ValueError as err:  # one line naming the key and the accepted ones, not a traceback
        raise SystemExit(str(err)) from None
    check_estimator(theirs)
    return settings, theirs


def main(argv: list[str] | None = None) -> None:
    settings, theirs = parse(list(sys.argv[1:] if argv is None else argv))
    try:  # before Ray starts: a version or a moved class KTAE cannot use
        ktae_openrlhf.check_trainer_module()
    except FrameworkMismatchError as err:
        raise SystemExit(str(err)) from None
    import ray

    ray.init(runtime_env=ktae_openrlhf.runtime_env(settings))  # OpenRLHF's train() reuses an initialised Ray
    sys.argv = [OPENRLHF_MODULE, *theirs]
    runpy.run_module(OPENRLHF_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
