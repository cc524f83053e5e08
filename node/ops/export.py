"""`lowcomm-node export`: a model as a directory that transformers loads as a LlamaForCausalLM.

    model.safetensors       the weights, in Llama's names and layout (node/ops/hf_layout.py)
    config.json             LlamaConfig
    tokenizer.json          the model's tokenizer (raw bytes as a 256-token byte-level BPE when
    tokenizer_config.json   the model was trained on bytes), for AutoTokenizer
    lowcomm.json            where it came from: the source, which weights, the tokenizer digest

Writing needs `safetensors` and `tokenizers` (the `hf` extra), not transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from node.data.corpus import DataError
from node.data.shards import write_atomically
from node.ops.hf_layout import llama_config, to_llama
from node.ops.model_source import (EXPORT_CONFIG, EXPORT_WEIGHTS, TOKENIZER_FILE, LoadedModel,
                                   load_source_tokenizer, safetensors_torch)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_model(loaded: LoadedModel, out: Path, dtype: str = "float32",
                 force: bool = False) -> Path:
    """Writes the directory; refuses to mix into a non-empty one unless `force`."""
    from node.data.tokenizer import end_of_text_id, file_digest
    save_file = safetensors_torch().save_file
    if dtype not in DTYPES:
        raise DataError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise DataError(f"--out '{out}' exists and is not empty: choose a new directory or "
                        f"pass --force to overwrite it")
    tokenizer = load_source_tokenizer(loaded)
    loaded.build()  # refuses weights that do not fit the config, before anything is written
    out.mkdir(parents=True, exist_ok=True)
    llama = to_llama(loaded.weights, loaded.model_cfg)
    tensors = {n: t.to(DTYPES[dtype]) for n, t in llama.items()}
    save_file(tensors, str(out / EXPORT_WEIGHTS), metadata={"format": "pt"})
    eos_id = end_of_text_id(tokenizer)
    config = llama_config(loaded.model_cfg, loaded.vocab_size, dtype, eos_id)
    write_atomically(out / EXPORT_CONFIG, json.dumps(config, indent=2).encode())
    write_atomically(out / TOKENIZER_FILE, tokenizer.to_str().encode())
    eos = tokenizer.id_to_token(eos_id) if eos_id is not None else None
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                        "model_max_length": loaded.model_cfg.max_seq_len,
                        "clean_up_tokenization_spaces": False}
    write_atomically(out / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2).encode())
    provenance = {"source": loaded.description, "dtype": dtype,
                  "tokenizer_digest": file_digest(out / TOKENIZER_FILE),
                  "trained_on_bytes": loaded.tokenizer_path is None}
    write_atomically(out / "lowcomm.json", json.dumps(provenance, indent=2).encode())
    return out
