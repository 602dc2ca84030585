"""The README's first lines are the two set-up commands, and CI runs the test one verbatim."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```bash")
    block = lines[start + 1: lines.index("```", start + 1)]
    return [line.split("  #")[0].strip() for line in block if line.strip()]


def test_readme_opens_with_two_commands():
    text = (ROOT / "README.md").read_text().splitlines()
    assert text[0].startswith("# ") and text[2] == "```bash"
    install, test = readme_commands()
    assert "pip install" in install and "python -m" in install
    assert "pytest" in test


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in [line.strip() for line in ci]
    assert any(line.strip() == "pip install torch==2.13.0" for line in ci)


def test_quick_start_runs_as_written_and_prints_no_negative_zero(capsys):
    text = (ROOT / "README.md").read_text()
    start = text.index("```python", text.index("## Quick start")) + len("```python")
    exec(compile(text[start:text.index("```", start)], "README.md quick start", "exec"), {})
    out = capsys.readouterr().out
    assert "group 0  token 7" in out and "-0.000" not in out
