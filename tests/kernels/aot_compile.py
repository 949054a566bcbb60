"""Compile the Triton decode kernels ahead of time for a CUDA target (sm_90) without a GPU.

Run as a script in a process *without* ``TRITON_INTERPRET`` (the test suite sets it for everything it
imports): ``python tests/kernels/aot_compile.py``. It catches what the interpreter lets through (types of
loop-carried values, int64 / int32 mixes, constexpr use) and prints, per decode variant, how the PTX reads
global memory (:func:`load_report`): plain loads (``ld.global``, vector ones among them) and the asynchronous
copies to shared memory that Triton's software pipelining turns a loop's tile loads into (``cp.async``, by bytes
a copy), the static instruction counts. Arguments get the 16-divisibility that a JIT launch with aligned tensors
gives them. Exit status 1 if a variant fails to compile.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kivi.kernels import _attention_kernels as K  # noqa: E402
from kivi.kernels import _paged_inputs_kernels as IK  # noqa: E402
from kivi.kernels import _paged_kernels as PK  # noqa: E402
from kivi.kernels import _paged_write_kernels as WK  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}
# (name, keys quantized, values quantized, key sink, value sink, dtype, key bits, value bits, mask)
VARIANTS = [
    ("balanced", True, True, True, True, "fp16", 4, 2, True),
    ("extreme-bf16", True, True, False, False, "bf16", 2, 2, False),
    ("k8-fp-values-fp32", True, False, True, False, "fp32", 8, 8, True),
    ("k1v4", True, True, True, True, "fp16", 1, 4, False),
    ("fp-only", False, False, False, False, "fp16", 8, 8, False),
    ("k3v3", True, True, True, True, "fp16", 3, 3, True),  # 3-bit rows: 24 bytes, codes straddle bytes
    ("k3v2-bf16", True, True, False, False, "bf16", 3, 2, False),
]
STRIDES_DIV16 = ["sq_b", "sq_h", "ksk_b", "ksk_h", "ksk_t", "kdata_st", "kpar_st", "skf_b", "skf_h", "skf_t",
                 "vsk_b", "vsk_h", "vsk_t", "vdata_st", "svf_b", "svf_h", "svf_t"]


def load_report(ptx: str) -> str:
    """The PTX's global reads, static counts: ``ld.global`` (vector ``ld.global.v*`` among them) and ``cp.async``
    copies by bytes (``16B`` copies move 8 bf16 / fp16 elements or 16 code bytes at once)."""
    copy = r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)"  # [dst], [src], bytes
    sizes = Counter(int(b, 16) for b in re.findall(copy, ptx))
    copies = ", ".join(f"{n} x {b}B" for b, n in sorted(sizes.items(), reverse=True)) or "none"
    return (f"global loads {ptx.count('ld.global'):4d} (vector {ptx.count('ld.global.v'):3d}), "
            f"async copies {sum(sizes.values()):3d} ({copies})")


def compile_variant(name, kq, vq, ksink, vsink, dt, kb, vb, valid):
    fn = K.decode_split_kernel
    pt = "*" + dt
    types = {n: "i32" for n in fn.arg_names}
    types.update(q_ptr=pt, ksink_ptr=pt, ktab_ptr="*i64", kdata_ptr="*u8" if kq else pt, kpar_ptr=pt, kf_ptr=pt,
                 vsink_ptr=pt, vtab_ptr="*i64", vdata_ptr="*u8" if vq else pt, vpar_ptr=pt, vf_ptr=pt,
                 valid_ptr="*u8", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", qk_scale="fp32")
    # a 3-bit row of 64 channels is 24 bytes: its row stride is not 16-divisible, its blocks' unit is 8 bytes
    kdu, vdu = (8 if kb == 3 else 16) if kq else 8, (8 if vb == 3 else 16) if vq else 8
    consts = dict(HKV=3, QG=3, QG_P2=16, D=64, BLOCK_D=64, BLOCK_N=64,
                  K_SINK=ksink, K_QUANT=kq, K_BITS=kb, K_G=32, K_DATA_UNIT=kdu, K_PAR_UNIT=8,
                  V_SINK=vsink, V_QUANT=vq, V_BITS=vb, V_G=32, V_DATA_UNIT=vdu, V_PAR_UNIT=8,
                  HAS_VALID=valid, dot_t=DTYPES[dt], PRECISION="ieee" if dt == "fp32" else "tf32", SCAN=32)
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    odd = {"kdata_st"} if kq and kb == 3 else set()
    odd |= {"vdata_st"} if vq and vb == 3 else set()
    div16 = [n for n, t in types.items() if t.startswith("*")] + [n for n in STRIDES_DIV16 if n not in odd]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    ptx = triton.compile(src, target=TARGET, options=dict(num_warps=4)).asm["ptx"]
    return load_report(ptx)


# the batched paged decode kernel: (name, dtype of q / rows / parameters, key bits, value bits, offsets stored)
PAGED_VARIANTS = [
    ("paged-k2v2-bf16", "bf16", 2, 2, True),
    ("paged-k4v2-fp16", "fp16", 4, 2, True),
    ("paged-k3v3-fp16-sym", "fp16", 3, 3, False),
]


def compile_paged(name, dt, kb, vb, offsets):
    """SmolLM2's shape (3 kv heads of 64, GQA 3) in vLLM pages of 128 tokens, fields at 16-byte offsets."""
    fn = PK.paged_split_kernel
    pt = "*" + dt
    types = {n: "i32" for n in fn.arg_names}
    types.update(q_ptr=pt, pool_ptr="*u8", par_ptr=pt, bt_ptr="*i32", counts_ptr="*i64", krows_ptr=pt,
                 kslots_ptr="*i32", knew_ptr=pt, vrows_ptr=pt, vslots_ptr="*i32", vnew_ptr=pt, m_ptr="*fp32",
                 l_ptr="*fp32", acc_ptr="*fp32", qk_scale="fp32")
    krow, vrow = (64 * kb + 7) // 8, (64 * vb + 7) // 8
    consts = dict(HKV=3, QG=3, QG_P2=16, D=64, BLOCK_D=64, BLOCK_N=64, P=128, G=32, PAR_ITEM=2, HAS_OFFSET=offsets,
                  BLOCK_BYTES=3 * 128 * 512,
                  K_CODES=0, K_SCALE=3 * 128 * 16, K_OFFSET=3 * 128 * 16 + 3 * 4 * 64 * 2, K_ROW_BYTES=krow,
                  K_BITS=kb, V_CODES=65536, V_SCALE=65536 + 3 * 128 * 16, V_OFFSET=65536 + 3 * 128 * 16 + 3 * 128 * 4,
                  V_ROW_BYTES=vrow, V_BITS=vb, dot_t=DTYPES[dt], PRECISION="tf32")
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    # the strides a JIT launch sees 16-divisible for SmolLM2's rows (D = 64 channels, 3 heads)
    strides = ["sq_n", "sq_h", "kr_sb", "kr_sr", "kr_sh", "kn_sn", "kn_sh", "vr_sb", "vr_sr", "vr_sh", "vn_sn", "vn_sh"]
    div16 = [n for n, t in types.items() if t.startswith("*")] + strides
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    ptx = triton.compile(src, target=TARGET, options=dict(num_warps=4)).asm["ptx"]
    return load_report(ptx)


# the paged writes (kivi/kernels/_paged_write_kernels.py): (name, ring / parameter dtype, key bits, value bits)
WRITE_VARIANTS = [("write-k2v2-bf16", "bf16", 2, 2), ("write-k4v8-fp16", "fp16", 4, 8)]


def _compile(fn, types, consts):
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    div16 = [n for n in fn.arg_names if sig[n].startswith("*")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=4)).asm["ptx"]


def compile_writes(name, dt, kb, vb):
    """The four write kernels for SmolLM2's shape in vLLM pages of 128 tokens (the paged variants' layout)."""
    pt = "*" + dt
    rings = dict(rt_ptr="*i32", rbase_ptr="*i64", rstep_ptr="*i64", rt_s0="i32", PW="i32", r_sb="i64", r_sr="i32",
                 r_sh="i32", n_s0="i32", n_s1="i32", flag_ptr="*i64")
    _compile(WK.gather_rows_kernel, dict(leave_ptr="*i64", out_ptr="*fp32", rows_ptr=pt, new_ptr=pt, **rings),
             dict(D=64, BLOCK_D=64))
    page = dict(x_ptr="*fp32", leave_ptr="*i64", pt_ptr="*i32", pt_s0="i32", pool_ptr="*u8", par_ptr=pt,
                flag_ptr="*i64")
    common = dict(D=64, BLOCK_D=64, G=32, PARAM_KIND={"fp32": 0, "fp16": 1, "bf16": 2}[dt], P=128,
                  BLOCK_BYTES=3 * 128 * 512, PAR_ITEM=2)
    _compile(WK.write_key_groups_kernel, page, dict(common, G_P2=32, BITS=kb, CODES=0, SCALE=3 * 128 * 16,
                                                     OFFSET=3 * 128 * 16 + 3 * 4 * 64 * 2, ROW_BYTES=64 * kb // 8))
    _compile(WK.write_values_kernel, page, dict(common, NG=2, BITS=vb, CODES=65536, SCALE=65536 + 3 * 128 * 16,
                                                 OFFSET=65536 + 3 * 128 * 16 + 3 * 128 * 4, ROW_BYTES=64 * vb // 8))
    _compile(WK.write_rings_kernel, dict(writes_ptr="*i64", krows_ptr=pt, vrows_ptr=pt, knew_ptr=pt, vnew_ptr=pt,
                                         **rings), dict(D=64, BLOCK_D=64))


def compile_inputs(dt):
    """The decode rows' inputs kernel (kivi/kernels/_paged_inputs_kernels.py) for SmolLM2's shape (9 query heads,
    3 kv heads of 64 channels), window rings of 3 blocks of 64 rows, pages of 128 tokens."""
    pt = "*" + dt
    types = dict(index_ptr="*i64", tokens_ptr="*i64", rt_ptr="*i32", base_ptr="*i64", step_ptr="*i64",
                 ks_ptr="*i64", vs_ptr="*i64", pt_ptr="*i32", q_ptr=pt, k_ptr=pt, v_ptr=pt, out_kids="*i32",
                 out_vids="*i32", out_pages="*i32", out_q=pt, out_k=pt, out_v=pt)
    _compile(IK.decode_inputs_kernel, types, dict(D=64, BLOCK_C=256, BLOCK_W=64, BLOCK_Q=1024, BLOCK_KV=256))


def compile_reduce():
    fn = K.decode_reduce_kernel
    consts = dict(HQ=9, QG=3, QG_P2=16, D=64, BLOCK_D=64, S_P2=8)
    types = dict(
        m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr="*fp16", so_b="i32", so_h="i32", NUM_SPLITS="i32"
    )
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    triton.compile(src, target=TARGET, options=dict(num_warps=4))


def main() -> int:
    failed = 0
    for v in VARIANTS:
        try:
            print(f"OK   {v[0]:<20} {compile_variant(*v)}")
        except Exception as e:  # report every variant, then fail
            failed += 1
            print(f"FAIL {v[0]:<20} {type(e).__name__}: {str(e)[:1500]}")
    for v in PAGED_VARIANTS:
        try:
            print(f"OK   {v[0]:<20} {compile_paged(*v)}")
        except Exception as e:
            failed += 1
            print(f"FAIL {v[0]:<20} {type(e).__name__}: {str(e)[:1500]}")
    for v in WRITE_VARIANTS:
        try:
            compile_writes(*v)
            print(f"OK   {v[0]}")
        except Exception as e:
            failed += 1
            print(f"FAIL {v[0]:<20} {type(e).__name__}: {str(e)[:1500]}")
    try:
        compile_inputs("bf16")
        print("OK   inputs-bf16")
    except Exception as e:
        failed += 1
        print(f"FAIL inputs-bf16 {type(e).__name__}: {str(e)[:1500]}")
    try:
        compile_reduce()
        print("OK   reduce")
    except Exception as e:
        failed += 1
        print(f"FAIL reduce {type(e).__name__}: {str(e)[:1500]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
