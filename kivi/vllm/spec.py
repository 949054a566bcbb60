"""The KV cache spec of a KIVI page group, and its manager: full attention whose blocks are never a prefix hit.

A prefix hit hands a request the cached blocks of a prompt prefix and starts its step after them. Under KIVI
the last ``R + G - 1`` tokens before any point are full precision and live in the request's own window
rings (:mod:`kivi.paged.geometry`), not in the shared page blocks: a hit would read a fresh ring for them
(stale rows, or zeros) and decode from a context kivi never holds. The page blocks of a finished prefix also
hold its window tokens only once they left the window, i.e. only if the first request ran ``R + G`` tokens
past them. So kivi's page group opts out of hits: :class:`KiviPageManager` finds no hit, and vLLM's
hybrid coordinator (the shortest hit over the groups that take part; the circular-buffer window groups take
none) then reports no hit for any request. Prefix caching on is then
correct and costs nothing; it shares nothing (``vllm:prefix_cache_hits`` stays 0; docs/vllm.md).

Registered in every vLLM process by :func:`kivi.vllm.register` through vLLM's KV cache spec registry (the
engine core builds the managers from the specs the workers send). Imports vLLM: loaded only by vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


@dataclasses.dataclass(frozen=True, kw_only=True)
class KiviPageSpec(FullAttentionSpec):
    """vLLM's full-attention spec of a layer whose blocks are KIVI pages (``state_content_bytes``: the page's
    bytes per head and token, :func:`kivi.paged.geometry.build_geometry`)."""


class KiviPageManager(FullAttentionManager):
    """Full attention blocks (allocation, freeing, preemption as vLLM's) that are never a prefix-cache hit."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        return tuple([] for _ in kv_cache_group_ids), 0


def page_spec(spec: FullAttentionSpec, state_content_bytes: int) -> KiviPageSpec:
    """``spec`` (vLLM's spec of a full-attention layer) as a :class:`KiviPageSpec` of ``state_content_bytes``."""
    if type(spec) is not FullAttentionSpec:
        raise NotImplementedError(f"kivi's vLLM plugin supports full-attention layers, got a {type(spec).__name__}")
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    fields["state_content_bytes"] = state_content_bytes
    return KiviPageSpec(**fields)


def register_spec() -> None:
    """Register :class:`KiviPageSpec` with :class:`KiviPageManager` (vLLM's built-in specs first: the registry
    fills them in only while it is empty)."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(KiviPageSpec, KiviPageManager, uniform_type_base_spec=FullAttentionSpec)


__all__ = ["KiviPageSpec", "KiviPageManager", "page_spec", "register_spec"]
