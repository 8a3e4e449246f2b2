"""``EntropyAdaptiveLLM``: the pair as a LangChain LLM over the shared engine (a thin adapter)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict, PrivateAttr, field_validator

from ead_llm.embedded import embedded_pair, recommended_threshold
from ead_llm.engine import Completion, Engine, Request
from ead_llm.ledger import CompletionLedger, Cost, Pricing
from ead_llm.loading import LoadConfig
from ead_llm.policies import EAD, Policy, check_policy, describe_policy
from ead_llm.registry import shared_engine
from ead_llm.sampling import SamplingParams
from ead_llm.types import Role
from ead_llm.validation import check_stop

CALL_OPTIONS = ("policy", "temperature", "top_p", "top_k", "max_tokens", "seed", "ignore_eos")


class EntropyAdaptiveLLM(BaseLLM):
    """A small and a large causal LM behaving as one LLM, the large one spent where text is hard.

    With no ``small``/``large`` it runs the embedded default pair offline. Every setting below
    except the model sources can be overridden per call (``llm.invoke(x, policy=SmallOnly())``).
    Each completion's cost dict is in ``generation_info["cost"]``; the call's sum is in
    ``llm_output["cost"]`` beside ``llm_output["token_usage"]``.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    small: str | None = None
    """Hugging Face id or local folder of the small model (None: the embedded pair)."""
    large: str | None = None
    """Hugging Face id or local folder of the large model (None: the embedded pair)."""
    policy: Policy | None = None
    """Which model speaks when: EAD(...), SmallOnly(), LargeOnly(). None: EAD with its defaults, and
    on the embedded pair with the threshold chosen for it on the task's dev split."""
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    max_tokens: int = 256
    """Most tokens generated per completion."""
    seed: int | None = 0
    """Seed of each call's random generators; the same seed and inputs give the same text."""
    stop: list[str] | None = None
    """Default stop strings, used when a call passes none."""
    ignore_eos: bool = False
    """Generate past EOS (for fixed-length benchmarks)."""
    pricing: Pricing | None = None
    """USD per million tokens per model; adds ``cost_usd`` to the cost dict."""
    device: str | None = None
    """Torch device; None picks CUDA when available, else CPU."""
    dtype: str | None = None
    """``float32``, ``bfloat16`` or ``float16``; None picks bf16 on a capable GPU, else float32."""
    revision: str | None = None
    """Hub revision of both models."""
    cache_dir: str | None = None
    """Hugging Face cache folder."""
    local_files_only: bool = False
    """Never reach the network."""
    trust_remote_code: bool = False
    """Allow model code from the Hub."""

    _engine: Engine = PrivateAttr()

    @field_validator("policy", mode="before")
    @classmethod
    def _check_policy(cls, value: Any) -> Policy | None:
        return None if value is None else check_policy(value)

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> list[str] | None:
        return None if value is None else list(check_stop(value))

    def model_post_init(self, context: Any) -> None:
        """Check the settings, then attach the shared engine (loading the pair on first use)."""
        self._sampling({}, None)
        if self.small is None or self.large is None:
            if self.small is not None or self.large is not None:
                raise ValueError("pass both small= and large=, or neither for the embedded default pair")
            small, large = embedded_pair()
            if self.policy is None:
                self.policy = EAD(threshold=recommended_threshold())
        else:
            small, large = self.small, self.large
        config = LoadConfig(
            small=small,
            large=large,
            device=self.device,
            dtype=self.dtype,
            revision=self.revision,
            cache_dir=self.cache_dir,
            local_files_only=self.local_files_only,
            trust_remote_code=self.trust_remote_code,
        )
        self._engine = shared_engine(config)
        if self.policy is None:
            self.policy = EAD()

    def _policy(self) -> Policy:
        if self.policy is None:  # set in model_post_init; only a bypassed constructor leaves it unset
            raise RuntimeError("EntropyAdaptiveLLM has no policy")
        return self.policy

    @property
    def engine(self) -> Engine:
        """The shared engine running this object's pair."""
        return self._engine

    # -- per-call settings ------------------------------------------------------------------------

    def _sampling(self, options: dict[str, Any], stop: list[str] | None) -> SamplingParams:
        return SamplingParams(
            temperature=options.get("temperature", self.temperature),
            top_p=options.get("top_p", self.top_p),
            top_k=options.get("top_k", self.top_k),
            max_tokens=options.get("max_tokens", self.max_tokens),
            stop=check_stop(stop if stop is not None else self.stop),
            seed=options.get("seed", self.seed),
            ignore_eos=options.get("ignore_eos", self.ignore_eos),
        )

    def _requests(self, prompts: list[str], stop: list[str] | None, kwargs: dict[str, Any]) -> list[Request]:
        unknown = sorted(set(kwargs) - set(CALL_OPTIONS))
        if unknown:
            raise ValueError(f"unknown call options {unknown}; accepted: {list(CALL_OPTIONS)}")
        policy = check_policy(kwargs.get("policy", self._policy()))
        sampling = self._sampling(kwargs, stop)
        return [Request(prompt=p, policy=policy, sampling=sampling) for p in prompts]

    # -- LangChain contract -----------------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "entropy-adaptive"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "small": self._engine.pair.small.info.source,
            "large": self._engine.pair.large.info.source,
            **describe_policy(self._policy()),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
        }

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` with the pair's tokenizer (used by ``get_num_tokens``)."""
        return list(self._engine.tokenizer.encode(text, add_special_tokens=False))

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        requests = self._requests(prompts, stop, kwargs)
        start = time.perf_counter()
        completions = self._engine.generate(requests, pricing=self.pricing)
        total = Cost.total([c.cost for c in completions], wall_time_s=time.perf_counter() - start)
        return LLMResult(
            generations=[[Generation(text=c.text, generation_info=_generation_info(c))] for c in completions],
            llm_output={
                "token_usage": {
                    "prompt_tokens": total.prompt_tokens,
                    "completion_tokens": total.completion_tokens,
                    "total_tokens": total.prompt_tokens + total.completion_tokens,
                },
                "cost": total.to_dict(),
                "model_name": self._llm_type,
                "policy": describe_policy(requests[0].policy if requests else self._policy()),
            },
        )

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        (request,) = self._requests([prompt], stop, kwargs)
        engine = self._engine
        pair = engine.pair
        ledger = CompletionLedger(pair.small.info, pair.large.info, len(engine.encode(request.prompt)), self.pricing)
        start = time.perf_counter()
        for event in engine.stream([request]):
            ledger.record(event)
            # lists and strings so that LangChain's chunk merging concatenates them
            info: dict[str, Any] = {
                "models": _ROLE_LETTER[event.role],
                "token_ids": [event.token_id],
                "entropies": [event.entropy],
            }
            if event.finish_reason is not None:
                info["finish_reason"] = event.finish_reason.value
                info["cost"] = ledger.cost(time.perf_counter() - start).to_dict()
            chunk = GenerationChunk(text=event.text, generation_info=info)
            if run_manager is not None:
                run_manager.on_llm_new_token(event.text, chunk=chunk)
            yield chunk


_ROLE_LETTER = {Role.SMALL: "S", Role.LARGE: "L"}


def _generation_info(completion: Completion) -> dict[str, Any]:
    """``models`` has one letter per token: S (small) or L (large)."""
    return {
        "finish_reason": completion.finish_reason.value,
        "cost": completion.cost.to_dict(),
        "models": "".join(_ROLE_LETTER[r] for r in completion.roles),
        "token_ids": list(completion.token_ids),
        "entropies": list(completion.entropies),
    }
