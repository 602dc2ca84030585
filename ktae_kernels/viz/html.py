"""The HTML key-token report: one self-contained file (inline CSS, no script, nothing fetched).

Per group, every rollout's tokens coloured by their KTAE score (blue: goes with correct rollouts, red:
with wrong ones, white: 0), correct / wrong rollouts marked, a tooltip per token with its table and
statistics, and the group's top key tokens. Each masked token is one
``<span class="tok" data-group=G data-rollout=I data-pos=T data-token=ID data-score=S>`` element.
"""
from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any, Sequence

from ..config import KTAEConfig
from .common import Prepared, key_rows, prepare
from .decode import make_decoder, visible

#: diverging end points (ColorBrewer RdBu, safe for the common colour-vision deficiencies).
POSITIVE_RGB = (33, 102, 172)
NEGATIVE_RGB = (178, 24, 43)

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.2em 2em;color:#222;max-width:1400px}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em}
.meta,.note{color:#555}.note{font-size:.9em}
.legend{display:flex;align-items:center;gap:.6em;margin:.6em 0;flex-wrap:wrap}
.bar{width:260px;height:14px;border:1px solid #999;
 background:linear-gradient(to right,rgb(178,24,43),#fff,rgb(33,102,172))}
details{margin:.4em 0 1em}dl{display:grid;grid-template-columns:max-content auto;gap:.1em 1em;margin:.4em 0}
dt{font-weight:600}dd{margin:0}
.group{border-top:1px solid #ccc}
.cols{display:flex;gap:2em;align-items:flex-start;flex-wrap:wrap}
.rollouts{flex:1 1 640px;min-width:0}
.rollout{display:flex;gap:.6em;align-items:baseline;padding:.15em 0 .15em .5em;margin:.15em 0}
.rollout.correct{border-left:4px solid #333}.rollout.wrong{border-left:4px dotted #999}
.mark{flex:0 0 8.5em;font-size:.85em;color:#333;white-space:nowrap}
.rollout.wrong .mark{color:#666}
.text{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:pre-wrap;
 overflow-wrap:anywhere;line-height:1.75}
.tok{border-radius:2px;padding:1px 0;box-shadow:inset -1px 0 rgba(0,0,0,.18)}
.prompt{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:pre-wrap;background:#f3f3f3;
 padding:.2em .5em;margin:.2em 0 .5em;max-height:8em;overflow:auto}
.ids .tok{padding:1px 2px;margin-right:2px}
table.keys{border-collapse:collapse;font-size:.85em}
.keys th,.keys td{padding:.15em .5em;text-align:right;border-bottom:1px solid #eee}
.keys th{background:#f5f5f5}.keys td.t{text-align:left;font-family:ui-monospace,monospace;white-space:pre}
.keys caption{text-align:left;font-weight:600;padding-bottom:.3em}
"""

EXPLAIN = (
    ("a / b", "correct / wrong rollouts of the group that contain the token (at least once)"),
    ("p", "two-sided Fisher exact test of the table [[a, b], [n_c - a, n_w - b]]: small = the token "
          "separates correct from wrong rollouts"),
    ("F", "exp(-2p), 0 when p = 1"),
    ("IG", "information gain (bits) of 'contains the token' about correct / wrong"),
    ("score", "top * (2 sigmoid(key) - 1) with key = (alpha F + beta IG) x / (alpha + beta); x is the "
              "direction (Cohen's h plus, with use_tf, a BM25 frequency ratio that is huge for a token seen "
              "on one side only, so such tokens saturate at +-top). Advantage = A_rollout + weight * score"),
)


def render_html(responses: Any, response_mask: Any, rewards: Any, index: Any, *, decode: Any = None,
                config: KTAEConfig | None = None, max_groups: int | None = 8, groups: Sequence[int] | None = None,
                top_k: int = 10, title: str = "KTAE key tokens", prompts: Sequence[str] | None = None,
                backend: str = "auto", correct: Any = None) -> str:
    """The report as an HTML string.

    Args:
        responses: integer ``[B, L]`` token ids; response_mask: ``[B, L]`` 0/1 (only masked-in tokens
            are drawn); rewards: ``[B]`` (or ``[B, L]``, summed); index: ``[B]`` group ids. The same
            inputs as ``ktae_kernels.key_token_scores``, which computes the scores.
        decode: ``decode(id) -> str``, or an object with ``.decode`` (a Hugging Face tokenizer), or
            None to show ``[id]``.
        config: KTAE hyper-parameters (``KTAEConfig()`` when None); ``config.correct_threshold``
            also decides the correct / wrong marks, unless ``correct`` is given.
        max_groups: groups drawn (None: all), those with both correct and wrong rollouts first.
        groups: dense group ids to draw instead (``KeyTokenScores.group`` numbering).
        top_k: rows of each group's key-token table.
        prompts: optional ``[B]`` prompt text of each rollout; the first of each group heads it.
        title: the page's heading; backend: the ``ktae_kernels`` backend computing the scores.
        correct: optional ``[B]`` correct / wrong labels, as in ``token_advantage``.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"`top_k` must be an int >= 0, got {top_k!r}")
    decoder, has_text = make_decoder(decode)
    prep = prepare(responses, response_mask, rewards, index, config=config, max_groups=max_groups,
                   groups=groups, backend=backend, correct=correct)
    cfg = prep.config
    B = prep.responses.shape[0]
    if prompts is not None and (isinstance(prompts, str) or len(prompts) != B):
        got = type(prompts).__name__ + ("" if isinstance(prompts, str) else f" of length {len(prompts)}")
        raise ValueError(f"`prompts` must be a sequence of B = {B} strings (one per rollout), got {got}")
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{_esc(title)}</title><style>{STYLE}</style></head>",
           f'<body class="{"text-mode" if has_text else "ids"}">', f"<h1>{_esc(title)}</h1>"]
    L = prep.responses.shape[1]
    hidden = prep.n_groups - len(prep.shown)
    out.append(f'<p class="meta">{B} rollouts x {L} positions in {prep.n_groups} groups; showing '
               f"{len(prep.shown)}" + (f" (groups with both correct and wrong rollouts first; {hidden} not shown)"
                                       if hidden else "") + ". " + _esc(_config_text(cfg)) + "</p>")
    out.append(f'<div class="legend"><span>{_fmt_score(-cfg.top)}: goes with <b>wrong</b> rollouts</span>'
               f'<span class="bar" role="img" aria-label="colour scale"></span>'
               f"<span>{_fmt_score(cfg.top)}: goes with <b>correct</b> rollouts</span>"
               "<span class=\"note\">white: 0. Hover a token for its statistics. "
               "&#10003; correct rollout (solid bar), &#10007; wrong rollout (dotted bar).</span></div>")
    out.append("<details><summary>What the numbers mean</summary><dl>"
               + "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in EXPLAIN) + "</dl></details>")
    if not has_text:
        out.append('<p class="note">No decoder given: tokens are shown as [id].</p>')
    for g in prep.shown:
        out.append(_group_html(prep, g, decoder, top_k, prompts))
    out.append("</body></html>\n")
    return "\n".join(out)


def write_report(path: str | Path, responses: Any, response_mask: Any, rewards: Any, index: Any, *,
                 decode: Any = None, config: KTAEConfig | None = None, max_groups: int | None = 8,
                 groups: Sequence[int] | None = None, top_k: int = 10, title: str = "KTAE key tokens",
                 prompts: Sequence[str] | None = None, backend: str = "auto", correct: Any = None) -> Path:
    """Write ``render_html(...)`` to ``path`` (parent folders created); returns the path.

    Inputs as ``ktae_kernels.key_token_scores``: ``responses [B, L]`` ids, ``response_mask [B, L]``,
    ``rewards [B]``, ``index [B]``. See ``render_html`` for the other arguments.
    """
    path = Path(path)
    text = render_html(responses, response_mask, rewards, index, decode=decode, config=config,
                       max_groups=max_groups, groups=groups, top_k=top_k, title=title, prompts=prompts,
                       backend=backend, correct=correct)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def score_colour(score: float, top: float) -> tuple[str, str]:
    """CSS background and text colour of a score in ``(-top, top)``: white at 0, blue up, red down."""
    t = max(-1.0, min(1.0, score / top)) if top > 0 else 0.0
    end = POSITIVE_RGB if t > 0 else NEGATIVE_RGB
    mag = abs(t)
    rgb = tuple(round(255 + (c - 255) * mag) for c in end)
    return f"rgb({rgb[0]},{rgb[1]},{rgb[2]})", ("#fff" if mag > 0.55 else "#111")


def _group_html(prep: Prepared, g: int, decoder, top_k: int, prompts: Sequence[str] | None) -> str:
    s = prep.scores
    label = s.group_labels[g]
    n_c, n_w = int(s.n_c[g]), int(s.n_w[g])
    members = prep.members(g)
    head = (f'<section class="group" id="group-{g}" data-group="{g}"><h2>group {g}'
            + (f" (index {_esc(str(label))})" if str(label) != str(g) else "")
            + f": {n_c} correct, {n_w} wrong rollouts</h2>")
    parts = [head]
    if prompts is not None and members:
        parts.append(f'<div class="prompt" title="prompt">{_esc(str(prompts[members[0]]))}</div>')
    if not prep.is_mixed(g):
        parts.append('<p class="note">Every rollout of this group is '
                     + ("correct" if n_w == 0 else "wrong") + ": nothing to contrast, every score is 0.</p>")
    parts.append('<div class="cols"><div class="rollouts">')
    for i in members:
        ok = bool(prep.correct[i])
        mark = "&#10003; correct" if ok else "&#10007; wrong"
        parts.append(f'<div class="rollout {"correct" if ok else "wrong"}" data-rollout="{i}">'
                     f'<span class="mark" title="rollout {i}, reward {prep.rewards[i].item():g}">{mark} '
                     f"#{i}</span><span class=\"text\">{_tokens_html(prep, g, i, decoder)}</span></div>")
    parts.append("</div>")
    parts.append(_key_table(prep, g, decoder, top_k))
    parts.append("</div></section>")
    return "".join(parts)


def _tokens_html(prep: Prepared, g: int, i: int, decoder) -> str:
    s, top = prep.scores, prep.config.top
    n_c, n_w = int(s.n_c[g]), int(s.n_w[g])
    spans = []
    ids, mask = prep.responses[i].tolist(), prep.mask[i].tolist()
    for t, (token, on) in enumerate(zip(ids, mask)):
        if not on:
            continue
        row = prep.rows[(g, token)]
        st = prep.row(row)
        text = decoder(token)
        background, colour = score_colour(st["score"], top)
        tip = (f"token {token} {text!r}\n"
               f"a={st['a']} of {n_c} correct, b={st['b']} of {n_w} wrong\n"
               f"p={st['p_value']:.4g}  F={st['F']:.3f}  IG={st['IG']:.3f} bits\n"
               f"score={st['score']:+.4f}")
        spans.append(f'<span class="tok" data-group="{g}" data-rollout="{i}" data-pos="{t}" data-token="{token}" '
                     f'data-score="{st["score"]!r}" title="{_esc(tip)}" '
                     f'style="background:{background};color:{colour}">{_esc(visible(text, keep_newlines=True))}</span>')
    return "".join(spans)


def _key_table(prep: Prepared, g: int, decoder, top_k: int) -> str:
    s = prep.scores
    rows = key_rows(prep, g, top_k)
    n_c, n_w = int(s.n_c[g]), int(s.n_w[g])
    if not rows:
        return '<p class="note keys-empty">No key tokens (every score is 0).</p>'
    out = [f'<table class="keys"><caption>top key tokens (by p, then |score|)</caption>'
           f"<tr><th>token</th><th>id</th><th>a/{n_c}</th><th>b/{n_w}</th><th>p</th><th>F</th><th>IG</th>"
           "<th>score</th></tr>"]
    for i in rows:
        st = prep.row(i)
        background, colour = score_colour(st["score"], prep.config.top)
        text = _esc(visible(decoder(int(st["token"]))))
        out.append(f'<tr><td class="t"><span style="background:{background};color:{colour};padding:0 3px">{text}'
                   f"</span></td><td>{st['token']}</td><td>{st['a']}</td><td>{st['b']}</td>"
                   f"<td>{st['p_value']:.3g}</td><td>{st['F']:.3f}</td><td>{st['IG']:.3f}</td>"
                   f"<td>{st['score']:+.3f}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _config_text(cfg: KTAEConfig) -> str:
    default = KTAEConfig()
    changed = [f"{k}={getattr(cfg, k)!r}" for k in ("alpha", "beta", "use_tf", "top", "k1", "b", "correct_threshold",
                                                     "ignore_token_ids", "fisher")
               if getattr(cfg, k) != getattr(default, k)]
    return "KTAEConfig(" + ", ".join(changed) + ")" if changed else "Default KTAEConfig()."


def _fmt_score(v: float) -> str:
    return f"{v:+g}" if math.isfinite(v) else str(v)


def _esc(text: str) -> str:
    return html.escape(text, quote=True)
