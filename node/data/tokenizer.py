"""Tokenizers: byte-level BPE trained on the user's own text, a given tokenizer.json, or raw bytes.

All three are Hugging Face `tokenizers` objects, saved as one tokenizer.json that transformers
and every other tool of that ecosystem read. A tokenizer is identified by the BLAKE2b-256 digest
of its tokenizer.json bytes (`file_digest`): that is what a swarm manifest pins
(data.tokenizer_digest), so that every volunteer tokenizes the same way.

The `tokenizers` package is an optional extra (`pip install lowcomm-node[hf]`); the daemon never
imports this module's heavy half, only `file_digest`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from node.data.corpus import DataError

END_OF_TEXT = "<|endoftext|>"
# End-of-document markers of common tokenizers, tried in this order for a given tokenizer.json.
KNOWN_EOS = (END_OF_TEXT, "</s>", "<eos>", "<|end_of_text|>")
UINT16_VOCAB = 1 << 16


def file_digest(path: str | Path) -> str:
    """BLAKE2b-256 of a file's bytes, hex: the identity of a tokenizer.json or a token shard."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=32)).hexdigest()


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError("the 'tokenizers' package is not installed: pip install "
                        "'lowcomm-node[hf]' (or pip install tokenizers)") from None
    return tokenizers


def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None):
    """A byte-level BPE (GPT-2's scheme: every byte is a symbol, so no text is out of
    vocabulary) with `vocab_size` entries, END_OF_TEXT among them, learnt from `texts`."""
    tk = _tokenizers()
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(f"--vocab-size {vocab_size} is too small for a byte-level BPE: it needs "
                        f"at least {len(alphabet) + 1} (256 bytes and {END_OF_TEXT})")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                     initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer, length=length)
    return tokenizer


def bytes_to_symbols() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2's): printable Latin-1
    bytes stand for themselves, the other 68 are moved to code points 256 and up in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    moved = (b for b in range(256) if b not in printable)
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(moved)})
    return table


def byte_tokenizer():
    """Token id = byte value (vocabulary 256): the tokenizer of a model trained on raw bytes
    (data.source = stdlib or text), so that such a model can be exported and sampled too."""
    tk = _tokenizers()
    vocab = {symbol: byte for byte, symbol in bytes_to_symbols().items()}
    tokenizer = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    return tokenizer


def load_tokenizer(path: str | Path):
    """A tokenizer.json (as `tokenizers` and transformers save it); one sentence if unusable."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file '{path}' does not exist: give the path of a "
                        f"tokenizer.json, or train one with --vocab-size N")
    try:
        return _tokenizers().Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a plain Exception for a bad file
        raise DataError(f"tokenizer file '{path}' cannot be read by the tokenizers library "
                        f"({str(exc).splitlines()[0][:160]}): give a tokenizer.json as "
                        f"Hugging Face tokenizers saves it") from None


def end_of_text_id(tokenizer) -> int | None:
    """The id that separates documents: the first of KNOWN_EOS the vocabulary holds."""
    for token in KNOWN_EOS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def shard_dtype(vocab_size: int, requested: str = "auto") -> str:
    """uint16 when every id fits (vocabulary <= 65,536), else uint32; a request that does not
    fit is refused in one sentence."""
    if requested == "auto":
        return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"
    if requested == "uint16" and vocab_size > UINT16_VOCAB:
        raise DataError(f"--dtype uint16 cannot hold the tokenizer's {vocab_size:,} token ids "
                        f"(at most {UINT16_VOCAB:,}): use --dtype uint32 (or auto)")
    return requested
