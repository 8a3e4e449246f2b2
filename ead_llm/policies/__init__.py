"""Decoding policies (what the user configures) and the decoders that carry them out: switching
(EAD, the baselines and controls), draft-and-verify (speculative decoding, EASD, the oracle),
branching (EAGER)."""
