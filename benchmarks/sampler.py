"""The sampler's cost per pass, against another revision's sampler side by side.

Logits are SmolLM2-135M-Instruct's at 64 positions of a story it is writing (real next-token
distributions: most nuclei are a few tokens, some reach 150), random peaked ones with ``--random``, or flat ones
over Qwen2.5's 151,936 tokens with ``--flat`` (a random model's: top-p keeps most of each row, so the filter
searches whole rows).
For batch 1, 16 and 64 and each setting (temperature only, top-k, top-p, both), both samplers draw the
same rows alternately, ``--repeats`` times each; the table gives the medians and new/old.

    OMP_NUM_THREADS=1 python benchmarks/sampler.py [--against REV] [--repeats 15] [--random | --flat]

``--against`` (default ``ba9eabd``, the sampler before issue 23's single filter) is any git revision; its
``ead_llm/core/sampler.py`` and ``ops.py`` are loaded from git into modules of their own, so the comparison
runs in one process on the same logits.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from ead_llm.core import sampler as current

SETTINGS = {
    "T=0.8": (0.8, 0, 1.0),
    "top_k=50": (0.8, 50, 1.0),
    "top_p=0.9": (0.8, 0, 0.9),
    "top_p=0.95,T=1": (1.0, 0, 0.95),
    "top_k=50,top_p=0.9": (0.8, 50, 0.9),
}


def revision_sampler(revision: str) -> ModuleType:
    """``ead_llm/core/sampler.py`` of ``revision``, importing that revision's ``ops.py`` (not the current one)."""
    root = Path(__file__).resolve().parents[1]
    folder = Path(tempfile.mkdtemp(prefix="ead-llm-sampler-"))
    for name in ("ops", "sampler"):
        source = subprocess.run(
            ["git", "show", f"{revision}:ead_llm/core/{name}.py"], cwd=root, check=True, capture_output=True, text=True
        ).stdout
        (folder / f"old_{name}.py").write_text(source.replace("from ead_llm.core.ops import", "from old_ops import"))
    sys.path.insert(0, str(folder))
    return importlib.import_module("old_sampler")


def story_logits() -> torch.Tensor:
    """SmolLM2's logits ``[64, V]`` at the last 64 positions of a story."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ead_llm.testing import smollm2

    path = smollm2.full_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    text += (
        "Once upon a time, on a rocky island far from the mainland, there lived an old lighthouse keeper named "
        "Elias. Every evening he climbed the spiral stairs to light the great lamp, and every morning he walked "
        "the shore looking for whatever the sea had left behind. One grey morning he found a green bottle"
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0, -64:].float()


def random_logits() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=generator) * 3
    logits[:, :5] += 10
    return logits


def flat_logits() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(64, 151_936, generator=generator) * 0.05


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="ba9eabd", help="git revision of the other sampler (default ba9eabd)")
    parser.add_argument("--repeats", type=int, default=15)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--random", action="store_true", help="random peaked logits instead of SmolLM2's")
    kind.add_argument("--flat", action="store_true", help="flat logits over 151,936 tokens instead of SmolLM2's")
    args = parser.parse_args()
    torch.set_num_threads(1)
    old = revision_sampler(args.against)
    logits = random_logits() if args.random else flat_logits() if args.flat else story_logits()
    print(f"threads {torch.get_num_threads()}, vocabulary {logits.shape[1]}, against {args.against}")
    print(f"{'batch':>5} {'setting':20} {'old ms':>8} {'new ms':>8} {'new/old':>8}")
    for batch in (1, 16, 64):
        rows = logits[:batch].contiguous()
        for name, (temperature, top_k, top_p) in SETTINGS.items():
            settings = [(temperature, top_k, top_p, 7, i) for i in range(batch)]
            samplers = {"old": old, "new": current}
            metas = {label: module.SamplingMetadata.build(settings) for label, module in samplers.items()}
            times: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(args.repeats):
                for label, module in samplers.items():
                    start = time.perf_counter()
                    module.sample(rows, metas[label])
                    times[label].append(time.perf_counter() - start)
            a, b = (statistics.median(times[label]) * 1000 for label in ("old", "new"))
            print(f"{batch:>5} {name:20} {a:8.2f} {b:8.2f} {b / a:8.2f}")


if __name__ == "__main__":
    main()
