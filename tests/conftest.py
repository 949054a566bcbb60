"""Shared fixtures: the embedded SmolLM2 (session-scoped), the `slow` marker rule, the numba kernel filled once
per run under xdist.

Tiny random models come from :func:`tests.helpers.tiny_model` (the suite's one model factory).
"""

from __future__ import annotations

import os

# Triton picks interpreter mode when first imported (transformers may import it early): set it first,
# so the Triton kernels run on CPU tensors in tests.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_cache_root():
    """The cache root the session's SmolLM2 loads share (fixed once, so env patches can't move it)."""
    from kivi.models import kivi_cache_dir

    return kivi_cache_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_cache_root):
    """(model, tokenizer) of the embedded default model; converted once per machine, loaded once per session."""
    from kivi.models import load_model

    return load_model("smollm2", cache_dir=smollm2_cache_root)


@pytest.fixture(scope="session")
def wikitext_ids(smollm2):
    from kivi.data import load_text

    _, tok = smollm2
    text = load_text()[:200_000]
    return tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]


#: Folders whose tests call the numba decode kernel from their first test on: collected last, so that on a cold
#: cache the workers run the other tests while the controller's background child fills the kernel (below)
#: instead of waiting for it at the start.
KERNEL_HEAVY = ("tests/attention/", "tests/batching/")


def pytest_collection_modifyitems(config, items):
    """The kernel's heaviest users last (:data:`KERNEL_HEAVY`; a stable sort); `slow` tests run only with
    KIVI_SLOW=1 or an explicit `-m` expression."""
    items.sort(key=lambda item: item.nodeid.startswith(KERNEL_HEAVY))
    if os.environ.get("KIVI_SLOW") == "1" or config.getoption("-m"):
        return
    skip = pytest.mark.skip(reason="slow: set KIVI_SLOW=1 or pass -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------ the numba decode kernel: compiled once per run, not per worker
# With xdist workers (scripts/test.sh) every worker whose first kernel use finds numba's cache cold would fill it
# in its own child process, compiling the same entries at once (~100 s each on the 2-core box). The controller
# fills it once instead, in one background child started before the workers; a worker's first cache probe waits
# until that child has saved the entries it asks for or is done (the variable below names the file it leaves
# when done), then probes as usual (and compiles itself, as kivi always does, if the cache is still cold).
_KERNEL_FILL_DONE = "KIVI_TEST_KERNEL_FILL_DONE"
_fill_child = None


@pytest.hookimpl(tryfirst=True)  # before xdist starts the workers (they inherit the environment)
def pytest_sessionstart(session):
    global _fill_child
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    from kivi.optional import numba_available

    if not numba_available():
        return
    import subprocess
    import sys
    import tempfile

    from kivi.attention.fused_cpu import dispatch, kernel

    if not dispatch._cache_missing(kernel, None):
        return
    done = os.path.join(tempfile.mkdtemp(prefix="kivi-kernel-fill-"), "done")
    import textwrap

    code = "try:\n" + textwrap.indent(dispatch.fill_code(None), "    ") + f"finally:\n    open({done!r}, 'w').close()\n"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    _fill_child = subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env)
    os.environ[_KERNEL_FILL_DONE] = done


def pytest_sessionfinish(session):
    if _fill_child is not None and _fill_child.poll() is None:  # a run that never needed the kernel
        _fill_child.terminate()
        _fill_child.wait()


@pytest.fixture
def single_sequence_kernel_filled():
    """Numba's cache holding the single-sequence decode entries before the test goes on: a test whose child process
    loads them waits here for the controller's background fill (see below) instead of compiling its own."""
    from kivi.optional import numba_available

    if numba_available():
        from kivi.attention.fused_cpu import dispatch

        dispatch._cache_missing(dispatch._kernel_module(), dispatch.SINGLE_SEQUENCE)


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        # one torch thread per xdist worker (KIVI_TEST_TORCH_THREADS to change it): the workers already fill the
        # cores, and two workers of two OpenMP threads each on the 2-core box spun for nothing (tests/cache:
        # 54.8 s -> 35.1 s, 100.7 -> 61.6 CPU-s with one thread each). Child processes keep their own defaults.
        import torch

        torch.set_num_threads(int(os.environ.get("KIVI_TEST_TORCH_THREADS") or 1))
    done = os.environ.get(_KERNEL_FILL_DONE)
    if not done or not hasattr(config, "workerinput"):
        return
    import time

    from kivi.attention.fused_cpu import dispatch

    probe = dispatch._cache_missing

    def cache_missing_after_the_controllers_fill(kernel, names):
        # the child saves each entry as it compiles it (single-sequence ones first: ~20 s of its ~75 s cold on
        # the 2-core box), so a worker waits for the entries it asks for, not for the whole fill
        deadline = time.monotonic() + 900
        while not os.path.exists(done) and time.monotonic() < deadline:
            if not probe(kernel, names):
                break
            time.sleep(0.5)
        return probe(kernel, names)

    dispatch._cache_missing = cache_missing_after_the_controllers_fill
