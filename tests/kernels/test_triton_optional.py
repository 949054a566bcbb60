"""Triton stays optional: `import kivi` / `import kivi.kernels` work without it (no triton marker)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKER = textwrap.dedent(
    """
    import sys

    class _BlockTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError(f"{name} blocked for this test")
            return None

    sys.meta_path.insert(0, _BlockTriton())
    for m in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        del sys.modules[m]
    """
)


def _run(body: str) -> subprocess.CompletedProcess:
    code = BLOCKER + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)


def test_import_kivi_without_triton():
    r = _run(
        """
        import torch
        import kivi
        import kivi.kernels as kk
        from kivi.kernels import triton_quant, triton_attention
        assert kk.triton_available() is False
        assert "triton" not in sys.modules
        # the torch reference still works without triton
        from kivi.quant.kv import quantize_kv
        from kivi.quant.side_format import SideFormat
        k = torch.randn(1, 1, 32, 16); v = torch.randn(1, 1, 32, 16); q = torch.randn(1, 2, 1, 16)
        pk, pv = quantize_kv(k, "channel", 2, 32), quantize_kv(v, "token", 2, 16)
        out = kk.torch_decode_attention_packed(q, pk, None, pv, None, scaling=0.25)
        assert out.shape == (1, 2, 1, 16)
        try:
            kk.quantize_pack_keys(k, SideFormat("channel", 2, 32))
        except ImportError as e:
            assert "triton" in str(e)
        else:
            raise AssertionError("expected ImportError without triton")
        print("OK")
        """
    )
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout
