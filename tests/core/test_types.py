"""``quick_init``: the hot path's frozen dataclasses built through their ``__dict__``, the same objects as before."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from ead_llm.core.model_runner import PassRow
from ead_llm.core.types import Emit, ForwardWork, Read, Role, TokenSample, quick_init
from ead_llm.policies.switching import EADState

QUICK = (ForwardWork, Emit, Read, TokenSample, PassRow, EADState)


def plain_twin(cls: type) -> type:
    """``cls`` as ``@dataclass(frozen=True)`` alone builds it (its generated ``__init__``)."""
    fields = [(f.name, Any, dataclasses.field(default=f.default)) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(cls.__name__, fields, frozen=True)


def shape(cls: type) -> list[tuple[str, Any, Any]]:
    """Each ``__init__`` parameter's name, kind and default."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(cls).parameters.values()]


def arguments(cls: type) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Ways to call ``cls``: required fields only, positionally and by keyword; every field, both ways; a mix."""
    fields = dataclasses.fields(cls)
    required = [f for f in fields if f.default is dataclasses.MISSING]
    values = {f.name: (f"value of {f.name}", i) for i, f in enumerate(fields)}  # distinct and hashable
    every = [values[f.name] for f in fields]
    return [
        (tuple(values[f.name] for f in required), {}),
        ((), {f.name: values[f.name] for f in required}),
        (tuple(every), {}),
        ((), dict(zip([f.name for f in fields], every, strict=True))),
        (tuple(every[:1]), {f.name: values[f.name] for f in fields[1:]}),
    ]


@pytest.mark.parametrize("cls", QUICK, ids=lambda c: c.__name__)
def test_a_quick_init_builds_what_the_dataclass_init_builds(cls: type) -> None:
    """The same signature (names, kinds, defaults) and, for any way of calling it, the same fields, equality and
    hash as the dataclass's own ``__init__``; still frozen; a missing or unknown argument still raises."""
    twin = plain_twin(cls)
    assert cls.__init__ is not twin.__init__  # (the quick one is in place)
    assert shape(cls) == shape(twin)
    for args, kwargs in arguments(cls):
        quick, plain = cls(*args, **kwargs), twin(*args, **kwargs)
        assert vars(quick) == vars(plain)
        assert list(vars(quick)) == list(vars(plain))  # fields in the same order
        assert quick == cls(*args, **kwargs) and hash(quick) == hash(cls(*args, **kwargs))
        assert repr(quick) == repr(plain).replace(twin.__qualname__, cls.__qualname__, 1)
        with pytest.raises(dataclasses.FrozenInstanceError):
            quick.__setattr__(dataclasses.fields(cls)[0].name, None)
    with pytest.raises(TypeError):
        cls()
    with pytest.raises(TypeError):
        cls(*arguments(cls)[2][0], unknown=1)


def test_quick_init_refuses_what_it_cannot_build() -> None:
    """A class that is not a frozen dataclass, or has a default factory, a keyword-only field, an init-less field,
    slots, a ``__post_init__`` or a field the generated code names itself, is refused rather than built wrong."""

    class Plain:
        x: int

    @dataclasses.dataclass
    class Thawed:
        x: int

    @dataclasses.dataclass(frozen=True)
    class Factory:
        x: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True)
    class KeywordOnly:
        x: int = dataclasses.field(kw_only=True)

    @dataclasses.dataclass(frozen=True)
    class NoInit:
        x: int = dataclasses.field(default=0, init=False)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted:
        x: int

    @dataclasses.dataclass(frozen=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(frozen=True)
    class Shadowing:
        own: int

    for cls in (Plain, Thawed, Factory, KeywordOnly, NoInit, Slotted, Checked, Shadowing):
        with pytest.raises(TypeError, match="quick_init"):
            quick_init(cls)


def test_a_read_is_the_role_it_was_given() -> None:
    """(A smoke check of a decorated class from the engine's side: defaults as the scheduler reads them.)"""
    read = Read(Role.LARGE, verify=True, drafts=2)
    assert (read.role, read.verify, read.drafts, read.siblings, read.chain, read.positions) == (
        Role.LARGE,
        True,
        2,
        (),
        0,
        3,
    )
