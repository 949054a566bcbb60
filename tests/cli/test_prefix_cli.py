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
