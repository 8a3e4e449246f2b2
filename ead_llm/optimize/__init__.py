"""Cost-aware optimisation: a policy per DSPy predictor (:class:`PolicyOptimizer`) and a pair's calibrated
EAD threshold (:func:`calibrate`). Names load on first use (the storage of calibrations is read by every
model at construction, without DSPy)."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "PolicyOptimizer": "ead_llm.optimize.policy_optimizer",
    "PolicySearchReport": "ead_llm.optimize.policy_optimizer",
    "PredictorReport": "ead_llm.optimize.policy_optimizer",
    "Trial": "ead_llm.optimize.policy_optimizer",
    "apply_policies": "ead_llm.optimize.policy_optimizer",
    "default_candidates": "ead_llm.optimize.policy_optimizer",
    "Calibration": "ead_llm.optimize.calibrate",
    "calibrate": "ead_llm.optimize.calibrate",
    "stored_policy": "ead_llm.optimize.calibrate",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ead_llm.optimize' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
