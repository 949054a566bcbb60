"""`SlidingKiviLayer`: a KIVI layer of a sliding-window attention layer.

It stops exposing tokens that no future query can reach (older than ``W + R + G`` tokens, cut at a
multiple of ``block_size``: :func:`~kivi.cache.schedule.sliding_cut`) and frees the blocks that held
only those; ``get_mask_sizes`` reports the first exposed token as the mask's ``kv_offset``. It keeps
no sink (its first tokens leave the attention window anyway).
"""

from __future__ import annotations

from ..config import KiviConfig
from .layer import KiviLayer
from .schedule import sliding_cut


class SlidingKiviLayer(KiviLayer):
    """A :class:`KiviLayer` with a sliding attention window of ``sliding_window`` tokens."""

    def __init__(self, config: KiviConfig, sliding_window: int, *args, **kwargs):
        if config.tiers:
            raise ValueError(f"tiers={list(config.tiers)} are not supported on sliding-window layers (this layer has "
                             f"sliding_window={sliding_window}); use a config without tiers for this model")
        if config.quantize_after:
            raise ValueError(f"quantize_after={config.quantize_after} is not supported on sliding-window layers (this "
                             f"layer has sliding_window={sliding_window}: its window evicts stored blocks only); set "
                             f"it to 0 for the sliding layers in layer_specific_config")
        self.sliding_window = sliding_window
        super().__init__(config, *args, **kwargs)

    def _cut(self) -> int:
        """Tokens before this position are out of reach of every future query.

        Depends only on (seen, W, R, G, block_size), so every sliding layer reports the same offset.
        """
        cfg = self.config
        return sliding_cut(self.seen, self.sliding_window, cfg.residual_length, cfg.group_size, cfg.block_size)

    def _before_forward(self) -> None:
        # Before building the views: the mask of this forward already excludes what is evicted.
        cut = self._cut()
        if cut > self.parts[0].k.store.start:
            for name in ("k", "v"):
                for side in self.sides(name):
                    side.store.evict(cut)

    @property
    def kv_offset(self) -> int:
        return max(self.parts[0].k.store.start, self._cut())

    def get_max_length(self) -> int:
        return self.sliding_window


def new_layer(config: KiviConfig, sliding_window: int | None = None) -> KiviLayer:
    """A :class:`KiviLayer`, or a :class:`SlidingKiviLayer` when ``sliding_window`` is given."""
    return KiviLayer(config) if sliding_window is None else SlidingKiviLayer(config, sliding_window)


__all__ = ["SlidingKiviLayer", "new_layer"]
