"""The PNG summary (matplotlib): the distribution of scores and each shown group's top key tokens."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from ..config import KTAEConfig
from .common import key_rows, prepare
from .decode import make_decoder, visible
from .html import NEGATIVE_RGB, POSITIVE_RGB


def write_png(path: str | Path, responses: Any, response_mask: Any, rewards: Any, index: Any, *,
              decode: Any = None, config: KTAEConfig | None = None, max_groups: int | None = 4,
              groups: Sequence[int] | None = None, top_k: int = 8, title: str = "KTAE key tokens",
              backend: str = "auto", correct: Any = None) -> Path:
    """Write a PNG: a histogram of the non-zero scores of every (group, token) of the batch, then one
    horizontal bar chart per shown group of its ``top_k`` key tokens (by p-value, then |score|).

    Inputs as ``ktae_kernels.key_token_scores`` (``responses [B, L]``, ``response_mask [B, L]``,
    ``rewards [B]``, ``index [B]``); ``decode``, ``config``, ``max_groups``, ``groups`` and
    ``correct`` as in ``write_report``. Needs matplotlib (``pip install "ktae_kernels[viz]"``). Returns the path.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError('write_png needs matplotlib: pip install "ktae_kernels[viz]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"`top_k` must be an int >= 1, got {top_k!r}")
    decoder, has_text = make_decoder(decode)
    prep = prepare(responses, response_mask, rewards, index, config=config, max_groups=max_groups,
                   groups=groups, backend=backend, correct=correct)
    top = prep.config.top
    pos, neg = (tuple(c / 255 for c in rgb) for rgb in (POSITIVE_RGB, NEGATIVE_RGB))
    panels = 1 + len(prep.shown)
    ncols = min(panels, 3)
    nrows = math.ceil(panels / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
    flat = axes.flatten().tolist()
    for ax in flat[panels:]:
        ax.axis("off")

    ax = flat[0]
    s = prep.scores
    nonzero = s.score[s.score != 0].double()
    bins = [top * (i / 10 - 1) for i in range(21)]
    if nonzero.numel():
        values = nonzero.tolist()
        c_neg, _, _ = ax.hist([v for v in values if v < 0], bins=bins, color=neg, label="toward wrong (< 0)")
        c_pos, _, _ = ax.hist([v for v in values if v > 0], bins=bins, color=pos, label="toward correct (> 0)")
        ax.set_ylim(0, 1.35 * max(float(c_neg.max()), float(c_pos.max()), 1.0))  # room for the legend
        ax.legend(fontsize=8, loc="upper center", ncols=2)
    else:
        ax.text(0.5, 0.5, "every score is 0", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlim=(-top, top), xlabel="key-token score", ylabel="(group, token) pairs")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts: no fractional ticks
    ax.set_title(f"non-zero scores: {nonzero.numel()} of {len(s)} (group, token) pairs", fontsize=10)

    for ax, g in zip(flat[1:], prep.shown):
        rows = key_rows(prep, g, top_k)
        n_c, n_w = int(s.n_c[g]), int(s.n_w[g])
        ax.set_title(f"group {g}: {n_c} correct, {n_w} wrong", fontsize=10)
        if not rows:
            ax.text(0.5, 0.5, "no key tokens (every score is 0)", ha="center", va="center", transform=ax.transAxes)
            ax.set(xlim=(-top, top), yticks=[])
            continue
        stats = [prep.row(i) for i in rows]
        labels = [(f"{_short(visible(decoder(int(st['token']))))} [{st['token']}]" if has_text else f"[{st['token']}]")
                  + f"  p={st['p_value']:.2g}" for st in stats]
        scores = [st["score"] for st in stats]
        ypos = list(range(len(rows)))[::-1]  # most significant on top
        ax.barh(ypos, scores, color=[pos if v > 0 else neg for v in scores])
        ax.set_yticks(ypos, labels, fontsize=8)
        ax.axvline(0, color="#444", lw=0.8)
        ax.set(xlim=(-top * 1.05, top * 1.05), xlabel=f"score (top {len(rows)} by p, then |score|)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _short(text: str, width: int = 14) -> str:
    """At most ``width`` characters, ``$`` escaped (matplotlib would read it as maths)."""
    text = text if len(text) <= width else text[: width - 1] + "\u2026"
    return text.replace("$", r"\$")
