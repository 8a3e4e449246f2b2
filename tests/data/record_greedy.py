"""Record every policy's greedy output on 100 embedded test problems (issue 14's reference).

Run once on the engine before a change (``python -m tests.data.record_greedy``); the test
``tests/test_greedy_reference.py`` checks that the engine still writes exactly these tokens.
Each stream is recorded per (request, path): token ids, which model wrote each token, and the
positions each model processed, hashed (sha256) so the file stays small.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from ead_llm import EAD, EAGER, EASD, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.request import Request, SamplingParams
from ead_llm.evaluation.task import problems
from ead_llm.policies.base import Policy
from ead_llm.policies.controls import FixedBlockSwitching, OracleSwitching, RandomSwitching

REFERENCE = Path(__file__).with_name("greedy_reference.json")
PROBLEMS = 100
MAX_TOKENS = 200

POLICIES: dict[str, Policy] = {
    "small_only": SmallOnly(),
    "large_only": LargeOnly(),
    "ead_default": EAD(threshold=0.05),
    "ead_dwell3": EAD(threshold=0.2, window=3, min_dwell=3),
    "ead_lookahead": EAD(threshold=0.1, window=1, min_dwell=1, lookahead=True),
    "speculative_g4": SpeculativeDecoding(gamma=4),
    "speculative_adaptive": SpeculativeDecoding(gamma=2, adaptive_gamma=True),
    "easd": EASD(entropy_threshold=0.3, top_n=3, overlap_threshold=0.3),
    "random": RandomSwitching(fraction=0.3, block=5),
    "fixed_block": FixedBlockSwitching(small_block=6, large_block=2),
    "oracle": OracleSwitching(),
    "eager_large": EAGER(theta=0.2, max_paths=3, temperature=0.0, percentile=90.0),
    "eager_ead": EAGER(theta=0.2, max_paths=2, temperature=0.0, decoder=EAD(threshold=0.05)),
}


def digest(values: list) -> str:
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()[:16]


def record(engine: Engine, policy: Policy, count: int = PROBLEMS) -> dict[str, dict[str, str]]:
    """Per ``index/path``: hashes of the token ids, roles, and processed positions (model, tokens, past), for the
    first ``count`` problems in one call."""
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    requests = [Request(p.prompt, policy, sampling) for p in problems("test", count)]
    streams: dict[str, dict[str, list]] = {}
    for event in engine.stream(requests):
        stream = streams.setdefault(f"{event.index}/{event.path}", {"tokens": [], "roles": [], "work": []})
        stream["tokens"].append(event.token_id)
        stream["roles"].append(event.role.letter)
        stream["work"].append([[w.role.letter, w.tokens, w.past] for w in event.work])
    return {key: {name: digest(values) for name, values in s.items()} for key, s in sorted(streams.items())}


def main() -> None:
    from ead_llm import EntropyAdaptiveLLM

    engine = EntropyAdaptiveLLM().shared_engine
    names = sys.argv[1:] or list(POLICIES)
    out = {name: record(engine, POLICIES[name]) for name in names}
    REFERENCE.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
    print(f"wrote {REFERENCE} ({sum(len(v) for v in out.values())} streams)")


if __name__ == "__main__":
    main()
