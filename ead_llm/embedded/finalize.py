"""Evaluate the trained embedded pair, pick EAD's threshold on dev, and write pair.json and model cards.

    python -m ead_llm.embedded.finalize [--dev 200] [--test 500]

Two EAD variants are swept on the dev split: as published (window 5, dwell 10) and with lookahead (window 1,
dwell 1). For each, the threshold is the cheapest run within ``--tolerance`` of the best dev accuracy among
those with the large model on at most ``--max-large-fraction`` of tokens; ``recommended_threshold`` is the
published variant's, ``recommended_policy`` the better of the two (what ``EntropyAdaptiveLLM()`` and
``ead-llm demo`` run). Every figure in the cards is measured on the test split, which the choice never sees.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, ModelInfo, load_pair
from ead_llm.core.types import Role
from ead_llm.embedded import EMBEDDED_DIR
from ead_llm.evaluation.bench.harness import LOOKAHEAD_EAD, PAPER_EAD
from ead_llm.evaluation.evaluate import PolicyRun, run_policy
from ead_llm.evaluation.task import Difficulty, problems
from ead_llm.policies.base import LargeOnly, SmallOnly
from ead_llm.policies.switching import EAD

SWEEP = (0.025, 0.05, 0.1, 0.2, 0.4, 0.8)
VARIANTS = {"published": PAPER_EAD, "lookahead": LOOKAHEAD_EAD}
"""The bench's two EAD variants: as published (window 5, dwell 10) and with lookahead (window 1, dwell 1)."""


def choose(runs: dict[float, PolicyRun], max_large_fraction: float, tolerance: float) -> float:
    """The cheapest threshold (least large fraction) within ``tolerance`` of the best accuracy among the runs
    within the large-fraction budget (all runs when none is)."""
    eligible = {t: r for t, r in runs.items() if r.large_fraction <= max_large_fraction} or runs
    best = max(r.accuracy for r in eligible.values())
    return min(
        (t for t, r in eligible.items() if r.accuracy >= best - tolerance), key=lambda t: eligible[t].large_fraction
    )


def summary(run: PolicyRun) -> dict[str, Any]:
    return {
        **run.policy,
        "accuracy": run.accuracy,
        "large_fraction": run.large_fraction,
        "parameter_ratio": run.cost.parameter_ratio,
        "switches": run.cost.switches,
        "tokens_per_s": run.tokens_per_s,
        "wall_time_s": run.cost.wall_time_s,
    }


def card(name: str, record: dict[str, Any], info: ModelInfo, vocab: int, test: dict[str, Any], n_test: int) -> str:
    shape = record["shape"]
    return f"""# ead-llm embedded {name} model

Part of the default pair that ships inside `ead-llm` (`EntropyAdaptiveLLM()` with no model
arguments). A Llama-architecture causal LM trained from scratch on the package's chain-arithmetic
task (`ead_llm.evaluation.task`): chains of {record["difficulty"]["min_steps"]}-{record["difficulty"]["max_steps"]}
additions and subtractions of {record["difficulty"]["min_digits"]}-{record["difficulty"]["max_digits"]}-digit
numbers, solved column by column with carries and borrows written out, ending in `#### N`.

| | |
| --- | --- |
| parameters | {info.params:,} ({info.non_embedding_params:,} non-embedding) |
| shape | hidden {shape["hidden"]}, {shape["layers"]} layers, {shape["heads"]} heads, MLP {shape["mlp"]} |
| tokenizer | character level, {vocab} tokens, shared by the pair |
| training data | train split of `ead_llm.evaluation.task`, generated on the fly (seed {record["seed"]}); loss on the solution only |
| training | {record["steps"]} steps of batch {record["batch"]}, AdamW, peak lr {record["peak_lr"]}, cosine; {record["train_seconds"] / 60:.1f} min on {record["threads"]} CPU threads ({record["machine"]}, torch {record["torch"]}) |
| reproduce | `python -m ead_llm.embedded.train --size {name} --steps {record["steps"]} --batch {record["batch"]} --threads {record["threads"]} --out DIR` |
| accuracy | {test["accuracy"]:.1%} exact match, greedy, on {n_test} test problems (`python -m ead_llm.embedded.finalize`) |
""" + "".join(
        f"| {label} | {record[key]} |\n"
        for key, label in (("selection", "training length"), ("note", "note"))
        if key in record
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", type=Path, default=EMBEDDED_DIR)
    parser.add_argument("--dev", type=int, default=200)
    parser.add_argument("--test", type=int, default=500)
    parser.add_argument("--max-large-fraction", type=float, default=0.35)
    parser.add_argument("--tolerance", type=float, default=0.01, help="dev accuracy given up for a cheaper run")
    args = parser.parse_args()
    small_dir, large_dir = args.folder / "small", args.folder / "large"
    engine = Engine(load_pair(LoadConfig(small=str(small_dir), large=str(large_dir), device="cpu")))
    difficulty = Difficulty(**json.loads((large_dir / "training.json").read_text())["difficulty"])
    dev = problems("dev", args.dev, difficulty=difficulty)
    test = problems("test", args.test, difficulty=difficulty)

    dev_runs = {
        (name, tau): run_policy(engine, dev, variant.policy(tau)) for name, variant in VARIANTS.items() for tau in SWEEP
    }
    for (name, tau), run in dev_runs.items():
        print(f"dev  EAD {name:<9} {tau:<6} acc {run.accuracy:.3f}  f_L {run.large_fraction:.3f}", flush=True)
    chosen = {
        name: choose({t: dev_runs[name, t] for t in SWEEP}, args.max_large_fraction, args.tolerance)
        for name in VARIANTS
    }
    best = chosen["published"]
    winner = max(VARIANTS, key=lambda n: (dev_runs[n, chosen[n]].accuracy, -dev_runs[n, chosen[n]].large_fraction))
    variant = VARIANTS[winner]
    recommended: dict[str, Any] = {
        "threshold": chosen[winner],
        "window": variant.window,
        "min_dwell": variant.min_dwell,
        "lookahead": variant.lookahead,
    }
    print(f"chosen on dev: {chosen}; recommended {recommended}", flush=True)

    test_runs: dict[str, PolicyRun] = {
        "small_only": run_policy(engine, test, SmallOnly()),
        "large_only": run_policy(engine, test, LargeOnly()),
    }
    for tau in sorted({0.05, 0.1, 0.2, best}):
        test_runs[f"ead_{tau}"] = run_policy(engine, test, EAD(threshold=tau))
    test_runs["recommended"] = run_policy(engine, test, EAD(**recommended))
    for name, run in test_runs.items():
        print(
            f"test {name:<12} acc {run.accuracy:.3f}  f_L {run.large_fraction:.3f}  "
            f"ratio {run.cost.parameter_ratio:.3f}  {run.tokens_per_s:.0f} tok/s",
            flush=True,
        )

    result = {
        "recommended_threshold": best,
        "recommended_policy": recommended,
        "chosen_on": (
            f"dev split, {args.dev} problems, max large fraction {args.max_large_fraction}, "
            f"the cheapest within {args.tolerance} of the best accuracy"
        ),
        "dev": [summary(r) for r in dev_runs.values()],
        "test_problems": args.test,
        "test": {name: summary(run) for name, run in test_runs.items()},
    }
    (args.folder / "pair.json").write_text(json.dumps(result, indent=2) + "\n")
    for role, folder, key in ((Role.SMALL, small_dir, "small_only"), (Role.LARGE, large_dir, "large_only")):
        record = json.loads((folder / "training.json").read_text())
        info = engine.pair.model(role).info
        text = card(role.value, record, info, engine.pair.vocab_size, result["test"][key], args.test)
        (folder / "README.md").write_text(text)
    print(json.dumps(result["test"], indent=2))


if __name__ == "__main__":
    main()
