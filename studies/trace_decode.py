"""Which source files one decode token passes through, from ``generate()`` to the attention kernel.

Runs a tiny random Llama (GQA, one layer) quantized with KIVI, prefills 200 tokens, then traces
one decode forward (``sys.setprofile``: every Python function call; the forward ``generate()``
makes for each new token) and prints the files entered, in order of
first entry, and how often a call goes back into a file already entered (a "re-entry": the call
comes from another file). Calls into torch, numpy, numba and the standard library are left out;
transformers and kivi files are listed. Numba-compiled functions are not Python calls, so the
kernel file appears once (its dispatcher).

    python studies/trace_decode.py            # kivi files and transformers files
    python studies/trace_decode.py --kivi-only
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import transformers

import kivi
from kivi import KiviCache, KiviConfig, quantize_model


def trace_one_step(kivi_only: bool) -> list[str]:
    """Files of the Python calls made by one decode forward (after a 200-token prefill)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = transformers.LlamaForCausalLM(cfg).eval()
    quantize_model(model, KiviConfig(group_size=32, residual_length=32))
    ids = torch.randint(1, 128, (1, 200))
    cache = KiviCache.from_model(model)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)  # prefill
        model(ids[:, -1:], cache=cache, use_cache=True)  # warm: compile / load the kernels
    roots = [os.path.dirname(kivi.__file__)] + ([] if kivi_only else [os.path.dirname(transformers.__file__)])
    calls: list[str] = []

    def prof(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if any(f.startswith(r) for r in roots):
                calls.append(f)

    with torch.no_grad():
        sys.setprofile(prof)
        try:
            model(ids[:, -1:], cache=cache, use_cache=True)  # the traced decode token
        finally:
            sys.setprofile(None)
    return calls


def summarise(calls: list[str]) -> tuple[list[str], int, int]:
    order, seen, reentries, transitions, prev = [], set(), 0, 0, None
    for f in calls:
        if f != prev:
            transitions += 1
            if f in seen:
                reentries += 1
            else:
                seen.add(f)
                order.append(f)
        prev = f
    return order, transitions, reentries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kivi-only", action="store_true", help="list kivi files only")
    args = ap.parse_args()
    calls = trace_one_step(args.kivi_only)
    order, transitions, reentries = summarise(calls)
    base = os.path.dirname(os.path.dirname(kivi.__file__))
    tbase = os.path.dirname(os.path.dirname(transformers.__file__))
    for i, f in enumerate(order, 1):
        print(f"{i:3d}  {os.path.relpath(f, base) if f.startswith(base) else os.path.relpath(f, tbase)}")
    kivi_files = [f for f in order if f.startswith(os.path.dirname(kivi.__file__))]
    print(f"files: {len(order)} ({len(kivi_files)} kivi); file changes: {transitions}; "
          f"re-entries into a file already entered: {reentries}")


if __name__ == "__main__":
    main()
