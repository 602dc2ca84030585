"""Token id -> display text: a caller's decoder (a callable or a Hugging Face tokenizer) or the id itself."""
from __future__ import annotations

from typing import Any, Callable

Decoder = Callable[[int], str]


def make_decoder(decode: Any = None) -> tuple[Decoder, bool]:
    """A cached ``id -> str`` function and whether it shows real text (False: the ids fallback).

    ``decode`` may be None (show ``[id]``), an object with a ``.decode`` method (a Hugging Face
    tokenizer: called as ``decode([id])``, so one token decodes alone) or any ``decode(id) -> str``
    callable. ``.decode`` wins over ``__call__``: a tokenizer's ``__call__`` encodes.
    """
    if decode is None:
        return (lambda token: f"[{token}]"), False
    method = getattr(decode, "decode", None)
    if callable(method):
        raw: Decoder = lambda token: method([token])  # noqa: E731
    elif callable(decode):
        raw = decode
    else:
        raise ValueError(f"`decode` must be None, a callable id -> str or an object with .decode (a tokenizer), "
                         f"got {type(decode).__name__}")
    cache: dict[int, str] = {}

    def cached(token: int) -> str:
        if token not in cache:
            try:
                text = raw(token)
            except Exception as err:  # noqa: BLE001 - name the argument and the id, keep the cause
                raise ValueError(f"`decode` failed on token id {token}: {type(err).__name__}: {err}") from err
            if not isinstance(text, str):
                raise ValueError(f"`decode` must return str, got {type(text).__name__} for token id {token}")
            cache[token] = text
        return cache[token]

    return cached, True


def visible(text: str, *, keep_newlines: bool = False) -> str:
    """Token text with invisible characters made visible: a newline as ``↵`` (followed by the newline
    itself when ``keep_newlines``, so the text still breaks there), a tab as ``→``, an empty token as
    ``∅``; other whitespace is kept (the report lays text out with ``white-space: pre-wrap``)."""
    if text == "":
        return "\u2205"
    newline = "\u21b5\n" if keep_newlines else "\u21b5"
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", newline)
    return text.replace("\t", "\u2192")
