"""Writing an analysis: analysis.json (everything), report.md (the figures, explained) and
PNG plots (spectrum, state horizon, per-head retention), matplotlib's Agg backend."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PLOTS = ("spectrum.png", "state_horizon.png", "memory_retention.png")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _clean(value: Any) -> Any:
    """JSON without NaN/inf (strict parsers refuse them): those become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def plot_spectrum(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    eig = [v for v in result["geometry"]["eigenvalues"] if v > 0]
    total = sum(eig) or 1.0
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.loglog(range(1, len(eig) + 1), eig)
    a.set_xlabel("principal component")
    a.set_ylabel("variance (eigenvalue)")
    a.set_title("state covariance spectrum")
    cum, acc = [], 0.0
    for v in eig:
        acc += v
        cum.append(acc / total)
    b.semilogx(range(1, len(cum) + 1), cum)
    for share in (0.9, 0.99):
        b.axhline(share, color="gray", lw=0.6, ls="--")
    b.set_xlabel("components")
    b.set_ylabel("cumulative variance share")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_state_horizon(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    h = result["state_horizon"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(h["lags"], [math.nan if v is None else v for v in h["raw"]], label="raw")
    if h.get("centered") is not None:
        ax.plot(
            h["lags"],
            [math.nan if v is None else v for v in h["centered"]],
            label="sequence mean removed",
        )
    ax.axhline(0, color="gray", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("lag k (tokens)")
    ax.set_ylabel("E[cos(p_t, p_t+k)]")
    ax.set_title("state horizon")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_retention(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    mem = result["memory_horizon"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if "skipped" in mem:
        ax.text(0.5, 0.5, mem["skipped"], ha="center", va="center", wrap=True)
        ax.set_axis_off()
    else:
        for head, curve in zip(mem["heads"], mem["retention"], strict=True):
            ys = [math.nan if v is None else v for v in curve]
            style = "--" if head["group"] == "fast" else "-"
            ax.plot(range(1, len(ys) + 1), ys, style, lw=1, label=f"h{head['head']}")
        ax.axhline(math.exp(-1), color="gray", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(1e-4, 1.05)
        ax.set_xlabel("lag k (tokens)")
        ax.set_ylabel("mean retention prod alpha")
        ax.set_title("memory retention per head (dashed: fast)")
        if len(mem["heads"]) <= 16:
            ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict[str, Any]) -> str:
    g, md, mem = result["geometry"], result["mean_direction"], result["memory_horizon"]
    h = result["state_horizon"]
    src = result.get("source", {})
    lines = [
        "# State analyses",
        "",
        f"Checkpoint `{src.get('checkpoint', '?')}` (step {src.get('step', '?')}), data "
        f"`{src.get('data', '?')}` split `{src.get('split', '?')}`: {result['windows']} windows "
        f"of {result['window_tokens']} tokens (states at positions {result['positions']}). "
        f"Held-out loss {_fmt(result['heldout_loss'], 4)} (ppl {_fmt(result['heldout_ppl'], 4)}).",
        "",
        "## State geometry (p_t, streamed covariance)",
        "",
        "| figure | value | meaning |",
        "|---|---|---|",
        f"| states | {g['n_states']:,} x {g['d']} | positions folded into the d x d sums |",
        f"| per-dim std min / median / max | {_fmt(g['std_min'])} / {_fmt(g['std_median'])} / "
        f"{_fmt(g['std_max'])} | spread of each coordinate |",
        f"| dead dims | {g['dead_dims']} | {g['dead_rule']} |",
        f"| mean abs off-diagonal corr | {_fmt(g['mean_abs_offdiag_corr'])} | "
        "how redundant coordinates are |",
        f"| PCs for 90% / 99% variance | {g['pcs_90']} / {g['pcs_99']} | "
        "dimensions actually used |",
        f"| stable rank | {_fmt(g['stable_rank'])} | sum(lambda)/max(lambda) of the "
        "centered states |",
        f"| participation ratio | {_fmt(g['participation_ratio'])} | "
        "(sum lambda)^2 / sum lambda^2 |",
        f"| mean / std of abs(p) | {_fmt(g['mean_norm'])} / {_fmt(g['std_norm'])} | state norm |",
        "",
        "## Mean direction s_bar = E[p_t]",
        "",
        f"- norm {_fmt(md['norm'])} = {_fmt(100 * md['norm_rel_mean_state_norm'])}% of the "
        "mean state norm",
        f"- cosine between per-batch means: mean {_fmt(md['cos_between_batch_means'])}, min "
        f"{_fmt(md['cos_between_batch_means_min'])} over {md['batches']} batches",
        f"- running mean within a sequence reaches cos {md['running_mean_level']} with s_bar "
        f"after {_fmt(md['running_mean_tokens_to_level'])} tokens"
        + (
            f" (cos at token 10: {_fmt(md['running_mean_cos'][9])})"
            if len(md["running_mean_cos"]) >= 10
            else ""
        ),
        "- decoded top-10 tokens: "
        + ", ".join(
            f"`{t!r}` ({p:.3g})"
            for t, p in zip(md.get("top_tokens", md["top_ids"]), md["top_probs"])
        ),
    ]
    if "spearman_unigram" in md:
        lines.append(
            f"- Spearman correlation of its decoded distribution with the training unigram "
            f"({md.get('unigram_source', '?')}, {md['unigram_tokens']:,} tokens): "
            f"{_fmt(md['spearman_unigram'])} over the vocabulary, "
            f"{_fmt(md['spearman_unigram_seen'])} over tokens seen"
        )
    else:
        lines.append(f"- unigram correlation: {md.get('unigram_source', 'not computed')}")
    raw, cen = h["raw"], h.get("centered")

    def at(curve: list | None, k: int) -> str:
        return _fmt(curve[k - 1]) if curve is not None and len(curve) >= k else "n/a"

    ks = [k for k in (1, 2, 4, 16, 64, 256) if k <= len(h["lags"])]
    lines += [
        "",
        "## State horizon E[cos(p_t, p_{t+k})]",
        "",
        "| k | " + " | ".join(str(k) for k in ks) + " |",
        "|---|" + "---|" * len(ks),
        "| raw | " + " | ".join(at(raw, k) for k in ks) + " |",
        "| sequence mean removed | " + " | ".join(at(cen, k) for k in ks) + " |",
        "",
        "## Memory horizon per head",
        "",
    ]
    if "skipped" in mem:
        lines.append(f"Skipped: {mem['skipped']}.")
    else:
        lines += [
            f"Retention prod alpha over held-out steps, lags 1..{mem['max_lag']}. Rule: "
            f"{mem['rule']}. Fast heads: {mem['fast_heads']}; slow heads: {mem['slow_heads']}.",
            "",
            "| head | group | 1/e lag | half-life (mean decay) | half-life (A_log, dt_bias) |",
            "|---|---|---|---|---|",
        ]
        for hd in mem["heads"]:
            lag = hd["lag_1e"]
            lines.append(
                f"| {hd['head']} | {hd['group']} | "
                f"{_fmt(lag) if lag is not None else '> ' + str(mem['max_lag'])} | "
                f"{_fmt(hd['half_life_mean_decay'])} | {_fmt(hd['half_life_param'])} |"
            )
    peak = result.get("peak_memory", {})
    lines += [
        "",
        "## Resources",
        "",
        f"- accumulators: {result['accumulator_bytes'] / 2**20:.2f} MiB (bounded: independent "
        "of the number of windows)",
        f"- peak process RSS {_fmt(peak.get('rss_mib'))} MiB"
        + (
            f", peak CUDA allocated {_fmt(peak.get('cuda_mib'))} MiB"
            if peak.get("cuda_mib") is not None
            else ""
        )
        + f"; {_fmt(result.get('seconds'))} s",
        "",
        "Plots: " + ", ".join(f"[{p}]({p})" for p in PLOTS),
        "",
    ]
    return "\n".join(lines)


def write_report(result: dict[str, Any], out: Path) -> list[Path]:
    """The three outputs into `out` (created); returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "analysis.json", out / "report.md"] + [out / p for p in PLOTS]
    paths[0].write_text(json.dumps(_clean(result), indent=1) + "\n")
    paths[1].write_text(markdown(result))
    plot_spectrum(result, paths[2])
    plot_state_horizon(result, paths[3])
    plot_retention(result, paths[4])
    return paths
