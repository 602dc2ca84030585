"""examples/: the TRL example runs (shortened); the verl launch script's overrides compose with verl's real
config tree, pass verl's own validation and drive one advantage step of verl's v1 trainer on a batch built
as verl builds it; the MATH data preparation yields rows verl's reward scores; the OpenRLHF launcher
starts Ray with the adapter's runtime_env and runs the real OpenRLHF CLI (installed with --no-deps,
its CUDA-only packages stubbed), whose own parser and checks accept run_ktae.sh's flags."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ktae_kernels import KTAEConfig, token_advantage
from ktae_kernels.integrations import openrlhf as ktae_openrlhf
from ktae_kernels.integrations.openrlhf import runtime_env, settings_from_env
from ktae_kernels.integrations.shared import AdapterSettings
from verl_fakes import FakeTransferQueue, Meta

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- TRL
def test_trl_example_runs_shortened(tmp_path, capsys):
    pytest.importorskip("trl", reason="trl not installed: pip install -e '.[trl]'")
    example = _load(EXAMPLES / "trl_grpo_ktae.py", "trl_grpo_ktae")
    summary = example.main(["--max-steps", "4", "--warmup-steps", "30", "--prompts-per-step", "4",
                            "--output-dir", str(tmp_path)])
    names = {"ktae/score_abs_mean", "ktae/key_token_share", "ktae/mixed_group_share",
             "ktae/distinct_tokens_per_group", "ktae/time_ms"}
    assert names <= set(summary) and "reward" in summary
    printed = capsys.readouterr().out
    assert "ktae/score_abs_mean=" in printed and "done in" in printed


# --------------------------------------------------------------------------------------------- verl
def _overrides(algo: str) -> list[str]:
    env = {**os.environ, "KTAE_PRINT_OVERRIDES": "1", "DATA": "/data/ktae_math", "MODEL": "/models/qwen2.5-math-7b"}
    out = subprocess.run(["bash", str(EXAMPLES / "verl" / "run_ktae.sh"), algo], env=env, capture_output=True,
                         text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def _compose(overrides: list[str]):
    verl = pytest.importorskip("verl", reason="verl not installed: pip install -e '.[verl]'")
    if tuple(int(x) for x in verl.__version__.split(".")[:2]) < (0, 9):
        pytest.skip(f"examples/verl/run_ktae.sh targets verl >= 0.9's config tree, found {verl.__version__}")
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=overrides)


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
def test_verl_script_overrides_compose_and_validate(algo):
    from omegaconf import OmegaConf

    overrides = _overrides(algo)
    config = _compose(overrides)
    OmegaConf.to_container(config, resolve=True)  # every interpolation resolves
    for override in overrides:
        key, value = override.lstrip("+").split("=", 1)
        assert OmegaConf.select(config, key) is not None, f"{key} does not resolve in verl's config"
    assert config.algorithm.adv_estimator == "ktae"
    assert config.trainer.v1.trainer_mode == "sync" and config.trainer.use_v1  # verl's own trainer
    assert config.actor_rollout_ref.rollout.n == 16 and config.data.max_response_length == 3072
    assert list(config.algorithm.ktae.ignore_token_ids) == [151643]
    if algo == "dapo":
        assert config.actor_rollout_ref.actor.clip_ratio_high == 0.28 and config.algorithm.filter_groups.enable
        assert config.reward.reward_kwargs.overlong_buffer_cfg.len == 512
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    bad = _compose(overrides + ["+algorithm.ktae.alhpa=1.0"])
    with pytest.raises(ValueError, match="alhpa"):
        validate_config(bad, use_reference_policy=need_reference_policy(bad), use_critic=need_critic(bad))


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
def test_verl_script_config_drives_one_advantage_step(monkeypatch, algo):
    """verl's v1 ``_compute_advantage`` with the script's config on 2 prompts x 16 rollouts of up to 3072
    Qwen-vocabulary tokens, stored per row in the TransferQueue as verl's agent loop stores them."""
    config = _compose(_overrides(algo))
    trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base", reason="verl v1 deps missing: '.[verl]'")
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack

    G, T, eos = config.actor_rollout_ref.rollout.n, config.data.max_response_length, 151643
    g = torch.Generator().manual_seed(0)
    B = 2 * G
    lengths = torch.randint(16, T + 1, (B,), generator=g)
    lengths[0] = T
    responses = torch.randint(0, 2000, (B, T), generator=g)  # a few thousand distinct ids, as real text
    responses[torch.arange(B), lengths - 1] = eos
    correct = torch.rand(B, generator=g) < 0.5
    scores = torch.zeros(B, T)
    score = correct.float() if algo == "grpo" else correct.float() * 2 - 1  # math: 1/0; DAPO's math: +1/-1
    scores[torch.arange(B), lengths - 1] = score
    uid = np.array([f"prompt-{i // G}" for i in range(B)], dtype=object)
    rows = lambda t: torch.nested.as_nested_tensor([r[:n] for r, n in zip(t, lengths.tolist())], layout=torch.jagged)  # noqa: E731
    store = TensorDict({"responses": rows(responses), "response_mask": rows(torch.ones(B, T, dtype=torch.long)),
                        "rm_scores": rows(scores), "uid": NonTensorStack(*uid.tolist())}, batch_size=B)
    fake = FakeTransferQueue(store)
    monkeypatch.setattr(trainer_base, "tq", fake)
    trainer = object.__new__(trainer_base.get_trainer_cls(config.trainer.v1.trainer_mode))
    trainer.config = config
    metrics = {}
    trainer._compute_advantage(Meta([f"{u}_{i}_0" for i, u in enumerate(uid)]), metrics=metrics)
    got = fake.put["advantages"].to_padded_tensor(padding=0.0)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    expected = token_advantage(responses, mask, scores, uid, config=KTAEConfig(ignore_token_ids=(eos,)),
                               correct=score > 0)
    assert got.shape == (B, T)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert {"ktae/score_abs_mean", "ktae/key_token_share", "ktae/mixed_group_share", "ktae/time_ms"} <= set(metrics)


def test_math_rows_are_scored_by_verls_reward():
    pytest.importorskip("verl", reason="verl not installed: pip install -e '.[verl]'")
    pytest.importorskip("verl.utils.reward_score.math_reward", reason="this verl has no MATH reward module")
    from verl.utils.reward_score import default_compute_score

    prep = _load(EXAMPLES / "verl" / "prepare_math.py", "prepare_math")
    records = [{"problem": "What is $2+3$?", "solution": "We add: $2+3=\\boxed{5}$.", "level": "Level 3",
                "type": "Algebra"},
               {"problem": "Easy?", "solution": "$\\boxed{1}$", "level": "Level 1", "type": "Algebra"},
               {"problem": "Find $x$.", "solution": "So $x=\\boxed{\\frac{1}{2}}$.", "level": "Level 5",
                "type": "Algebra"}]
    rows = prep.train_rows(records)
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["5", "\\frac{1}{2}"]
    assert rows[0]["prompt"][0]["role"] == "user" and "\\boxed{}" in rows[0]["prompt"][0]["content"]
    for row in rows + prep.test_rows([{"problem": "p", "answer": "7", "level": 4, "subject": "Geometry"}]):
        truth = row["reward_model"]["ground_truth"]
        assert default_compute_score(row["data_source"], f"so the answer is \\boxed{{{truth}}}", truth) == 1.0
        assert default_compute_score(row["data_source"], "so the answer is \\boxed{42}", truth) == 0.0


def test_openrlhf_rows_from_math():
    prep = _load(EXAMPLES / "verl" / "prepare_math.py", "prepare_math")
    rows = prep.openrlhf_rows(prep.test_rows([{"problem": "What is $1+1$?", "answer": "2"}]))
    assert rows == [{"prompt": f"What is $1+1$? {prep.INSTRUCTION}", "label": "2"}]


# ----------------------------------------------------------------------------------------- OpenRLHF
def test_openrlhf_reward_func_follows_the_contract():
    reward = _load(EXAMPLES / "openrlhf" / "reward_func.py", "reward_func")
    prompts = ["Q1 ", "Q2 ", "Q3 "]
    queries = ["Q1 so \\boxed{\\dfrac{1}{2}}.", "Q2 \\boxed{3}", "Q3 no answer"]
    out = reward.reward_func(queries, prompts, ["\\frac{1}{2}", "4", "1"])
    assert set(out) == {"rewards", "scores", "extra_logs"}
    assert out["scores"].tolist() == [1.0, 0.0, 0.0] and out["rewards"].shape == (3,)


def _launcher_flags() -> list[str]:
    """``run_ktae.sh``'s command line for the launcher (its one list of OpenRLHF flags)."""
    env = {**os.environ, "KTAE_PRINT_ARGS": "1"}
    return subprocess.run(["bash", str(EXAMPLES / "openrlhf" / "run_ktae.sh")], env=env, capture_output=True,
                          text=True, check=True).stdout.splitlines()


def test_openrlhf_launcher_hands_openrlhf_an_initialised_ray(monkeypatch):
    """A contract test (``ray.init`` is stubbed; tests/test_integration_openrlhf.py starts real Ray with the
    same runtime_env): the launcher checks the settings, the estimator and OpenRLHF's trainer module before
    Ray starts, starts Ray with ``runtime_env(settings)`` and runs OpenRLHF's own CLI, whose parser and
    checks accept every flag of run_ktae.sh (stopped where training would start)."""
    pytest.importorskip("openrlhf", reason="OpenRLHF not installed: pip install --no-deps openrlhf==0.11.2")
    import openrlhf.utils
    import openrlhf_real
    import ray

    launcher = _load(EXAMPLES / "openrlhf" / "train_ktae_ray.py", "train_ktae_ray")
    printed = _launcher_flags()
    started, parsed = {}, []

    def stop(args):
        parsed.append((args, ray.is_initialized()))
        raise openrlhf_real.Parsed(args)

    monkeypatch.setattr(ray, "init", lambda **kw: started.update(kw))
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(openrlhf.utils, "get_strategy", stop)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(openrlhf_real.Parsed):
        launcher.main(printed)
    (args, initialised), = parsed
    assert initialised and args.algo.advantage.estimator == "group_norm"
    assert args.rollout.n_samples_per_prompt == 16 and args.reward.remote_url == [
        str(EXAMPLES / "openrlhf" / "reward_func.py")]
    settings = AdapterSettings(KTAEConfig(ignore_token_ids=(151643,)))
    assert started["runtime_env"] == runtime_env(settings)
    assert settings_from_env(started["runtime_env"]["env_vars"]) == settings
    started.clear()
    group = ["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt=4"]
    with pytest.raises(SystemExit, match="group outcome advantage"):
        launcher.main(["--", "--algo.advantage.estimator", "gae"])
    for samples in ([], ["--rollout.n_samples_per_prompt", "1"], ["--rollout.n_samples_per_prompt=x"]):
        with pytest.raises(SystemExit, match="KTAE needs groups of rollouts: pass --rollout.n_samples_per_prompt >= 2"):
            launcher.main(["--", "--algo.advantage.estimator", "reinforce", *samples])
    with pytest.raises(SystemExit, match=r"--ktae has unknown keys \['alhpa'\] \(did you mean 'alpha'\?\)"):
        launcher.main(["--ktae", '{"alhpa": 1}', "--", *group])
    monkeypatch.setattr(ktae_openrlhf, "installed_version", lambda: "0.12.0")
    monkeypatch.delenv("KTAE_ALLOW_UNTESTED", raising=False)
    with pytest.raises(SystemExit, match="KTAE supports OpenRLHF >= 0.10.2, < 0.12; found OpenRLHF 0.12.0"):
        launcher.main(["--", *group])
    assert not started


def test_openrlhf_launcher_names_an_unknown_key_in_one_line():
    """``train_ktae_ray.py --ktae '{"alhpa": 1}'`` as a user runs it: exit status 1 and one line on stderr
    naming the key, the likely one, and every accepted key; no traceback."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "openrlhf" / "train_ktae_ray.py"), "--ktae", '{"alhpa": 1}',
                           "--", "--algo.advantage.estimator", "group_norm"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent),
                                                                             os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("--ktae has unknown keys ['alhpa'] (did you mean 'alpha'?); expected KTAEConfig fields [")
    for key in ("alpha", "beta", "weight", "ignore_token_ids", "backend", "metrics", "correct_key", "threads"):
        assert repr(key) in line


def test_verl_script_checks_the_plugin_before_launching(tmp_path):
    """run_ktae.sh runs ``--check`` with its own overrides, then ``main_ppo``, both with
    ``VERL_USE_EXTERNAL_MODULES`` naming the adapter (verl raises when that import fails); a failed check
    stops the script before ``main_ppo``. ``python3`` is a stand-in that records its calls."""
    log = tmp_path / "calls"
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text('#!/usr/bin/env bash\necho "$VERL_USE_EXTERNAL_MODULES|$*" >> "$CALLS"\n'
                    '[[ "$3" == "--check" ]] && exit "${CHECK_RC:-0}"\nexit 0\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}", "CALLS": str(log),
           "VERL_USE_EXTERNAL_MODULES": "my_plugin", "DATA": "/data/ktae_math", "MODEL": "/models/qwen2.5-math-7b"}
    script = str(EXAMPLES / "verl" / "run_ktae.sh")
    subprocess.run(["bash", script, "dapo", "trainer.total_epochs=1"], env=env, check=True)
    check, launch = log.read_text().splitlines()
    overrides = " ".join(_overrides("dapo") + ["trainer.total_epochs=1"])
    assert check == f"my_plugin,ktae_kernels.integrations.verl|-m ktae_kernels.integrations.verl --check {overrides}"
    assert launch == f"my_plugin,ktae_kernels.integrations.verl|-m verl.trainer.main_ppo {overrides}"
    log.unlink()
    failed = subprocess.run(["bash", script, "grpo"], env={**env, "CHECK_RC": "1"}, capture_output=True)
    assert failed.returncode == 1 and len(log.read_text().splitlines()) == 1


def test_verl_script_overrides_pass_the_check():
    """The script's own overrides pass ``--check``'s settings part (its plugin part: test_integration_verl)."""
    pytest.importorskip("verl", reason="verl not installed: pip install -e '.[verl]'")
    from ktae_kernels.integrations.verl.check import config_problem

    for algo in ("grpo", "dapo"):
        assert config_problem(_overrides(algo)) is None


# --------------------------------------------------------------------------------- install lines
#: files a user copies install commands from.
INSTALL_DOCS = ["README.md", "docs/*.md", "examples/**/*.md", "examples/**/*.sh", "examples/**/*.py",
                "ktae_kernels/integrations/**/*.py"]


def _install_lines() -> list[tuple[str, str]]:
    """``(file, command)`` for every ``pip install ...`` command (up to a comment, backtick or ``&&``)."""
    import re

    root = EXAMPLES.parent
    paths = sorted({path for pattern in INSTALL_DOCS for path in root.glob(pattern)})
    return [(str(path.relative_to(root)), command.strip()) for path in paths
            for command in re.findall(r"pip install(?:(?!  #|`|&&|\\).)*", path.read_text())]


def test_install_lines_never_name_the_package_from_pypi():
    """ktae_kernels is not on PyPI: every install line installs it from a clone (``-e .``, ``.[extra]``), a
    built sdist or wheel file, or ``git+`` with a URL whose owner is a plain ``<placeholder>``."""
    import re

    lines = _install_lines()
    assert len(lines) >= 8
    from_git = re.compile(r"""["']?[\w.-]+(\[[^\]]*\])?\s*@\s*git\+[^\s"']+["']?""")
    for where, command in lines:
        rest = re.sub(r"\S*ktae[_-]kernels-\S*\.(whl|tar\.gz)", "", from_git.sub("", command))  # a built file
        assert not re.search(r"ktae[_-]kernels", rest), f"{where}: `{command}` installs ktae_kernels from PyPI, where it is not"
        for url in re.findall(r"git\+(\S+)", command):
            assert re.search(r"/<[a-z-]+>/", url), f"{where}: `{command}`: the git URL's owner must be a <placeholder>"


def test_openrlhf_is_installed_through_its_extra():
    """Users install OpenRLHF through the ``openrlhf`` extra (its pins are the adapter's range); the only
    other OpenRLHF install lines are the tests' ``--no-deps`` ones."""
    import re

    lines = _install_lines()
    for where, command in lines:
        bare = re.sub(r"\[[^\]]*\]", "", command)  # extras such as ".[test,openrlhf]" aside
        if re.search(r"openrlhf", bare, re.I):
            assert "--no-deps" in command, f"{where}: `{command}` installs OpenRLHF outside the `openrlhf` extra"
    users = {where for where, command in lines if re.search(r"\[[^\]]*\bopenrlhf\b[^\]]*\]", command)}
    assert {"README.md", "examples/README.md", "examples/openrlhf/run_ktae.sh"} <= users, users


def _frameworks():
    """``(name pattern, extra, (minimum, below))`` of each adapter, from its own constants."""
    pytest.importorskip("trl")
    pytest.importorskip("verl")
    from ktae_kernels.integrations import trl as ktae_trl
    from ktae_kernels.integrations.verl import framework as ktae_verl

    return [("verl", "verl", (ktae_verl.MIN_VERSION, ktae_verl.BELOW_VERSION)),
            ("TRL", "trl", (ktae_trl.MIN_VERSION, ktae_trl.BELOW_VERSION)),
            ("OpenRLHF", "openrlhf", (ktae_openrlhf.MIN_VERSION, ktae_openrlhf.BELOW_VERSION))]


def test_extras_docs_and_changelog_state_the_adapters_ranges():
    """pyproject's framework extras pin exactly each adapter's tested range, and every place a user reads
    a range (README, CHANGELOG, docs, examples) states that range with its upper bound."""
    import re
    import tomllib

    from packaging.requirements import Requirement

    root = EXAMPLES.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    texts = {str(p.relative_to(root)): p.read_text() for pattern in ("README.md", "CHANGELOG.md", "docs/*.md",
                                                                      "examples/**/*.md", "examples/**/*.sh",
                                                                      "examples/**/*.py") for p in root.glob(pattern)}
    for name, extra, (minimum, below) in _frameworks():
        (pin,) = [Requirement(r) for r in extras[extra] if Requirement(r).name == extra]
        assert {(s.operator, s.version) for s in pin.specifier} == {(">=", minimum), ("<", below)}, extra
        stated = {}
        for where, text in texts.items():
            for match in re.finditer(rf"(?i)\b{name}\b[^\n>]{{0,60}}>=\s*{re.escape(minimum)}(?![\d.])([^\n]{{0,12}})",
                                     text):
                assert re.match(rf",\s*<\s*{re.escape(below)}(?![\d.])", match.group(1)), \
                    f"{where}: `{match.group(0)}` does not state {name}'s range >= {minimum}, < {below}"
                stated[where] = True
        assert {"README.md", "CHANGELOG.md", "docs/integrations.md"} <= set(stated), (name, sorted(stated))


def test_examples_readme_openrlhf_snippets_run(monkeypatch):
    """examples/README.md's OpenRLHF Python block starts Ray with the adapter's runtime_env (``ray.init`` is
    stubbed: a contract test), and its ``ray job submit`` JSON names the setup hook and parses as settings."""
    import json
    import re

    ray = pytest.importorskip("ray")
    text = (EXAMPLES / "README.md").read_text()
    block, = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "runtime_env" in b]
    started = {}
    monkeypatch.setattr(ray, "init", lambda **kw: started.update(kw))
    exec(compile(block, "examples/README.md", "exec"), {})
    assert started["runtime_env"] == runtime_env(AdapterSettings(KTAEConfig(ignore_token_ids=(151643,))))
    job = json.loads(re.search(r"--runtime-env-json '(.*?)'", text, re.S).group(1))
    assert job["worker_process_setup_hook"] == "ktae_kernels.integrations.openrlhf.worker_setup"
    assert settings_from_env(job["env_vars"]) == AdapterSettings(KTAEConfig(ignore_token_ids=(151643,)), metrics="scores")
