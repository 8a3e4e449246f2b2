import math

import pytest

from ead_llm.core.types import Role
from ead_llm.policies.base import LargeOnly, SmallOnly, check_policy, describe_policy
from ead_llm.policies.switching import EAD, ead_target, rolling_mean


def run(policy: EAD, entropies: list[float]) -> list[Role]:
    """Roles of each token when the active model reports ``entropies`` in turn."""
    state = policy.start()
    roles = []
    for h in entropies:
        role = policy.choose(state)
        roles.append(role)
        state = policy.advance(state, role, h)
    return roles


def letters(roles: list[Role]) -> str:
    return "".join("L" if r is Role.LARGE else "S" for r in roles)


def test_no_switch_before_min_dwell() -> None:
    policy = EAD(threshold=1.0, window=1, min_dwell=4)
    # entropy high from the first token; first decision after 4 tokens
    assert letters(run(policy, [5.0] * 6)) == "SSSSLL"


def test_switch_back_when_entropy_falls_after_dwell() -> None:
    policy = EAD(threshold=1.0, window=1, min_dwell=3)
    # S S S -> L (dwell 3 on L) -> back to S once a low entropy is seen after the dwell
    entropies = [5.0, 5.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert letters(run(policy, entropies)) == "SSSLLLSS"


def test_window_mean_decides_not_last_token() -> None:
    policy = EAD(threshold=1.0, window=4, min_dwell=4)
    # mean of (0, 0, 0, 3.9) = 0.975 <= 1: stay small; next window (0, 0, 3.9, 0.2) = 1.025 > 1: switch
    entropies = [0.0, 0.0, 0.0, 3.9, 0.2, 0.0]
    assert letters(run(policy, entropies)) == "SSSSSL"


def test_threshold_is_strict() -> None:
    policy = EAD(threshold=1.0, window=2, min_dwell=2)
    assert letters(run(policy, [1.0, 1.0, 1.0])) == "SSS"  # mean == threshold: small
    assert letters(run(policy, [1.0, 1.01, 1.0])) == "SSL"


def test_min_dwell_zero_decides_every_token() -> None:
    policy = EAD(threshold=0.5, window=1, min_dwell=0)
    assert letters(run(policy, [1.0, 0.0, 1.0, 1.0, 0.0])) == "SLSLL"


def test_dwell_counts_from_last_switch() -> None:
    policy = EAD(threshold=1.0, window=1, min_dwell=2)
    # S S -> L; on L the very next token has low entropy but dwell 2 must pass first
    assert letters(run(policy, [2.0, 2.0, 0.0, 0.0, 0.0, 2.0])) == "SSLLSS"


def test_window_history_kept_or_reset_on_switch() -> None:
    kept = EAD(threshold=1.0, window=3, min_dwell=1)
    reset = EAD(threshold=1.0, window=3, min_dwell=1, reset_window_on_switch=True)
    entropies = [3.0, 0.0, 0.0, 0.0]
    # kept: after token 1 mean 3 -> L; token 2 mean (3, 0) = 1.5 -> stay L; token 3 mean 1 -> S
    assert letters(run(kept, entropies)) == "SLLS"
    # reset: window restarts on L; token 2 mean 0 -> S at once
    assert letters(run(reset, entropies)) == "SLSS"


def test_start_on_large_and_infinite_threshold() -> None:
    assert letters(run(EAD(threshold=math.inf, min_dwell=0), [50.0] * 5)) == "SSSSS"
    assert letters(run(EAD(threshold=0.0, min_dwell=0, start_on="large"), [0.0] * 3)) == "LSS"


def test_single_model_policies() -> None:
    assert set(run(SmallOnly(), [9.0] * 3)) == {Role.SMALL}  # type: ignore[arg-type]
    assert set(run(LargeOnly(), [0.0] * 3)) == {Role.LARGE}  # type: ignore[arg-type]


def test_pure_helpers() -> None:
    assert rolling_mean([1.0, 2.0, 6.0]) == 3.0
    assert rolling_mean([]) == 0.0
    assert ead_target(0.3, 0.25) is Role.LARGE
    assert ead_target(0.25, 0.25) is Role.SMALL


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"threshold": -0.1}, "threshold"),
        ({"threshold": float("nan")}, "threshold"),
        ({"threshold": "0.2"}, "threshold"),
        ({"window": 0}, "window"),
        ({"window": 2.5}, "window"),
        ({"min_dwell": -1}, "min_dwell"),
        ({"min_dwell": True}, "min_dwell"),
        ({"start_on": "medium"}, "start_on"),
        ({"lookahead": 1}, "lookahead"),
    ],
)
def test_invalid_settings_name_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        EAD(**kwargs)


def test_positional_threshold_and_description() -> None:
    policy = EAD(0.125)
    assert policy.threshold == 0.125
    assert describe_policy(policy)["policy"] == "ead"
    assert describe_policy(EAD(math.inf))["threshold"] == "inf"
    with pytest.raises(ValueError, match="policy must be a policy object"):
        check_policy("ead")


def test_lookahead_takes_the_same_decision_one_token_earlier() -> None:
    policy = EAD(threshold=1.0, window=2, min_dwell=2, lookahead=True)
    state = policy.start()
    assert policy.withhold(state, Role.SMALL, 5.0) is None  # dwell not reached: emit
    state = policy.advance(state, Role.SMALL, 0.0)
    assert policy.withhold(state, Role.SMALL, 0.5) is None  # window mean 0.25: emit
    revised = policy.withhold(state, Role.SMALL, 3.0)  # mean 1.5 > 1 after 2 tokens: withhold
    assert revised == policy.advance(state, Role.SMALL, 3.0) and policy.choose(revised) is Role.LARGE
    large = policy.advance(policy.advance(revised, Role.LARGE, 0.0), Role.LARGE, 0.0)
    assert policy.withhold(large, Role.LARGE, 9.0) is None  # the large model's tokens are never withheld
    assert EAD(threshold=1.0, window=1, min_dwell=0).withhold(EAD().start(), Role.SMALL, 9.0) is None
    for other in (SmallOnly(), LargeOnly()):
        assert other.withhold(other.start(), Role.SMALL, 9.0) is None
