"""numba's on-disk cache, checked before it is trusted: unreadable entries are set aside, once, with a warning.

numba keeps each ``cache=True`` function's compiled code in an index file (``*.nbi``) and data files
(``*.nbc``) under ``__pycache__`` or ``NUMBA_CACHE_DIR``, and unpickles them when the function is next
compiled; a truncated or corrupted file (a full disk, a bad copy) then raises ``UnpicklingError`` (or
``EOFError``, ...) on every use, forever. :func:`set_aside_unreadable` reads every index and data file of the
given dispatchers the way numba does (``pickle``), renames the ones that fail to ``<name>.unreadable`` and warns
once; numba then finds no code for them and compiles them again (a missing data file named by an index is a
miss to numba). numba writes each file to a temporary name and renames it, so a reader never sees one half
written: a file that does not unpickle is damaged, not in flight.

What it does not see: bytes changed inside a file that still unpickles (e.g. inside the object code).

These are numba internals (``_cache``, ``_cache_file``, ``_load_index``, ``_load_data``, ``_data_path``,
``_index_path``, as numba 0.65 and 0.68 define them; a numba without them raises ``AttributeError``, which the
caller reports). Imports nothing at module level.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable

#: Suffix of a cache file set aside (numba reads only ``*.nbi`` / ``*.nbc``).
SET_ASIDE = ".unreadable"


def unreadable_files(dispatchers: Iterable) -> list[str]:
    """Paths of the index and data files of ``dispatchers`` (numba ``Dispatcher`` objects) that do not unpickle.

    Reads each index (and, where the index is readable, each data file it names); a dispatcher numba cannot cache
    for (no writable cache directory) has nothing to read. Loads and compiles no code.
    """
    from numba.core.caching import NullCache

    bad: list[str] = []
    for d in dispatchers:
        cache = d._cache
        if isinstance(cache, NullCache):
            continue
        files = cache._cache_file
        try:
            overloads = files._load_index()
        except OSError:  # unreadable for a reason numba reports itself (permissions, ...)
            continue
        except Exception:
            bad.append(files._index_path)
            continue
        for name in overloads.values():
            try:
                files._load_data(name)
            except OSError:  # missing: numba compiles again and writes it
                continue
            except Exception:
                bad.append(files._data_path(name))
    return bad


def set_aside_unreadable(dispatchers: Iterable, what: str) -> list[str]:
    """Rename the unreadable cache files of ``dispatchers`` (:func:`unreadable_files`) to ``<name>.unreadable``
    and warn once (a ``RuntimeWarning`` naming ``what`` and the files); returns the paths set aside.

    A file that another process has set aside (or healed) meanwhile is skipped. Where renaming fails the file is
    removed; where that fails too, the warning says so and numba will raise on it.
    """
    moved, stuck = [], []
    for path in unreadable_files(dispatchers):
        try:
            os.replace(path, path + SET_ASIDE)
        except FileNotFoundError:
            continue
        except OSError:
            try:
                os.remove(path)
            except FileNotFoundError:
                continue
            except OSError:
                stuck.append(path)
                continue
        moved.append(path)
    if moved or stuck:
        where = os.path.dirname((moved or stuck)[0])
        names = ", ".join(os.path.basename(p) for p in moved + stuck)
        msg = (f"kivi: numba's cache of {what} in {where} held {len(moved) + len(stuck)} unreadable file(s) "
               f"({names}); ")
        msg += (f"set aside as *{SET_ASIDE} and compiled again" if not stuck
                else f"{len(stuck)} could not be moved or removed, and numba will fail on them: delete them")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return moved


__all__ = ["SET_ASIDE", "set_aside_unreadable", "unreadable_files"]
