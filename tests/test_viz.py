"""ktae_kernels.viz: the HTML report (one element per masked token with its score, escaped text, the ids
fallback), the PNG summary, the CLI over a saved batch, the demo's --report and the trainer's hook."""
from __future__ import annotations

import math
from html.parser import HTMLParser

import pytest
import torch

from ktae_kernels import KTAEConfig, key_token_scores
from ktae_kernels.__main__ import demo_batch
from ktae_kernels.viz import make_decoder, render_html, write_report
from ktae_kernels.viz.__main__ import main as viz_main


class Page(HTMLParser):
    """Collects the token elements (their attributes and text), every start tag, and the text of the page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tokens: list[dict] = []
        self.tags: list[str] = []
        self.text: list[str] = []
        self._open: dict | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        if tag == "span" and "tok" in (attrs.get("class") or "").split():
            self._open = dict(attrs, text="")
            self.tokens.append(self._open)

    def handle_endtag(self, tag):
        if tag == "span":
            self._open = None

    def handle_data(self, data):
        self.text.append(data)
        if self._open is not None:
            self._open["text"] += data


def parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    return page


def score_table(responses, mask, rewards, index, config=None) -> dict[tuple[int, int], float]:
    s = key_token_scores(responses, mask, rewards, index, config=config)
    return {(g, t): v for g, t, v in zip(s.group.tolist(), s.token.tolist(), s.score.tolist())}


def test_one_element_per_masked_token_with_its_score():
    responses, mask, rewards, index = demo_batch()
    page = parse(render_html(responses, mask, rewards, index, max_groups=None))
    assert page.tags[:2] == ["html", "head"] and "script" not in page.tags
    assert len(page.tokens) == int(mask.sum())
    table = score_table(responses, mask, rewards, index)
    seen = set()
    for tok in page.tokens:
        g, i, t, token = (int(tok[k]) for k in ("data-group", "data-rollout", "data-pos", "data-token"))
        assert bool(mask[i, t]) and int(responses[i, t]) == token and int(index[i]) == g
        assert float(tok["data-score"]) == pytest.approx(table[(g, token)], abs=1e-12)
        assert tok["text"] == f"[{token}]"  # no decoder: the ids fallback
        assert tok["title"].startswith(f"token {token} ") and "a=" in tok["title"] and "IG=" in tok["title"]
        seen.add((i, t))
    assert len(seen) == len(page.tokens)
    planted = [tok for tok in page.tokens if tok["data-token"] == "7" and tok["data-group"] == "0"]
    assert planted and all(float(tok["data-score"]) > 0.99 for tok in planted)
    assert "rgb(33,102,172)" in planted[0]["style"]  # the positive end of the colour scale


def test_groups_with_both_outcomes_come_first_and_max_groups_limits():
    responses, mask, rewards, index = demo_batch(groups=3)
    rewards = rewards.clone()
    rewards[:8] = 1.0  # group 0: every rollout correct, so every score in it is 0
    text = render_html(responses, mask, rewards, index, max_groups=2)
    page = parse(text)
    assert {tok["data-group"] for tok in page.tokens} == {"1", "2"}
    assert len(page.tokens) == int(mask[8:].sum())
    only = parse(render_html(responses, mask, rewards, index, groups=[0]))
    assert {tok["data-group"] for tok in only.tokens} == {"0"}
    assert all(float(tok["data-score"]) == 0.0 for tok in only.tokens)
    assert "every rollout of this group is correct" in " ".join(only.text).lower()
    with pytest.raises(ValueError, match="`groups`"):
        render_html(responses, mask, rewards, index, groups=[3])
    with pytest.raises(ValueError, match="`max_groups`"):
        render_html(responses, mask, rewards, index, max_groups=0)


def test_token_text_is_escaped():
    responses, mask, rewards, index = demo_batch(groups=1)
    evil = '<script>alert(1)</script>'
    decode = {7: evil, 13: 'a"b\'c & <b>'}.get
    text = render_html(responses, mask, rewards, index, decode=lambda t: decode(t, f"w{t} "))
    assert "<script" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    page = parse(text)
    benign = parse(render_html(responses, mask, rewards, index, decode=lambda t: f"w{t} "))
    assert page.tags == benign.tags, "token text must add no element (no <script>, no <b>)"
    sevens = [tok for tok in page.tokens if tok["data-token"] == "7"]
    assert sevens and all(tok["text"] == evil for tok in sevens)  # inert text, shown as written
    assert all(evil in tok["title"] for tok in sevens)
    quotes = [tok for tok in page.tokens if tok["data-token"] == "13"]
    assert quotes and quotes[0]["text"] == 'a"b\'c & <b>'


def test_decoders():
    class Tokenizer:  # like a Hugging Face tokenizer: __call__ encodes, .decode takes a list of ids
        def __call__(self, text):
            raise AssertionError("the report must call .decode, not __call__")

        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    assert make_decoder(Tokenizer())[0](5) == "<5>"
    assert make_decoder(lambda t: f"x{t}")[0](5) == "x5"
    fallback, has_text = make_decoder(None)
    assert fallback(5) == "[5]" and not has_text
    with pytest.raises(ValueError, match="`decode`"):
        make_decoder(42)
    with pytest.raises(ValueError, match="`decode` failed on token id 3"):
        make_decoder(lambda t: 1 / 0)[0](3)
    with pytest.raises(ValueError, match="`decode` must return str"):
        make_decoder(lambda t: t)[0](3)
    responses, mask, rewards, index = demo_batch(groups=1)
    page = parse(render_html(responses, mask, rewards, index, decode=Tokenizer(), prompts=["1+1="] * 8))
    assert {tok["text"] for tok in page.tokens} == {f"<{t}>" for t in responses[mask].tolist()}
    assert "1+1=" in page.text


def test_write_report_and_bad_inputs_name_the_argument(tmp_path):
    responses, mask, rewards, index = demo_batch(groups=1)
    path = write_report(tmp_path / "sub" / "r.html", responses, mask, rewards, index,
                        config=KTAEConfig(use_tf=False))
    page = parse(path.read_text(encoding="utf-8"))
    table = score_table(responses, mask, rewards, index, KTAEConfig(use_tf=False))
    assert all(math.isclose(float(t["data-score"]), table[(0, int(t["data-token"]))], abs_tol=1e-12)
               for t in page.tokens)
    with pytest.raises(ValueError, match="response_mask"):
        render_html(responses, mask[:, :3], rewards, index)
    with pytest.raises(ValueError, match="`top_k`"):
        render_html(responses, mask, rewards, index, top_k=-1)
    with pytest.raises(ValueError, match="`prompts`"):
        render_html(responses, mask, rewards, index, prompts=["only one"])


def test_png_summary(tmp_path):
    pytest.importorskip("matplotlib")
    from ktae_kernels.viz import write_png

    responses, mask, rewards, index = demo_batch(groups=3)
    path = write_png(tmp_path / "s.png", responses, mask, rewards, index, decode=lambda t: f"tok$${t}", max_groups=2)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_on_a_saved_batch(tmp_path, capsys):
    responses, mask, rewards, index = demo_batch()
    batch = tmp_path / "batch.pt"
    torch.save(dict(responses=responses, response_mask=mask, rewards=rewards, index=[f"uid-{i}" for i in index]), batch)
    out = tmp_path / "report.html"
    argv = [str(batch), "-o", str(out), "--groups", "1"]
    if _has("matplotlib"):
        argv += ["--png", str(tmp_path / "s.png")]
    assert viz_main(argv) == 0
    page = parse(out.read_text(encoding="utf-8"))
    assert {tok["data-group"] for tok in page.tokens} == {"0"} and len(page.tokens) == int(mask[:8].sum())
    assert "uid-0" in " ".join(page.text)
    assert _has("matplotlib") is False or (tmp_path / "s.png").stat().st_size > 0

    tuple_file = tmp_path / "tuple.pt"
    torch.save((responses, mask, rewards, index), tuple_file)
    assert viz_main([str(tuple_file), "-o", str(tmp_path / "t.html")]) == 0
    assert len(parse((tmp_path / "t.html").read_text()).tokens) == int(mask.sum())

    torch.save(dict(responses=responses, rewards=rewards, index=index), tmp_path / "bad.pt")
    assert viz_main([str(tmp_path / "bad.pt"), "-o", str(tmp_path / "x.html")]) == 2
    assert "missing key 'response_mask'" in capsys.readouterr().err
    assert viz_main([str(tmp_path / "nope.pt")]) == 2


def test_cli_ignore_ids_is_one_comma_separated_value(tmp_path, capsys):
    batch = _saved_demo_batch(tmp_path)
    out = tmp_path / "ignored.html"
    assert viz_main(["--ignore-ids", "7,5", str(batch), "-o", str(out)]) == 0  # the ids do not swallow BATCH_FILE
    ignored = [tok for tok in parse(out.read_text()).tokens if tok["data-token"] in ("5", "7")]
    assert ignored and all(float(tok["data-score"]) == 0.0 for tok in ignored)
    with pytest.raises(SystemExit):
        viz_main(["--ignore-ids", "7,x", str(batch)])
    assert "comma-separated integer token ids, got '7,x'" in capsys.readouterr().err


def _saved_demo_batch(tmp_path):
    responses, mask, rewards, index = demo_batch()
    torch.save(dict(responses=responses, response_mask=mask, rewards=rewards, index=index), tmp_path / "batch.pt")
    return tmp_path / "batch.pt"


@pytest.mark.slow
def test_cli_with_a_hub_name_offline_fails_at_once_in_one_line(tmp_path):
    """A hub name that is not cached, with the hub switched off (HF_HUB_OFFLINE=1, an empty cache): exit 2
    and one line saying to pass a local folder, without transformers' retries and traceback."""
    import os
    import subprocess
    import sys
    import time

    pytest.importorskip("transformers")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ktae_kernels.viz", str(_saved_demo_batch(tmp_path)), "--tokenizer",
                           "Qwen/Qwen2.5-0.5B", "-o", str(tmp_path / "r.html")], env=env, capture_output=True,
                          text=True, timeout=120)
    elapsed = time.perf_counter() - started
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("python -m ktae_kernels.viz: error: --tokenizer 'Qwen/Qwen2.5-0.5B' is neither a local "
                           "folder nor in the Hugging Face cache, and the hub is switched off here (HF_HUB_OFFLINE)")
    assert "pass a local folder" in line
    assert elapsed < 40, f"{elapsed:.0f} s"  # the interpreter's start and imports; no network retries


def test_cli_tokenizer_errors_are_one_line(tmp_path, monkeypatch, capsys):
    """No network (the hub's metadata request fails to connect: stubbed), a path that is no folder, and a
    folder without tokenizer files: each exits 2 with one line that names the cause."""
    pytest.importorskip("transformers")
    httpx = pytest.importorskip("httpx")
    import huggingface_hub
    import transformers

    def not_cached(path, local_files_only=False, **kwargs):
        if local_files_only:
            raise OSError(f"{path} is not in the cache")
        raise AssertionError("the download must not be tried without a connection")

    def no_connection(name, timeout=None, **kwargs):
        assert timeout is not None and timeout <= 10
        raise httpx.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "model_info", no_connection)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", not_cached)
    batch = str(_saved_demo_batch(tmp_path))
    out = ["-o", str(tmp_path / "r.html")]
    for tokenizer, says in [("Qwen/Qwen2.5-0.5B", "the Hugging Face hub cannot be reached (ConnectError); pass a local "
                                                  "folder"),
                            (str(tmp_path / "missing"), "no such folder; pass a local folder"),
                            (str(tmp_path), "cannot load a tokenizer from this folder: ")]:
        if tokenizer == str(tmp_path):
            monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                                lambda path, **kw: (_ for _ in ()).throw(OSError("no tokenizer files\nmore lines")))
        assert viz_main([batch, "--tokenizer", tokenizer, *out]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert says in line, line


def test_demo_teaches_and_writes_its_report(tmp_path, capsys):
    from ktae_kernels.__main__ import main as demo_main

    demo_main(["--report", str(tmp_path / "demo.html")])
    out = capsys.readouterr().out
    table = out[out.index("token  a  b"):]
    first = table.splitlines()[1].split()
    assert first[:3] == ["7", "4", "0"], "the planted token has the smallest p, so it is listed first"
    assert "planted in the wrong rollouts" in table and "one-sided" in table and "use_tf=False" in out
    assert "token id" in out and "advantage" in out and "reference:" in out
    assert len(parse((tmp_path / "demo.html").read_text()).tokens) == int(demo_batch()[1].sum())
    demo_main([])
    assert "python -m ktae_kernels --report demo.html" in capsys.readouterr().out


def test_trainer_writes_a_report_every_n_steps(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    from training.config import TrainConfig
    from training.train import build_parser, train

    assert build_parser().parse_args(["--report-every", "2"]).report_every == 2
    with pytest.raises(ValueError, match="report_every"):
        TrainConfig(report_every=-1)
    cfg = TrainConfig(steps=2, report_every=2, warmup_steps=0, prompts_per_step=2, group_size=4, eval_size=0,
                      device="cpu", progress=False, out_dir=str(tmp_path), ktae_backend="torch")
    train(cfg)
    assert sorted(p.name for p in tmp_path.glob("report-*.html")) == ["report-step0002.html"]
    page = parse((tmp_path / "report-step0002.html").read_text(encoding="utf-8"))
    assert page.tokens and "=" in " ".join(page.text)  # decoded tokens and the prompts ("12+34=")


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
