"""PNG plots of a benchmark's test split (matplotlib, no display needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import FixedLocator, NullLocator

from ead_llm.evaluation.bench.report import pair_name, pareto_frontier

STYLE: dict[str, dict[str, Any]] = {
    "small_only": {"marker": "o", "color": "tab:gray", "label": "SmallOnly"},
    "large_only": {"marker": "o", "color": "black", "label": "LargeOnly"},
    "random_switching": {"marker": "x", "color": "tab:red", "label": "random switching (matched fraction)"},
    "fixed_block": {"marker": "s", "color": "tab:orange", "label": "fixed-block switching"},
    "oracle": {"marker": "D", "color": "tab:green", "label": "oracle (top-1 disagreements)"},
    "query_router": {"marker": "*", "color": "gold", "label": "query router (first tokens' entropy)"},
    "speculative": {"marker": "^", "color": "tab:purple", "label": "speculative decoding"},
    "easd": {"marker": "v", "color": "tab:pink", "label": "EASD"},
    "eager": {"marker": "P", "color": "tab:brown", "label": "EAGER"},
}


def _errors(runs: list[dict[str, Any]]) -> list[list[float]]:
    return [[r["accuracy"] - r["ci_low"] for r in runs], [r["ci_high"] - r["accuracy"] for r in runs]]


EAD_COLORS = ("tab:blue", "tab:cyan", "navy", "tab:olive")


def _series(run: dict[str, Any]) -> str:
    """Which line a run belongs to: its policy, and for EAD its variant (the label without tau)."""
    return run["label"].rsplit(" tau=", 1)[0] if run["policy"] == "ead" else run["policy"]


def _style(series: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    if series in STYLE:
        return STYLE[series]
    variants = sorted({_series(r) for r in runs if r["policy"] == "ead"})
    color = EAD_COLORS[variants.index(series) % len(EAD_COLORS)]
    return {"marker": "o", "color": color, "label": f"{series} (threshold sweep)"}


def dodge(points: list[tuple[float, float]], size: float = 0.015, height: float = 0.03) -> list[float]:
    """x positions for ``points`` such that no marker sits on another: each point, in turn, takes the nearest of
    x, x + step, x - step, x + 2 step, ... (step: ``size`` of the x span) that no point placed before it is within
    a step of in x while within ``height`` of the y span in y. Nudges alternate sides, so a cluster stays centred
    on its true place."""
    if not points:
        return []
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    step = size * ((max(xs) - min(xs)) or 1.0)
    rise = height * ((max(ys) - min(ys)) or 1.0)
    placed: list[tuple[float, float]] = []
    for x, y in points:
        offsets = (k * sign for k in range(len(points) + 1) for sign in ((1,) if k == 0 else (1, -1)))
        spots = (x + k * step for k in offsets)
        spot = next(c for c in spots if all(abs(px - c) >= step or abs(py - y) > rise for px, py in placed))
        placed.append((spot, y))
    return [x for x, _ in placed]


def _to_symlog(x: float, linthresh: float) -> float:
    """Where ``x`` sits on a symlog axis (linear below ``linthresh``, one decade per unit above)."""
    return x / linthresh if abs(x) <= linthresh else math.copysign(1 + math.log10(abs(x) / linthresh), x)


def _from_symlog(t: float, linthresh: float) -> float:
    return t * linthresh if abs(t) <= 1 else math.copysign(linthresh * 10 ** (abs(t) - 1), t)


def decade_ticks(xs: list[float]) -> list[float]:
    """Ticks of a symlog axis over ``xs``: 0 where a point is 0, then every decade from the smallest positive
    point's up (no tick between 0 and the first decade, where their labels would collide)."""
    positive = [x for x in xs if x > 0]
    low, high = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    return [0.0] * any(x <= 0 for x in xs) + [10.0**e for e in range(low, high + 1)]


def crowded(xs: list[float]) -> bool:
    """Whether most points (60%) sit in the left fifth of the x range while the range spans a decade or
    more: a log axis then spreads them."""
    positive = [x for x in xs if x > 0]
    if len(positive) < 3 or max(positive) <= 0:
        return False
    low, high = min(xs), max(xs)
    left = sum(1 for x in xs if x <= low + 0.2 * (high - low))
    return left >= 0.6 * len(xs) and max(positive) / min(positive) >= 10


def _draw(ax: Axes, runs: list[dict[str, Any]], x_key: str) -> None:
    shown = [r for r in runs if r.get(x_key) is not None]
    values = [r[x_key] for r in shown]
    if crowded(values):
        ticks = decade_ticks(values)
        linthresh = next(t for t in ticks if t > 0) / 10  # 0 and the first decade a decade apart
        ax.set_xscale("symlog", linthresh=linthresh)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        moved = dodge([(_to_symlog(r[x_key], linthresh), r["accuracy"]) for r in shown])  # apart as drawn
        shifted = [_from_symlog(t, linthresh) for t in moved]
    else:
        shifted = dodge([(r[x_key], r["accuracy"]) for r in shown])
    x_of = {id(r): x for r, x in zip(shown, shifted, strict=True)}
    for series in dict.fromkeys(_series(r) for r in shown):
        style = _style(series, shown)
        group = [r for r in shown if _series(r) == series]
        line = len(group) > 1 and group[0]["policy"] == "ead"
        if line:  # a sweep is drawn in threshold order (times are noisy: sorting by x would zig-zag)
            group.sort(key=lambda r: r["params"]["threshold"])
        ax.errorbar(
            [x_of[id(r)] for r in group],
            [r["accuracy"] for r in group],
            yerr=_errors(group),
            fmt=style["marker"] + ("-" if line else ""),
            color=style["color"],
            label=style["label"],
            capsize=3,
            markersize=6,
            markerfacecolor="none",  # hollow: a marker drawn over another leaves it visible
            linewidth=1,
        )
        for run in group:
            if run["chosen"]:
                ax.plot(x_of[id(run)], run["accuracy"], "*", color=style["color"], markersize=16)
    by_label = {r["label"]: r for r in shown}
    for run in shown:  # a thin line from each control to the EAD point it is matched to
        matched = by_label.get(run["matched_to"]) if run.get("matched_to") else None
        if matched is not None:
            xs, ys = [x_of[id(run)], x_of.get(id(matched), matched[x_key])], [run["accuracy"], matched["accuracy"]]
            ax.plot(xs, ys, ":", color=STYLE[run["policy"]]["color"], linewidth=0.8, alpha=0.6)
    frontier = pareto_frontier([(r[x_key], r["accuracy"]) for r in shown])
    if frontier:
        xs = [p[0] for p in frontier]
        ys = [p[1] for p in frontier]
        ax.step(xs, ys, where="post", linestyle="--", color="lightgray", zorder=0, label="Pareto frontier")
    ax.set_ylabel("test accuracy (95% Wilson interval)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)


def _large_reference(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in runs if r["policy"] == "large_only"), None)


def plot_all(data: dict[str, Any], out: Path) -> dict[str, Path]:
    """Accuracy against large-token fraction, wall-clock cost and FLOPs (test split); the paths written."""
    runs = [r for r in data["runs"] if r["split"] == "test"]
    title = f"{data['task']}: {pair_name(data['pair'])}"
    large = _large_reference(runs)
    files: dict[str, Path] = {}

    fig, ax = plt.subplots(figsize=(11, 5.5))
    _draw(ax, runs, "large_fraction")
    if large is not None:
        ax.axhline(0.97 * large["accuracy"], color="black", linestyle=":", linewidth=1, label="97% of LargeOnly")
    ax.axvline(data["config"]["budget"], color="tab:blue", linestyle=":", linewidth=1, label="dev budget")
    ax.set_xlabel("fraction of tokens from the large model")
    ax.set_title(f"{title}\naccuracy against large-model tokens (* = chosen on dev)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    files["plot_large_fraction"] = out / "accuracy_vs_large_fraction.png"
    fig.tight_layout()
    fig.savefig(files["plot_large_fraction"], dpi=110)
    plt.close(fig)

    for key, name, xlabel in (
        ("wall_cost_vs_large", "accuracy_vs_wall_clock.png", "wall-clock time relative to LargeOnly"),
        ("flops_vs_large", "accuracy_vs_flops.png", "forward FLOPs relative to LargeOnly"),
    ):
        fig, ax = plt.subplots(figsize=(11, 5.5))
        _draw(ax, runs, key)
        if key == "wall_cost_vs_large":
            ead = [r for r in runs if r["policy"] == "ead" and r[key] is not None]
            for run in ead:  # where the parameter ratio says EAD should be
                ax.plot([run["parameter_ratio"], run[key]], [run["accuracy"]] * 2, color="tab:gray", alpha=0.3)
            ax.plot(
                [r["parameter_ratio"] for r in ead],
                [r["accuracy"] for r in ead],
                "o",
                markerfacecolor="none",
                color="tab:gray",
                label="EAD points at their parameter ratio",
            )
        ax.set_xlabel(xlabel)
        ax.set_title(f"{title}\n{xlabel.split(' relative')[0]}: accuracy against cost (* = chosen on dev)")
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        files[f"plot_{key.split('_')[0]}"] = out / name
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
    return files
