"""The package's layers depend one way (docs/ARCHITECTURE.md), read from the import graph of ``kivi/``.

Every ``import`` statement counts, also those inside functions (lazy imports) and under
``TYPE_CHECKING``. A module may import modules of its own layer or of lower layers, never of a
higher one, and no module may reach itself again through imports (no cycles). A new module must
be given a layer in :data:`LAYERS` (the test fails until it is). The split packages (``kivi.models``,
``kivi.cli``) keep small modules that use each other's public names only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "kivi"

#: Layer of each module, by longest matching name prefix (lower layers first).
LAYERS: dict[str, int] = {
    # 0 primitives: pure quantize / pack, optional-dependency probes, the glibc malloc pin
    "kivi.quant.primitives": 0, "kivi.quant.clipping": 0, "kivi.quant.packing": 0, "kivi.quant.rotation": 0,
    "kivi.optional": 0,
    "kivi.malloc_pin": 0, "kivi.numba_cache": 0,
    # the one writer and the one bounded reader of user-named files (every layer writes or reads them)
    "kivi.files": 0,
    # the one rule of the host frameworks' version pins (kivi.batching, kivi.vllm)
    "kivi.version_pin": 0,
    # the value that names one side's quantized format (built by the config, read by every layer above)
    "kivi.quant.side_format": 0,
    # 1 configuration: what to quantize and how; which attention backend reads it
    "kivi.config": 1,
    "kivi.config_checks": 1,
    "kivi.backends": 1,
    # the one table of what each host and backend does with a config (refusals, kernel choices)
    "kivi.capabilities": 1,
    # the one rule of a sampling temperature (below it: greedy), shared by generate, batching and serving
    "kivi.sampling": 1,
    # 2 formats: quantized segments and the kernels that write them
    "kivi.quant": 2,
    "kivi.kernels._common": 2,
    "kivi.kernels.triton_quant": 2,
    "kivi.kernels._quant_kernels": 2,
    # 3 storage, and the token arithmetic (pure ints) that storage, cache and planner share
    "kivi.cache.store": 3,
    "kivi.cache.schedule": 3,
    "kivi.cache.tiers": 3,
    # where a paged request's full-precision rows live: the one window-ring rule (pure torch)
    "kivi.paged.ring": 3, "kivi.paged": 3,
    # 4 cache (schedule, layers, the transformers Cache, what update hands to attention)
    "kivi.cache": 4,
    # one layer's step over KIVI pages for every paged host (views, boundary, leaving tokens, the all-or-nothing commit)
    "kivi.paged.step": 4,
    # replaying a recorded prefill into any cache through its update path (the long-context suite's shared prefill)
    "kivi.cache.replay": 4,
    # 5 attention over the cache's views, and its kernels
    "kivi.attention": 5,
    # one paged decode kernel call (pages, block table, ring slot tables, counts, backend) for both paged hosts
    "kivi.paged.decode": 5,
    # the framework-free paged step every paged host calls: the page and window-ring geometry, the step's plan, its
    # decode rows through the batched kernel, the compiled writes, the layer's step itself (kivi.paged.forward)
    "kivi.paged.geometry": 5, "kivi.paged.plan": 5, "kivi.paged.decode_call": 5, "kivi.paged.inputs_kernel": 5,
    "kivi.paged.write": 5, "kivi.paged.write_kernel": 5, "kivi.paged.forward": 5,
    "kivi.kernels": 5,
    "kivi.kernels.segments": 5,
    # 6 integration with a model
    "kivi.integration": 6,
    "kivi.prefix": 6,
    # KIVI pages in transformers' continuous batching (depends on cache, quant and integration's backends)
    "kivi.batching": 6,
    # the vLLM plugin (depends on cache, quant, attention; never on kivi.batching, whose transformers pin vLLM's
    # differs)
    "kivi.vllm": 6,
    # 7 tools: planner, evaluation, model loading, data, command line; the package facade
    "kivi.memory": 7, "kivi.eval": 7, "kivi.models": 7, "kivi.data": 7, "kivi.cli": 7, "kivi.__main__": 7,
    # models: errors and aliases, the converted-copy cache and its manifest, loading, weight quantization
    "kivi.models.errors": 7,
    "kivi.models.aliases": 7,
    "kivi.models.conversion_cache": 7,
    "kivi.models.copy_manifest": 7,
    "kivi.models.load": 7,
    "kivi.models.weights": 7,
    # the command line's shared pieces: argparse types, option groups, output, model loading, CPU threads
    "kivi.cli.validators": 7,
    "kivi.cli.options": 7,
    "kivi.cli.output": 7,
    "kivi.cli.loading": 7,
    "kivi.cli.threads": 7,
    "kivi.serving": 7,
    "kivi.serving.auth": 7,
    "kivi": 7,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(name: str) -> bool:
    return (ROOT.parent / name.replace(".", "/") / "__init__.py").exists()


def _exists(name: str) -> bool:
    base = ROOT.parent / name.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """kivi modules imported anywhere in ``path`` (absolute names)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "kivi")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "kivi":
                continue
            subs = [f"{target}.{a.name}" for a in node.names if _exists(f"{target}.{a.name}")]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(target)
    found.discard(me)
    return found


def _layer(name: str) -> int | None:
    best = None
    for prefix, rank in LAYERS.items():
        if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, rank)
    return None if best is None else best[1]


GRAPH = {_module_name(p): _imports(p) for p in sorted(ROOT.rglob("*.py"))}


def test_graph_is_read():
    assert "kivi.cache.side" in GRAPH and "kivi.cache.store" in GRAPH["kivi.cache.side"]
    assert "kivi.cache.view" in GRAPH["kivi.attention.reference"]  # a relative import


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_module_has_a_layer(module):
    assert _layer(module) is not None, f"{module} has no layer: add it to LAYERS in {__file__}"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_of_a_higher_layer(module):
    mine = _layer(module)
    upward = sorted(t for t in GRAPH[module] if _exists(t) and (_layer(t) or 0) > mine)
    assert not upward, f"{module} (layer {mine}) imports higher layers: {[(t, _layer(t)) for t in upward]}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_checker_sees_a_cycle_and_an_upward_import():
    """The two rules can fail: a made-up graph with a cycle and an upward edge is caught."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _layer("kivi.cache.layer") < _layer("kivi.integration")
    assert _layer("kivi.cache.store") < _layer("kivi.cache.layer")


#: Packages split into modules with one job each: every module stays small, and uses its siblings' public names.
SPLIT_PACKAGES = ("kivi.models", "kivi.cli")
MAX_MODULE_LINES = 450


@pytest.mark.parametrize("package", SPLIT_PACKAGES)
def test_split_package_modules_are_small(package):
    folder = ROOT.parent / package.replace(".", "/")
    assert (folder / "__init__.py").is_file(), f"{package} is a package, not one module"
    long = {p.name: n for p in folder.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules of {package} over {MAX_MODULE_LINES} lines: {long}"


#: The one module allowed over :data:`MAX_MODULE_LINES`: the numba decode kernel (one compiled unit).
LONG_MODULES = ("attention/fused_cpu/kernel.py",)


def test_every_module_is_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES and name not in LONG_MODULES}
    assert long == {}, f"modules of kivi over {MAX_MODULE_LINES} lines: {long}"


@pytest.mark.parametrize("package", SPLIT_PACKAGES)
def test_split_package_modules_import_no_private_names_of_each_other(package):
    found = []
    for path in (ROOT.parent / package.replace(".", "/")).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")
                          and not a.name.startswith("__")]  # __version__ is public
    assert found == []
