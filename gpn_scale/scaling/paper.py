"""The GPN paper's published 130M results, and the sweep's own figures at the same size.

The paper's numbers are those of the model spec's table "Published results (the anchors)"
(gpn-model.md): FineWeb-Edu held-out perplexity (the last, unused bin of shuffled
FineWeb-Edu-10B, every position of 2048-token windows) and LAMBADA (EleutherAI split,
accuracy of the first subword of the last word; perplexity over the last word's subwords),
after 10k steps of 128 x 2048 tokens with the LLaMA-2 tokenizer. Each family's row names the
shipped config of the paper's shape, whose parameters are counted here (not copied), so the
sweep's runs "at the same size" are those within SIZE_TOLERANCE of that count.

The sweep's figures per family: the (N, D) cell nearest the paper's N (within tolerance;
then the D nearest the paper's), its seeds' held-out loss as perplexity exp(mean loss) and,
where the final checkpoints were scored with `gpn-scale eval --task lambada`, their LAMBADA
accuracy and perplexity; each with a t-interval over the seeds (the mean's, at the report's
level; a perplexity's is exp of the interval of the mean log). The sweep's perplexity is on
its own held-out data: it is the paper's measure only when the runs used the paper's data,
tokenizer and windows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SOURCE = (
    "the GPN paper's published results at 130M (model spec gpn-model.md, table "
    '"Published results (the anchors)")'
)
PAPER_TOKENS = 10_000 * 128 * 2048  # 10k steps x batch 128 x 2048-token windows
PAPER_SEQ_LEN = 2048
SIZE_TOLERANCE = 0.15  # |N_sweep / N_paper - 1| for "the same size"


@dataclass(frozen=True)
class PaperRow:
    family: str  # the family label (gpn_scale/scaling/families.py)
    config: str  # the shipped config of the paper's shape (configs/model/<config>.yaml)
    fineweb_ppl: float
    lambada_acc: float
    lambada_ppl: float


PAPER_130M: tuple[PaperRow, ...] = (
    PaperRow("transformer_pp", "transformer_pp_130m", 16.05, 0.223, 18.99),
    PaperRow("gated_deltanet", "gated_deltanet_130m_paper", 15.34, 0.208, 17.23),
    PaperRow("gpn+m", "gpn_m_130m", 18.06, 0.146, 33.45),
    PaperRow("gpn+m-2l", "gpn_m_130m_2l", 16.95, 0.160, 27.39),
    PaperRow("gpn", "gpn_130m", 23.51, 0.015, 263.6),
)


@functools.cache
def paper_params(config: str) -> int:
    """Parameters of the paper's shape, counted by its family (LLaMA-2 vocabulary)."""
    from gpn_scale.scaling.families import model_facts

    return model_facts(config, PAPER_SEQ_LEN).params


def mean_interval(
    values: Sequence[float], level: float, log: bool = False
) -> tuple[float, float | None, float | None]:
    """(mean, low, high) of the seeds' values: a t-interval of the mean at `level` (None with
    fewer than 2 values); `log`: of the mean log, returned exponentiated (a perplexity)."""
    from scipy import stats

    xs = [math.log(v) for v in values] if log else list(values)
    n = len(xs)
    mean = sum(xs) / n
    low = high = None
    if n >= 2:
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
        half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
        low, high = mean - half, mean + half
    if log:
        return (
            math.exp(mean),
            None if low is None else math.exp(low),
            None if high is None else math.exp(high),
        )
    return mean, low, high


def compare_with_paper(records: Sequence[Any], level: float = 0.95) -> list[dict[str, Any]]:
    """One entry per paper row: the paper's figures and the sweep's at the same size (None
    where the sweep has no run within SIZE_TOLERANCE). `records`: the collector's usable
    RunRecords (family, N, D, loss, seed, lambada_acc, lambada_ppl)."""
    out = []
    for row in PAPER_130M:
        n_paper = paper_params(row.config)
        entry: dict[str, Any] = {
            "family": row.family,
            "paper": {
                "config": row.config,
                "N": n_paper,
                "D": PAPER_TOKENS,
                "fineweb_ppl": row.fineweb_ppl,
                "lambada_acc": row.lambada_acc,
                "lambada_ppl": row.lambada_ppl,
            },
            "sweep": None,
        }
        near = [
            r
            for r in records
            if r.family == row.family
            and r.N
            and r.loss is not None
            and abs(r.N / n_paper - 1) <= SIZE_TOLERANCE
        ]
        if near:
            # the nearest N (log distance), then the D nearest the paper's
            best_n = min({r.N for r in near}, key=lambda n: abs(math.log(n / n_paper)))
            at_n = [r for r in near if r.N == best_n]
            best_d = min({r.D for r in at_n if r.D}, key=lambda d: abs(math.log(d / PAPER_TOKENS)))
            cell = [r for r in at_n if r.D == best_d]
            loss, low, high = mean_interval([float(r.loss) for r in cell], level)
            sweep: dict[str, Any] = {
                "N": best_n,
                "N_vs_paper": best_n / n_paper - 1,
                "D": best_d,
                "seeds": len(cell),
                "runs": [r.name for r in cell],
                "heldout_ppl": math.exp(loss),
                "heldout_ppl_ci": None
                if low is None or high is None
                else [math.exp(low), math.exp(high)],
                "lambada_acc": None,
                "lambada_acc_ci": None,
                "lambada_ppl": None,
                "lambada_ppl_ci": None,
                "lambada_seeds": 0,
            }
            accs = [r.lambada_acc for r in cell if r.lambada_acc is not None]
            ppls = [r.lambada_ppl for r in cell if r.lambada_ppl is not None]
            if accs:
                m, lo, hi = mean_interval(accs, level)
                sweep["lambada_acc"] = m
                sweep["lambada_acc_ci"] = None if lo is None else [lo, hi]
                sweep["lambada_seeds"] = len(accs)
            if ppls:
                m, lo, hi = mean_interval(ppls, level, log=True)
                sweep["lambada_ppl"] = m
                sweep["lambada_ppl_ci"] = None if lo is None else [lo, hi]
            entry["sweep"] = sweep
        out.append(entry)
    return out


def _fmt(value: float | None, ci: Sequence[float] | None, spec: str) -> str:
    if value is None:
        return "—"
    text = format(value, spec)
    return text if ci is None else f"{text} [{format(ci[0], spec)}, {format(ci[1], spec)}]"


def paper_lines(entries: Sequence[dict[str, Any]], level: float) -> list[str]:
    """The report's section: the paper's 130M figures beside the sweep's."""
    lines = [
        "## The paper at 130M",
        "",
        f"Published figures: {SOURCE}; FineWeb-Edu held-out perplexity and LAMBADA (accuracy "
        f"of the last word's first subword; perplexity over its subwords) after "
        f"{PAPER_TOKENS / 1e9:.2f}B tokens. Beside them, each family's sweep cell nearest "
        f"the paper's N (within ±{SIZE_TOLERANCE:.0%}): held-out perplexity exp(mean loss) "
        "and, where the final checkpoints were scored with `gpn-scale eval --task lambada`, "
        f"LAMBADA; brackets: {level:.0%} t-intervals over the seeds. The sweep's perplexity "
        "is on its own held-out data: the paper's measure only with the paper's data "
        "(FineWeb-Edu 10B), tokenizer (LLaMA-2) and windows (2048).",
        "",
        "| family | paper config (N) | paper PPL | paper LAMBADA acc | paper LAMBADA PPL | "
        "sweep N (vs paper), D, seeds | sweep held-out PPL | sweep LAMBADA acc | "
        "sweep LAMBADA PPL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        p, s = e["paper"], e["sweep"]
        left = (
            f"| {e['family']} | {p['config']} ({p['N'] / 1e6:.1f}M) | {p['fineweb_ppl']:.2f} | "
            f"{p['lambada_acc']:.3f} | {p['lambada_ppl']:.2f} | "
        )
        if s is None:
            lines.append(left + f"no run within ±{SIZE_TOLERANCE:.0%} of N | — | — | — |")
            continue
        lines.append(
            left
            + f"{s['N'] / 1e6:.1f}M ({s['N_vs_paper']:+.1%}), {s['D']:.3g}, {s['seeds']} | "
            + f"{_fmt(s['heldout_ppl'], s['heldout_ppl_ci'], '.2f')} | "
            + f"{_fmt(s['lambada_acc'], s['lambada_acc_ci'], '.3f')} | "
            + f"{_fmt(s['lambada_ppl'], s['lambada_ppl_ci'], '.2f')} |"
        )
    lines.append("")
    return lines
