"""What an object really keeps alive: the bytes of every tensor storage reachable from it.

``reachable_tensor_bytes(cache)`` walks attributes, dicts, lists, tuples and sets from ``cache``
and adds up the storages of the tensors it meets, each storage once (a view counts its whole
storage: a zero-length slice can pin a large tensor). For a :class:`~kivi.KiviCache` it should
equal ``cache.nbytes``; the tests and ``benchmarks/bench_memory.py reachable`` check that it does.
"""

from __future__ import annotations

import types
from typing import Any

import torch

_LEAVES = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def reachable_tensor_bytes(root: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` (attributes and containers)."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, _LEAVES) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            storages[st.data_ptr() if st.nbytes() else id(st)] = st.nbytes()
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
        for slot in getattr(type(obj), "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                stack.append(getattr(obj, slot))
    return sum(storages.values())


__all__ = ["reachable_tensor_bytes"]
