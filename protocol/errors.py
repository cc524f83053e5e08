"""Error types of protocol/: each says in one sentence what is wrong. All are ValueErrors."""

from __future__ import annotations


class ProtocolError(ValueError):
    """Base of every error raised by protocol/ on bad input."""


class LayoutError(ProtocolError):
    """Two dicts of named tensors do not hold the same names, shapes or dtypes."""


class ConfigurationError(ProtocolError):
    """A hyper-parameter or bound is out of its allowed range."""


class CodecError(ProtocolError):
    """A tensor cannot be encoded, or a description/payload pair cannot be decoded safely."""
