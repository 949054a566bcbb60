"""Attention that reads the packed KIVI cache (see docs in each module).

Importing this package registers the ``"kivi"`` attention implementation and mask function with
transformers.
"""

from ..backends import ATTN_IMPLEMENTATION, resolve_attention_backend
from .blocked import blocked_attention
from .interface import kivi_attention_forward, register
from .prefill import chunked_prefill
from .reference import dense_attention, materialize_view, reference_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "resolve_attention_backend",
    "blocked_attention",
    "reference_attention",
    "dense_attention",
    "materialize_view",
    "kivi_attention_forward",
    "register",
    "chunked_prefill",
]
