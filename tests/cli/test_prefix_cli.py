"""`kivi generate --save-prefix / --load-prefix`, run as a user would, on a tiny model saved to a folder."""

from __future__ import annotations

import json

import pytest
import torch

from tests.cli.test_cli_basic import kivi
from tests.helpers import tiny_model

QUANT = ["--k-bits", "2", "--v-bits", "2", "--group-size", "16", "--residual-length", "32", "--sink-tokens", "4"]


def _save_model(folder, seed):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    model = tiny_model("llama", seed=seed, weight_scale=4.0, eos_token_id=None, bos_token_id=None)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_cli")
    doc = root / "doc.txt"
    doc.write_text(" ".join(f"w{3 + (i * 37) % 125}" for i in range(150)))
    return _save_model(root / "model", 0), _save_model(root / "other", 1), doc


def _json(p):
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_save_then_load_continue_like_the_library(folders, tmp_path, capsys):
    import kivi as kv
    from kivi.cli import main
    from kivi.models import load_model
    from kivi.prefix import prefill

    model_dir, _, doc = folders
    f = tmp_path / "doc.kivi"
    # saved in this process (fast), loaded in a fresh one (as a user would, later)
    assert main(["generate", "--model", str(model_dir), "--prompt-file", str(doc), "--raw", *QUANT,
                 "--max-new-tokens", "12", "--json", "--save-prefix", str(f)]) == 0
    saved = json.loads(capsys.readouterr().out)
    assert f.is_file() and saved["prefix_tokens"] == saved["prompt_tokens"] == 150
    loaded = _json(kivi("generate", "--model", str(model_dir), "--load-prefix", str(f), "--prompt", "w5 w6",
                        "--max-new-tokens", "12", "--json"))
    assert loaded["prefix_tokens"] == 150 and loaded["prompt_tokens"] == 152
    assert loaded["config"] == saved["config"]  # the file's configuration, without repeating the options

    model, tok = load_model(str(model_dir))
    kv.quantize_model(model, kv.KiviConfig.from_dict(saved["config"]))
    ids = tok(doc.read_text(), return_tensors="pt")["input_ids"]
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    # --save-prefix changes nothing in what is generated
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0, 150:].tolist()
    assert saved["tokens"] == plain
    # --load-prefix continues as the saving process would have: prefix in the cache, then the question
    full = torch.cat([ids, tok("w5 w6", return_tensors="pt", add_special_tokens=False)["input_ids"]], dim=-1)
    cont = model.generate(full, attention_mask=torch.ones_like(full), cache=prefill(model, ids), **kw)
    assert loaded["tokens"] == cont[0, 152:].tolist()


def _main_error(capsys, *args: str) -> str:
    """Run ``kivi`` in this process (fast); it must exit 2 with one line on stderr, which is returned."""
    from kivi.cli import main

    assert main(list(args)) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kivi")]
    assert len(lines) == 1
    return lines[0]


def test_prefix_errors_are_one_line(folders, tmp_path, capsys):
    from kivi.cli import main

    model_dir, other_dir, doc = folders
    assert "folder" in _main_error(capsys, "generate", "--model", str(tmp_path / "not-loaded"), "--prompt", "w3",
                                   "--save-prefix", str(tmp_path / "no" / "dir" / "p.kivi"))  # checked before loading
    assert "missing.kivi' does not exist" in _main_error(capsys, "generate", "--prompt", "w3", "--load-prefix",
                                                         str(tmp_path / "missing.kivi"))
    f = tmp_path / "p.kivi"
    assert main(["generate", "--model", str(model_dir), "--prompt-file", str(doc), "--raw", *QUANT,
                 "--max-new-tokens", "1", "--json", "--save-prefix", str(f)]) == 0
    capsys.readouterr()
    assert "config differs (file vs given): k_bits 2 vs 4" in _main_error(
        capsys, "generate", "--model", str(model_dir), "--load-prefix", str(f), "--prompt", "w3", "--k-bits", "4",
        *QUANT[2:])
    assert "prefix file was saved for model LlamaForCausalLM (weights" in _main_error(
        capsys, "generate", "--model", str(other_dir), "--load-prefix", str(f), "--prompt", "w3")
    f.write_bytes(f.read_bytes()[:-10])
    assert "file is truncated" in _main_error(capsys, "generate", "--model", str(tmp_path / "not-loaded"),
                                              "--load-prefix", str(f), "--prompt", "w3")
    assert "not allowed with argument" in _main_error(capsys, "generate", "--prompt", "w3", "--load-prefix", str(f),
                                                      "--save-prefix", str(f))


def _full_disk(monkeypatch):
    """safetensors' writer failing as it does on a full disk (its own error type, errno 28 in the text)."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "text"])
def test_save_prefix_on_a_full_disk_prints_the_result_then_one_line(folders, tmp_path, capsys, monkeypatch,
                                                                    json_out):
    from kivi.cli import main

    model_dir, _, doc = folders
    args = ["generate", "--model", str(model_dir), "--prompt-file", str(doc), "--raw", *QUANT,
            "--max-new-tokens", "6", *(["--json"] if json_out else [])]
    assert main(args) == 0
    plain = capsys.readouterr().out
    _full_disk(monkeypatch)
    f = tmp_path / "doc.kivi"
    assert main([*args, "--save-prefix", str(f)]) == 2
    out, err = capsys.readouterr()
    if json_out:  # the whole result, saying the prefix was not saved
        got, want = json.loads(out), json.loads(plain)
        assert got["tokens"] == want["tokens"] and got["text"] == want["text"] and got["prefix_saved"] is False
    else:  # the streamed text, as without the option
        assert out == plain and out.strip()
    lines = [line for line in err.splitlines() if line.startswith("kivi")]
    assert lines == [
        f"kivi generate: error: --save-prefix {str(f)!r} was not saved: No space left on device (the generated "
        "text above is complete)"
    ]
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []  # no partial file


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 8 KiB file system (tmpfs; needs root, skipped otherwise), unmounted afterwards."""
    import os
    import subprocess

    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(mnt)],
                                           capture_output=True, check=False).returncode:
        pytest.skip("a tiny tmpfs needs root (mount -t tmpfs)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_save_prefix_on_a_real_full_disk(folders, tiny_tmpfs):
    model_dir, _, doc = folders
    f = tiny_tmpfs / "doc.kivi"
    p = kivi("generate", "--model", str(model_dir), "--prompt-file", str(doc), "--raw", *QUANT,
             "--max-new-tokens", "6", "--json", "--save-prefix", str(f))
    assert p.returncode == 2, p.stderr
    assert json.loads(p.stdout)["prefix_saved"] is False and json.loads(p.stdout)["new_tokens"] == 6
    assert [line for line in p.stderr.splitlines() if line.startswith("kivi")] == [
        f"kivi generate: error: --save-prefix {str(f)!r} was not saved: No space left on device "
        "(the generated text above is complete)"
    ]
    assert list(tiny_tmpfs.iterdir()) == []


@pytest.mark.parametrize("extra", [dict(tiers=[(32, None), (64, (4, 4)), (None, 2)]),
                                   dict(head_bits={0: {"k_bits": [4, 2], "v_bits": [2, 4]}})],
                         ids=["tiers", "per-head"])
def test_save_prefix_saves_tiers_and_per_head_widths(folders, tmp_path, capsys, extra):
    """A tiered or per-head configuration saves with --save-prefix and --load-prefix continues from it."""
    from kivi.cli import main
    from kivi.config import KiviConfig

    model_dir, _, doc = folders
    cfg = tmp_path / "cfg.json"
    KiviConfig(k_bits=4, v_bits=4, group_size=16, residual_length=32, **extra).to_json(cfg)
    f = tmp_path / "p.kivi"
    assert main(["generate", "--model", str(model_dir), "--prompt-file", str(doc), "--raw", "--config", str(cfg),
                 "--max-new-tokens", "2", "--json", "--save-prefix", str(f)]) == 0
    saved = json.loads(capsys.readouterr().out)
    assert f.is_file() and saved["prefix_tokens"] == 150
    assert main(["generate", "--model", str(model_dir), "--load-prefix", str(f), "--prompt", "w5 w6",
                 "--max-new-tokens", "2", "--json"]) == 0
    loaded = json.loads(capsys.readouterr().out)
    assert loaded["prefix_tokens"] == 150 and loaded["config"] == saved["config"]


def test_forged_prefix_files_are_one_line(folders, tmp_path, capsys):
    """A file whose checksums were recomputed after forging: NaNs in a window, a tensor retyped, a layer dtype."""
    from kivi.cli import main
    from tests.cache.test_persist_fuzz import read_parts, write_parts

    model_dir, _, doc = folders
    f = tmp_path / "p.kivi"
    assert main(["generate", "--model", str(model_dir), "--prompt-file", str(doc), "--raw", *QUANT,
                 "--max-new-tokens", "1", "--json", "--save-prefix", str(f)]) == 0
    capsys.readouterr()

    def nan_window(h, meta, p):
        lo, hi = h["layer0.parts.0.k.window"]["data_offsets"]
        return p[:lo] + b"\xff" * (hi - lo) + p[hi:]  # all NaN

    def retyped(h, meta, p):
        h["layer1.parts.0.v.window"]["dtype"] = "I32"

    def dtype(h, meta, p):
        meta["cache"]["layers"][1]["dtype"] = "complex64"

    for fn, want in (
        (nan_window, "tensor layer0.parts.0.k.window: found 2176 non-finite values, expected finite values only"),
        (retyped, "tensor layer1.parts.0.v.window: found int32 [1, 2, 32, 32], expected float32"),
        (dtype, "cache.layers[1].dtype: found 'complex64', expected one of"),
    ):
        header, meta, payload = read_parts(f)
        out = tmp_path / f"{fn.__name__}.kivi"
        write_parts(out, header, meta, fn(header, meta, payload) or payload)
        line = _main_error(capsys, "generate", "--model", str(model_dir), "--load-prefix", str(out), "--prompt", "w3")
        assert want in line, line
