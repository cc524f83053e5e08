"""Tensor codecs behind one interface (protocol/codecs/base.py), found by name in a registry.

    codec = get_codec("lowrank", rank=8, bits=4)
    encoded = codec.encode(tensor, name="layers.0.wq")       # Encoded(description, payload)
    tensor = codec.decode(encoded.description, encoded.payload, max_elements=tensor.numel())

Registered names: identity, fp16, bf16, blockwise (bits 8|4, block_size), lowrank, topk (k, chunk,
bits 2|4|8).
"""

from protocol.codecs.base import DEFAULT_MAX_ELEMENTS, Codec, Encoded, codec_names, decode, \
    description_size, get_codec, register_codec
from protocol.codecs.blockwise import BlockwiseCodec
from protocol.codecs.cast import BFloat16Codec, Float16Codec, IdentityCodec
from protocol.codecs.lowrank import LowRankCodec
from protocol.codecs.topk import TopKCodec
from protocol.errors import CodecError

__all__ = ["DEFAULT_MAX_ELEMENTS", "BFloat16Codec", "BlockwiseCodec", "Codec", "CodecError", "Encoded",
           "Float16Codec", "IdentityCodec", "LowRankCodec", "TopKCodec", "codec_names", "decode", "description_size",
           "get_codec", "register_codec"]
