#!/usr/bin/env python
"""What a KiviCache keeps alive vs what it reports: reachable tensor bytes against ``cache.nbytes``.

For each configuration: prefill ``--context`` random tokens through a quantized model (the
default ``generate``-style path: ``quantize_model`` + ``KiviCache.from_model``, packed attention),
then 64 decode steps, a crop of 100 tokens, a beam reorder of the batch; after each step the bytes
of every tensor storage reachable from the cache object (``kivi.eval.reachable_tensor_bytes``) are
compared with ``cache.nbytes``. Models: the embedded SmolLM2 (full attention), and a random
Mistral of SmolLM2's attention shape with ``sliding_window=1024`` (sliding-window eviction).

    python benchmarks/reachable_bytes.py --context 4096 --out results/memory/reachable_bytes_4k.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from common import write_json


def measure(model, cfg, context: int, batch: int) -> list[dict]:
    from kivi import KiviCache, quantize_model
    from kivi.eval.reachable import reachable_tensor_bytes

    quantize_model(model, cfg)
    cache = KiviCache.from_model(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g)
    rows = []

    def row(when: str) -> None:
        reach, nb = reachable_tensor_bytes(cache), cache.nbytes
        rows.append({"when": when, "tokens": cache.get_seq_length(), "reachable_bytes": reach, "nbytes": nb,
                     "difference": reach - nb})
        print(f"  {when:24s} tokens {cache.get_seq_length():6d}  reachable {reach:12,d}  nbytes {nb:12,d}  "
              f"difference {reach - nb:+,d}", file=sys.stderr, flush=True)

    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        row(f"after {context}-token prefill")
        for _ in range(64):
            logits = model(logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
        row("after 64 decode steps")
        cache.crop(-100)  # transformers 5: a negative count of tokens to remove
        row("after crop(-100)")
        cache.reorder_cache(torch.arange(batch - 1, -1, -1))
        row("after reorder")
    return rows


def main() -> int:
    import transformers

    from kivi import KiviConfig
    from kivi.models import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    smol, _ = load_model("smollm2")
    c = smol.config
    sliding_cfg = transformers.MistralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        sliding_window=1024)
    torch.manual_seed(0)
    sliding = transformers.MistralForCausalLM(sliding_cfg).eval()
    out = {"command": " ".join(sys.argv), "context": a.context, "batch": a.batch, "rows": []}
    for label, model_fn, cfg in (
        ("SmolLM2, KIVI 2/2", lambda: smol, KiviConfig()),
        ("SmolLM2, balanced", lambda: smol, KiviConfig.preset("balanced")),
        ("Mistral (sliding 1024), KIVI 2/2", lambda: sliding, KiviConfig()),
    ):
        print(label, file=sys.stderr)
        for r in measure(model_fn(), cfg, a.context, a.batch):
            out["rows"].append({"model_config": label, **r})
    if a.out:
        write_json(a.out, out)
    else:
        print(json.dumps(out, indent=2))
    bad = [r for r in out["rows"] if r["difference"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
