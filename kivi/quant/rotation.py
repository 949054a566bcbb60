"""Orthogonal rotation of keys per head before quantization (``KiviConfig.key_rotation``).

For an orthogonal ``R`` (``R @ R.T = I``), ``q . k = (q R) . (k R)``: quantizing ``k R`` instead of ``k`` leaves
attention unchanged in exact arithmetic and only moves where the quantization error falls. ``"hadamard"``
is the normalized Walsh-Hadamard matrix of size ``head_dim`` (a power of two) with a fixed pseudo-random
+-1 sign on each row, ``R = diag(s) H / sqrt(D)`` (what llama.cpp applies to quantized K caches by default,
and vLLM / SGLang ship as an option). KIVI groups keys per channel over tokens, so the rotation mixes the
channels whose groups KIVI keeps apart; whether it helps is measured (docs/evaluation.md, "Key rotation
(Hadamard) screened with the suite").

Stored keys are ``quantize(k R)``; :func:`kivi.quant.kv.dequantize_kv` returns ``dequantize(...) R.T``
(the keys in their own basis), so every reader that dequantizes sees ordinary keys. Sink tokens and the
full-precision window are never rotated (bit-exact). Readers of packed codes (the fused kernels, pages)
refuse a rotated format.
"""

from __future__ import annotations

import torch

#: ``KiviConfig.key_rotation`` values: ``"none"`` (KIVI as published) or ``"hadamard"``.
KEY_ROTATIONS = ("none", "hadamard")
#: Seed of the fixed sign diagonal (part of the stored format: a saved cache is read back with the same one).
SIGN_SEED = 0x4B495649

_MATRICES: dict[tuple[str, int], torch.Tensor] = {}


def check_rotation(rotation: object, *, name: str = "key_rotation") -> None:
    """``ValueError`` unless ``rotation`` is one of :data:`KEY_ROTATIONS`."""
    if not isinstance(rotation, str) or rotation not in KEY_ROTATIONS:
        raise ValueError(f"{name}={rotation!r} is not allowed; choose one of {list(KEY_ROTATIONS)}")


def rotation_head_dim_problem(rotation: str, head_dim: int) -> str | None:
    """Why ``rotation`` cannot rotate heads of ``head_dim`` channels (``None``: it can)."""
    if rotation == "hadamard" and (head_dim < 1 or head_dim & (head_dim - 1)):
        return (f"key_rotation='hadamard' needs head_dim to be a power of two (a Walsh-Hadamard matrix); "
                f"this model has head_dim={head_dim}; use key_rotation='none'")
    return None


def rotation_matrix(rotation: str, head_dim: int) -> torch.Tensor:
    """The float32 ``[D, D]`` orthogonal matrix ``R`` of ``rotation`` (memoised); keys are stored as ``k R``."""
    check_rotation(rotation)
    why = rotation_head_dim_problem(rotation, head_dim)
    if why:
        raise ValueError(why)
    key = (rotation, head_dim)
    m = _MATRICES.get(key)
    if m is None:
        if rotation == "none":
            m = torch.eye(head_dim, dtype=torch.float64)
        else:
            h = torch.ones(1, 1, dtype=torch.float64)
            while h.shape[0] < head_dim:  # Sylvester: H_2n = [[H, H], [H, -H]]
                h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
            gen = torch.Generator().manual_seed(SIGN_SEED)
            signs = torch.randint(0, 2, (head_dim,), generator=gen).to(torch.float64) * 2 - 1
            m = signs[:, None] * h / head_dim**0.5
        m = m.to(torch.float32)
        _MATRICES[key] = m
    return m


def rotate(x: torch.Tensor, rotation: str) -> torch.Tensor:
    """``x [..., D] @ R`` in float32 (``x`` itself, unchanged, for ``"none"``)."""
    if rotation == "none":
        return x
    return x.float() @ rotation_matrix(rotation, x.shape[-1]).to(x.device)


def unrotate(x: torch.Tensor, rotation: str) -> torch.Tensor:
    """``x [..., D] @ R.T`` in float32: the inverse of :func:`rotate` (``x`` itself for ``"none"``)."""
    if rotation == "none":
        return x
    return x.float() @ rotation_matrix(rotation, x.shape[-1]).to(x.device).T


__all__ = ["KEY_ROTATIONS", "SIGN_SEED", "check_rotation", "rotate", "rotation_head_dim_problem",
           "rotation_matrix", "unrotate"]
