"""KIVI cache: per-layer storage (`KiviLayer`) and the transformers `Cache` (`KiviCache`)."""

from .kivi_cache import KiviCache
from .layer import KiviLayer
from .store import BlockStore, FpSegment
from .view import AttentionView, PackedStates, materialize

__all__ = ["KiviCache", "KiviLayer", "AttentionView", "PackedStates", "materialize", "BlockStore", "FpSegment"]
