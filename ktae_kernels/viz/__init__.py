"""See the key tokens: a self-contained HTML report and a matplotlib PNG summary of a batch's KTAE scores.

``write_report(path, responses, mask, rewards, index, decode=tokenizer)`` writes the HTML report (no
dependency beyond the core install); ``write_png`` needs matplotlib (the ``viz``, ``bench`` or
``train`` extra). From the shell: ``python -m ktae_kernels.viz BATCH_FILE -o report.html``.
"""
from .decode import make_decoder
from .html import render_html, write_report
from .png import write_png

__all__ = ["make_decoder", "render_html", "write_png", "write_report"]
