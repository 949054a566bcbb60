"""The table and the plot of ``bench_serving.py``'s report (generated tokens/s is the headline column)."""

from __future__ import annotations

from pathlib import Path


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}ms"


def format_table(report: dict) -> str:
    lines = [f"# {report['command']}",
             f"# model {report['model']} ({report['dtype']}), workload {report['workload']}, {report['requests']} "
             f"requests, page {report['page_size']}, {report['threads']} thread(s), "
             f"{'a fresh process per row' if report['fresh_process_per_row'] else 'rows in one process'}"]
    load = report.get("load_average")
    if load and "end" in load:
        lines.append("# load average (1/5/15 min) at the start " + "/".join(f"{x:.1f}" for x in load["start"])
                     + ", at the end " + "/".join(f"{x:.1f}" for x in load["end"]))
    for name in dict.fromkeys(r["workload"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["workload"] == name]
        p, n = rows[0]["prompt_tokens"], rows[0]["new_tokens"]
        lines.append(f"## {name}: prompts {min(p)}-{max(p)} tokens (sum {sum(p)}), new tokens {min(n)}-{max(n)} "
                     f"(sum {sum(n)})")
        lines.append(f"{'row':26s} {'budget':>9s} {'sched/mbt':>14s} {'gen tok/s':>9s} {'tok/s':>8s} "
                     f"{'TTFT p50':>9s} {'TTFT p95':>9s} {'tok p50':>8s} {'tok p95':>8s} {'held':>4s} {'fits':>4s} "
                     f"{'transient':>10s} {'shared':>6s} {'same':>6s}")
        for r in rows:
            s = r.get("settings", {})
            label = {"one-at-a-time": "one-at-a-time ", "http": "http-"}.get(r["kind"], "") + r["cache"]
            if r.get("kivi_root"):
                label += f" ({Path(r['kivi_root']).name})"
            budget = "-" if r["budget_bytes"] is None else f"{r['budget_bytes'] / 2**20:.1f}Mi"
            sched = f"{s['scheduler']}/{s['max_batch_tokens']}" if s else "-"
            tr = r.get("dequantized_transient_bytes")
            same = r.get("same_tokens_as_one_at_a_time") or r.get("same_text_as_batch")
            same = "-" if same is None else f"{same['identical']}/{same['requests']}"
            lines.append(
                f"{label:26s} {budget:>9s} {sched:>14s} {r['generated_tokens_per_s']:9.2f} "
                f"{r['total_tokens_per_s']:8.1f} {_s(r['ttft_p50_s']):>9s} {_s(r['ttft_p95_s']):>9s} "
                f"{_ms(r['per_token_p50_s']):>8s} {_ms(r['per_token_p95_s']):>8s} {r['requests_held_at_once']:4d} "
                f"{r.get('capacity_requests', '-'):>4} {'-' if tr is None else f'{tr / 2**20:.1f}Mi':>10s} "
                f"{r.get('shared_prompt_tokens') or 0:6d} "
                f"{same:>6s}")
    if any(r["kind"] == "http" for r in report["rows"]):
        lines.append("same: batch rows, greedy tokens equal to the one-at-a-time row of the same cache; http rows, "
                     "text equal to the first batch row of the same cache")
    for name, a in report.get("single_request_agreement", {}).items():
        lines.append(f"greedy tokens vs one-request generate() with the same config ({name}): {a['identical']}/"
                     f"{a['requests']} requests identical (first differing token: {a['first_differing_token']})")
    cap = report["capacity"]
    lines.append(f"computed: requests of {cap['tokens_per_request']} tokens held at once in "
                 f"{cap['budget_bytes'] / 2**30:.1f} GiB (fp16 model, from page sizes): "
                 + ", ".join(f"{k} {v}" for k, v in cap["requests_that_fit"].items()))
    return "\n".join(lines)


def plot_budgets(report: dict, path: str | Path) -> Path:
    """Generated tokens/s vs budget (MiB): one line per cache and scheduler setting of the batch rows, the
    one-at-a-time rows as horizontal lines (they use no budget). One panel per workload."""
    import matplotlib  # noqa: PLC0415 (optional dependency)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = list(dict.fromkeys(r["workload"] for r in report["rows"]))
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = [r for r in report["rows"] if r["workload"] == name]
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            if r["kind"] != "batch":
                continue
            s = r.get("settings", {})
            key = r["cache"] + (f" ({s['scheduler']}/{s['max_batch_tokens']})" if len(
                {(x.get("settings") or {}).get("max_batch_tokens") for x in rows if x["kind"] == "batch"}) > 1
                or len({(x.get("settings") or {}).get("scheduler") for x in rows if x["kind"] == "batch"}) > 1
                else "") + (f" (kivi from {Path(r['kivi_root']).name})" if r.get("kivi_root") else "")
            lines.setdefault(key, []).append((r["budget_bytes"] / 2**20, r["generated_tokens_per_s"]))
        for key, pts in lines.items():
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=key)
        for r in rows:
            if r["kind"] == "http":
                ax.scatter([r["budget_bytes"] / 2**20], [r["generated_tokens_per_s"]], marker="x", s=60,
                           label=f"kivi serve (HTTP), {r['cache']}")
            if r["kind"] == "one-at-a-time":
                ax.axhline(r["generated_tokens_per_s"], linestyle="--", linewidth=1,
                           label=f"one at a time, {r['cache']}", color="gray" if r["cache"] == "dynamic" else None)
        ax.set_xlabel("cache budget (MiB)")
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{report['model']}, {name}, {report['threads']} thread(s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    from kivi.files import write_file

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:  # kivi's one writer: the figure goes to a temporary name, then replaces a regular file only
        write_file(out, lambda tmp: fig.savefig(tmp, dpi=110, format=out.suffix[1:].lower() or "png"))
    finally:
        plt.close(fig)
    return out
