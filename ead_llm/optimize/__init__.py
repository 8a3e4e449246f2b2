"""Cost-aware optimisation: a policy per DSPy predictor (:class:`PolicyOptimizer`)."""

from ead_llm.optimize.policy_optimizer import (
    PolicyOptimizer,
    PolicySearchReport,
    PredictorReport,
    Trial,
    apply_policies,
    default_candidates,
)

__all__ = [
    "PolicyOptimizer",
    "PolicySearchReport",
    "PredictorReport",
    "Trial",
    "apply_policies",
    "default_candidates",
]
