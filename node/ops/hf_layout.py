"""Our decoder's weights in transformers' LlamaForCausalLM layout, and back.

The two models compute the same function; only names and two layouts differ:
- our attention keeps q, k and v in one matrix (`attn.qkv`, rows [q; k; v]) and the SwiGLU's
  gate and up projections in one (`ffn.gate_up`, rows [gate; up]): Llama keeps them apart;
- our rotary embedding turns interleaved pairs (x[2i], x[2i+1]) of each head by angle
  pos·θ^(-2i/d), Llama's `rotate_half` turns the pairs (x[i], x[i + d/2]). Attention scores
  q·k are unchanged when the same permutation P of each head's dimensions is applied to q and
  k, so the export reorders the rows of W_q and W_k within each head, (0, 2, 4, ..., 1, 3, 5,
  ...), which maps our pair i to Llama's pair i. W_v and W_o are untouched.
Nothing else differs: RMSNorm with a weight, SiLU gating, scaled dot-product attention with
scale 1/√d_head, no biases, an optional tied output projection.
"""

from __future__ import annotations

from typing import Any

import torch

from node.config.schema import ModelConfig

LLAMA_PREFIX = "model."


def _interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows (head, i, pair) -> (head, pair, i): per head, even dimensions first, then odd."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_llama(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameter names -> LlamaForCausalLM's (contiguous tensors, ready for safetensors).
    With tied embeddings the output projection is left out (transformers ties it on load)."""
    out = {"model.embed_tokens.weight": weights["embed.weight"],
           "model.norm.weight": weights["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = weights["head.weight"]
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = weights[ours + "attn.qkv.weight"].chunk(3, dim=0)
        gate, up = weights[ours + "ffn.gate_up.weight"].chunk(2, dim=0)
        out.update({
            theirs + "input_layernorm.weight": weights[ours + "attn_norm.weight"],
            theirs + "self_attn.q_proj.weight": _interleaved_to_halves(q, cfg.n_heads),
            theirs + "self_attn.k_proj.weight": _interleaved_to_halves(k, cfg.n_heads),
            theirs + "self_attn.v_proj.weight": v,
            theirs + "self_attn.o_proj.weight": weights[ours + "attn.out.weight"],
            theirs + "post_attention_layernorm.weight": weights[ours + "ffn_norm.weight"],
            theirs + "mlp.gate_proj.weight": gate,
            theirs + "mlp.up_proj.weight": up,
            theirs + "mlp.down_proj.weight": weights[ours + "ffn.down.weight"]})
    return {name: t.detach().contiguous() for name, t in out.items()}


def from_llama(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `to_llama` (for `generate` and `perplexity` on an export)."""
    out = {"embed.weight": tensors["model.embed_tokens.weight"],
           "norm.weight": tensors["model.norm.weight"],
           "head.weight": tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])}
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q = _halves_to_interleaved(tensors[theirs + "self_attn.q_proj.weight"], cfg.n_heads)
        k = _halves_to_interleaved(tensors[theirs + "self_attn.k_proj.weight"], cfg.n_heads)
        v = tensors[theirs + "self_attn.v_proj.weight"]
        out.update({
            ours + "attn_norm.weight": tensors[theirs + "input_layernorm.weight"],
            ours + "attn.qkv.weight": torch.cat([q, k, v]),
            ours + "attn.out.weight": tensors[theirs + "self_attn.o_proj.weight"],
            ours + "ffn_norm.weight": tensors[theirs + "post_attention_layernorm.weight"],
            ours + "ffn.gate_up.weight": torch.cat([tensors[theirs + "mlp.gate_proj.weight"],
                                                    tensors[theirs + "mlp.up_proj.weight"]]),
            ours + "ffn.down.weight": tensors[theirs + "mlp.down_proj.weight"]})
    return out


def llama_config(cfg: ModelConfig, vocab_size: int, dtype: str,
                 eos_token_id: int | None) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM with our model's shapes. rope_theta is written in both
    spellings: transformers 4.x reads `rope_theta`, 5.x `rope_parameters`."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_hidden,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_heads, "head_dim": cfg.dim // cfg.n_heads,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
            "mlp_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": None, "eos_token_id": eos_token_id, "use_cache": True,
            "torch_dtype": dtype}


def model_config_from_llama(config: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig from a config.json that `llama_config` wrote."""
    rope = config.get("rope_parameters") or {}
    return ModelConfig(preset="export", dim=config["hidden_size"],
                       n_layers=config["num_hidden_layers"],
                       n_heads=config["num_attention_heads"],
                       ffn_hidden=config["intermediate_size"],
                       max_seq_len=config["max_position_embeddings"],
                       vocab_size=config["vocab_size"],
                       rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                       norm_eps=config["rms_norm_eps"],
                       tie_embeddings=bool(config.get("tie_word_embeddings", False)))
