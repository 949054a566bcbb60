"""KIVI cache: per-layer storage (`KiviLayer`) and the transformers `Cache` (`KiviCache`)."""

from .cache import KiviCache
from .layer import AttentionView, KiviLayer
from .store import BlockStore, FpSegment

__all__ = ["KiviCache", "KiviLayer", "AttentionView", "BlockStore", "FpSegment"]
