"""``CompletionAdapter``: DSPy signatures on a plain completion model (the embedded pair).

DSPy's standard adapters write chat turns with ``[[ ## field ## ]]`` markers that an instruct model
follows. A completion model trained on one format (the embedded pair: a problem line, the worked
solution, ``#### answer``) follows none of that, so this adapter maps a signature onto that plain
format instead:

- prompt: the input fields' values, one per line (each demo first, as input lines followed by its
  outputs, when ``max_demos`` allows);
- completion: every output field before the last receives the text before the answer line; the
  last receives what follows ``answer_prefix`` on that line, converted to the field's type; a
  numeric field takes the first number there (as ``ead_llm.evaluation.task.extract_answer`` does), so
  DSPy metrics agree with the task's own scoring. A completion without the answer line (cut off by
  ``max_tokens``, say) is a parse error, never an answer read from whatever line came last.

Streaming the answer field with DSPy's ``streamify`` takes :class:`CompletionStreamListener` (DSPy's
``StreamListener`` knows the marker formats of its own adapters only).

Instruct pairs keep DSPy's standard adapters (``ChatAdapter``/``JSONAdapter``); with ``JSONAdapter`` the
engine enforces the JSON schema DSPy sends. :class:`StrictJSONAdapter` sends one for every signature,
also where ``JSONAdapter`` falls back to "any JSON object" (a ``dict`` output such as ReAct's
``next_tool_args``), so the keys, their order and any ``Literal`` (ReAct's tool names) are enforced too.
"""

from __future__ import annotations

import re
from queue import Queue
from typing import Any

import dspy
import pydantic
from dspy.adapters.utils import parse_value
from dspy.signatures.signature import Signature
from dspy.streaming import StreamListener
from dspy.utils.exceptions import AdapterParseError

from ead_llm.core.validation import check_int
from ead_llm.evaluation.task import ANSWER_PREFIX

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class CompletionAdapter(dspy.Adapter):
    """Plain prompt/answer format for completion models; see the module docstring."""

    def __init__(self, answer_prefix: str = ANSWER_PREFIX, max_demos: int | None = None, **kwargs: Any) -> None:
        """``answer_prefix`` marks the final answer line; ``max_demos`` caps the few-shot blocks
        rendered before the input (None: all; 0 for a model trained without them, such as the
        embedded pair)."""
        super().__init__(**kwargs)
        if not isinstance(answer_prefix, str) or not answer_prefix.strip():
            raise ValueError(f"answer_prefix must be a non-blank string, got {answer_prefix!r}")
        if max_demos is not None:
            check_int("max_demos", max_demos, minimum=0)
        self.answer_prefix = answer_prefix
        self.max_demos = max_demos

    def _input_block(self, signature: type[Signature], values: dict[str, Any]) -> str:
        missing = [name for name in signature.input_fields if name not in values]
        if missing:
            raise ValueError(f"missing input fields {missing} for signature {signature.signature}")
        return "".join(f"{str(values[name]).rstrip()}\n" for name in signature.input_fields)

    def _output_block(self, signature: type[Signature], values: dict[str, Any]) -> str:
        *earlier, final = signature.output_fields
        body = "".join(f"{str(values[name]).rstrip()}\n" for name in earlier if values.get(name))
        return f"{body}{self.answer_prefix}{values[final]}\n"

    def format(
        self, signature: type[Signature], demos: list[dict[str, Any]], inputs: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """One user message holding the raw prompt (the LM passes it through in ``text`` format)."""
        usable = [
            d for d in demos if all(k in d for k in signature.input_fields) and list(signature.output_fields)[-1] in d
        ]
        if self.max_demos is not None:
            usable = usable[: self.max_demos]
        blocks = [self._input_block(signature, d) + self._output_block(signature, d) for d in usable]
        return [{"role": "user", "content": "".join(blocks) + self._input_block(signature, inputs)}]

    def parse(self, signature: type[Signature], completion: str) -> dict[str, Any]:
        """Split a completion into the output fields (see the module docstring)."""
        *earlier, final = signature.output_fields
        head, found, tail = completion.partition(self.answer_prefix)
        if not found:
            raise AdapterParseError(
                adapter_name=type(self).__name__,
                signature=signature,
                lm_response=completion,
                message=f"no {self.answer_prefix.strip()!r} answer line for field {final!r} (was the output cut off "
                "by max_tokens?)",
            )
        answer = tail.splitlines()[0].strip() if tail.strip() else ""
        annotation = signature.output_fields[final].annotation
        if annotation in (int, float) and (number := _NUMBER.search(answer)) is not None:
            answer = number.group(0)
        try:
            value = parse_value(answer, annotation)
        except Exception as exc:
            raise AdapterParseError(
                adapter_name=type(self).__name__,
                signature=signature,
                lm_response=completion,
                message=f"cannot read field {final!r} from {answer!r}: {exc}",
            ) from exc
        parsed: dict[str, Any] = {name: head.strip() for name in earlier}
        parsed[final] = value
        return parsed


class CompletionStreamListener(StreamListener):
    """``dspy.streaming.StreamListener`` for :class:`CompletionAdapter`: streams the answer field (the text
    after the answer prefix, up to the end of its line). Other fields have no marker to find in the text."""

    def receive(self, chunk: Any) -> Any:
        adapter = dspy.settings.adapter
        if isinstance(adapter, CompletionAdapter):
            fields = list(self.predict.signature.output_fields) if self.predict is not None else []
            if fields and self.signature_field_name != fields[-1]:
                raise ValueError(
                    f"CompletionAdapter streams only the answer field {fields[-1]!r}, not {self.signature_field_name!r}"
                )
            self.adapter_identifiers[type(adapter).__name__] = {
                "start_identifier": adapter.answer_prefix,
                "end_identifier": re.compile(r"\n"),
                "start_indicator": adapter.answer_prefix[0],
                "end_pattern_prefixes": [],
                "end_pattern_contains": "\n",
            }
        return super().receive(chunk)

    def flush(self) -> str:
        """The tokens held back at the end of the stream, up to the end of the answer line."""
        if not isinstance(dspy.settings.adapter, CompletionAdapter):
            return super().flush()
        queue: Queue[str] = self.field_end_queue
        held = "".join(queue.queue)
        self.field_end_queue: Queue[str] = Queue()
        return held.split("\n", 1)[0]


class StrictJSONAdapter(dspy.JSONAdapter):
    """DSPy's ``JSONAdapter`` that always asks for the signature's full JSON schema (``dict`` fields as free
    objects, the rest exact, no other keys), which an ead-llm pair enforces token by token: the answer
    always has every output field, and a ``Literal`` field (ReAct's ``next_tool_name``) one of its values."""

    def _prepare_response_format(self, lm: Any, lm_kwargs: dict[str, Any], signature: type[Signature]) -> None:
        if "response_format" not in lm.supported_params:
            return super()._prepare_response_format(lm, lm_kwargs, signature)
        fields: dict[str, Any] = {name: (field.annotation, ...) for name, field in signature.output_fields.items()}
        model = pydantic.create_model("Outputs", __config__=pydantic.ConfigDict(extra="forbid"), **fields)
        lm_kwargs["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "outputs", "schema": model.model_json_schema(), "strict": True},
        }
        return None
