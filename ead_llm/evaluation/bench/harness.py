"""The benchmark: every policy and control on one task, with the numbers that make them comparable.

On the dev split it sweeps EAD's threshold for each EAD variant (window, min_dwell, lookahead)
and EAGER's theta, and chooses, before the test split is touched, the EAD setting with the best
dev accuracy under the user's cost budget (and EAGER's best theta). On the test split it runs
SmallOnly, LargeOnly, every EAD variant over the thresholds (the chosen point marked),
SpeculativeDecoding, EASD, EAGER, and the controls: random switching at each EAD point's realised
large-token fraction (in blocks of that point's ``min_dwell``), fixed-block switching at the
chosen point's fraction, the oracle, and the query router at each threshold (a whole call on one model,
chosen by the entropy of its first tokens). Every run is greedy (EAGER samples, seeded). All test
runs use the same batching (``batch_size``), so their wall-clock times compare; dev runs only
feed the choice (accuracy and large fraction do not depend on batching), so they run batched.
"""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch

from ead_llm.accounting.ledger import Cost
from ead_llm.adapters.prompts import render
from ead_llm.core.engine import Engine
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.validation import check_float, check_int, check_stop
from ead_llm.evaluation.bench.tasks import BenchTask, Example
from ead_llm.evaluation.evaluate import PolicyRun, run_policy
from ead_llm.evaluation.stats import mcnemar_exact, wilson_interval
from ead_llm.policies.base import LargeOnly, Policy, SmallOnly
from ead_llm.policies.controls import FixedBlockSwitching, OracleSwitching, QueryRouter, RandomSwitching
from ead_llm.policies.eager import EAGER
from ead_llm.policies.speculative import EASD, SpeculativeDecoding
from ead_llm.policies.switching import EAD

Kind = Literal["baseline", "ead", "control", "speculative", "eager"]
BudgetMetric = Literal["large_fraction", "parameter_ratio"]
Progress = Callable[[str, int], None]
"""``progress(label of the current run, problems just finished)``."""


@dataclass(frozen=True)
class EADVariant:
    """EAD's settings other than the threshold."""

    window: int = 5
    min_dwell: int = 10
    lookahead: bool = False
    start_on: str = "small"
    """The model that writes the first ``min_dwell`` tokens ("small" or "large")."""

    def __post_init__(self) -> None:
        self.policy(0.0)  # validates

    def policy(self, threshold: float) -> EAD:
        return EAD(
            threshold=threshold,
            window=self.window,
            min_dwell=self.min_dwell,
            lookahead=self.lookahead,
            start_on=self.start_on,  # type: ignore[arg-type]
        )

    @property
    def name(self) -> str:
        start = " start large" if self.start_on == "large" else ""
        return f"EAD{'+lookahead' if self.lookahead else ''} w{self.window}/d{self.min_dwell}{start}"

    def label(self, threshold: float) -> str:
        return f"{self.name} tau={threshold:g}"

    @staticmethod
    def parse(text: str) -> EADVariant:
        """``"5:10"``, ``"1:1:lookahead"``, ``"5:10:large"`` (window, min_dwell, then optionally
        ``lookahead`` and ``large``: start on the large model)."""
        parts = text.split(":")
        flags = parts[2:]
        if len(parts) < 2 or any(f not in ("lookahead", "large") for f in flags) or len(set(flags)) != len(flags):
            raise ValueError(
                "an EAD variant is WINDOW:MIN_DWELL[:lookahead][:large], like 5:10, 1:1:lookahead or "
                f"5:10:large; got {text!r}"
            )
        try:
            window, dwell = int(parts[0]), int(parts[1])
        except ValueError:
            raise ValueError(f"an EAD variant's window and min_dwell are integers, got {text!r}") from None
        start_on = "large" if "large" in flags else "small"
        return EADVariant(window, dwell, lookahead="lookahead" in flags, start_on=start_on)


PAPER_EAD = EADVariant(5, 10)
LOOKAHEAD_EAD = EADVariant(1, 1, lookahead=True)


@dataclass(frozen=True)
class BenchConfig:
    """What the benchmark runs."""

    thresholds: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4)
    """EAD thresholds (bits) swept on both splits, for every variant."""
    variants: tuple[EADVariant, ...] = (PAPER_EAD, LOOKAHEAD_EAD)
    """EAD variants: the paper's window 5 / dwell 10, and (ours) lookahead with window 1 / dwell 1."""
    budget: float = 0.25
    """The chosen threshold's dev ``budget_metric`` must not exceed this."""
    budget_metric: BudgetMetric = "large_fraction"
    gamma: int = 4
    """Speculative decoding and EASD drafts per round."""
    easd_threshold: float = 2.0
    """EASD entropy threshold (bits)."""
    eager_thetas: tuple[float, ...] = (0.4, 0.8)
    """EAGER thetas (nats) tried on dev; the best is run on test. Empty: no EAGER."""
    eager_paths: int = 8
    """EAGER's max_paths."""
    max_tokens: int = 400
    batch_size: int = 1
    """Requests per engine call on the test split, the same for every run (1: one at a time, latency)."""
    dev_batch_size: int = 32
    """Requests per engine call on the dev split (only accuracy and large fraction are used there)."""
    seed: int = 0
    """Seed of EAGER's sampling and of the random control's patterns."""
    prompt_format: Literal["text", "chat"] = "text"
    """``chat`` renders each prompt as a user turn with the pair's chat template."""
    repeats: int = 1
    """Times each test run is repeated for its wall clock (the median counts; outcomes are the first
    repeat's, greedy runs give the same text every time). ``--quick`` uses 3."""
    spread_warning: float = 0.2
    """Warn when a test run's repeats differ by more than this fraction of their median."""
    stop: tuple[str, ...] = ()
    """Stop strings of every completion (a "Q:/A:" prompt that never reaches end-of-text stops at "\\nQ:")."""
    speculative: bool = True
    """Run SpeculativeDecoding and EASD."""
    controls: bool = True
    """Run the random, fixed-block and oracle controls, and the query router."""
    router_probe: int = 8
    """The query router's probe (tokens the small model writes before a call is routed by their mean entropy),
    run at each of ``thresholds`` among the controls: the per-call anchor to EAD's per-token switching."""

    def __post_init__(self) -> None:
        if not self.thresholds:
            raise ValueError("thresholds must name at least one EAD threshold")
        for value in self.thresholds:
            check_float("thresholds", value, minimum=0.0)
        for value in self.eager_thetas:
            check_float("eager_thetas", value, minimum=0.0)
        if not self.variants or not all(isinstance(v, EADVariant) for v in self.variants):
            raise ValueError("variants must be one or more EADVariant(window, min_dwell, lookahead)")
        check_float("budget", self.budget, minimum=0.0, maximum=1.0)
        if self.budget_metric not in ("large_fraction", "parameter_ratio"):
            raise ValueError(f"budget_metric must be 'large_fraction' or 'parameter_ratio', got {self.budget_metric!r}")
        check_int("gamma", self.gamma, minimum=1)
        check_float("easd_threshold", self.easd_threshold, minimum=0.0)
        check_int("eager_paths", self.eager_paths, minimum=1)
        check_int("max_tokens", self.max_tokens, minimum=1)
        check_int("batch_size", self.batch_size, minimum=1)
        check_int("dev_batch_size", self.dev_batch_size, minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_int("repeats", self.repeats, minimum=1)
        check_int("router_probe", self.router_probe, minimum=1)
        check_float("spread_warning", self.spread_warning, minimum=0.0)
        if self.prompt_format not in ("text", "chat"):
            raise ValueError(f"prompt_format must be 'text' or 'chat', got {self.prompt_format!r}")
        object.__setattr__(self, "stop", check_stop(self.stop))

    @staticmethod
    def quick(**overrides: Any) -> BenchConfig:
        """A smaller sweep for a first look (``ead-llm bench --quick``)."""
        settings: dict[str, Any] = {"thresholds": (0.1, 0.4), "eager_thetas": (0.8,), "eager_paths": 4, "repeats": 3}
        return BenchConfig(**{**settings, **overrides})

    def settings(self) -> list[tuple[EADVariant, float]]:
        """Every EAD point: each variant at each threshold."""
        return [(variant, t) for variant in self.variants for t in self.thresholds]


@dataclass(frozen=True)
class BenchRun:
    """One policy on one split: its outcomes per problem and its summed cost."""

    label: str
    kind: Kind
    policy: dict[str, Any]
    split: str
    correct: tuple[bool, ...]
    cost: Cost
    chosen: bool = False
    """The dev-chosen EAD threshold (or EAGER theta)."""
    matched_to: str | None = None
    """The EAD run a control is matched to."""
    target_fraction: float | None = None
    """The large-token fraction a control aimed at."""
    outputs: tuple[str, ...] = ()
    """Each problem's output text, in order."""
    wall_times: tuple[float, ...] = ()
    """Wall clock of each repeat (test runs with ``repeats`` > 1); the cost's is their median."""

    @property
    def wall_spread(self) -> float | None:
        """(slowest - fastest) / median of the repeats, or None for a single timing."""
        if len(self.wall_times) < 2:
            return None
        middle = statistics.median(self.wall_times)
        return (max(self.wall_times) - min(self.wall_times)) / middle if middle > 0 else None

    @property
    def n(self) -> int:
        return len(self.correct)

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / self.n

    @property
    def ci(self) -> tuple[float, float]:
        return wilson_interval(sum(self.correct), self.n)

    @property
    def tokens_per_s(self) -> float:
        return self.cost.completion_tokens / self.cost.wall_time_s if self.cost.wall_time_s > 0 else 0.0

    def record(
        self, reference: BenchRun | None = None, paired: BenchRun | None = None, small: BenchRun | None = None
    ) -> dict[str, Any]:
        """A flat summary: the fields of ``results.json``'s ``runs``. ``reference`` is LargeOnly on the
        same split (for the relative costs), ``small`` SmallOnly (for the ideal time of the run's
        token mix); ``paired`` the EAD run a control is tested against."""
        low, high = self.ci
        cost = self.cost.to_dict()
        params = {k: v for k, v in self.policy.items() if k != "policy"}
        out: dict[str, Any] = {
            "label": self.label,
            "policy": self.policy["policy"],
            "kind": self.kind,
            "params": params,
            "split": self.split,
            "n": self.n,
            "correct": sum(self.correct),
            "accuracy": self.accuracy,
            "ci_low": low,
            "ci_high": high,
            "large_fraction": self.cost.large_fraction,
            "parameter_ratio": self.cost.parameter_ratio,
            "flops": self.cost.flops,
            "wall_time_s": self.cost.wall_time_s,
            "tokens_per_s": self.tokens_per_s,
            "completion_tokens": self.cost.completion_tokens,
            "small_processed_tokens": self.cost.small_processed_tokens,
            "large_processed_tokens": self.cost.large_processed_tokens,
            "switches": self.cost.switches,
            "chosen": self.chosen,
            "matched_to": self.matched_to,
            "target_fraction": self.target_fraction,
            "speedup_vs_large": None,
            "wall_cost_vs_large": None,
            "flops_vs_large": None,
            "accuracy_vs_large": None,
            "ideal_wall_cost_vs_large": None,
            "wall_vs_ideal": None,
            "vs_ead": None,
            "counters": {k: v for k, v in cost.items() if k in self.cost.extra or k == "acceptance_rate"},
            "outcomes": "".join("1" if c else "0" for c in self.correct),
            "outputs": list(self.outputs),
            "wall_times_s": list(self.wall_times),
            "wall_spread": self.wall_spread,
        }
        if reference is not None:
            out.update(relative_costs(self, reference))
            if small is not None:
                ideal = ideal_wall_s(self, small, reference)
                out["ideal_wall_cost_vs_large"] = ideal / reference.cost.wall_time_s
                out["wall_vs_ideal"] = self.cost.wall_time_s / ideal if ideal > 0 else None
        if paired is not None:
            ead_only, control_only, p_value = mcnemar_exact(paired.correct, self.correct)
            out["vs_ead"] = {"ead_only": ead_only, "control_only": control_only, "p_value": p_value}
        return out


def relative_costs(run: BenchRun, reference: BenchRun) -> dict[str, float | None]:
    """Speed-up, wall-clock and FLOP cost, and accuracy of ``run`` relative to ``reference`` (LargeOnly)."""
    wall, ref_wall = run.cost.wall_time_s, reference.cost.wall_time_s
    return {
        "speedup_vs_large": ref_wall / wall if wall > 0 else None,
        "wall_cost_vs_large": wall / ref_wall if ref_wall > 0 else None,
        "flops_vs_large": run.cost.flops / reference.cost.flops if reference.cost.flops else None,
        "accuracy_vs_large": run.accuracy / reference.accuracy if reference.accuracy else None,
    }


def ideal_wall_s(run: BenchRun, small: BenchRun, large: BenchRun) -> float:
    """What ``run``'s tokens would take at the per-token times of SmallOnly and LargeOnly on the same
    problems: each model's tokens at its own speed, with no catch-up, verification or switching."""
    per_small = small.cost.wall_time_s / max(1, small.cost.completion_tokens)
    per_large = large.cost.wall_time_s / max(1, large.cost.completion_tokens)
    return run.cost.small_tokens * per_small + run.cost.large_tokens * per_large


def choose_under_budget(points: Sequence[tuple[float, float, float]], budget: float) -> tuple[float, bool]:
    """From ``(setting, accuracy, cost)`` points, the setting with the best accuracy whose cost is
    within ``budget`` (ties: the cheaper, then the first); when none is, the cheapest (and False)."""
    if not points:
        raise ValueError("choose_under_budget needs at least one point")
    eligible = [p for p in points if p[2] <= budget]
    if not eligible:
        return min(points, key=lambda p: p[2])[0], False
    best = max(eligible, key=lambda p: (p[1], -p[2]))
    return best[0], True


def fixed_block_for(fraction: float, large_block: int) -> FixedBlockSwitching:
    """Fixed-block switching with ``large_block`` large tokens per cycle and a large fraction near ``fraction``."""
    if fraction <= 0.0:
        return FixedBlockSwitching(small_block=1, large_block=0)
    if fraction >= 1.0:
        return FixedBlockSwitching(small_block=0, large_block=1)
    small_block = max(1, round(large_block * (1 - fraction) / fraction))
    return FixedBlockSwitching(small_block=small_block, large_block=large_block)


@dataclass
class BenchReport:
    """Everything one benchmark measured."""

    task: str
    extractor: str
    pair: dict[str, Any]
    config: BenchConfig
    machine: dict[str, Any]
    runs: list[BenchRun] = field(default_factory=list)
    selection: dict[str, Any] = field(default_factory=dict)

    def find(self, split: str, kind: str | None = None, policy: str | None = None) -> list[BenchRun]:
        return [
            r
            for r in self.runs
            if r.split == split
            and (kind is None or r.kind == kind)
            and (policy is None or r.policy["policy"] == policy)
        ]

    def _by_label(self, split: str) -> dict[str, BenchRun]:
        return {r.label: r for r in self.runs if r.split == split}

    def records(self) -> list[dict[str, Any]]:
        """One summary per run (dev runs first), relative costs against LargeOnly of the same split."""
        out = []
        for split in ("dev", "test"):
            reference = next(iter(self.find(split, policy="large_only")), None)
            small = next(iter(self.find(split, policy="small_only")), None)
            labels = self._by_label(split)
            for run in self.find(split):
                paired = labels.get(run.matched_to) if run.matched_to else None
                out.append(run.record(reference, paired, small))
        return out

    def goals(self) -> dict[str, Any]:
        """The issue's goals for the dev-chosen EAD point on the test split, each with its numbers
        (taken from the runs' records, so they match the table)."""
        chosen = next((r for r in self.find("test", "ead") if r.chosen), None)
        large = next(iter(self.find("test", policy="large_only")), None)
        if chosen is None or large is None:
            return {}
        small = next(iter(self.find("test", policy="small_only")), None)
        ead = chosen.record(large, small=small)
        retention, wall, ratio = ead["accuracy_vs_large"], ead["wall_cost_vs_large"], ead["parameter_ratio"]
        out: dict[str, Any] = {
            "ead": chosen.label,
            "accuracy_retained": {
                "value": retention,
                "goal": ">= 0.97",
                "met": retention is not None and retention >= 0.97,
            },
            "large_fraction": {
                "value": ead["large_fraction"],
                "goal": "<= 0.25",
                "met": ead["large_fraction"] <= 0.25,
            },
            "wall_clock_vs_parameter_ratio": {
                "value": None if wall is None else wall / ratio,
                "wall_cost_vs_large": wall,
                "parameter_ratio": ratio,
                "ideal_wall_cost_vs_large": ead["ideal_wall_cost_vs_large"],
                "small_only_wall_cost_vs_large": None if small is None else small.record(large)["wall_cost_vs_large"],
                "goal": "<= 1.2",
                "met": wall is not None and wall <= 1.2 * ratio,
            },
        }
        randoms = self.find("test", "control", "random_switching")
        control = next((r for r in randoms if r.matched_to == chosen.label), None)
        if control is not None:
            random = control.record(large, paired=chosen)
            out["beats_random"] = {
                "ead_accuracy": ead["accuracy"],
                "random_accuracy": random["accuracy"],
                "random_ci_high": random["ci_high"],
                "random_large_fraction": random["large_fraction"],
                "mcnemar_p": random["vs_ead"]["p_value"],
                "goal": "EAD accuracy above the random control's 95% interval",
                "met": ead["accuracy"] > random["ci_high"],
            }
        return out

    def timing_warnings(self) -> list[str]:
        """Test runs whose repeated wall clocks disagree by more than the configured spread (a busy machine)."""
        limit = self.config.spread_warning
        return [
            f"{run.label}: repeats took {', '.join(f'{w:.2f}' for w in run.wall_times)} s "
            f"({run.wall_spread:.0%} apart): the machine was busy; its times are not comparable"
            for run in self.runs
            if run.wall_spread is not None and run.wall_spread > limit
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "timing_warnings": self.timing_warnings(),
            "task": self.task,
            "extractor": self.extractor,
            "pair": self.pair,
            "config": asdict(self.config),
            "machine": self.machine,
            "selection": self.selection,
            "goals": self.goals(),
            "runs": self.records(),
        }


def machine_info(engine: Engine) -> dict[str, Any]:
    """Where the numbers were measured, and how busy the machine was when the run began (the 1, 5 and
    15-minute load averages: timings on a loaded machine are not comparable with an idle one's)."""
    import os

    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "load_average": load,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(engine.pair.device),
        "gpu": torch.cuda.get_device_name(engine.pair.device) if engine.pair.device.type == "cuda" else None,
    }


def planned_problems(task: BenchTask, config: BenchConfig) -> int:
    """How many problem completions a benchmark runs (for a progress bar)."""
    points = len(config.settings())
    dev_runs = points + len(config.eager_thetas)
    test_runs = 2 + points + (2 if config.speculative else 0) + (1 if config.eager_thetas else 0)
    if config.controls:
        test_runs += points + 2 + len(config.thresholds)  # random per point, fixed, oracle, router per threshold
    return dev_runs * len(task.dev) + test_runs * len(task.test) * config.repeats


class _Runner:
    """Runs policies on a split with the benchmark's settings and records them."""

    def __init__(
        self,
        engine: Engine,
        task: BenchTask,
        config: BenchConfig,
        progress: Progress | None,
        on_run: Callable[[BenchRun], None] | None = None,
    ) -> None:
        self.engine, self.task, self.config, self.progress, self.on_run = engine, task, config, progress, on_run
        self.splits = {"dev": self._render(task.dev), "test": self._render(task.test)}

    def _render(self, examples: Sequence[Example]) -> list[Example]:
        if self.config.prompt_format == "text":
            return list(examples)
        tokenizer = self.engine.tokenizer
        return [replace(e, prompt=render(tokenizer, [("user", e.prompt)], "chat")) for e in examples]  # type: ignore[arg-type]

    def run(self, label: str, kind: Kind, policy: Policy, split: str, **extra: Any) -> BenchRun:
        def tick(done: int) -> None:
            if self.progress is not None:
                self.progress(label, done)

        repeats = self.config.repeats if split == "test" else 1
        results: list[PolicyRun] = []
        for _ in range(repeats):
            results.append(
                run_policy(
                    self.engine,
                    self.splits[split],
                    policy,
                    chunk=self.config.batch_size if split == "test" else self.config.dev_batch_size,
                    sampling=SamplingParams(
                        max_tokens=self.config.max_tokens, temperature=0.0, seed=self.config.seed, stop=self.config.stop
                    ),
                    scorer=self.task.score,
                    on_chunk=tick,
                )
            )
        result = results[0]
        walls = tuple(r.cost.wall_time_s for r in results)
        cost = replace(result.cost, wall_time_s=statistics.median(walls)) if repeats > 1 else result.cost
        outputs = tuple(c.text for c in result.completions)
        run = BenchRun(
            label,
            kind,
            result.policy,
            split,
            result.correct,
            cost,
            outputs=outputs,
            wall_times=walls if repeats > 1 else (),
            **extra,
        )
        if self.on_run is not None:
            self.on_run(run)
        return run

    def warm_up(self) -> None:
        """One short untimed request per model, so the first timed run pays no start-up cost."""
        prompt = self.splits["dev"][0].prompt
        params = SamplingParams(max_tokens=8, temperature=0.0)
        self.engine.generate([Request(prompt, SmallOnly(), params), Request(prompt, LargeOnly(), params)])


def _eager(config: BenchConfig, theta: float, decoder: EAD, task: BenchTask) -> EAGER:
    return EAGER(theta=theta, max_paths=config.eager_paths, decoder=decoder, extractor=task.extract)


def _dev_choices(runner: _Runner, report: BenchReport) -> tuple[tuple[EADVariant, float], float | None]:
    """Run the dev sweeps; return the chosen EAD setting and EAGER theta (None: no EAGER)."""
    config, task = runner.config, runner.task
    settings = config.settings()
    dev_ead = [runner.run(v.label(t), "ead", v.policy(t), "dev") for v, t in settings]
    metric = config.budget_metric
    points = [(i, r.accuracy, float(getattr(r.cost, metric))) for i, r in enumerate(dev_ead)]
    index, within = choose_under_budget(points, config.budget)
    variant, threshold = settings[int(index)]
    per_variant = {}
    for v in config.variants:
        own = [p for p in points if settings[int(p[0])][0] == v]
        best, fits = choose_under_budget(own, config.budget)
        per_variant[v.name] = {"threshold": settings[int(best)][1], "within_budget": fits}
    report.selection = {
        "metric": metric,
        "budget": config.budget,
        "ead": variant.label(threshold),
        "variant": asdict(variant),
        "threshold": threshold,
        "within_budget": within,
        "per_variant": per_variant,
        "dev": [{"ead": r.label, "accuracy": a, metric: c} for (_, a, c), r in zip(points, dev_ead, strict=True)],
    }
    runs = [replace(r, chosen=True) if i == index else r for i, r in enumerate(dev_ead)]
    theta = None
    if config.eager_thetas:
        decoder = variant.policy(threshold)
        dev_eager = [
            runner.run(f"EAGER theta={th:g}", "eager", _eager(config, th, decoder, task), "dev")
            for th in config.eager_thetas
        ]
        pairs = zip(config.eager_thetas, dev_eager, strict=True)
        scored = [(th, r.accuracy, r.cost.completion_tokens) for th, r in pairs]
        theta = max(scored, key=lambda item: (item[1], -item[2]))[0]
        report.selection["eager_theta"] = theta
        report.selection["eager_dev"] = [{"theta": t, "accuracy": a, "completion_tokens": n} for t, a, n in scored]
        runs += [
            replace(r, chosen=True) if th == theta else r for th, r in zip(config.eager_thetas, dev_eager, strict=True)
        ]
    report.runs.extend(runs)
    return (variant, threshold), theta


def _controls(runner: _Runner, test_ead: list[BenchRun]) -> list[BenchRun]:
    """Random switching matched to each EAD point, fixed blocks matched to the chosen one, the oracle, and the
    query router at each threshold."""
    config = runner.config
    runs = []
    for ead_run in test_ead:
        fraction, block = ead_run.cost.large_fraction, max(1, int(ead_run.policy["min_dwell"]))
        control = RandomSwitching(fraction=fraction, block=block, seed=config.seed)
        label = f"Random f={fraction:.3f} block {block}"
        runs.append(runner.run(label, "control", control, "test", matched_to=ead_run.label, target_fraction=fraction))
    chosen = next(r for r in test_ead if r.chosen)
    fraction = chosen.cost.large_fraction
    fixed = fixed_block_for(fraction, max(1, int(chosen.policy["min_dwell"])))
    label = f"Fixed {fixed.small_block}S/{fixed.large_block}L"
    runs.append(runner.run(label, "control", fixed, "test", matched_to=chosen.label, target_fraction=fraction))
    runs.append(runner.run("Oracle", "control", OracleSwitching(), "test"))
    for threshold in config.thresholds:
        router = QueryRouter(threshold=threshold, probe=config.router_probe)
        runs.append(runner.run(f"Router tau={threshold:g} probe {router.probe}", "control", router, "test"))
    return runs


def run_bench(
    engine: Engine,
    task: BenchTask,
    config: BenchConfig | None = None,
    *,
    progress: Progress | None = None,
    on_run: Callable[[BenchRun], None] | None = None,
) -> BenchReport:
    """Run the benchmark of ``task`` on ``engine``'s pair (see the module docstring); ``on_run`` is told
    of each run as it finishes (the partial results the CLI writes)."""
    config = config or BenchConfig()
    if not isinstance(engine, Engine):
        raise ValueError(f"engine must be an ead_llm Engine, got {engine!r}")
    if not isinstance(task, BenchTask):
        raise ValueError(f"task must be a BenchTask (embedded_task() or load_jsonl_task(...)), got {task!r}")
    if not isinstance(config, BenchConfig):
        raise ValueError(f"config must be a BenchConfig, got {config!r}")
    runner = _Runner(engine, task, config, progress, on_run)
    small, large = engine.pair.small.info, engine.pair.large.info
    report = BenchReport(
        task=task.name,
        extractor=task.extractor,
        pair={"small": small.source, "large": large.source, "small_params": small.params, "large_params": large.params},
        config=config,
        machine=machine_info(engine),
    )
    runner.warm_up()
    (variant, threshold), theta = _dev_choices(runner, report)

    runs = [
        runner.run("SmallOnly", "baseline", SmallOnly(), "test"),
        runner.run("LargeOnly", "baseline", LargeOnly(), "test"),
    ]
    test_ead = [
        runner.run(v.label(t), "ead", v.policy(t), "test", chosen=(v, t) == (variant, threshold))
        for v, t in config.settings()
    ]
    runs += test_ead
    if config.speculative:
        for adaptive in (False, True):
            suffix = " adaptive" if adaptive else ""
            speculative = SpeculativeDecoding(gamma=config.gamma, adaptive_gamma=adaptive)
            easd = EASD(entropy_threshold=config.easd_threshold, gamma=config.gamma, adaptive_gamma=adaptive)
            runs.append(runner.run(f"Speculative gamma={config.gamma}{suffix}", "speculative", speculative, "test"))
            runs.append(runner.run(f"EASD tau={config.easd_threshold:g}{suffix}", "speculative", easd, "test"))
    if theta is not None:
        eager = _eager(config, theta, variant.policy(threshold), task)
        runs.append(runner.run(f"EAGER theta={theta:g}", "eager", eager, "test", chosen=True))
    if config.controls:
        runs += _controls(runner, test_ead)
    report.runs.extend(runs)
    return report
