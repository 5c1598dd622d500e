"""results.md of the device check (bench/gpu.py): the same figures as its results.json
(the format: accounting/device_runs.py), as tables and lists for people: the checks, the
ledger by launch role, the phase split, the ceilings and the block scheduler's placement, the
throughput runs and the headline."""

from __future__ import annotations

from typing import Any

from gpn_scale.accounting import device_runs
from gpn_scale.bench import gpu_throughput as throughput
from gpn_scale.bench.gpu_placement import markdown as placement_md


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(blob: dict) -> str:
    """results.md: the same figures as results.json, for people."""
    meta = blob["meta"]
    lines = [
        f"# Device check: {meta['device_name']}",
        "",
        f"torch {meta['torch']} (CUDA {meta.get('torch_cuda')}), triton {meta.get('triton', '?')}, "
        f"driver {meta.get('driver', '-')}; T={meta['seq_len']}, "
        f"{'bf16 autocast' if meta['bf16'] else 'fp32'}; step kernels: {meta.get('step_form')}; "
        f"commit {meta.get('commit', '?')[:12]}; "
        + (
            f"{meta['elapsed_s']} s of {meta.get('max_seconds', 0):g} s"
            if meta.get("elapsed_s") is not None
            else f"a budget of {meta.get('max_seconds', 0):g} s"
        ),
        "",
        "| check | result | ok |",
        "|---|---|---|",
    ]
    for c in blob["checks"]:
        detail = {k: v for k, v in c.items() if k not in ("check", "ok")}
        lines.append(f"| {c['check']} | {detail} | {'yes' if c['ok'] else '**NO**'} |")
    lines += _ledger_md(blob) + _phases_md(blob) + _ceilings_md(blob)
    if blob.get("placement"):
        lines += placement_md(blob["placement"])
    for key in ("ncu", "trace"):
        if key in blob:
            lines += ["", f"{key}: {blob[key]}"]
    lines += _runs_md(blob)
    return "\n".join(lines) + "\n"


def _ledger_md(blob: dict) -> list[str]:
    rows = blob.get("ledger", {}).get("rows", [])
    if not rows:
        return []
    from gpn_scale.bench.gpu_ledger import by_role

    out = ["", "## Where the step goes: launch roles by measured time (ledger, in sequence)"]
    for (config, batch), roles in by_role(rows).items():
        total = sum(r["s_per_step"] for r in roles)
        out += [
            "",
            f"{config} at B={batch}: {total:.3f} s of kernels per training step",
            "",
            "| role | s/step | share | predicted s/step | alone us | GB/s | copy share | "
            "programs/SM | regs | smem B |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {r['role']} | {r['s_per_step']:.4f} | {r['s_per_step'] / total:.0%} | "
            f"{_fmt(r.get('predicted_s_per_step'), '.4f')} | {r['alone_s'] * 1e6:.1f} | "
            f"{_fmt(r.get('gbytes_per_s'), '.0f')} | {_fmt(r.get('copy_share'), '.0%')} | "
            f"{r['programs_per_sm']:.2f} | {_fmt(r.get('registers'), 'd')} | "
            f"{_fmt(r.get('shared'), 'd')} |"
            for r in roles
        ]
    what_ifs = blob.get("ledger", {}).get("what_ifs", [])
    if what_ifs:
        from gpn_scale.bench.gpu_ledger import what_ifs_markdown

        out += [
            "",
            "## What-ifs: launch settings the accounting chose against, timed alone",
            "",
            what_ifs_markdown(what_ifs).rstrip("\n"),
        ]
    return out


def _phases_md(blob: dict) -> list[str]:
    rows = blob.get("phases", [])
    out = []
    for p in rows:
        if "phases_s" not in p:
            out += ["", f"phases {p.get('config')} B={p.get('batch')}: {p.get('error')}"]
            continue
        out += ["", f"Phases of one step, {p['config']} at B={p['batch']} ({p['step_s']:.3f} s):"]
        out += [
            f"- {name}: {sec:.3f} s ({sec / p['step_s']:.0%})"
            for name, sec in sorted(p["phases_s"].items(), key=lambda kv: -kv[1])
        ]
    return out


def _ceilings_md(blob: dict) -> list[str]:
    c = blob.get("ceilings")
    if not c:
        return []
    if "error" in c:
        return ["", f"ceilings: {c['error']}"]
    out = ["", "Ceilings measured (the accounting prices with these once committed):"]
    out += [f"- {k}: {c[k]:.4g}" for k in device_runs_keys() if isinstance(c.get(k), float)]
    for g in c.get("gemms", []):
        out.append(
            f"- cuBLAS {g['role']} {g['shape']}: {g['tflops']:.0f} TFLOP/s, "
            f"{g.get('gbytes_per_s', 0):.0f} GB/s"
        )
    return out


def device_runs_keys() -> tuple[str, ...]:
    from gpn_scale.accounting.ceilings import MEASURED_KEYS

    return MEASURED_KEYS


def _runs_md(blob: dict) -> list[str]:
    header = (
        "| model | params | batch | tokens/s | MFU | peak alloc GB | peak reserved GB "
        "| GPU busy | kernels / time step | launch calls / time step | step s |"
    )
    lines = ["", header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    params = blob["meta"].get("params", {})
    for r in blob["runs"]:
        head = f"| {r['model']} | {params.get(r['model'], 0):,} | {r['batch']} |"
        if "tokens_per_s" not in r:
            why = "out of memory" if r.get("oom") else r.get("skipped") or f"**{r.get('error')}**"
            lines.append(head + f" {why} | | | | | | | |")
            continue
        lines.append(
            head + f" {r['tokens_per_s']:,.0f} | {_fmt(r.get('mfu'), '.1%')} | "
            f"{_fmt(r.get('peak_allocated_gb'), '.1f')} | {_fmt(r.get('peak_reserved_gb'), '.1f')}"
            f" | {_fmt(r.get('gpu_busy_fraction'), '.0%')} | "
            f"{_fmt(r.get('kernels_per_time_step'), '.1f')} | "
            f"{_fmt(r.get('launch_calls_per_time_step'), '.1f')} | {r['step_s']:.3f} |"
        )
    for name, r in throughput.best_rows(blob["runs"]).items():
        if r.get("top_device_work"):
            lines += ["", f"Device time by kernel, {name} at B={r['batch']} (s per step):"]
            lines += [
                f"- {w['seconds']:.4f} s ({w['seconds'] / r['step_s']:.0%}), {w['count']}x "
                f"per profiled window: `{w['name']}`"
                for w in r["top_device_work"]
            ]
    summary = blob.get("summary", {})
    ratio = summary.get("ratio_to_transformer_pp", {})
    if ratio:
        lines += ["", "GPN / Transformer++ tokens/s, each at its best batch:"]
        for name, x in ratio.items():
            lines.append(
                f"- {name}: **{x['ratio']:.2f}x** ({x['tokens_per_s']:,.0f} at B={x['batch']} vs "
                f"{x['transformer_tokens_per_s']:,.0f} at B={x['transformer_batch']}, "
                f"{x.get('transformer', 'eager')})"
            )
    headline = summary.get(device_runs.HEADLINE)
    said = f"**{headline:.2f}x**" if headline else "not measured"
    lines += ["", f"Headline, GPN+M / compiled Transformer++: {said}"]
    return lines
