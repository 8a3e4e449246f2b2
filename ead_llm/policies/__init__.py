"""Decoding policies (what the user configures) and the decoders that carry them out: switching
(EAD, the baselines and controls), draft-and-verify (speculative decoding, EASD, the oracle),
branching (EAGER)."""

# every family registers its policies (and switching the default decoder) when imported
from ead_llm.policies import controls, eager, speculative, switching  # noqa: F401
