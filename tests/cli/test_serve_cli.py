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
    (["--port", "70000"], "argument --port: 70000 is not a port number"),
    (["--threads", "0"], "--threads"),
    (["--float-cache", "--preset", "extreme"], "--float-cache"),
    (["--preset", "nope"], "preset='nope' is unknown"),
    (["--preset", "extreme", "--config", "x.json"], "either --preset or --config"),
    (["--preset", "extreme", "--quantize-after", "512"], "KIVI pages in continuous batching quantize from the first"),
    (["--float-cache", "--api-key", " "], "--api-key / $KIVI_API_KEY is empty"),
    (["--max-body-size", "lots"], "--max-body-size"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
], ids=["cache-memory", "negative-cache", "max-new-tokens", "max-batch-tokens", "port", "threads",
        "float-and-preset", "unknown-preset", "preset-and-config", "quantize-after", "empty-key", "body-size",
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
