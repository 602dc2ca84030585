"""``python -m ktae_kernels.integrations.verl --check [Hydra overrides]``: before a launch, check that
``import verl`` registers the "ktae" estimator in a fresh process with this environment (a plugin that
fails to load is otherwise only logged at DEBUG, and the job dies at its first advantage step), that
the overrides' ``algorithm.ktae`` section parses, and that the installed verl is in the supported range
with the trainer code KTAE wraps in place. Exits non-zero saying why."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Mapping, Sequence

from ..shared import FrameworkMismatchError, version_tuple
from .settings import ESTIMATOR, check_trainer_config

MODULE = "ktae_kernels.integrations.verl"
#: the name of the adapter's ``verl.plugins`` entry point (pyproject.toml).
PLUGIN = "ktae"

#: run in a fresh interpreter: exit 0 when `import verl` registered the adapter's estimator, 2 when
#: importing the adapter raises (the error is printed), 3 when verl loaded no adapter at all (printed:
#: verl's version and the value of this environment's "ktae" entry point, or null).
_PROBE = f"""
import importlib.metadata, json, sys, verl
from verl.trainer.ppo import core_algos
fn = core_algos.ADV_ESTIMATOR_REGISTRY.get({ESTIMATOR!r})
if fn is not None and getattr(fn, "__module__", "").startswith({MODULE!r}):
    sys.exit(0)
try:
    import {MODULE}
except Exception as err:
    print(f"{{type(err).__name__}}: {{err}}")
    sys.exit(2)
points = [ep.value for ep in importlib.metadata.entry_points(group="verl.plugins") if ep.name == {PLUGIN!r}]
print(json.dumps({{"verl": verl.__version__, "entry_point": points[0] if points else None}}))
sys.exit(3)
"""


def plugin_problem(env: dict[str, str] | None = None, timeout: float = 300.0) -> str | None:
    """Why ``import verl`` in a fresh process with ``env`` leaves "ktae" unregistered, or None."""
    env = dict(os.environ if env is None else env)
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode == 0:
        return None
    if proc.returncode == 2:
        return (f"verl loads {MODULE} but importing it raises, which verl logs only at DEBUG level: "
                f"{proc.stdout.strip()}")
    if proc.returncode == 3:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        return (f"`import verl` does not register the {ESTIMATOR!r} estimator: "
                f"{unregistered_cause(env, found['verl'], found['entry_point'])}")
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
    return f"`import verl` fails in a fresh process (exit {proc.returncode}):\n{tail}"


def unregistered_cause(env: Mapping[str, str], verl_version: str, entry_point: str | None) -> str:
    """Why verl, ``verl_version``, loaded no adapter in an environment ``env`` whose "ktae" entry point is
    ``entry_point`` (None: absent), and the fix. ``VERL_USE_EXTERNAL_MODULES`` naming the adapter always
    works; verl raises when that import fails."""
    modules = f"set VERL_USE_EXTERNAL_MODULES={MODULE}"
    raw = env.get("VERL_USE_EXTERNAL_PLUGINS", "auto")
    plugins = raw.strip().lower()
    if version_tuple(verl_version) < (0, 9):
        return f"verl {verl_version} loads no verl.plugins entry points (they came with verl 0.9): {modules}"
    if plugins == "none":
        return (f"VERL_USE_EXTERNAL_PLUGINS=none turns verl's plugin discovery off, so it never loads the "
                f"{PLUGIN!r} entry point: unset it, list {PLUGIN} in it, or {modules}")
    if plugins != "auto" and PLUGIN not in {name.strip() for name in plugins.split(",")}:
        return (f"VERL_USE_EXTERNAL_PLUGINS={raw!r} loads only the entry points it names, and not {PLUGIN!r}: add "
                f"{PLUGIN} to it, or {modules}")
    if entry_point is None:
        return (f"this environment has no {PLUGIN!r} verl.plugins entry point: ktae_kernels is importable but not "
                f"pip-installed here (a source folder on PYTHONPATH?); `pip install -e .` in the clone, or {modules}")
    return f"verl {verl_version} did not load the {PLUGIN!r} entry point ({entry_point}): {modules}"


def compose_config(overrides: Sequence[str], config_name: str = "ppo_trainer", config_dir: str | None = None):
    """verl's trainer config with Hydra ``overrides``, as ``verl.trainer.main_ppo`` composes it."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = config_dir or os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
        return compose(config_name, overrides=list(overrides))


def config_problem(overrides: Sequence[str], config_name: str = "ppo_trainer", config_dir: str | None = None) -> str | None:
    """Why the overrides' KTAE settings would stop a run, or None."""
    config = compose_config(overrides, config_name, config_dir)
    try:
        settings = check_trainer_config(config)
    except (ValueError, FrameworkMismatchError) as err:
        return str(err)
    if settings is None:
        return f"algorithm.adv_estimator is {config.algorithm.adv_estimator!r}, not {ESTIMATOR!r}: KTAE would not run"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="check the plugin and the overrides' algorithm.ktae")
    parser.add_argument("--config-name", default="ppo_trainer", help="verl config name (main_ppo's --config-name)")
    parser.add_argument("--config-path", default=None, help="config directory (default: verl's trainer/config)")
    parser.add_argument("overrides", nargs="*", help="the Hydra overrides of the launch")
    args = parser.parse_args(argv)
    if not args.check:
        parser.error("nothing to do: pass --check")
    problem = plugin_problem() or config_problem(args.overrides, args.config_name, args.config_path)
    if problem:
        print(f"ktae check failed: {problem}", file=sys.stderr)
        return 1
    print(f"ktae check passed: `import verl` registers {ESTIMATOR!r}; the algorithm.ktae settings parse")
    return 0
