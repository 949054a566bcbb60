"""Speculative decoding on a KIVI cache with SmolLM2: lossless, and how much prompt lookup gains.

(a) ``--check``: greedy tokens of plain decoding vs prompt-lookup decoding vs assisted generation,
    each with the same KIVI config, over ``--new`` tokens; ``equal`` must be true. The only real
    model here is SmolLM2-135M, so the assisted run uses SmolLM2 as its own draft (with its own
    KIVI cache): that tests losslessness (the verify forward and crop), not the speed of a draft.
(b) ``--speed``: a task where prompt lookup helps: the prompt holds a WikiText-2 document followed by
    its first sentence again, and the model continues (it tends to copy the document). Plain
    greedy decoding and prompt-lookup decoding with the same KIVI cache, in the same process,
    interleaved ``--repeat`` times; tokens/s of the generate call (prefill included in both, the
    same prompt) and the acceptance rate (accepted candidate tokens / proposed candidate tokens,
    counted by wrapping transformers' candidate generator's ``update_candidate_strategy``).

    python benchmarks/bench_speculative.py --check --configs extreme balanced --new 200 --threads 1 \\
        --out results/speculative/spec_lossless.json
    python benchmarks/bench_speculative.py --speed --configs extreme balanced --new 200 --threads 1 \\
        --repeat 3 --out results/speculative/spec_prompt_lookup.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from common import set_threads, write_json
from kivi import KiviConfig, load_model, quantize_model
from kivi.attention.fused_cpu import SINGLE_SEQUENCE
from kivi.data import load_text


def document_prompt(tokenizer, doc_tokens: int, index: int = 0) -> torch.Tensor:
    """A WikiText-2 document (about ``doc_tokens`` tokens) followed by its opening again: the model
    is asked to restate the document, which prompt lookup can copy from the prompt. ``index`` picks
    another stretch of the text (20,000 characters further on per index)."""
    text = load_text()[20000 * index:]
    ids = tokenizer(text[:20000], return_tensors="pt").input_ids[0, :doc_tokens]
    doc = tokenizer.decode(ids)
    opening = tokenizer.decode(ids[:24])
    prompt = f"{doc}\n\nThe same text again, word for word:\n\n{opening}"
    return tokenizer(prompt, return_tensors="pt").input_ids


class Acceptance:
    """Counts proposed and accepted candidates by wrapping a candidate generator's update hook."""

    def __init__(self):
        self.proposed = self.accepted = self.rounds = 0

    def install(self):
        from transformers.generation import candidate_generator as cg

        self._orig = {}
        acc = self
        for cls in (cg.PromptLookupCandidateGenerator, cg.AssistedCandidateGenerator):
            orig = cls.get_candidates
            upd = cls.update_candidate_strategy
            self._orig[cls] = (orig, upd)

            def get_candidates(gen, input_ids, *a, _orig=orig, **k):
                out = _orig(gen, input_ids, *a, **k)
                acc._last = out[0].shape[1] - input_ids.shape[1]
                return out

            def update(gen, input_ids, scores, num_matches, _upd=upd):
                acc.proposed += acc._last
                acc.accepted += int(num_matches)
                acc.rounds += 1
                return _upd(gen, input_ids, scores, num_matches)

            cls.get_candidates, cls.update_candidate_strategy = get_candidates, update
        return self

    def restore(self):
        for cls, (orig, upd) in self._orig.items():
            cls.get_candidates, cls.update_candidate_strategy = orig, upd


def generate(model, prompt, new, **spec):
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, **spec)
        return out[0, prompt.shape[1]:], time.perf_counter() - t0


def config_of(name: str, backend: str) -> KiviConfig:
    """A preset name, or a KiviConfig JSON file (any name ending in .json), read through ``backend``."""
    if name.endswith(".json"):
        return dataclasses.replace(KiviConfig.from_json(name), attention_backend=backend)
    return KiviConfig.preset(name, attention_backend=backend)


def check(model, tokenizer, cfg_name, args) -> list[dict]:
    return [check_prompt(model, tokenizer, cfg_name, args, i) for i in args.prompts]


def check_prompt(model, tokenizer, cfg_name, args, index: int) -> dict:
    cfg = config_of(cfg_name, args.backend)
    quantize_model(model, cfg)
    prompt = document_prompt(tokenizer, args.doc_tokens, index)
    plain, _ = generate(model, prompt, args.new)
    lookup, _ = generate(model, prompt, args.new, prompt_lookup_num_tokens=args.lookup)
    assisted, _ = generate(model, prompt, args.new, assistant_model=model, num_assistant_tokens=args.draft_tokens)
    return {
        "config": cfg_name, "backend": args.backend, "prompt": index, "prompt_tokens": prompt.shape[1],
        "new_tokens": args.new, "prompt_lookup_equal": bool(torch.equal(plain, lookup)),
        "assisted_self_draft_equal": bool(torch.equal(plain, assisted)),
        "first_difference": {
            "prompt_lookup": next((i for i, (a, b) in enumerate(zip(plain, lookup)) if a != b), None),
            "assisted": next((i for i, (a, b) in enumerate(zip(plain, assisted)) if a != b), None),
        },
    }


def speed(model, tokenizer, cfg_name, args) -> dict:
    cfg = config_of(cfg_name, args.backend)
    quantize_model(model, cfg)
    prompt = document_prompt(tokenizer, args.doc_tokens)
    generate(model, prompt, 8)  # warm-up (numba kernels, allocator)
    rows = {"plain": [], "prompt_lookup": []}
    acc = Acceptance().install()
    equal = True
    try:
        for _ in range(args.repeat):
            plain, tp = generate(model, prompt, args.new)
            before = (acc.proposed, acc.accepted, acc.rounds)
            lookup, tl = generate(model, prompt, args.new, prompt_lookup_num_tokens=args.lookup)
            equal &= bool(torch.equal(plain, lookup))
            rows["plain"].append(args.new / tp)
            rows["prompt_lookup"].append(args.new / tl)
            rows.setdefault("acceptance", []).append(
                (acc.accepted - before[1]) / max(1, acc.proposed - before[0]))
            rows.setdefault("rounds", []).append(acc.rounds - before[2])
    finally:
        acc.restore()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {
        "config": cfg_name, "backend": args.backend, "prompt_tokens": prompt.shape[1], "new_tokens": args.new,
        "prompt_lookup_num_tokens": args.lookup, "repeat": args.repeat, "threads": args.threads,
        "plain_tok_s": rows["plain"], "prompt_lookup_tok_s": rows["prompt_lookup"],
        "acceptance_rate": rows["acceptance"], "verify_forwards": rows["rounds"],
        "speedup_median": med([b / a for a, b in zip(rows["plain"], rows["prompt_lookup"])]),
        "tokens_equal": equal,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="(a) greedy token equality, speculative vs plain")
    mode.add_argument("--speed", action="store_true", help="(b) prompt lookup vs plain: tokens/s, acceptance")
    p.add_argument("--configs", nargs="+", default=["extreme", "balanced"],
                   help="KiviConfig presets or JSON files (*.json)")
    p.add_argument("--backend", default="cpu", choices=["cpu", "reference"])
    p.add_argument("--new", type=int, default=200, help="new tokens per generate call")
    p.add_argument("--doc-tokens", type=int, default=400, help="tokens of the WikiText document in the prompt")
    p.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    p.add_argument("--draft-tokens", type=int, default=5, help="num_assistant_tokens of the self-draft")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--prompts", type=int, nargs="+", default=[0],
                   help="--check: which documents to try (index i: WikiText-2 from character 20,000 * i on)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    set_threads(args.threads, SINGLE_SEQUENCE)  # the numba kernels load now, before any timed generate call
    model, tokenizer = load_model("smollm2")
    results = []
    for name in args.configs:
        rows = check(model, tokenizer, name, args) if args.check else [speed(model, tokenizer, name, args)]
        for r in rows:
            print(json.dumps(r), flush=True)
        results.extend(rows)
    out = {"command": "python benchmarks/bench_speculative.py " + " ".join(argv or __import__("sys").argv[1:]),
           "results": results}
    if args.out:
        write_json(args.out, out, indent=1)


if __name__ == "__main__":
    main()
