"""Launch OpenRLHF's ``train_ppo_ray`` with KTAE: ``python examples/openrlhf/train_ktae_ray.py [--ktae JSON] -- <OpenRLHF flags>``.

    python examples/openrlhf/train_ktae_ray.py --ktae '{"ignore_token_ids": [151643]}' -- \\
        --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 16 ...   # see run_ktae.sh

Checks the settings, the estimator, the group size, OpenRLHF's version and the trainer module KTAE extends, then starts
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


def flag_value(openrlhf_args: list[str], flag: str, default: str) -> str:
    """The last value of ``flag`` among OpenRLHF's flags (``flag value`` or ``flag=value``), else ``default``."""
    value = default
    for i, arg in enumerate(openrlhf_args):
        if arg == flag and i + 1 < len(openrlhf_args):
            value = openrlhf_args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def check_flags(openrlhf_args: list[str]) -> tuple[str, int]:
    """``(estimator, n_samples_per_prompt)`` among OpenRLHF's flags: KTAE needs a group estimator and
    groups of at least 2 rollouts. OpenRLHF's defaults: ``gae`` (PPO with a critic) and 1 sample."""
    try:
        estimator = ktae_openrlhf.check_estimator(flag_value(openrlhf_args, ktae_openrlhf.ESTIMATOR_FLAG, "gae"))
        samples = flag_value(openrlhf_args, ktae_openrlhf.SAMPLES_FLAG, "1")
        return estimator, ktae_openrlhf.check_group_size(int(samples) if samples.lstrip("-").isdigit() else samples)
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
    check_flags(theirs)
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
