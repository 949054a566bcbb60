"""KIVI pages in transformers' continuous batching (``model.generate_batch`` / ``init_continuous_batching``).

:func:`init_continuous_batching` and :func:`generate_batch` are the entry points; see
docs/serving.md, "KIVI pages in transformers' continuous batching". Modules: ``version`` (the tested transformers
versions), ``layout`` (bytes of a KIVI block: pages of every layer, window blocks), ``allocator`` (block
bookkeeping and each request's KIVI state), ``paged_cache`` (the paged cache's forward), ``decode`` (a decode
step's block tables, counts and window rows for the paged decode kernel, :mod:`kivi.paged.decode`),
``paged_attention`` (the ``"kivi_paged"`` attention over packed pages), ``manager`` (the entry points),
``requests`` (the checks of a request before it is scheduled), ``usage`` (what the blocks are doing now). Page
reads and writes are :mod:`kivi.cache.pages`'.
"""

from .layout import PageLayout, build_layout, fp_block_bytes
from .manager import KiviBatchingManager, generate_batch, init_continuous_batching
from .usage import BlockUsage, block_usage
from .version import TESTED_TRANSFORMERS, check_transformers_version

__all__ = [
    "init_continuous_batching", "generate_batch", "KiviBatchingManager", "PageLayout", "build_layout",
    "fp_block_bytes", "TESTED_TRANSFORMERS", "check_transformers_version", "BlockUsage", "block_usage",
]
