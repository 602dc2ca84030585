"""The helpers every adapter shares (``ktae_kernels.integrations.shared``): settings sections, group ids
and the baseline, labels and their source, metrics by mode with ``ktae/backend`` and ``ktae/threads``,
and the supported-version check."""
from __future__ import annotations

import re
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from ktae_kernels import ExecutionOptions, KTAEConfig, available_backends, key_token_scores, token_advantage
from ktae_kernels.integrations import shared
from ktae_kernels.metrics import ktae_metrics
from ktae_kernels.registry import backend_names



def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(0, 12, (8, 6), generator=g)
    mask = torch.rand(8, 6, generator=g) < 0.8
    rewards = torch.tensor([1.0, 0, 1, 0, 0, 0, 1, 1])
    index = np.array(["b", "b", "b", "b", "a", "a", "a", "a"], dtype=object)
    return responses, mask, rewards, index


def test_settings_name_the_section_and_the_expected_keys():
    s = shared.settings_from_mapping({"alpha": 2.0, "ignore_token_ids": 7, "metrics": "scores", "correct_key": None},
                                     where="algorithm.ktae", default_baseline="mean")
    assert s == shared.AdapterSettings(KTAEConfig(alpha=2.0, ignore_token_ids=(7,), baseline="mean"), "auto", "scores",
                                       None)
    with pytest.raises(ValueError, match=r"sec has unknown keys \['alhpa'\] \(did you mean 'alpha'\?\); expected "
                                         r"KTAEConfig fields .* or one of \['backend', 'metrics', 'correct_key', "
                                         r"'threads'\]"):
        shared.settings_from_mapping({"alhpa": 1}, where="sec")
    with pytest.raises(ValueError, match=r"sec has unknown keys \['zzz'\]; expected"):
        shared.settings_from_mapping({"zzz": 1}, where="sec")
    with pytest.raises(ValueError, match="sec.metrics must be one of"):
        shared.settings_from_mapping({"metrics": "all"}, where="sec")
    with pytest.raises(ValueError, match="sec: .*correct_key.* non-empty string"):
        shared.settings_from_mapping({"correct_key": ""}, where="sec")


def test_a_bad_backend_name_fails_when_the_settings_are_built():
    """A backend name that is neither "auto" nor a registered backend (a typo, ``null`` in a config, the
    string "None") fails where the settings are read, naming the setting and listing the accepted names,
    not at the first training step."""
    accepted = ("auto", *backend_names())
    for bad in ("gpu", None, "None", "", 3):
        with pytest.raises(ValueError, match=rf"sec.backend must be 'auto' or one of {re.escape(str(backend_names()))}, got "
                                             rf"{re.escape(repr(bad))}$"):
            shared.settings_from_mapping({"backend": bad}, where="sec")
        with pytest.raises(ValueError, match=r"`backend` must be 'auto' or one of \('reference'"):
            shared.AdapterSettings(backend=bad)
    for good in accepted:
        assert shared.settings_from_mapping({"backend": good}, where="sec").backend == good
    assert shared.settings_from_mapping({}, where="sec").backend == "auto"


def test_dense_groups_and_the_baseline_for_every_label_kind():
    _, _, rewards, index = _batch()
    for labels in (index, list(index), torch.tensor([1, 1, 1, 1, 0, 0, 0, 0])):
        group, size = shared.dense_groups(labels)
        assert group.tolist() == [1, 1, 1, 1, 0, 0, 0, 0] and size.tolist() == [4, 4]
    base = shared.rollout_baseline(rewards, index, KTAEConfig())
    r = rewards.double().reshape(2, 4)
    want = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1)
    torch.testing.assert_close(base, want, rtol=0, atol=1e-12)


def test_labels_take_the_first_source_present():
    rewards = torch.tensor([1.0, -1.0, 0.5])
    assert shared.correct_labels(rewards, 0.0, [("acc", None), ("scores", [0, 1, 1])]).source == "scores"
    first = shared.correct_labels(rewards, 0.0, [("acc", np.array([True, False, False], dtype=object))])
    assert first.source == "acc" and first.correct.tolist() == [True, False, False]
    assert shared.correct_labels(rewards, 0.7).correct.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="label source 'acc' has shape \\(2,\\), expected \\(3,\\)"):
        shared.correct_labels(rewards, 0.0, [("acc", [1, 0])])
    assert shared.column_values({"acc": [1, None, 0]}, "acc") is None
    assert shared.column_values({"acc": [1, 1, 0]}, None) is None


def test_metrics_by_mode_with_backend_threads_and_label_source():
    responses, mask, rewards, index = _batch(seed=1)
    config = KTAEConfig(weight=0.5)
    labels = shared.Labels(rewards > 0, "acc")
    base = shared.rollout_baseline(rewards, index, config)
    adv = token_advantage(responses, mask, rewards, index, config=config, rollout_advantage=base, correct=labels.correct)
    kts = key_token_scores(responses, mask, rewards, index, config=config, correct=labels.correct)
    calls = []

    def scores():
        calls.append(1)
        return kts

    common = dict(advantages=adv, mask=mask, rollout_advantage=base, group=index, backend="cpu")
    started = time.perf_counter()
    assert shared.step_metrics(shared.AdapterSettings(config, metrics="off"), labels, started, scores=scores, **common) == {}
    cheap = shared.step_metrics(shared.AdapterSettings(config), labels, started, scores=scores, **common)
    assert not calls
    full = shared.step_metrics(shared.AdapterSettings(config, metrics="scores"), labels, started, scores=scores, **common)
    assert calls == [1]
    want = ktae_metrics(kts)
    for name in ("ktae/score_abs_mean", "ktae/key_token_share", "ktae/mixed_group_share"):
        assert cheap[name] == pytest.approx(want[name], abs=1e-6) and full[name] == want[name]
    assert "ktae/distinct_tokens_per_group" in full and "ktae/distinct_tokens_per_group" not in cheap
    for values in (cheap, full):
        assert values["ktae/threads"] == torch.get_num_threads() and values["ktae/label_source/acc"] == 1.0
        assert values["ktae/backend/cpu"] == 1.0 and values["ktae/time_ms"] > 0


@pytest.mark.parametrize("backend", ["torch", "reference", "cpu"])
def test_threads_are_logged_only_when_the_native_kernel_ran(backend):
    """``ktae/backend/<name>`` names the backend that ran; ``ktae/threads`` (the native kernel's thread
    budget) appears only when that is the native ``cpu`` kernel, never for a path that ran no kernel threads."""
    if backend not in available_backends("cpu"):
        pytest.skip(f"backend {backend!r} is not built here")
    responses, mask, rewards, index = _batch(seed=2)
    settings = shared.AdapterSettings(KTAEConfig(), backend=backend, options=ExecutionOptions(threads=3))
    ran = shared.backend_that_runs(settings.backend, responses.device)
    assert ran == backend
    adv = token_advantage(responses, mask, rewards, index, backend=backend)
    values = shared.step_metrics(settings, shared.Labels(rewards > 0, "reward"), time.perf_counter(), backend=ran,
                                 advantages=adv, mask=mask, rollout_advantage=shared.rollout_baseline(
                                     rewards, index, settings.config), group=index)
    assert [k for k in values if k.startswith("ktae/backend/")] == [f"ktae/backend/{backend}"]
    assert values.get("ktae/threads") == (3.0 if backend == "cpu" else None)


def test_the_backend_that_runs_resolves_auto_and_the_distributed_path():
    native = "cpu" in available_backends("cpu")
    assert shared.backend_that_runs("auto", "cpu") == ("cpu" if native else "torch")
    assert shared.backend_that_runs("auto", "cpu", distributed=True) == "torch"
    assert shared.backend_that_runs("reference", "cpu") == "reference"
    with pytest.raises(ValueError, match="`backend` must be 'auto' or one of"):
        shared.backend_that_runs("fast", "cpu")


def test_thread_budget_follows_the_settings():
    """``ktae/threads``: the settings' ``threads`` (``ExecutionOptions.threads``) when set, else torch's count."""
    assert shared.kernel_thread_budget(ExecutionOptions()) == torch.get_num_threads()
    assert shared.kernel_thread_budget(ExecutionOptions(threads=3)) == 3
    settings = shared.settings_from_mapping({"threads": 2}, where="sec")
    assert settings.options.threads == 2 and shared.kernel_thread_budget(settings.options) == 2
    with pytest.raises(ValueError, match="sec: ExecutionOptions.threads must be None or an int >= 1"):
        shared.settings_from_mapping({"threads": 0}, where="sec")


def test_versions_outside_the_tested_range_stop_the_adapter():
    """Below the range: an error (features missing). At or past its upper end: an error too (nobody compared
    KTAE's results with the framework's own there), unless ``$KTAE_ALLOW_UNTESTED`` names the framework."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared.check_version("OpenRLHF", "0.11.2", "0.10.2", "0.12", environ={})
        shared.check_version("OpenRLHF", "0.10.2.post1", "0.10.2", "0.12", environ={})
    with pytest.raises(shared.FrameworkMismatchError, match=r"supports OpenRLHF >= 0.10.2, < 0.12; found OpenRLHF "
                                                            r"0.10.1: upgrade OpenRLHF"):
        shared.check_version("OpenRLHF", "0.10.1", "0.10.2", "0.12", environ={shared.ALLOW_UNTESTED: "openrlhf"})
    for framework, version, minimum, below in [("verl", "0.10.0", "0.6", "0.10"), ("TRL", "2.0.0", "1.0", "2"),
                                               ("OpenRLHF", "0.12.0", "0.10.2", "0.12")]:
        name = framework.lower()
        with pytest.raises(shared.FrameworkMismatchError,
                           match=rf"KTAE supports {framework} >= {minimum}, < {below}; found {framework} {version}, .*"
                                 rf"the \[{name}\] extra .* set KTAE_ALLOW_UNTESTED={name} to run with a warning"):
            shared.check_version(framework, version, minimum, below, environ={shared.ALLOW_UNTESTED: "other"})
        with pytest.warns(RuntimeWarning, match=rf"tested with {framework} >= {minimum}, < {below}; found {framework} "
                                                rf"{version}, allowed by \$KTAE_ALLOW_UNTESTED"):
            shared.check_version(framework, version, minimum, below, environ={shared.ALLOW_UNTESTED: f"x, {name.upper()}"})


# ------------------------------------------------------------------------------------------ the guide
GUIDE = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text(encoding="utf-8")


def _guide_section(title: str) -> str:
    start = GUIDE.index(f"\n## {title}\n")
    end = GUIDE.find("\n## ", start + 1)
    return GUIDE[start:end if end > 0 else None]


def test_the_guide_describes_the_version_check_as_the_code_runs_it():
    """docs/integrations.md states each adapter's supported range as its constants, that a version past
    it stops the adapter (``check_version`` raises) unless ``$KTAE_ALLOW_UNTESTED`` names the framework,
    and the names that variable takes."""
    from ktae_kernels.integrations import openrlhf
    from ktae_kernels.integrations.verl import framework

    text = _guide_section("When a framework moves")
    ranges = {"verl": (framework.MIN_VERSION, framework.BELOW_VERSION), "openrlhf": (openrlhf.MIN_VERSION,
                                                                                   openrlhf.BELOW_VERSION)}
    trl = pytest.importorskip("ktae_kernels.integrations.trl")
    ranges["trl"] = (trl.MIN_VERSION, trl.BELOW_VERSION)
    rows = {line.split("|")[1].strip().lower(): line for line in text.splitlines() if line.startswith("| ")}
    for name, (minimum, below) in ranges.items():
        assert f"| >= {minimum}, < {below} |" in rows[name], name
        assert f"`{name}`" in text, name  # a name KTAE_ALLOW_UNTESTED takes
        with pytest.raises(shared.FrameworkMismatchError):
            shared.check_version(name, below, minimum, below, environ={})
    assert f"`{shared.ALLOW_UNTESTED}`" in text and f"{shared.ALLOW_UNTESTED}=verl,trl" in text
    assert shared.allowed_untested({shared.ALLOW_UNTESTED: "verl, TRL"}) == {"verl", "trl"}
    assert "is a `RuntimeWarning`" not in text.replace("then a `RuntimeWarning`", "")


def test_the_guide_has_no_dated_measurements():
    """Timings live in docs/benchmarks.md beside their raw results; the guide points there."""
    for note in ("UTC", "load average", "EPYC", " ms a step"):
        assert note not in GUIDE, note
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", GUIDE)
    assert "benchmarks.md" in GUIDE
