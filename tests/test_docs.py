"""The README opens with its two set-up commands, which CI runs verbatim with its whole-suite command; the
README and the CHANGELOG speak to users (no lab notebook) and agree with pyproject."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CHANGELOG = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")

#: the one line that installs a torch where none is: PyTorch's CPU build (PyPI's Linux torch is the CUDA one)
CPU_TORCH = "pip show -qq torch || pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "


def bash_blocks(text: str) -> list[list[str]]:
    """The commands of each ```bash block, comments dropped."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    return [[line.split("  #")[0].strip() for line in block.splitlines() if line.strip()] for block in blocks]


def readme_commands() -> list[str]:
    return bash_blocks(README)[0]


def whole_suite_command() -> str:
    (command,) = bash_blocks(README)[1]
    return command


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_readme_opens_with_two_commands():
    lines = README.splitlines()
    assert lines[0].startswith("# ") and lines[2] == "```bash"
    install, test = readme_commands()
    assert "pip install" in install and install.endswith("python -m ktae_kernels")
    assert test == "python -m pytest -q -m core"


def test_the_first_command_installs_a_cpu_torch_only_where_there_is_none():
    """No torch: PyTorch's CPU build, pinned to the version CI tests. A torch already there: kept (pip
    keeps an installed torch that meets the package's bound). Never an unpinned `pip install torch`."""
    install, _ = readme_commands()
    assert install.startswith(CPU_TORCH)
    rest = install.removeprefix(CPU_TORCH)
    assert "torch" not in rest and rest.startswith('pip install -e ".[')
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch>=2.4" in dependencies and "(>= 2.4)" in README


def test_ci_runs_the_readme_commands_verbatim_after_the_cpu_wheel():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    install, test = readme_commands()
    steps = [ci.index("pip install torch==2.13.0"), ci.index(install), ci.index(test), ci.index(whole_suite_command())]
    assert steps == sorted(steps)
    assert "python -m ktae_kernels --check" in ci and "python -m pytest -q" in whole_suite_command()


def test_readme_is_short_with_one_speed_table_and_no_lab_notes():
    """At most 200 lines; its measured numbers in one table under one line of machine and date; no clock
    times or load averages (those live in docs/benchmarks.md beside the raw results)."""
    assert len(README.splitlines()) <= 200
    speed = section(README, "Speed")
    assert len(re.findall(r"^\|---", speed, re.M)) == 1
    assert len(re.findall(r"^Measured \d{4}-\d{2}-\d{2}: ", speed, re.M)) == 1
    assert len(re.findall(r"\b20\d\d-\d\d-\d\d\b", README)) == 1
    for note in ("UTC", "load average", "1-minute load"):
        assert note not in README and note not in CHANGELOG


def test_changelog_agrees_with_the_readme_and_pyproject():
    """Each framework's supported range reads the same in the CHANGELOG, the README and pyproject's extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, bounds in (("verl", ("0.6", "0.10")), ("trl", ("1.0", "2")), ("openrlhf", ("0.10.2", "0.12"))):
        for doc in (README, CHANGELOG):
            ranges = re.findall(rf"\b{name}\b[^\n)]{{0,60}}?>= ([\d.]+), < ([\d.]+)", doc, re.I)
            assert ranges and set(ranges) == {bounds}, (name, ranges)
        if name in extras:
            assert any(re.fullmatch(rf"{name}(\[[^]]*\])?>={bounds[0]},<{bounds[1]}", d) for d in extras[name]), name


def test_quick_start_runs_as_written_and_prints_no_negative_zero(capsys):
    start = README.index("```python", README.index("## Quick start")) + len("```python")
    exec(compile(README[start:README.index("```", start)], "README.md quick start", "exec"), {})
    out = capsys.readouterr().out
    assert "group 0  token 7" in out and "-0.000" not in out


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation but ``-`` and ``_``
    dropped, spaces as ``-`` (code blocks' ``#`` lines are not headings)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_relative_link_reaches_its_file_and_heading():
    """A link such as ``[benchmarks.md](benchmarks.md#a-shared-node)`` in the README, the CHANGELOG, docs/ or
    examples/ names a file of the repository and, with ``#``, one of that file's headings."""
    broken = []
    for page in [ROOT / "README.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/*.md"), *ROOT.glob("examples/**/*.md")]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text(encoding="utf-8")):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken
