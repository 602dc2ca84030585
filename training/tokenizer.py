"""Tokenizers: a character-level one built in code for the toy tasks, or a local HF tokenizer."""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

#: characters of the toy arithmetic tasks; each is one token.
CHARS = "0123456789+-*=() "
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"


def build_char_tokenizer() -> PreTrainedTokenizerBase:
    """A real HF fast tokenizer (one token per character of ``CHARS``, ids 0..3 special).

    Built from a ``tokenizers`` word-level model with a one-character pre-tokenizer, so it encodes,
    decodes, pads and saves (``save_pretrained``) like any hub tokenizer, with nothing downloaded.
    """
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """A local tokenizer directory (``local_files_only``: never downloads); pad falls back to eos."""
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer at `--model {path}` has no eos token; generation needs one")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def decode_answers(tokenizer: PreTrainedTokenizerBase, responses: list[list[int]]) -> list[str]:
    """The responses' text for the verifier: the eos that ends a response dropped, every other token kept,
    so that a special token inside an answer (pad, bos, unk) makes it wrong instead of vanishing."""
    eos = tokenizer.eos_token_id
    return tokenizer.batch_decode([r[:-1] if r and r[-1] == eos else r for r in responses], skip_special_tokens=False)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Prompt token ids: bos (when the tokenizer has one) followed by the text's tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids
