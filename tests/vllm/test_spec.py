"""kivi.vllm.spec: the KIVI page group's KV cache spec and its manager, in vLLM's registry, without an engine.

The engine test (test_engine_behaviour.py, prefix caching) shows the effect end to end; these check the
pieces: the spec keeps every field vLLM gave and carries the page's bytes, the manager never finds a hit
where vLLM's full-attention manager does, and registering it keeps vLLM's built-in specs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm


def _full_spec(**kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, **kw)


def test_page_spec_keeps_vllms_fields_and_sets_the_page_bytes():
    from kivi.vllm.spec import KiviPageSpec, page_spec

    spec = _full_spec()
    page = page_spec(spec, 40)
    assert type(page) is KiviPageSpec
    assert (page.block_size, page.num_kv_heads, page.head_size, page.dtype) == (128, 3, 64, torch.bfloat16)
    assert page.state_content_bytes == 40 and page.page_size_bytes == 3 * 128 * 40
    assert page.page_size_bytes != spec.page_size_bytes


def test_page_spec_refuses_other_attention_kinds():
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from kivi.vllm.spec import page_spec

    sliding = SlidingWindowSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=256)
    with pytest.raises(NotImplementedError, match="SlidingWindowSpec"):
        page_spec(sliding, 40)


def test_registered_manager_never_finds_a_hit_where_full_attention_does():
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from kivi.vllm.spec import KiviPageManager, page_spec, register_spec

    register_spec()
    register_spec()  # every vLLM process calls it once; twice is harmless
    spec = _full_spec()
    page = page_spec(spec, 40)
    assert KVCacheSpecRegistry.get_manager_class(page) is KiviPageManager
    assert KVCacheSpecRegistry.get_manager_class(spec) is FullAttentionManager  # the built-ins are still there
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(page) is type(spec)

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=128)
    hashes = [BlockHash(bytes([i]) * 32) for i in range(2)]
    blocks = pool.get_new_blocks(2)
    for blk, h in zip(blocks, hashes):  # two full blocks of a prompt, cached as vLLM caches them
        blk.set_block_hash(make_block_hash_with_group_id(h, 0), 128)
        pool.cached_block_hash_to_block.insert(blk.block_hash, blk)
    args = dict(block_hashes=hashes, max_length=300, kv_cache_group_ids=[0], block_pool=pool,
                drop_eagle_block=False, alignment_tokens=128)
    _, full_hit = FullAttentionManager.find_longest_cache_hit(kv_cache_spec=spec, **args)
    found, kivi_hit = KiviPageManager.find_longest_cache_hit(kv_cache_spec=page, **args)
    assert full_hit == 256  # the same blocks are a hit for vLLM's own full attention
    assert kivi_hit == 0 and found == ([],)
