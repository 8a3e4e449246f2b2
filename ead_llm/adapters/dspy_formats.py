"""DSPy's ``ChatAdapter`` format, enforced while decoding.

DSPy's default adapter asks for the output fields between markers and parses them back::

    [[ ## reasoning ## ]]
    free text

    [[ ## answer ## ]]
    42

    [[ ## completed ## ]]

An LM is called with messages only, so the format is read from what the adapter wrote: the last user
message names the output fields in order ("Respond with the corresponding output fields, starting with the
field `[[ ## reasoning ## ]]`, then ..."), and the system message gives each field's note ("must be a
single int value", "must exactly match (no extra characters) one of: a; b", "must adhere to the JSON schema:
{...}"). From them :func:`chat_adapter_constraint` builds a Lark grammar: every marker in order, free text
bounded in length (a weak model ends a field instead of rambling to ``max_tokens``), ints, floats, bools,
literals and JSON values as their notes say. The answer always parses, whichever model writes its tokens.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence

from ead_llm.core.grammar import DEFAULT_BOUNDS, Constraint, JsonBounds

_REQUEST = re.compile(
    r"Respond with the corresponding output fields, starting with the field (.*?)"
    r"and then ending with the marker for `\[\[ ## completed ## \]\]`",
    re.DOTALL,
)
_MARKER = re.compile(r"`\[\[ ## (\w+) ## \]\]`")
_NOTE = "        # note: the value you produce "


def _regex_literal(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/``."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in "\\.^$|?*+()[]{}/" else c for c in text)


def _marker(name: str) -> str:
    return f"[[ ## {name} ## ]]"


def _notes(system: str) -> dict[str, str]:
    """Each field's note in the system message's structure section (``{name}        # note: ...``)."""
    out = {}
    for line in system.splitlines():
        match = re.match(r"\{(\w+)\}" + re.escape(_NOTE) + r"(.*)$", line)
        if match:
            out[match.group(1)] = match.group(2).strip()
    return out


def _value_rule(note: str | None, bounds: JsonBounds | None) -> str | None:
    """The Lark body of a typed field's value, or None for free text."""
    if note is None:
        return None
    digits = (bounds or DEFAULT_BOUNDS).max_integer_digits
    if note.startswith("must be a single int value"):
        return f"/-?(0|[1-9][0-9]{{0,{digits - 1}}})/"
    if note.startswith("must be a single float value"):
        fraction = (bounds or DEFAULT_BOUNDS).max_fraction_digits
        return f"/-?(0|[1-9][0-9]{{0,{digits - 1}}})(\\.[0-9]{{1,{fraction}}})?/"
    if note.startswith("must be True or False"):
        return '"True" | "False"'
    literal = re.match(r"must exactly match \(no extra characters\) one of: (.*)$", note)
    if literal:
        return " | ".join(json.dumps(option) for option in literal.group(1).split("; "))
    schema = re.match(r"must adhere to the JSON schema: (.*)$", note)
    if schema:
        try:
            return Constraint.json_schema(json.loads(schema.group(1)), strict=False, bounds=bounds).lark_rule()
        except ValueError:
            return None
    return None


def chat_adapter_constraint(
    turns: Sequence[tuple[str, str]], bounds: JsonBounds | None = DEFAULT_BOUNDS, max_tokens: int = 256
) -> Constraint | None:
    """The grammar of the answer DSPy's ``ChatAdapter`` asked for in ``turns`` (``(role, text)``), or None when
    the turns are not in its format. The free-text and JSON fields share ``max_tokens`` (less the markers) at
    about one character per token: free text holds a share, a JSON value about as much (its strings, keys,
    entries and items bounded more tightly than ``bounds``), so that a rambling model still reaches
    ``[[ ## completed ## ]]``."""
    users = [text for role, text in turns if role == "user"]
    request = _REQUEST.search(users[-1]) if users else None
    if request is None:
        return None
    names = _MARKER.findall(request.group(1))
    if not names:
        return None
    system = next((text for role, text in turns if role == "system"), "")
    notes = _notes(system)
    free = sum(_value_rule(notes.get(name), bounds) is None for name in names)
    json_fields = sum("must adhere to the JSON schema" in notes.get(name, "") for name in names)
    share = max(16, (max_tokens - 16 * len(names)) // max(1, free + json_fields))
    max_text = share
    if bounds is not None:  # a JSON field (ReAct's tool arguments) takes about one share too
        bounds = dataclasses.replace(
            bounds,
            max_string_length=min(bounds.max_string_length, max(8, share // 8)),
            max_key_length=min(bounds.max_key_length, 32),
            max_properties=min(bounds.max_properties, 4),
            max_items=min(bounds.max_items, 8),
        )
    lines = ["start: " + " ".join(f"f{i}" for i in range(len(names)))]
    for i, name in enumerate(names):
        end = "\n\n" + _marker(names[i + 1] if i + 1 < len(names) else "completed")
        end += "\n" if i + 1 < len(names) else ""
        head = json.dumps(_marker(name) + "\n") if i == 0 else ""
        value = _value_rule(notes.get(name), bounds)
        if value is None:  # free text up to the next marker (lazy: it ends at the marker's first occurrence)
            lines.append(f"f{i}: {head} t{i}".replace(":  ", ": "))
            lines.append(f"t{i}[lazy]: /(?s:.{{0,{max_text}}}){_regex_literal(end)}/")
        else:
            lines.append(f"f{i}: {head} v{i} {json.dumps(end)}".replace(":  ", ": "))
            lines.append(f"v{i}: {value}")
    return Constraint.lark("\n".join(lines) + "\n")
