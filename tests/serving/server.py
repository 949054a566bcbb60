"""A tiny checkpoint with a character tokenizer and a chat template, and `kivi serve` in a subprocess."""

from __future__ import annotations

import os
import signal
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.helpers import tiny_model

CHARS = string.ascii_letters + string.digits + " .,!?<>"
EOS_ID = 1
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
ROOT = Path(__file__).resolve().parents[2]


def tiny_tokenizer():
    """One token per character (so streamed pieces join exactly), ``<eos>`` special, a chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": EOS_ID, **{c: i + 2 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_chat_model(max_position_embeddings: int = 4096):
    """The default tiny GQA Llama over :func:`tiny_tokenizer`'s vocabulary; EOS is never its argmax
    (its output row is zero), so greedy requests run to ``max_tokens``."""
    model = tiny_model("llama", vocab_size=len(CHARS) + 2, eos_token_id=EOS_ID, pad_token_id=None,
                       max_position_embeddings=max_position_embeddings)
    with torch.no_grad():
        model.lm_head.weight[EOS_ID] = 0
    model.generation_config.eos_token_id = EOS_ID
    return model


def save_tiny_checkpoint(folder: Path, **kw) -> Path:
    tiny_chat_model(**kw).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m kivi serve ...` on a free localhost port; :meth:`stop` ends it (SIGINT, then SIGKILL)."""

    def __init__(self, args: list[str], *, timeout: float = 60.0, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KIVI_DEBUG": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "kivi", "serve", "--port", str(self.port), *args],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kivi serve exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kivi serve did not answer within {timeout} s:\n{self.output}")
            time.sleep(0.1)

    def health(self) -> dict:
        import httpx

        return httpx.get(f"{self.url}/health", timeout=5.0).json()

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.output = self.proc.stdout.read()
        return self.proc.returncode

    def stop_cleanly(self) -> None:
        """:meth:`stop`, checking that Ctrl-C ended the server as every kivi command ends: status 130 and
        one line after the banner."""
        rc = self.stop()
        after_banner = self.output.split(" new tokens per request", 1)[-1].splitlines()[1:]
        assert rc == 130 and after_banner == ["kivi serve: interrupted"], f"kivi serve exited with {rc}:\n{self.output}"
