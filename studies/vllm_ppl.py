"""Perplexity of vLLM with kivi's plugin against kivi's own cache, same config, same WikiText-2 windows.

Both sides build the windows with :func:`kivi.data.token_windows` (the shipped text, the converted SmolLM2's
tokenizer) and print their SHA-1, so the two runs are checked to score the same tokens.

* ``--engine vllm`` (run with .venv-vllm): ``LLM.generate`` with ``prompt_logprobs`` over each window, the
  prompt in chunks of ``--prefix`` tokens (``max_num_batched_tokens = prefix``, one request at a time). The
  first chunk is the plugin's exact prefill; the second is a chunk into a request that holds ``prefix``
  tokens, which the plugin attends with kivi's per-query precision (each query reads what one-token
  decoding would have quantized by its step: ``kivi.vllm.paged``), i.e. the continuation is scored through
  the quantized pages and window ring, not an exact prefill. Scored: the tokens after the prefix.
* ``--engine kivi`` (run with .venv): :func:`kivi.eval.perplexity` (``kivi eval ppl``'s protocol: prefix
  prefilled, the rest in chunks of 16 with the same per-query precision).

``--kivi '{"preset": "extreme"}'`` (``additional_config["kivi"]`` / KiviConfig fields); ``--kivi fp``: vLLM
without the plugin (the kivi side always reports its full-precision ``DynamicCache`` too). Prints one JSON
line per result.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time


def windows_of(context: int, count: int):
    from transformers import AutoTokenizer

    from kivi.data import load_text, token_windows
    from kivi.models import converted_cache_path

    path = str(converted_cache_path("smollm2"))
    tok = AutoTokenizer.from_pretrained(path)
    w = token_windows(tok, load_text(), context, count)
    return path, w, hashlib.sha1(w.numpy().tobytes()).hexdigest()


def vllm_ppl(path: str, windows, prefix: int, kivi: dict | None, dtype: str) -> dict:
    from vllm import LLM, SamplingParams

    extra = {} if kivi is None else {"additional_config": {"kivi": kivi}}
    llm = LLM(path, dtype=dtype, enforce_eager=True, seed=0, max_model_len=windows.shape[1] + 16,
              enable_chunked_prefill=True, max_num_batched_tokens=prefix, max_num_seqs=1,
              enable_prefix_caching=False, **extra)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": w.tolist()} for w in windows], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    nll, n = 0.0, 0
    for w, o in zip(windows.tolist(), outs):
        for i in range(prefix, len(w)):  # prompt_logprobs[i]: log p(token i | tokens < i)
            nll -= o.prompt_logprobs[i][w[i]].logprob
            n += 1
    return {"ppl": math.exp(nll / n), "nll": nll / n, "tokens_scored": n, "seconds_all": seconds}


def kivi_config(kivi: dict):
    from kivi import KiviConfig

    kivi = dict(kivi)
    preset = kivi.pop("preset", None)
    return KiviConfig.from_dict(kivi) if preset is None else KiviConfig.preset(preset, **kivi)


def kivi_ppl(windows, prefix: int, configs: list[dict], dtype: str) -> list[dict]:
    """kivi's own caches on the windows in one pass (:func:`kivi.eval.compare`: the full-precision
    ``DynamicCache`` first, then each config, the prefill shared)."""
    from kivi import load_model
    from kivi.eval import compare

    model, _ = load_model("smollm2", dtype=dtype)
    t0 = time.perf_counter()
    out = compare(model, windows, [kivi_config(c) for c in configs], prefix=prefix, progress=False)
    seconds = time.perf_counter() - t0
    rows = [dict(kivi=None, **{k: out["fp"][k] for k in ("ppl", "nll", "tokens_scored")})]
    for c, r in zip(configs, out["results"]):
        rows.append(dict(kivi=c, **{k: r[k] for k in ("ppl", "nll", "tokens_scored", "kl", "top1_agreement")}))
    for r in rows:
        r["seconds_all"] = seconds
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["vllm", "kivi"], required=True)
    ap.add_argument("--kivi", action="append", help='KiviConfig fields as JSON, or "fp" (vllm: one; kivi: any, '
                    'full precision always included); default {"preset": "extreme"}')
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    configs = [None if k == "fp" else json.loads(k) for k in (args.kivi or ['{"preset": "extreme"}'])]
    path, windows, sha = windows_of(args.context, args.windows)
    if args.engine == "vllm":
        if len(configs) != 1:
            ap.error("--engine vllm takes one --kivi (one engine per config)")
        rows = [dict(kivi=configs[0], **vllm_ppl(path, windows, args.prefix, configs[0], args.dtype))]
    else:
        rows = kivi_ppl(windows, args.prefix, [c for c in configs if c is not None], args.dtype)
    for r in rows:
        r.update(engine=args.engine, windows=args.windows, context=args.context, prefix=args.prefix,
                 dtype=args.dtype, windows_sha1=sha)
        print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
