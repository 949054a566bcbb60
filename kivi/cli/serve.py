"""`kivi serve`: an OpenAI-compatible HTTP server with continuous batching and a KIVI cache."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from . import CliError
from .loading import load_model_from_args
from .options import add_config_args, add_model_args, config_from_args
from .validators import byte_size, non_negative_float, port_number, positive_int, text_value, utf8_text

DEFAULT_PRESET = "balanced"
DEFAULT_PAGE_SIZE = 256
GRACEFUL_SHUTDOWN_S = 5.0
#: the environment variable --api-key defaults to (a key on the command line is visible to every local user)
API_KEY_ENV = "KIVI_API_KEY"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server: continuous batching over a KIVI paged cache",
        description="Loads a model and serves POST /v1/chat/completions and /v1/completions (streaming and not), "
        "GET /v1/models and GET /health. Requests share one continuous-batching manager whose paged cache holds "
        f"--cache-memory bytes of KIVI pages (preset {DEFAULT_PRESET!r} unless --preset/--config/fields say "
        "otherwise; --float-cache for transformers' float pages). See docs/serving.md.",
        epilog="examples:\n"
        "  kivi serve                                  # SmolLM2-135M on 127.0.0.1:8000, 512MiB of KIVI pages\n"
        "  kivi serve --port 9000 --preset extreme --cache-memory 2GiB\n"
        "  kivi serve --model ./my-checkpoint --float-cache --max-new-tokens 256\n"
        "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        "       -d '{\"model\": \"any\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", type=text_value, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--cache-memory", default="512MiB", type=byte_size,
                   help="bytes of the paged KV cache shared by all requests, e.g. 512MiB, 2GiB (default 512MiB)")
    p.add_argument("--max-new-tokens", type=positive_int, default=512,
                   help="most tokens one request may generate, and the default when it sets no max_tokens "
                   "(default 512)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=512,
                   help="tokens per forward (prompts are prefilled in chunks of this size; default 512)")
    p.add_argument("--page-size", type=positive_int, default=DEFAULT_PAGE_SIZE,
                   help="tokens per page of the paged cache (KIVI pages: a multiple of the config's group size; "
                   f"default {DEFAULT_PAGE_SIZE}, transformers' default)")
    p.add_argument(
        "--served-model-name", default=None, type=text_value, help="the model id /v1/models lists (default: --model)"
    )
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--float-cache", action="store_true",
                   help="transformers' float paged cache instead of KIVI pages (the baseline)")
    p.add_argument("--api-key", default=None, type=utf8_text,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (401 otherwise); "
                   f"printable ASCII without spaces; default: ${API_KEY_ENV}, else no key. Set one before --host "
                   "0.0.0.0")
    p.add_argument("--max-body-size", default="4MiB", type=byte_size,
                   help="largest request body read, e.g. 1MiB (413 beyond it; default 4MiB)")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=GRACEFUL_SHUTDOWN_S, metavar="SECONDS",
                   help="on Ctrl-C / SIGTERM, how long open requests may still run before they are ended with an "
                   f"error (default {GRACEFUL_SHUTDOWN_S:g}; 0: at once)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn log level (default warning)")
    add_config_args(p)
    # a server's process ends right after a clean shutdown: see kivi.cli._exit_now
    p.set_defaults(func=run, exit_without_finalizing=True)


def _check_args(args: argparse.Namespace) -> tuple[Any, int]:
    """``(kivi_config or None, cache bytes)``; bad values fail before the model loads."""
    from ..config import KiviConfig

    cache_memory = args.cache_memory  # each option is checked by its argparse type
    cfg = config_from_args(args)
    if args.float_cache:
        if cfg is not None:
            raise CliError("--float-cache serves transformers' float pages; it takes no KIVI options "
                           "(--preset, --config, --k-bits, ...)")
        return None, cache_memory
    if cfg is not None and (cfg.quantize_after or any(o.get("quantize_after")
                                                       for o in cfg.layer_specific_config.values())):
        raise CliError("--quantize-after / quantize_after: KIVI pages in continuous batching quantize from the first "
                       "token (their window blocks are sized for the window); serve with quantize_after=0")
    from ..batching import check_transformers_version  # KIVI pages hook into private transformers code

    try:
        check_transformers_version()
    except RuntimeError as e:
        raise CliError(f"{e} (or serve --float-cache)") from None
    return (cfg if cfg is not None else KiviConfig.preset(DEFAULT_PRESET)), cache_memory


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $KIVI_API_KEY, else None (no key); surrounding spaces dropped; an empty key, or one
    outside printable ASCII (:func:`kivi.serving.auth.api_key_problem`), is refused."""
    from ..serving.auth import api_key_problem

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is None:
        return None
    if not key.strip():
        raise CliError(f"--api-key / ${API_KEY_ENV} is empty; give a key, or unset it to serve without one")
    key = key.strip()
    problem = api_key_problem(key)
    if problem is not None:
        raise CliError(f"--api-key / ${API_KEY_ENV} {problem}".encode("ascii", "backslashreplace").decode("ascii"))
    return key


def run(args: argparse.Namespace) -> int:
    kivi_config, cache_memory = _check_args(args)
    api_key = _api_key(args)
    try:
        import fastapi  # noqa: F401
        import openai  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CliError(f"kivi serve needs the serve extra ({e.name} is missing): pip install 'kivi[serve]'") from None
    from ..serving.lifecycle import listen

    try:  # bound now, kept for uvicorn: a second server on this port fails here, before loading anything
        sock = listen(args.host, args.port)
    except OSError as e:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    try:
        return _serve(args, sock, kivi_config, cache_memory, api_key)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock: Any, kivi_config: Any, cache_memory: int, api_key: str | None) -> int:
    """Load the model, start the engine, serve on ``sock`` until a signal: 0, or 128 + the signal."""
    import signal

    from ..serving.app import build_app
    from ..serving.engine import Engine
    from ..serving.lifecycle import serve_until_signal

    model, tokenizer = load_model_from_args(args)  # --weight-bits 8 / 4: quanto weights
    if not getattr(tokenizer, "is_fast", False):
        raise CliError(f"kivi serve streams text with a fast (Rust) tokenizer; {args.model!r} has a slow one")
    from .threads import load_kernels_then_set_threads

    # KIVI pages on CPU decode with numba kernels: loaded first, or --threads would not reach numba's pool
    load_kernels_then_set_threads(args.threads, kernels=kivi_config is not None and model.device.type == "cpu")
    try:
        engine = Engine(model, tokenizer, kivi_config, cache_memory=cache_memory,
                        max_new_tokens=args.max_new_tokens, max_batch_tokens=args.max_batch_tokens,
                        page_size=args.page_size)
    except RuntimeError as e:  # the manager did not start (e.g. the budget holds no block)
        raise CliError(str(e)) from None
    except ValueError as e:  # the pages cannot be built (e.g. --page-size not a multiple of the group size)
        raise CliError(f"cannot build the paged cache: {e}") from None
    try:
        name = args.served_model_name or args.model
        app = build_app(engine, model_name=name, api_key=api_key, max_body_bytes=args.max_body_size)
        cache = "float pages" if kivi_config is None else f"KIVI pages (k{kivi_config.k_bits}/v{kivi_config.v_bits})"
        stats = engine.stats()
        key = "API key required" if api_key else "no API key"
        print(f"kivi serve: {name} on http://{args.host}:{args.port}/v1 — {cache}, {cache_memory:,} bytes "
              f"({stats.blocks_total} blocks), max {args.max_new_tokens} new tokens per request, {key}",
              file=sys.stderr, flush=True)
        stopped_by = serve_until_signal(app, engine, sock, grace_s=args.shutdown_timeout, log_level=args.log_level)
    finally:
        engine.stop()
    if stopped_by is None:
        return 0
    print(f"kivi serve: {'interrupted' if stopped_by == signal.SIGINT else 'terminated'}", file=sys.stderr, flush=True)
    return 128 + int(stopped_by)
