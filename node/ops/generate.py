"""`lowcomm-node generate` and `lowcomm-node perplexity`: a quick look at what a model says, and
how well it predicts held-out text. Both run our own decoder (node/train/model.py) on the CPU or
GPU, from a checkpoint or an export (node/ops/model_source.py); transformers is not needed.

Sampling, per new token: logits ℓ of the last position (the context cropped to the model's
max_seq_len), p = softmax(ℓ / T) over the k largest (all when k = 0); T = 0 takes the argmax.
Perplexity over N predicted tokens: exp( −(1/N) Σ_t log p(x_t | x_<t) ), the text cut into
consecutive windows of `context` tokens (each window starts with no earlier context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from node.data.corpus import DataError
from node.train.model import Decoder


@dataclass
class SamplingSettings:
    max_new_tokens: int = 100
    temperature: float = 0.8
    top_k: int = 50
    seed: int = 0


@torch.no_grad()
def sample(model: Decoder, prompt: list[int], s: SamplingSettings) -> list[int]:
    """The prompt's continuation: `s.max_new_tokens` new token ids."""
    if not prompt:
        raise DataError("the prompt is empty after tokenization: give --prompt some text")
    generator = torch.Generator().manual_seed(s.seed)
    tokens = torch.tensor([prompt], dtype=torch.long)
    new = []
    for _ in range(s.max_new_tokens):
        logits = model(tokens[:, -model.cfg.max_seq_len:])[0, -1].float()
        if s.temperature == 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / s.temperature
            if s.top_k:
                kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, -math.inf)
            next_id = int(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator))
        new.append(next_id)
        tokens = torch.cat([tokens, torch.tensor([[next_id]])], dim=1)
    return new


@dataclass
class PerplexityResult:
    tokens: int          # tokens predicted
    mean_nll: float      # nats per token
    perplexity: float


@torch.no_grad()
def perplexity(model: Decoder, ids: np.ndarray, context: int, batch_size: int = 8
               ) -> PerplexityResult:
    if len(ids) < 2:
        raise DataError(f"the held-out text has {len(ids)} token(s): perplexity needs at least 2")
    context = min(context, model.cfg.max_seq_len)
    ids = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    full = (len(ids) - 1) // context
    inputs = ids[:full * context].view(full, context)
    targets = ids[1:full * context + 1].view(full, context)
    batches = [(inputs[i:i + batch_size], targets[i:i + batch_size])
               for i in range(0, full, batch_size)]
    rest = ids[full * context:]  # the last, shorter window
    if len(rest) >= 2:
        batches.append((rest[None, :-1], rest[None, 1:]))
    total = sum(float(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(),
                                      reduction="sum")) for x, y in batches)
    count = len(ids) - 1
    mean = total / count
    return PerplexityResult(count, mean, math.exp(mean))


def held_out_ids(path: Path, tokenizer, vocab_size: int) -> np.ndarray:
    """A text file through the model's tokenizer, or a token shard (.bin) as it is."""
    if not path.is_file():
        raise DataError(f"held-out file '{path}' does not exist: give a text file or a "
                        f"prepare-data shard such as val-00000.bin")
    if path.suffix == ".bin":
        from node.data.shards import read_index
        index = read_index(path.parent)
        dtype = index["dtype"] if index else ("uint16" if vocab_size <= 1 << 16 else "uint32")
        ids = np.fromfile(path, dtype=dtype)
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"held-out file '{path}' is not UTF-8 text (offset {exc.start}): "
                            f"convert it to UTF-8") from None
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    if len(ids) and int(ids.max()) >= vocab_size:
        raise DataError(f"held-out file '{path}' holds token id {int(ids.max())}, outside the "
                        f"model's vocabulary of {vocab_size}: give shards of the model's data")
    return ids
