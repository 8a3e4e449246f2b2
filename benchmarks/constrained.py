"""The cost of grammar-constrained decoding, and where EAD's entropy is taken under a constraint.

(a) Mask cost per step against the unconstrained step, at batch 1 and 16, for two vocabularies:
    SmolLM2-135M-Instruct (49,152 ids, its real tokenizer) and a random model of Qwen2.5-0.5B's shape
    with 151,936 ids (SmolLM2's tokenizer widened by real BPE merges). Each side runs ``LargeOnly``
    sampled (temperature 0.8) for ``--tokens`` steps: unconstrained (``ignore_eos``), then under a
    JSON schema that cannot close within those steps (so the batch keeps its size). The engine's
    decode steps are timed (the prefill step left out); the mask's share is the time inside the
    engine's masking (matcher masks + applying them to the logits) per step, against the
    unconstrained decode step at the same batch.
(b) EAD under a JSON schema on the SmolLM2 pair (the distilled draft when built, else the untrained
    early exit): entropy after the mask (the default) against entropy of the raw logits, on 20
    capital-city questions answered as ``{"country": ..., "capital": ...}``: large-token fraction,
    answers right, outputs valid; with SmallOnly and LargeOnly under the same schema for reference.

    python benchmarks/constrained.py [--tokens 24] [--repeats 3] [--threads 1] [--json out.json] [--skip-b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ead_llm import EAD, LargeOnly, SmallOnly
from ead_llm.core.engine import Engine
from ead_llm.core.grammar import Constraint
from ead_llm.core.loading import LoadConfig, LoadedModel, ModelPair, describe_model, load_pair
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.types import Role
from ead_llm.evaluation.extract import contains_answer
from ead_llm.testing import smollm2
from ead_llm.testing.tiny import widened_tokenizer

FREE_TEXT = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
    "required": ["notes"],
}
"""Cannot close within ``--tokens``: every row stays in the batch, constrained, to the last step."""
CAPITAL = {
    "type": "object",
    "properties": {"country": {"type": "string", "maxLength": 40}, "capital": {"type": "string", "maxLength": 40}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}
TASK = Path(__file__).resolve().parents[1] / "docs" / "bench-smollm2" / "task.jsonl"


def qwen_shaped(vocab: int, seed: int = 0) -> LlamaForCausalLM:
    """A random model of Qwen2.5-0.5B's size (896 wide, 24 layers, 14 heads, 2 KV heads, tied head)."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


def pair_of(model: Any, tokenizer: Any, name: str, vocab: int) -> ModelPair:
    loaded = LoadedModel(Role.LARGE, model, describe_model(name, model))
    return ModelPair(
        tokenizer=tokenizer,
        small=LoadedModel(Role.SMALL, model, loaded.info),
        large=loaded,
        device=torch.device("cpu"),
        vocab_size=vocab,
        eos_token_ids=frozenset({int(tokenizer.eos_token_id)}),
    )


class Timed:
    """Wraps an engine's step and its masking to time them; a call's first step (the prompt's prefill) is
    left out, so both sides compare decode steps only."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.step_s, self.mask_s, self.steps = engine, 0.0, 0.0, 0
        self._mask_now = 0.0
        self._seen = False
        step, constrain, rounds = engine._step, engine._constrain, engine._constrain_rounds

        def timed_step() -> None:
            self._mask_now = 0.0
            start = time.perf_counter()
            step()
            if self._seen:
                self.step_s += time.perf_counter() - start
                self.mask_s += self._mask_now
                self.steps += 1
            self._seen = True

        def timed(fn: Any) -> Any:
            def run(*args: Any) -> None:
                start = time.perf_counter()
                fn(*args)
                self._mask_now += time.perf_counter() - start

            return run

        engine._step = timed_step  # type: ignore[method-assign]
        engine._constrain = timed(constrain)  # type: ignore[method-assign]
        engine._constrain_rounds = timed(rounds)  # type: ignore[method-assign]

    def reset(self) -> None:
        self.step_s = self.mask_s = 0.0
        self.steps = 0
        self._seen = False


def mask_cost(pair: ModelPair, tokens: int, repeats: int) -> dict[str, Any]:
    engine = Engine(pair)
    timer = Timed(engine)
    prompt = "Write notes about the history of the city of Paris as JSON: "
    out: dict[str, Any] = {}
    for batch in (1, 16):
        free_steps, masked_steps, shares = [], [], []
        for r in range(repeats):
            for constrained in (False, True):
                params = SamplingParams(
                    temperature=0.8,
                    max_tokens=tokens,
                    seed=r,
                    ignore_eos=not constrained,
                    constraint=Constraint.json_schema(FREE_TEXT) if constrained else None,
                )
                engine.generate([Request(prompt, LargeOnly(), params, sample_index=i) for i in range(batch)])  # warm
                timer.reset()
                engine.generate([Request(prompt, LargeOnly(), params, sample_index=i) for i in range(batch)])
                per_step = 1e3 * timer.step_s / timer.steps
                if constrained:
                    masked_steps.append(per_step)
                    mask_ms = 1e3 * timer.mask_s / timer.steps
                    shares.append(mask_ms / free_steps[-1])
                else:
                    free_steps.append(per_step)
        out[f"batch_{batch}"] = {
            "unconstrained_step_ms": spread(free_steps),
            "constrained_step_ms": spread(masked_steps),
            "mask_share_of_unconstrained_step": spread(shares, 4),
        }
        print(pair.large.info.source, pair.vocab_size, batch, json.dumps(out[f"batch_{batch}"]), flush=True)
    return out


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def entropy_rule(questions: list[dict[str, str]]) -> dict[str, Any]:
    full = smollm2.full_model()
    draft = smollm2.early_exit_draft()
    pair = load_pair(LoadConfig(small=str(draft), large=str(full), device="cpu"))
    engine = Engine(pair)
    tokenizer = pair.tokenizer
    constraint = Constraint.json_schema(CAPITAL)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{q['prompt']} Answer as JSON with the country and its capital."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for q in questions
    ]
    out: dict[str, Any] = {"draft": str(draft), "questions": len(questions)}
    runs = [
        ("small_only", SmallOnly(), True),
        ("large_only", LargeOnly(), True),
        ("ead_after_mask", EAD(threshold=2.0, window=1, min_dwell=1, lookahead=True), True),
        ("ead_raw_logits", EAD(threshold=2.0, window=1, min_dwell=1, lookahead=True), False),
        ("ead_5_10_after_mask", EAD(threshold=2.0), True),
        ("ead_5_10_raw_logits", EAD(threshold=2.0), False),
    ]
    for name, policy, after in runs:
        engine.entropy_after_mask = after
        params = SamplingParams(max_tokens=48, constraint=constraint)
        start = time.perf_counter()
        done = engine.generate([Request(p, policy, params) for p in prompts])
        wall = time.perf_counter() - start
        large = sum(c.cost.large_tokens for c in done)
        total = sum(len(c.token_ids) for c in done)
        parsed = []
        for c in done:
            try:
                parsed.append(json.loads(c.text))
            except json.JSONDecodeError:
                parsed.append(None)
        right = sum(
            1
            for p, q in zip(parsed, questions, strict=True)
            if p is not None and contains_answer(str(p.get("capital", "")), q["answer"])
        )
        out[name] = {
            "large_fraction": round(large / max(total, 1), 3),
            "right": right,
            "valid_json": sum(p is not None for p in parsed),
            "tokens": total,
            "wall_s": round(wall, 1),
            "example": done[0].text,
        }
        print(name, json.dumps(out[name]), flush=True)
    engine.entropy_after_mask = True
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-b", action="store_true", help="only the mask cost")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"threads": args.threads, "tokens": args.tokens, "repeats": args.repeats}
    folder = smollm2.full_model()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    small_vocab = pair_of(AutoModelForCausalLM.from_pretrained(folder).eval(), tokenizer, "SmolLM2-135M", 49152)
    report["vocab_49152"] = mask_cost(small_vocab, args.tokens, args.repeats)
    wide = widened_tokenizer(tokenizer, 151936)
    report["vocab_151936"] = mask_cost(
        pair_of(qwen_shaped(151936), wide, "random-qwen2.5-0.5b-shape", 151936), args.tokens, args.repeats
    )
    if not args.skip_b:
        lines = [json.loads(line) for line in TASK.read_text().splitlines() if line.strip()]
        capitals = [q for q in lines if "capital" in q["prompt"].lower()][:20]
        report["entropy_rule"] = entropy_rule(capitals)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
