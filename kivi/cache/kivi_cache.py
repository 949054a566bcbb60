"""`KiviCache`: a transformers 5.x ``Cache`` made of :class:`KiviLayer` s."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..backends import Backend, attention_reads_views, cache_attention_backend, resolve_backend
from ..config import KiviConfig
from .heads import KIVI_LAYERS, build_layer, kv_heads_of
from .padding import install_padding_hook
from .support import model_head_dim, model_layer_types, plan_layers, text_config
from .view import PackedStates


class KiviCache(Cache):
    """KIVI-quantized KV cache.

    Build it with :meth:`from_model` (reads the layer types, e.g. sliding-window layers, from the
    model config and installs the padding hook; ``update`` then takes ``layer_idx`` in
    ``[0, number of layers)``), or ``KiviCache(config)`` for a plain stack of full-attention layers
    created on first use, in order (``layer_idx`` at most the number of layers created so far).

    What ``update`` returns is decided once, when the cache is built (``attention_backend``):
    ``"reference"`` (the default of ``KiviCache(config)``) returns dequantized keys/values, which any
    attention reads; ``"cpu"`` / ``"triton"`` return :class:`~kivi.cache.view.PackedStates` that only
    the ``"kivi"`` attention reads (what :meth:`from_model` builds for a model after
    :func:`kivi.quantize_model`). A multi-token forward into a non-empty cache (chunked prefill, a
    speculative verify forward) gives each query its own precision, which only the ``"kivi"``
    attention reads: see :meth:`from_model` for a model that runs another attention.

    Padding: the cache leaves padded tokens out of every quantization statistic. It learns which
    tokens are padding from the 2-D ``attention_mask`` of each forward: the hook that
    :meth:`from_model` / :func:`kivi.quantize_model` install passes it on; without the hook, call
    :meth:`set_attention_mask` before each forward (otherwise all tokens count as real).
    """

    def __init__(self, config: KiviConfig | None = None, layers: list | None = None, *,
                 attention_backend: str | Backend = "reference"):
        self.config = config if config is not None else KiviConfig()
        self._attention_mask: torch.Tensor | None = None
        self._prompt_length: int | None = None  # see set_prompt_length
        self._record_past = False  # see activate_past_recording
        # Fixed for the cache's life: "reference" materialises, "cpu"/"triton" return PackedStates that
        # carry this object (a name is resolved once here, for this cache's config).
        self.backend: Backend = (attention_backend if isinstance(attention_backend, Backend)
                                 else resolve_backend(attention_backend, config=self.config))
        # Layers given (one per decoder layer of a model): their number is fixed; else created in order.
        self.num_layers: int | None = len(layers) if layers is not None else None
        super().__init__(layers=list(layers) if layers is not None else [])

    @property
    def attention_backend(self) -> str:
        """The name of :attr:`backend` (``"reference"``, ``"cpu"`` or ``"triton"``)."""
        return self.backend.name

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model(cls, model: Any, config: KiviConfig | None = None, *, reading_views: bool = False) -> "KiviCache":
        """A cache with one layer per decoder layer of ``model`` (HF ``PreTrainedModel``).

        What ``update`` returns suits the attention the model runs when the cache is built. After
        :func:`kivi.quantize_model` (the ``"kivi"`` attention) each query of a multi-token forward reads the
        history at its own precision, as one-token decoding would. A model that runs another attention (never
        quantized, or after :func:`kivi.dequantize_model`) gets plain tensors for every forward; in a
        multi-token forward into a non-empty cache (chunked prefill, a speculative verify forward) every
        query then reads the history as it was before the forward (the old window at full precision) plus
        the forward's tokens exactly, slightly more precise for the later queries than one-token decoding
        (docs/python.md, "Speculative decoding"). ``reading_views``: the caller runs every forward under
        :func:`kivi.attention.interface.reading_views` (the evaluation tools do), so per-query precision
        applies wherever ``"kivi"`` implements the model's attention.
        """
        config = config if config is not None else getattr(model, "kivi_config", None) or KiviConfig()
        cache = cls.from_model_config(model.config, config, attention_backend=cache_attention_backend(model, config))
        cache._set_reader(attention_reads_views(model, reading_views=reading_views))
        install_padding_hook(model)
        return cache

    def _set_reader(self, reads_views: bool) -> None:
        """Whether the attention reading this cache reads views (per-query precision) or tensors only."""
        for layer in self.layers:
            if isinstance(layer, KIVI_LAYERS):
                layer.per_query_views = reads_views

    @property
    def reads_views(self) -> bool:
        """Whether ``update`` gives each query of a multi-token forward its own precision (views that only
        the ``"kivi"`` attention reads); False when built by :meth:`from_model` for a model whose attention
        reads tensors only. Fixed when the cache is built."""
        return all(layer.per_query_views for layer in self.layers if isinstance(layer, KIVI_LAYERS))

    @classmethod
    def from_model_config(cls, model_config: Any, config: KiviConfig, *,
                          attention_backend: str | Backend = "reference") -> "KiviCache":
        plan = plan_layers(model_config, config)
        kv_heads = kv_heads_of(model_config)
        if config.head_bits and kv_heads is not None:
            config.check_kv_heads(kv_heads)
        layers = [build_layer(config, i, window) for i, (_, window) in enumerate(plan)]
        return cls(config, layers=layers, attention_backend=attention_backend)

    # ------------------------------------------------------------------ speculative decoding
    def set_prompt_length(self, prompt_length: int | None) -> None:
        """The prompt of the next prefill has ``prompt_length`` tokens (``None``: the whole first forward).

        Only the prompt's queries of a forward into an empty cache read every token at full precision;
        the rest read what one-token decoding would give them. transformers' assisted and prompt-lookup
        decoding run the prompt and the first candidates in one forward, so :func:`kivi.quantize_model`'s
        ``generate`` sets this from the prompt (see ``docs/python.md``, "Speculative decoding").
        """
        if prompt_length is not None and (isinstance(prompt_length, bool) or not isinstance(prompt_length, int)
                                          or prompt_length < 1):
            raise ValueError(f"prompt_length={prompt_length!r} must be a positive int or None")
        self._prompt_length = prompt_length
        for layer in self.layers:
            if isinstance(layer, KIVI_LAYERS):
                layer.prompt_length = prompt_length

    def activate_past_recording(self, **kwargs) -> None:
        """Keep each forward's tokens at full precision until the next crop (exact crop; transformers calls
        this before assisted and prompt-lookup decoding). Also for layers created later. ``kwargs``: what
        transformers passes its layers (5.25: ``recurrent_states_to_keep``, for layers with recurrent states;
        KIVI layers hold none)."""
        self._record_past = True
        for layer in self.layers:  # what transformers' Cache does, with the keywords of any 5.x release
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording(**kwargs)

    # ------------------------------------------------------------------ padding
    def set_attention_mask(self, attention_mask: torch.Tensor | None) -> None:
        """The 2-D ``[batch, past + new]`` mask of the next forward (1 = real token, 0 = padding).

        Only its last ``n`` columns are read (the ``n`` tokens of the forward). ``None`` = no padding.
        """
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                # 4-D masks carry no per-token padding information we can use; treat as no padding.
                attention_mask = None
        self._attention_mask = attention_mask

    def _new_token_valid(self, n: int, batch: int) -> torch.Tensor | None:
        m = self._attention_mask
        if m is None:
            return None
        if m.shape[0] != batch or m.shape[-1] < n:
            raise ValueError(
                f"attention_mask of shape {tuple(m.shape)} does not cover a forward of {n} tokens with batch {batch}"
            )
        return m[:, -n:].to(torch.bool)

    # ------------------------------------------------------------------ transformers API
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer_idx = self._check_update(key_states, value_states, layer_idx)
        nlayers = len(self.layers)
        try:
            while len(self.layers) <= layer_idx:
                new = build_layer(self.config, len(self.layers))
                new.prompt_length, new.record_past = self._prompt_length, self._record_past
                self.layers.append(new)
            layer = self.layers[layer_idx]
            if not isinstance(layer, KIVI_LAYERS):
                return layer.update(key_states, value_states, *args, **kwargs)
            valid = self._new_token_valid(key_states.shape[-2], key_states.shape[0])
            if not self.backend.packed:
                return layer.update(key_states, value_states, valid=valid)
            with layer.all_or_nothing():  # one checkpoint for the append and the views handed to attention
                k_view, v_view = layer._append(key_states, value_states, valid)
                return PackedStates(k_view, self.backend), PackedStates(v_view, self.backend)
        except BaseException:
            del self.layers[nlayers:]  # layers this call created
            raise

    def _check_update(self, key_states: Any, value_states: Any, layer_idx: Any) -> int:
        """Refuse, before anything changes, an ``update`` no layer can take; returns ``layer_idx`` as an int.

        Keys and values: floating tensors ``[batch, kv_heads, tokens, head_dim]`` of one dtype and device,
        equal in every dimension (one head_dim per layer: value groups and every attention backend read
        keys and values with the same one). ``layer_idx``: an int in ``[0, num_layers)`` when the number of
        layers is fixed (:meth:`from_model`, ``layers=``), else at most the layers created so far.
        """
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor [batch, kv_heads, tokens, head_dim], "
                                f"got {type(x).__name__}")
            if x.dim() != 4:
                raise ValueError(f"{name} must be 4-D [batch, kv_heads, tokens, head_dim], got shape {tuple(x.shape)}")
            if not x.dtype.is_floating_point:
                raise ValueError(f"{name}.dtype={x.dtype} is not allowed; keys and values must be floating point")
        if key_states.shape != value_states.shape:
            what = [f"{dim} {a} vs {b}" for dim, a, b in zip(("batch", "kv_heads", "tokens", "head_dim"),
                                                             key_states.shape, value_states.shape) if a != b]
            raise ValueError(
                f"key_states {tuple(key_states.shape)} and value_states {tuple(value_states.shape)} "
                f"must have the same [batch, kv_heads, tokens, head_dim]; they differ in {', '.join(what)}"
            )
        if key_states.dtype != value_states.dtype or key_states.device != value_states.device:
            raise ValueError(f"key_states ({key_states.dtype} on {key_states.device}) and value_states "
                             f"({value_states.dtype} on {value_states.device}) must have the same dtype and device")
        try:
            idx = operator.index(layer_idx)
        except TypeError:
            idx = None
        if idx is None or isinstance(layer_idx, bool):
            raise TypeError(f"layer_idx must be an int, got {layer_idx!r} ({type(layer_idx).__name__})")
        if self.num_layers is not None and not 0 <= idx < self.num_layers:
            raise ValueError(f"layer_idx={idx} is out of range: this cache has {self.num_layers} layers "
                             f"(allowed 0..{self.num_layers - 1})")
        if self.num_layers is None and not 0 <= idx <= len(self.layers):
            raise ValueError(f"layer_idx={idx} is not allowed: KiviCache(config) creates its layers in order on "
                             f"first use and has {len(self.layers)}, so layer_idx must be in 0..{len(self.layers)} "
                             "(KiviCache.from_model(model) builds every layer of the model up front)")
        return idx

    # ------------------------------------------------------------------ edits of every layer, all or nothing
    def _on_every_layer(self, edit) -> None:
        """``edit(layer)`` on every layer; if one raises, every KiviLayer is put back as it was.

        (A layer that is not a KiviLayer, passed in ``layers=``, has no checkpoint: it is edited as
        transformers does, one layer after the other.)
        """
        checkpoints = [(layer, layer.checkpoint()) for layer in self.layers if isinstance(layer, KIVI_LAYERS)]
        try:
            for layer in self.layers:
                edit(layer)
        except BaseException:
            for layer, checkpoint in checkpoints:
                layer.rollback(checkpoint)
            raise

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens of every layer (all layers or none)."""
        self._on_every_layer(lambda layer: layer.crop(tokens_to_remove))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._on_every_layer(lambda layer: layer.reorder_cache(beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._on_every_layer(lambda layer: layer.batch_repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._on_every_layer(lambda layer: layer.batch_select_indices(indices))

    # ------------------------------------------------------------------ accounting
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of every tensor the cache holds, by kind (sums to :attr:`nbytes`)."""
        total: dict[str, int] = {}
        for layer in self.layers:
            if isinstance(layer, KIVI_LAYERS):
                parts = layer.memory_breakdown()
            else:  # a full-precision transformers layer (e.g. sliding window kept in FP)
                nb = 0
                if layer.is_initialized and layer.keys is not None:
                    nb = (
                        layer.keys.numel() * layer.keys.element_size()
                        + layer.values.numel() * layer.values.element_size()
                    )
                parts = {"fp_unquantized": nb}
            for k, v in parts.items():
                total[k] = total.get(k, 0) + v
        return total

    @property
    def nbytes(self) -> int:
        """Total bytes of every tensor the cache holds (real storage, not a formula)."""
        return sum(self.memory_breakdown().values())

    # ------------------------------------------------------------------ save / load (kivi/cache/persist.py)
    def save(self, path: Any, *, fingerprint: dict, input_ids: torch.Tensor | None = None) -> Any:
        """Write the packed cache to a safetensors file (about :attr:`nbytes`); see :mod:`kivi.cache.persist`.

        ``fingerprint``: the model and tokenizer it was made with (:func:`kivi.prefix.model_fingerprint`);
        ``input_ids [B, T]``: the tokens it holds, stored with it. Nothing in the cache changes.
        """
        from .persist import save_cache

        return save_cache(self, path, fingerprint=fingerprint, input_ids=input_ids)

    @classmethod
    def load(cls, path: Any, *, fingerprint: dict, model: Any = None, config: KiviConfig | None = None,
             attention_backend: str | None = None) -> "KiviCache":
        """A cache saved by :meth:`save`, bit for bit; raises ``PrefixFileError`` naming what differs.

        ``fingerprint`` must equal the saved one (the model and tokenizer). ``config`` (default: the
        ``model``'s ``kivi_config`` when it has one) must equal the saved config (``attention_backend``
        aside). With ``model``: its layers must match, the cache reads with the backend built for it and
        the padding hook is installed (like :meth:`from_model`). ``attention_backend`` overrides
        (default ``"reference"`` without a model). The token ids saved with it:
        :func:`kivi.cache.persist.load_cache` or :func:`kivi.prefix.load_prefix`.
        """
        return cls.load_with_ids(path, fingerprint=fingerprint, model=model, config=config,
                                 attention_backend=attention_backend)[0]

    @classmethod
    def load_with_ids(cls, path: Any, *, fingerprint: dict, model: Any = None, config: KiviConfig | None = None,
                      attention_backend: str | None = None) -> tuple["KiviCache", torch.Tensor | None]:
        """:meth:`load`, also returning the token ids saved with the cache (``None`` if none were)."""
        from .persist import load_cache

        windows, device, shape = None, "cpu", {}
        if model is not None:
            config = config if config is not None else getattr(model, "kivi_config", None)
            windows = [window for _, window in model_layer_types(model.config)]
            device = getattr(model, "device", "cpu")
            shape = {"kv_heads": kv_heads_of(model.config), "head_dim": model_head_dim(text_config(model.config))}
        config, layers, ids = load_cache(path, fingerprint=fingerprint, config=config, windows=windows, device=device,
                                         **shape)
        if model is not None:
            install_padding_hook(model)
            if attention_backend is not None:  # checked against the model (packed needs its "kivi" attention)
                config = dataclasses.replace(config, attention_backend=attention_backend)
            attention_backend = cache_attention_backend(model, config)
        cache = cls(config, layers=layers, attention_backend=attention_backend or "reference")
        if model is not None:  # what update returns suits the model's attention, as for from_model
            cache._set_reader(attention_reads_views(model))
        return cache, ids

    def __repr__(self) -> str:
        return (
            f"KiviCache({self.config.describe()}, layers={len(self.layers)}, tokens={self.get_seq_length()}, "
            f"attention_backend={self.attention_backend!r})"
        )

