"""`kivi serve` options: bad values fail with one line before the model loads (in-process)."""

from __future__ import annotations

import errno
import importlib
import socket

import pytest

from kivi.cli import main


@pytest.mark.parametrize(("argv", "message"), [
    (["--cache-memory", "lots"], "--cache-memory"),
    (["--cache-memory=-5MiB"], "--cache-memory"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: 0 is not a positive integer"),
    (["--max-batch-tokens", "-1"], "argument --max-batch-tokens: -1 is not a positive integer"),
    (["--page-size", "0"], "argument --page-size: 0 is not a positive integer"),
    (["--port", "70000"], "argument --port: 70000 is not a port number"),
    (["--threads", "0"], "--threads"),
    (["--float-cache", "--preset", "extreme"], "--float-cache"),
    (["--preset", "nope"], "preset='nope' is unknown"),
    (["--preset", "extreme", "--config", "x.json"], "either --preset or --config"),
    (["--preset", "extreme", "--quantize-after", "512"], "KIVI pages in continuous batching quantize from the first"),
    (["--float-cache", "--api-key", " "], "--api-key / $KIVI_API_KEY is empty"),
    (["--float-cache", "--api-key", "clé"], "--api-key / $KIVI_API_KEY holds '\\xe9' (U+00E9) at index 2: a key is "
                                            "printable ASCII"),
    (["--float-cache", "--api-key", "two words"], "holds ' ' (U+0020) at index 3"),
    (["--max-body-size", "lots"], "--max-body-size"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
], ids=["cache-memory", "negative-cache", "max-new-tokens", "max-batch-tokens", "page-size", "port", "threads",
        "float-and-preset", "unknown-preset", "preset-and-config", "quantize-after", "empty-key", "non-ascii-key",
        "key-with-space", "body-size",
        "shutdown-timeout"])
def test_bad_options_fail_with_one_line(capsys, argv, message):
    rc = main(["serve", "--model", "/nonexistent/never-loaded", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err


def test_a_busy_port_fails_before_the_model_loads(capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = main(["serve", "--model", "/nonexistent/never-loaded", "--float-cache", "--port", str(port)])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot listen on 127.0.0.1:{port}" in err, err


def test_an_empty_key_in_the_environment_fails_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("KIVI_API_KEY", "")
    rc = main(["serve", "--model", "/nonexistent/never-loaded", "--float-cache"])
    err = capsys.readouterr().err
    assert rc == 2 and "$KIVI_API_KEY is empty" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("key", ["ключ", "line\nbreak", "bell\x07"])
def test_a_key_in_the_environment_outside_printable_ascii_fails_in_one_line(monkeypatch, capsys, key):
    """Such a key could never be sent and matched (HTTP headers are latin-1 bytes): refused before anything loads."""
    monkeypatch.setenv("KIVI_API_KEY", key)
    rc = main(["serve", "--model", "/nonexistent/never-loaded", "--float-cache"])
    err = capsys.readouterr().err
    assert rc == 2 and "$KIVI_API_KEY holds" in err and "printable ASCII" in err and err.count("\n") == 1, err


def test_the_port_is_held_from_before_the_model_loads(monkeypatch, capsys):
    """Two servers started on one port: the second cannot bind while the first loads its model (the
    port is bound and listening from the check on), so only one ever prints its banner."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    serve = importlib.import_module("kivi.cli.serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen = {}

    def load_while_another_server_binds(args):
        with socket.socket() as other:  # what a second `kivi serve` (uvicorn) does on the same port
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                other.bind(("127.0.0.1", port))
                other.listen()
                seen["other"] = "bound"
            except OSError as e:
                seen["other"] = e.errno
        raise serve.CliError("stop before loading")

    monkeypatch.setattr(serve, "load_model_from_args", load_while_another_server_binds)
    rc = main(["serve", "--model", "/nonexistent/never-loaded", "--float-cache", "--port", str(port)])
    err = capsys.readouterr().err
    assert rc == 2 and "stop before loading" in err and "on http://" not in err, err
    assert seen["other"] == errno.EADDRINUSE
    with socket.socket() as again:  # and it is released when the command ends
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


def test_serve_is_listed_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "serve" in capsys.readouterr().out


def test_an_untested_transformers_version_fails_in_one_line_naming_it(monkeypatch, capsys):

    # the transformers module object kivi.batching.version reads (in a full run it was seen to differ
    # from sys.modules["transformers"] at this point)
    version = importlib.import_module("kivi.batching.version")
    monkeypatch.setattr(version.transformers, "__version__", "5.99.0")
    rc = main(["serve", "--model", "/nonexistent/never-loaded", "--preset", "extreme"])
    err = capsys.readouterr().err
    assert rc == 2 and "5.99.0" in err and "--float-cache" in err and err.count("\n") == 1, err


def _serve_until_the_engine(monkeypatch, argv):
    """Run ``kivi serve argv`` on the tiny model up to the engine's construction; the engine's arguments
    (``kwargs``, plus ``torch_threads``: torch's thread count then)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import torch

    import kivi.serving.engine as engine_module
    from tests.serving.server import tiny_chat_model, tiny_tokenizer

    serve = importlib.import_module("kivi.cli.serve")
    seen = {}

    class Captured:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs, torch_threads=torch.get_num_threads())
            raise RuntimeError("stop at the engine")

    monkeypatch.setattr(serve, "load_model_from_args", lambda args: (tiny_chat_model(), tiny_tokenizer()))
    monkeypatch.setattr(engine_module, "Engine", Captured)
    threads = torch.get_num_threads()
    try:
        rc = main(["serve", "--model", "tiny", "--port", "0", *argv])
    finally:
        torch.set_num_threads(threads)
    return rc, seen


def test_page_size_and_max_batch_tokens_reach_the_engine(monkeypatch, capsys):
    rc, seen = _serve_until_the_engine(monkeypatch, ["--float-cache", "--page-size", "128",
                                                     "--max-batch-tokens", "64"])
    assert rc == 2 and "stop at the engine" in capsys.readouterr().err
    assert (seen["page_size"], seen["max_batch_tokens"]) == (128, 64)


def test_a_page_size_the_pages_cannot_hold_fails_in_one_line(monkeypatch, capsys):
    """KIVI pages hold whole key groups: --page-size 100 with group_size 32 is refused naming both."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from tests.serving.server import tiny_chat_model, tiny_tokenizer

    serve = importlib.import_module("kivi.cli.serve")
    monkeypatch.setattr(serve, "load_model_from_args", lambda args: (tiny_chat_model(), tiny_tokenizer()))
    rc = main(["serve", "--model", "tiny", "--port", "0", "--k-bits", "2", "--v-bits", "2", "--group-size", "32",
               "--page-size", "100"])
    err = capsys.readouterr().err
    assert rc == 2 and "page_size=100" in err and "group_size=32" in err and err.count("\n") == 1, err


def test_kivi_pages_load_their_kernels_before_the_threads_are_set(monkeypatch, capsys):
    """--threads reaches numba's pool only when the kernels are loaded first (loading them can reset torch's
    count, and numba's is set only once numba is loaded); the engine starts after both."""
    import kivi.attention.fused_cpu as fused_cpu
    import kivi.cli.threads as threads

    order = []
    monkeypatch.setattr(fused_cpu, "fused_decode_available", lambda: True)
    monkeypatch.setattr(fused_cpu, "warmup", lambda: order.append("kernels") or 0.0)
    monkeypatch.setattr(threads, "set_cpu_threads", lambda n: order.append(("threads", n)))
    rc, seen = _serve_until_the_engine(monkeypatch, ["--k-bits", "2", "--v-bits", "2", "--threads", "1"])
    assert rc == 2 and seen and order == ["kernels", ("threads", 1)], (order, capsys.readouterr().err)
    order.clear()
    rc, seen = _serve_until_the_engine(monkeypatch, ["--float-cache", "--threads", "1"])
    assert rc == 2 and order == [("threads", 1)]  # float pages use no kivi kernel


@pytest.mark.parametrize(("argv", "pinned"), [
    (["serve", "--model", "/nonexistent/never-loaded", "--float-cache", "--preset", "extreme"], False),
    (["eval", "ppl", "--model", "/nonexistent/never-loaded"], True),
], ids=["serve", "eval"])
def test_serve_keeps_glibcs_allocator_default(monkeypatch, capsys, argv, pinned):
    """``kivi serve`` does not pin the mmap threshold (its cache is one pool made at start; pinned, every step's
    temporaries were fresh mappings and a float decode step took 1.8x as long); long CPU runs still pin it."""
    import kivi.malloc_pin

    calls = []
    monkeypatch.setattr(kivi.malloc_pin, "reduce_fragmentation", lambda *a, **k: calls.append(a) or True)
    main(argv)  # both fail on their options (after the allocator decision, before any model loads)
    capsys.readouterr()
    assert bool(calls) == pinned
