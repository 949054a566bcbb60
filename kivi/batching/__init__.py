"""KIVI pages in transformers' continuous batching (``model.generate_batch`` / ``init_continuous_batching``).

:func:`init_continuous_batching` and :func:`generate_batch` are the entry points; see
docs/serving.md, "KIVI pages in transformers' continuous batching". Modules: ``version`` (the tested transformers
versions), ``layout`` (bytes of a KIVI block: every layer's unit of the paged core's geometry), ``allocator`` (block
bookkeeping and each request's KIVI state), ``paged_cache`` (the paged cache: the core's step,
:func:`kivi.paged.forward.paged_step`, over transformers' block tables), ``paged_attention`` (the ``"kivi_paged"``
attention that runs it), ``manager`` (the entry points), ``requests`` (the checks of a request before it is
scheduled), ``usage`` (what the blocks are doing now).
"""

from .layout import PageLayout, build_layout, fp_block_bytes
from .manager import KiviBatchingManager, generate_batch, init_continuous_batching
from .usage import BlockUsage, block_usage
from .version import TESTED_TRANSFORMERS, check_transformers_version

__all__ = [
    "init_continuous_batching", "generate_batch", "KiviBatchingManager", "PageLayout", "build_layout",
    "fp_block_bytes", "TESTED_TRANSFORMERS", "check_transformers_version", "BlockUsage", "block_usage",
]
