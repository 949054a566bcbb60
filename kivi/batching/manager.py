"""Continuous batching with KIVI pages: :func:`init_continuous_batching` and :func:`generate_batch`.

Both build a :class:`KiviBatchingManager`, transformers' ``ContinuousBatchingManager`` with three
changes: its cache is a :class:`~kivi.batching.paged_cache.KiviPagedCache` of ``cache_memory`` bytes
(``kivi_config=None``: transformers' own float ``PagedAttentionCache`` with the same byte budget,
``num_blocks = cache_memory // float block bytes``); a request is checked by ``add_request`` /
``add_requests`` before it is queued (:mod:`kivi.batching.requests`: prompt type, ids, context,
``max_new_tokens``) and refused (``ValueError``) when it can never fit the budget, instead of failing in
the generation loop or waiting forever; with KIVI pages the model runs the ``"kivi_paged"`` attention while the
manager runs (:mod:`kivi.batching.paged_attention`: the paged core's step per layer) and gets its own back when
it stops.

The hook (``_create_batch_processor``) is private transformers code: versions other than the tested
ones are refused (:mod:`kivi.batching.version`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import (
    SCHEDULER_MAPPING,
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
    FIFOScheduler,
    update_cb_config_after_cache_creation,
)
from transformers.generation.continuous_batching.utils import WorkloadHints

from ..backends import ATTN_IMPLEMENTATION, Backend, backend_named
from ..capabilities import reasons
from ..config import KiviConfig
from ..optional import triton_available
from ..sampling import is_greedy_temperature
from .layout import PageLayout, build_layout, fp_block_bytes
from .paged_attention import PAGED_ATTN_IMPLEMENTATION
from .paged_cache import KiviPagedCache
from .requests import RequestLimits, check_request, check_requests
from .version import check_transformers_version

CB_FIELDS = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}

#: Tokens per forward when the caller sets no ``max_batch_tokens`` (both caches; transformers' own default is
#: 8192). With transformers' FIFO scheduler (kivi's default too) every decoding request is scheduled first and
#: prefill chunks of admitted requests fill the rest of the step, so this bounds how long a decode step waits
#: for them; on CPU 512 served the most generated tokens/s of 256 / 512 / 2048 and ``prefill_first`` for
#: float and KIVI pages (docs/serving.md, "Scheduler setting").
DEFAULT_MAX_BATCH_TOKENS = 512


class KiviBatchingManager(ContinuousBatchingManager):
    """transformers' continuous batching manager over KIVI pages (or the float paged cache) of a fixed byte budget.

    ``layout`` is ``None`` for the float cache. ``capacity_blocks``: blocks the budget holds (``None``:
    transformers sizes the float cache itself).
    """

    def __init__(self, model: Any, generation_config: GenerationConfig,
                 continuous_batching_config: ContinuousBatchingConfig, workload_hints: WorkloadHints | None, *,
                 kivi_config: KiviConfig | None, cache_memory: int | None,
                 layout: PageLayout | None, packed_backend: Backend | None = None) -> None:
        self.kivi_config = kivi_config
        self.packed_backend = packed_backend
        self.cache_memory = cache_memory
        self.layout = layout
        text = model.config.get_text_config()
        self.block_bytes = layout.block_bytes if layout is not None else fp_block_bytes(
            text, model.dtype, continuous_batching_config.page_size)
        self.page_size = continuous_batching_config.page_size
        self.capacity_blocks = None if cache_memory is None else cache_memory // self.block_bytes
        #: what a request's prompt and length must respect (kivi.batching.requests)
        self.limits = RequestLimits.of(model)
        super().__init__(model, generation_config, continuous_batching_config, workload_hints)

    def switch_to_cb_friendly_attn(self, model: Any, auto_switch_to_flash: bool = True) -> None:
        """With KIVI pages the model runs ``"kivi_paged"`` attention (the paged core's step per layer); with the
        float cache transformers' choice, where kivi's ``"kivi"`` attention (quantize_model) becomes ``sdpa``, and
        so does ``eager`` on CPU when the model supports SDPA (transformers would run ``paged|eager``: the same
        batch mask, about half the speed of SDPA there)."""
        current = model.config._attn_implementation
        if self.layout is not None:
            if current != PAGED_ATTN_IMPLEMENTATION:
                model.set_attn_implementation(PAGED_ATTN_IMPLEMENTATION)
                if self._original_attn_impl is None:
                    self._original_attn_impl = current
            return
        on_cpu = getattr(model.device, "type", "cpu") == "cpu"
        to_sdpa = current == ATTN_IMPLEMENTATION or (
            current == "eager" and on_cpu and getattr(model, "_supports_sdpa", False))
        if to_sdpa:
            model.set_attn_implementation("sdpa")
        super().switch_to_cb_friendly_attn(model, auto_switch_to_flash)
        if to_sdpa:
            self._original_attn_impl = current

    def restore_attention(self) -> None:
        """Give the model back the attention implementation it had (``stop()`` does it for a started manager)."""
        if self._original_attn_impl is not None:
            self.model.set_attn_implementation(self._original_attn_impl)
            self._original_attn_impl = None

    def request_blocks(self, tokens: int) -> int:
        """Blocks a request of ``tokens`` tokens (prompt + new) takes at its longest."""
        if self.layout is not None:
            return self.layout.request_blocks(tokens)
        return -(-tokens // self.page_size)

    def check_request_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """``ValueError`` when a request of ``prompt_tokens + max_new_tokens`` tokens can never fit the budget."""
        need = self.request_blocks(prompt_tokens + max_new_tokens)
        if self.capacity_blocks is not None and need > self.capacity_blocks:
            kind = "KIVI" if self.layout is not None else "float"
            raise ValueError(
                f"request of {prompt_tokens} prompt tokens + max_new_tokens={max_new_tokens} "
                f"needs {need} {kind} blocks "
                f"of {self.block_bytes} bytes ({need * self.block_bytes} bytes) but cache_memory={self.cache_memory} "
                f"holds {self.capacity_blocks}; raise cache_memory or shorten the request"
            )

    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    *args: Any, **kwargs: Any) -> str | None:
        """transformers' ``add_request`` after :func:`~kivi.batching.requests.check_request` and
        :meth:`check_request_fits` (``max_new_tokens=None``: the generation config's)."""
        new = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        ids = check_request(input_ids, new, self.limits, param="input_ids")
        self.check_request_fits(len(ids), new)
        return super().add_request(ids, request_id, new, *args, **kwargs)

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, *args: Any,
                     **kwargs: Any) -> list[str]:
        """transformers' ``add_requests`` once every request passed the checks of :meth:`add_request`
        (a bad one is named by its index, ``inputs[i]``, and none is queued)."""
        new = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        checked = check_requests(inputs, new, self.limits)
        for ids in checked:
            self.check_request_fits(len(ids), new)
        return super().add_requests(checked, new, *args, **kwargs)

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        if self.layout is None:
            return super()._create_batch_processor()
        # transformers' _create_batch_processor (the same in 5.24 and 5.25) with the cache swapped for KIVI pages
        batch_processor = getattr(self, "batch_processor", None)
        if isinstance(batch_processor, ContinuousBatchProcessor):
            batch_processor.reset()
            return batch_processor
        cache = KiviPagedCache(self.model.config.get_text_config(), self.continuous_batching_config,
                               self.model.device, layout=self.layout, cache_memory=self.cache_memory,
                               packed_backend=self.packed_backend)
        self._use_prefix_sharing = cache.use_prefix_sharing
        update_cb_config_after_cache_creation(cb_config=self.continuous_batching_config, num_blocks=cache.num_blocks,
                                              max_batch_tokens=cache.max_batch_tokens)
        self.continuous_batching_config.max_blocks_per_request = 0
        scheduler_cls = SCHEDULER_MAPPING.get(self.continuous_batching_config.scheduler_type, FIFOScheduler)
        scheduler = scheduler_cls(cache=cache, safety_margin=self.continuous_batching_config.safety_margin,
                                  max_requests_per_batch=self.continuous_batching_config.max_requests_per_batch)
        return ContinuousBatchProcessor(
            cache=cache, config=self.model.config.get_text_config(), generation_config=self.generation_config,
            continuous_batching_config=self.continuous_batching_config, logit_processor=self.logit_processor,
            input_queue=self.input_queue if self.is_tp_driver else None,
            cancel_queue=self.cancel_queue if self.is_tp_driver else None, output_router=self.output_router,
            background_thread_status=self.background_thread_status, model_device=self.model.device,
            model_dtype=self.model.dtype, scheduler=scheduler, distributed_helper=self.distributed_helper,
        )


def _cb_config(kwargs: dict[str, Any]) -> ContinuousBatchingConfig:
    """The ``ContinuousBatchingConfig`` from ``continuous_batching_config=`` and/or its fields given as kwargs."""
    base = kwargs.pop("continuous_batching_config", None)
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k in CB_FIELDS}
    if base is not None and not isinstance(base, ContinuousBatchingConfig):
        raise TypeError(f"continuous_batching_config must be a ContinuousBatchingConfig, got {type(base).__name__}")
    if base is None:
        return ContinuousBatchingConfig(**fields)
    return dataclasses.replace(base, **fields) if fields else dataclasses.replace(base)


def _check_kivi_cb_config(cb: ContinuousBatchingConfig) -> None:
    """Refuse the continuous-batching options KIVI pages cannot serve, naming each."""
    if cb.use_async_batching:
        raise ValueError("use_async_batching=True is not supported with KIVI pages (the cache reads the batch plan "
                         "of the forward it runs; async batching prepares the next batch during it)")
    if cb.varlen_compile_config is not None or cb.decode_compile_config is not None or cb.default_compile_level:
        raise ValueError("torch.compile of the forward (varlen/decode_compile_config, default_compile_level) is not "
                         "supported with KIVI pages (the page reads are data dependent)")
    if cb.use_cuda_graph not in (None, False, (False, False)):
        raise ValueError(f"use_cuda_graph={cb.use_cuda_graph!r} is not supported with KIVI pages")
    cb.use_async_batching = False
    cb.use_cuda_graph = False
    cb.max_blocks_per_request = 0


def pages_attention_backend(kivi_config: KiviConfig, model: Any) -> str:
    """The backend of the paged step for ``kivi_config.attention_backend``: ``"cpu"`` (kivi's CPU kernels; what
    ``"auto"`` is on CPU), ``"reference"`` (dequantized request by request; ``"auto"`` off CPU) or ``"triton"``
    (kivi's Triton kernels, the vLLM plugin's GPU path: opt-in, never run on a GPU; on CPU pages under
    ``TRITON_INTERPRET=1``). What :mod:`kivi.capabilities` refuses, and ``"triton"`` where its kernels cannot
    run on the model's device (:func:`kivi.kernels._common.require_triton`), raise here, before anything runs."""
    requested = kivi_config.attention_backend
    device = getattr(getattr(model, "device", None), "type", "cpu")
    backend = requested if requested != "auto" else "cpu" if device == "cpu" else "reference"
    why = [r for r in reasons(kivi_config, "batching", backend, model_config=model.config,
                              triton=triton_available() if backend == "triton" else None)
           if not r.everywhere or r.kind == "model"]
    if why and (requested != "auto" or any(r.kind == "model" for r in why)):
        r = why[0]
        raise ValueError(f"attention_backend={requested!r} " + (
            f"cannot run this model with KIVI pages: {r}" if r.kind == "model" else str(r)))
    if backend == "triton":
        from ..kernels._common import require_triton

        require_triton(torch.device(device))
    return backend if not why else "reference"


def _greedy_if_tiny_temperature(gen: GenerationConfig) -> GenerationConfig:
    """``gen``, or a copy with ``do_sample=False`` when it samples at a temperature :func:`kivi.sampling.
    is_greedy_temperature` calls greedy (below 1e-5: float32 logits divided by it give inf/nan probabilities)."""
    if getattr(gen, "do_sample", False) and is_greedy_temperature(getattr(gen, "temperature", None)):
        gen = copy.deepcopy(gen)
        gen.do_sample = False
    return gen


def init_continuous_batching(model: Any, kivi_config: KiviConfig | None, *, cache_memory: int | None = None,
                             generation_config: GenerationConfig | None = None, **kwargs: Any) -> KiviBatchingManager:
    """A continuous-batching manager for ``model`` whose cache is KIVI pages (``kivi_config``) or, with
    ``kivi_config=None``, transformers' float paged cache, in ``cache_memory`` bytes.

    ``kwargs``: ``continuous_batching_config=`` (a ``ContinuousBatchingConfig``), any of its fields
    (``page_size``, ``max_batch_tokens``, ``scheduler_type``, ``max_requests_per_batch``, ``allow_block_sharing``,
    ...), and ``workload_hints=``. ``max_batch_tokens`` unset: :data:`DEFAULT_MAX_BATCH_TOKENS`.
    ``cache_memory=None``: for the float cache, transformers sizes it from the free memory as usual; KIVI pages
    need a budget (``ValueError``). A generation config that samples below :data:`kivi.sampling.GREEDY_BELOW`
    decodes greedily. Returns transformers' ``ContinuousBatchingManager`` (``add_request`` /
    ``get_result`` / ``start`` / ``stop``).
    """
    workload_hints = kwargs.pop("workload_hints", None)
    cb = _cb_config(kwargs)
    if cb.max_batch_tokens is None:
        cb.max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS
    if kwargs:
        raise TypeError(f"unexpected keyword argument(s) {sorted(kwargs)}; allowed: continuous_batching_config, "
                        f"workload_hints and the ContinuousBatchingConfig fields {sorted(CB_FIELDS)}")
    if kivi_config is not None and not isinstance(kivi_config, KiviConfig):
        raise TypeError(f"kivi_config must be a KiviConfig or None, got {type(kivi_config).__name__}")
    if cache_memory is not None and (isinstance(cache_memory, bool) or not isinstance(cache_memory, int)
                                     or cache_memory < 1):
        raise ValueError(f"cache_memory={cache_memory!r} must be a positive number of bytes or None")
    gen = _greedy_if_tiny_temperature(generation_config if generation_config is not None else model.generation_config)
    if (getattr(gen, "num_return_sequences", None) or 1) > 1 and kivi_config is not None:
        raise ValueError(f"num_return_sequences={gen.num_return_sequences} is not supported with KIVI pages "
                         "(forked requests would share a full-precision window)")
    layout, packed_backend = None, None
    text = model.config.get_text_config()
    if kivi_config is not None:
        check_transformers_version()
        if cache_memory is None:
            raise ValueError("cache_memory=None: KIVI pages need a byte budget (e.g. cache_memory=2 * 1024**3)")
        _check_kivi_cb_config(cb)
        layout = build_layout(model.config, kivi_config, cb.page_size, model.dtype)
        packed_backend = pages_attention_backend(kivi_config, model)
    elif cache_memory is not None:
        cb.num_blocks = max(1, cache_memory // fp_block_bytes(text, model.dtype, cb.page_size))
    if gen.eos_token_id is None:
        gen.eos_token_id = -1
    return KiviBatchingManager(model, gen, cb, workload_hints, kivi_config=kivi_config, cache_memory=cache_memory,
                               layout=layout, packed_backend=None if packed_backend is None
                               else backend_named(packed_backend, kivi_config))


def generate_batch(model: Any, inputs: list[list[int]], kivi_config: KiviConfig | None, *,
                   cache_memory: int | None = None, generation_config: GenerationConfig | None = None,
                   **kwargs: Any) -> dict[str, Any]:
    """``model.generate_batch`` over KIVI pages (or the float paged cache with ``kivi_config=None``).

    Returns ``{request_id: GenerationOutput}`` in the order of ``inputs``, as transformers does.
    ``kwargs``: ``max_new_tokens``, ``record_timestamps``, and what :func:`init_continuous_batching` takes.
    Every request is checked before anything runs: a prompt that is not a list / tuple of ints or a 1-D
    integer tensor raises ``TypeError``; an empty one, an id outside ``[0, vocab_size)``, ``max_new_tokens``
    not a positive int, prompt + ``max_new_tokens`` beyond ``max_position_embeddings``
    (:mod:`kivi.batching.requests`) or a request that can never fit ``cache_memory`` raise ``ValueError``,
    naming the request (``inputs[i]``).
    """
    if isinstance(inputs, (list, tuple)) and not inputs:
        return {}
    gen = generation_config if generation_config is not None else model.generation_config
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    max_new_tokens = gen.max_new_tokens if max_new_tokens is None else max_new_tokens
    inputs = check_requests(inputs, max_new_tokens, RequestLimits.of(model))
    record_timestamps = kwargs.pop("record_timestamps", False)
    if "workload_hints" not in kwargs:
        kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max(len(x) for x in inputs),
                                                 max_generated_length=max_new_tokens, num_requests=len(inputs))
    manager = init_continuous_batching(model, kivi_config, cache_memory=cache_memory, generation_config=gen, **kwargs)
    try:
        for x in inputs:  # refuse before starting anything
            manager.check_request_fits(len(x), max_new_tokens)
    except ValueError:
        manager.restore_attention()
        raise
    results: dict[str, Any] = {}
    manager.start()
    try:
        ids = manager.add_requests(inputs=inputs, max_new_tokens=max_new_tokens, record_timestamps=record_timestamps)
        while len(results) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError(f"the continuous-batching loop stopped with {len(ids) - len(results)} requests "
                                   "unfinished (see the transformers log for its error)")
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    failed = {k: v.error for k, v in results.items() if v.error is not None}
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed in continuous batching: {next(iter(failed.values()))}")
    return {rid: results[rid] for rid in ids}


__all__ = ["KiviBatchingManager", "init_continuous_batching", "generate_batch", "pages_attention_backend",
           "DEFAULT_MAX_BATCH_TOKENS"]
