"""Where a config loses the suite's answers (``kivi eval attribute``): per sample that full precision answers and
the config does not, the decision between the two answers, under the config and under ablations of it that keep
one part at full precision (one side, one layer, one kv head).

The **margin** of a cache on a lost sample is ``logit(fp's token) - logit(config's token)`` at the first token
where full precision's and the config's greedy answers differ, after their common prefix (teacher-forced one
token per forward, as :func:`.runner.answer` decodes). Full precision's margin is positive and the config's
negative (greedy picked each token); a sample where the recomputed margins disagree with that is reported as
``consistent: False`` and left out of the averages. An ablation's **recovery** on a sample is
``(m_ablation - m_config) / (m_fp - m_config)`` (0: no help, 1: full precision's margin); it **fixes** the sample
when its margin is positive (at that token it picks full precision's answer).

Ablations (:func:`ablations`): keys at full precision everywhere, values at full precision everywhere, each
layer at full precision; then (:func:`head_ablations`) the keys, and apart the values, of each kv head of the
``top`` layers with the highest mean recovery at 8 bits (kivi's widest code; a per-head width cannot be "off").
Every ablation replays the sample's one full-precision prefill (:func:`.runner.record_prefill`), so it costs a
replay, the question and a few tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ...config import KiviConfig
from ..caches import kv_geometry, make_cache
from ..progress import progress_bar
from .haystack import Haystack, Template, decode, encode
from .runner import record_prefill
from .tasks import Sample, make_sample

#: the width a head ablation gives one kv head (kivi's widest code)
HEAD_BITS = 8


def lost_pairs(rows: Sequence[dict[str, Any]], config: str, fp: str = "fp") -> list[tuple[dict, dict]]:
    """``(fp row, config row)`` of every (length, task, protocol, sample) where ``config`` scores below ``fp``, in
    (length, task, protocol, sample) order."""
    by = {(r["config"], r["length"], r["task"], r["protocol"], r["sample"]): r for r in rows
          if r.get("score") is not None}  # a failed answer (runner.failed_answer) has nothing to compare
    out = [(by[(fp, *k[1:])], r) for k, r in by.items() if k[0] == config and (fp, *k[1:]) in by
           and by[(fp, *k[1:])]["score"] > r["score"]]
    return sorted(out, key=lambda p: (p[1]["length"], p[1]["task"], p[1]["protocol"], p[1]["sample"]))


def first_divergence(good: Sequence[int], bad: Sequence[int]) -> tuple[list[int], int, int] | None:
    """``(common prefix, good's token, bad's token)`` at the first position the two token lists differ; ``None``
    when one is a prefix of the other (no single token decides between them)."""
    for i, (g, b) in enumerate(zip(good, bad)):
        if g != b:
            return list(good[:i]), int(g), int(b)
    return None


def _without_side(cfg: KiviConfig, side: str) -> KiviConfig:
    flag, bits = ("quantize_key", "k_bits") if side == "k" else ("quantize_value", "v_bits")
    heads = {i: rest for i, e in cfg.head_bits.items() if (rest := {n: w for n, w in e.items() if n != bits})}
    lsc = {i: {**o, flag: False} for i, o in cfg.layer_specific_config.items()}
    return dataclasses.replace(cfg, **{flag: False}, layer_specific_config=lsc, head_bits=heads)


def _layer_off(cfg: KiviConfig, layer: int) -> KiviConfig:
    lsc = dict(cfg.layer_specific_config)
    lsc[layer] = {**lsc.get(layer, {}), "quantize_key": False, "quantize_value": False}
    heads = {i: e for i, e in cfg.head_bits.items() if i != layer}
    return dataclasses.replace(cfg, layer_specific_config=lsc, head_bits=heads)


def ablations(cfg: KiviConfig, num_layers: int) -> list[tuple[str, KiviConfig]]:
    """``(label, config)``: ``keys fp``, ``values fp`` and ``layer L fp`` for every layer ``L`` of ``cfg``."""
    out = [("keys fp", _without_side(cfg, "k")), ("values fp", _without_side(cfg, "v"))]
    return out + [(f"layer {i} fp", _layer_off(cfg, i)) for i in range(num_layers)]


def head_ablations(cfg: KiviConfig, layer: int, num_kv_heads: int) -> list[tuple[str, KiviConfig]]:
    """``(label, config)``: ``layer L head h K8b`` and ``layer L head h V8b`` for every kv head ``h`` of
    ``layer`` (a side it quantizes): that head's keys (values) at :data:`HEAD_BITS` bits, everything else as in
    ``cfg`` (its per-head widths, else the layer's)."""
    lcfg = dataclasses.replace(cfg, layer_specific_config={}, head_bits={},
                               **cfg.layer_specific_config.get(layer, {}))
    entry = cfg.head_bits.get(layer, {})
    widths = {name: list(entry.get(name, [getattr(lcfg, name)] * num_kv_heads))
              for name, on in (("k_bits", lcfg.quantize_key), ("v_bits", lcfg.quantize_value)) if on}
    out = []
    for h in range(num_kv_heads):
        for name in widths:
            w = {**widths, name: [HEAD_BITS if i == h else b for i, b in enumerate(widths[name])]}
            out.append((f"layer {layer} head {h} {name[0].upper()}{HEAD_BITS}b",
                        dataclasses.replace(cfg, head_bits={**cfg.head_bits, layer: w})))
    return out


def margin(model: Any, spec: Any, sample: Sample, protocol: str,
           prefill: tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor], prefix: Sequence[int], good: int,
           bad: int) -> float:
    """``logit(good) - logit(bad)`` of cache ``spec`` after the shared ``prefill`` (replayed), the question
    (question-after) and ``prefix`` fed one token per forward."""
    from ...attention.interface import reading_views  # noqa: PLC0415
    from ...cache.replay import replay_prefill  # noqa: PLC0415

    dev = next(model.parameters()).device
    states, logits = prefill
    cache = make_cache(model, spec, read_packed=True)
    with torch.inference_mode(), reading_views(model, cache):
        replay_prefill(cache, states)
        if protocol == "question-after":
            q = torch.tensor([list(sample.question)], device=dev)
            logits = model(input_ids=q, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        for t in prefix:
            logits = model(input_ids=torch.tensor([[int(t)]], device=dev), cache=cache, use_cache=True).logits[:, -1]
    return float(logits[0, good].float() - logits[0, bad].float())


def _tokens(tok: Any, text: str) -> list[int] | None:
    ids = encode(tok, text)
    return ids if decode(tok, ids) == text else None


def attribute(model: Any, tok: Any, text: str, rows: Sequence[dict[str, Any]], label: str, cfg: KiviConfig, *,
              fp: str = "fp", top: int = 2, progress: bool = True) -> dict[str, Any]:
    """The attribution of ``label``'s losses in ``rows`` (one suite run's rows: model, text, seed and samples
    shared; ``cfg`` the config ``label`` names): per lost sample its margins (``samples``), per ablation the mean
    recovery and the samples fixed (``ablations``, best first). ``ValueError`` when ``cfg`` is not a KiviConfig
    or ``rows`` lack ``label`` / ``fp``."""
    if not isinstance(cfg, KiviConfig):
        raise ValueError(f"config {label!r} is {type(cfg).__name__}: attribution ablates a KiviConfig")
    labels = {r["config"] for r in rows}
    for name in (label, fp):
        if name not in labels:
            raise ValueError(f"the rows hold no answers of config {name!r} (they hold {sorted(labels)})")
    metas = {(r["seed"], r["samples"]) for r in rows}
    if len(metas) != 1:
        raise ValueError(f"the rows mix runs of different seeds / sample counts: {sorted(metas)}")
    seed, samples = metas.pop()
    layers, kv_heads, _ = kv_geometry(model)
    hay, tpl = Haystack.from_text(tok, text), Template.of(tok)
    items, skipped = [], []
    for f, r in lost_pairs(rows, label, fp):
        where = {k: r[k] for k in ("length", "task", "protocol", "sample")}
        good, bad = _tokens(tok, f["answer"]), _tokens(tok, r["answer"])
        split = first_divergence(good, bad) if good is not None and bad is not None else None
        if split is None:
            skipped.append({**where, "reason": "the answers do not split at one token (re-tokenized text differs, "
                                              "or one answer is a prefix of the other)"})
            continue
        items.append((where, f, r, split))
    base = [("fp", "fp"), ("config", cfg), *ablations(cfg, layers)]
    found = _run(model, tok, hay, tpl, items, base, seed, samples, f"attribute {label}", progress)
    out = [{**where, "expected": list(r["expected"]), "fp_answer": f["answer"], "config_answer": r["answer"],
            "split_at": len(prefix), "fp_token": decode(tok, [good]), "config_token": decode(tok, [bad]),
            "margins": m, "consistent": m["fp"] > 0 > m["config"]}
           for (where, f, r, (prefix, good, bad)), m in zip(items, found)]
    ranked = [a for a in _summarize(out, [n for n, _ in base[2:]]) if a["ablation"].startswith("layer ")]
    heads = [a for row in ranked[:top] for a in head_ablations(cfg, int(row["ablation"].split()[1]), kv_heads)]
    for s, m in zip(out, _run(model, tok, hay, tpl, items, heads, seed, samples, f"attribute {label}: heads",
                              progress)):
        s["margins"].update(m)
    return {"config": label, "fp": fp, "seed": seed, "samples_per_task": samples, "layers": layers,
            "kv_heads": kv_heads, "head_bits": HEAD_BITS, "lost": len(items) + len(skipped), "skipped": skipped,
            "samples": out, "ablations": _summarize(out, [n for n, _ in base[2:] + heads])}


def _run(model, tok, hay, tpl, items, specs, seed, samples, desc, progress) -> list[dict[str, float]]:
    """Per item the margins ``{label: margin}`` of every spec in ``specs``: one full-precision prefill per
    item (made again per call: a run with many lost samples keeps one prefill in memory at a time)."""
    out = []
    if not specs:
        return [{} for _ in items]
    bar = progress_bar(len(items) * len(specs), desc, enabled=progress, unit="replay")
    try:
        for where, _, _, (prefix, good, bad) in items:
            sample = make_sample(hay, tpl, where["task"], where["length"], where["sample"], samples=samples, seed=seed)
            pre = record_prefill(model, sample.context if where["protocol"] == "question-after" else sample.ids)
            m = {}
            for name, spec in specs:
                bar.set_description(f"{where['task']} #{where['sample']} {name}")
                m[name] = margin(model, spec, sample, where["protocol"], pre, prefix, good, bad)
                bar.update(1)
            out.append(m)
            del pre
    finally:
        bar.close()
    return out


def _summarize(samples: Sequence[dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """Per ablation over the consistent samples: mean recovery, samples fixed, and per task; best first."""
    ok = [s for s in samples if s["consistent"]]
    out = []
    for name in names:
        rec = [(s["margins"][name] - s["margins"]["config"]) / (s["margins"]["fp"] - s["margins"]["config"])
               for s in ok if name in s["margins"]]
        if not rec:
            continue
        fixed = [s for s in ok if s["margins"].get(name, -1.0) > 0]
        tasks = sorted({s["task"] for s in ok})
        out.append({"ablation": name, "mean_recovery": sum(rec) / len(rec), "n": len(rec), "fixed": len(fixed),
                    "fixed_by_task": {t: sum(1 for s in fixed if s["task"] == t) for t in tasks}})
    return sorted(out, key=lambda r: -r["mean_recovery"])


__all__ = ["HEAD_BITS", "ablations", "attribute", "first_divergence", "head_ablations", "lost_pairs", "margin"]
