"""Fuzz (hypothesis): random argument lists through every `kivi` subcommand -> exit 0 or 2, never a
traceback; an argument list holding one value known to be invalid is refused (exit 2, one line)
before any model loads.

Each case runs in its own process: a "zygote" subprocess imports kivi once, then forks one child per
case that runs ``kivi.cli.main(argv)`` and exits with its status, exactly as ``python -m kivi`` does
(a fresh interpreter per case would cost ~2-8 s of imports each on this machine). In the children
``kivi.models.load.load_model`` exits 99: "reached the model load" (allowed for argument lists that are
valid, a failure when the list holds a known-invalid value). The options of every subcommand are
read from the parser itself, so a new option or subcommand is fuzzed without editing this file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kivi.cli import build_parser, validators

ROOT = Path(__file__).resolve().parents[2]
LOAD_REACHED = 99
MAX_EXAMPLES = int(os.environ.get("KIVI_FUZZ_EXAMPLES", 120))  # more for a one-off deep run

ZYGOTE = r"""
import json, os, sys, traceback
os.environ["HF_HUB_OFFLINE"] = "1"
import kivi.models.load
from kivi.cli import main, build_parser
build_parser()  # every subcommand module imported before forking

def reached(*a, **kw):
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(99)

kivi.models.load.load_model = reached
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    out_path, err_path = req["out"], req["err"]
    pid = os.fork()
    if pid == 0:
        fd_out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        fd_err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        fd_in = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd_out, 1); os.dup2(fd_err, 2); os.dup2(fd_in, 0)
        try:
            rc = main(req["argv"])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            rc = 1
        try:
            sys.stdout.flush(); sys.stderr.flush()
        finally:
            os._exit(rc)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class Zygote:
    def __init__(self, tmp: Path):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "KIVI_CACHE_DIR": str(tmp / "kivi-cache")}
        env.pop("KIVI_DEBUG", None)
        self.tmp = tmp
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=tmp, env=env)
        assert self.proc.stdout.readline().strip() == "ready"
        self.cases = 0
        self.outcomes: dict[int, int] = {}

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        out, err = self.tmp / "out.txt", self.tmp / "err.txt"
        self.proc.stdin.write(json.dumps({"argv": argv, "out": str(out), "err": str(err)}) + "\n")
        self.proc.stdin.flush()
        rc = json.loads(self.proc.stdout.readline())["rc"]
        self.cases += 1
        self.outcomes[rc] = self.outcomes.get(rc, 0) + 1
        return rc, out.read_text(errors="replace"), err.read_text(errors="replace")

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "adir").mkdir()
    (tmp / "five.json").write_text("5")
    (tmp / "binary.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    (tmp / "ok.json").write_text('{"k_bits": 4, "v_bits": 2}')
    z = Zygote(tmp)
    t0 = time.perf_counter()
    yield z
    z.close()
    print(f"\nCLI fuzz: {z.cases} cases in {time.perf_counter() - t0:.1f} s; exit status -> cases: "
          f"{dict(sorted(z.outcomes.items()))} ({LOAD_REACHED} = reached the model load)", file=sys.stderr)


# --------------------------------------------------------------------------- what to feed
#: Values any option may get (valid for some, nonsense for others).
POOL = ["0", "1", "2", "4", "-1", "16", "64", "1k", "32k", "0.5", "1.5", "nan", "inf", "-inf", "1e400",
        str(2**70), "", " ", "x", "caf\udce9", "-", "all", "5:1", "1,2", "a,b", "80GB", "80XB", "[1]", "{}",
        '{"k_bits": 7}', "high", "extreme", "ultra", "cpu", "reference", "triton", "float16", "fp8",
        "adir", "adir/out.json", "/nonexistent/x.json", "five.json", "binary.json", "ok.json", "/no/such.txt"]

#: Values known to be invalid, by the option's argparse type (or destination): an argument list
#: holding one must be refused before any model loads.
INVALID_BY_TYPE = {
    validators.positive_int: ["0", "-1", "x", "1.5", "nan", ""],
    validators.non_negative_int: ["-1", "x", "inf"],
    validators.seed: ["-1", str(2**64), str(2**70), "x"],
    validators.finite_float: ["nan", "inf", "x"],
    validators.positive_float: ["0", "-1", "nan", "inf", "1e400", "x"],
    validators.non_negative_float: ["-1", "nan", "inf", "-inf"],
    validators.token_count: ["0", "-1", "lots", "1.5"],
    validators.byte_size: ["80XB", "0", "x"],
    validators.output_path: ["/nonexistent/dir/x.json", "adir", ""],
    validators.utf8_text: ["caf\udce9"],
    validators.int_list: ["0", "a,b", ""],
    validators.fraction_list: ["1.5", "x", "-0.1"],
    validators.json_object: ["[1]", "{", "5"],
    validators.model_dtype: ["fp8", "int4"],
    int: ["x", "1.5"],
}
INVALID_BY_DEST = {
    "k_bits": ["5", "0", "x"], "v_bits": ["7"], "group_size": ["0", "-1"], "residual_length": ["-32", "100"],
    "residual_bits": ["5"], "sink_tokens": ["-1", "5000"], "preset": ["ultra"],
    "attention_backend": ["cuda", "triton"], "config": ["/nonexistent.json", "binary.json", "five.json"],
    "profile": ["five.json", "binary.json", "/nonexistent.json"], "candidates": ["five.json"],
    "presets": ["turbo", "binary.json"], "text": ["/no/such.txt"], "scale_dtype": ["fp8"], "block_size": ["100"],
    "sliding_layers": ["x:y"], "max_ppl_increase": ["lots", "nan"],
}
#: Options fuzzed only with their invalid values (a valid one would start a download or a conversion).
NO_RANDOM = {"model", "text", "prompt_file"}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """``{"estimate": parser, "eval ppl": parser, ...}``: every leaf subcommand of `kivi`."""
    out = {}

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out[prefix.strip()] = parser
        for a in subs:
            for name, p in a.choices.items():
                walk(f"{prefix} {name}", p)

    walk("", build_parser())
    return out


COMMANDS = subcommands()
#: Commands that never load a model: any argument list may run them to the end.
NO_MODEL = {"estimate", "cache ls", "cache verify", "cache clear"}


def options(cmd: str) -> list[argparse.Action]:
    return [a for a in COMMANDS[cmd]._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def invalid_values(action: argparse.Action) -> list[str]:
    return INVALID_BY_DEST.get(action.dest) or INVALID_BY_TYPE.get(action.type, [])


@st.composite
def argument_lists(draw):
    cmd = draw(st.sampled_from(sorted(COMMANDS)))
    acts = options(cmd)
    argv = cmd.split()
    for a in draw(st.lists(st.sampled_from(acts), max_size=4, unique_by=lambda a: a.dest)) if acts else []:
        if a.dest in NO_RANDOM and cmd not in NO_MODEL:
            continue
        flag = draw(st.sampled_from(a.option_strings))
        if a.nargs == 0:
            argv.append(flag)
        else:
            argv += [flag, draw(st.sampled_from(POOL))]
    kind = draw(st.sampled_from(["none", "invalid", "unknown-flag", "missing-value", "help"]))
    poisoned = [a for a in acts if invalid_values(a) and a.nargs != 0]
    expect = None
    if kind == "invalid" and poisoned:
        a = draw(st.sampled_from(poisoned))
        argv += [a.option_strings[-1], draw(st.sampled_from(invalid_values(a)))]
        expect = 2
    elif kind == "unknown-flag":
        argv.append("--no-such-option")
        expect = 2
    elif kind == "missing-value" and [a for a in acts if a.nargs is None]:
        argv.append(draw(st.sampled_from([a for a in acts if a.nargs is None])).option_strings[-1])
        expect = 2
    elif kind == "help":
        argv.append("--help")
        expect = "help"
    return argv, expect


@pytest.mark.long  # ~30 s: the random-argument fuzzer (the CLI's error tests name each refusal)
@settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=argument_lists())
def test_random_arguments_exit_0_or_2_never_a_traceback(zygote, case):
    argv, expect = case
    rc, out, err = zygote.run(argv)
    if os.environ.get("KIVI_FUZZ_LOG"):
        with open(os.environ["KIVI_FUZZ_LOG"], "a") as f:
            f.write(json.dumps({"argv": argv, "expect": expect, "rc": rc, "err": err[-300:]}) + "\n")
    assert "Traceback" not in err, (argv, err)
    assert rc in (0, 2, LOAD_REACHED), (argv, rc, err)
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kivi") and "error" in lines[0], (argv, err)
    if expect == 2:
        assert rc == 2, (argv, rc, "an invalid argument was not refused before the model load", err)
    elif expect == "help":
        assert rc in (0, 2), (argv, rc, err)  # 2: an error met before --help in the list
    if rc == LOAD_REACHED:
        assert " ".join(argv[:2]) not in NO_MODEL and argv[0] not in NO_MODEL, argv


def test_every_subcommand_is_fuzzed():
    assert {"estimate", "generate", "demo", "eval ppl", "eval kld", "eval passkey", "profile", "sweep", "tune",
            "cache ls", "cache verify", "cache clear"} <= set(COMMANDS)
