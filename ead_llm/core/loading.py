"""Loading a pair of causal LMs that share a tokenizer, from Hugging Face ids or local folders."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from tenacity import RetryError, Retrying, retry_if_exception, stop_after_attempt, wait_exponential
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ead_llm.core.sources import GGUF_SUFFIX, check_source, hub_unreachable, is_local, model_source
from ead_llm.core.types import Role
from ead_llm.core.validation import check_float, check_int

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LoadOptions(BaseModel):
    """How a pair is loaded and where it runs, apart from which models: the settings of :class:`LoadConfig`, which
    the adapters' constructors (``EntropyAdaptiveLLM(device=..., dtype=...)``) take as they are."""

    model_config = ConfigDict(extra="forbid")

    device: str | None = None
    """``cuda``, ``cpu``, ``cuda:1``...; None picks CUDA when available, else the CPU."""
    dtype: str | None = None
    """``float32``, ``bfloat16`` or ``float16``; None picks bf16 on a GPU that has it, else float32."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of both models."""
    cache_dir: str | None = None
    """Hugging Face cache folder."""
    local_files_only: bool = False
    """Never reach the network (also implied by ``HF_HUB_OFFLINE=1``)."""
    trust_remote_code: bool = False
    """Allow model code from the Hub."""
    load_attempts: int = 4
    """Tries per file set before giving up on transient network or file errors (>= 1)."""
    retry_wait_s: float = 1.0
    """First backoff between tries, doubled each time up to 30 s (>= 0)."""

    @field_validator("load_attempts", mode="before")
    @classmethod
    def _check_attempts(cls, value: Any) -> int:
        return check_int("load_attempts", value, minimum=1)

    @field_validator("retry_wait_s", mode="before")
    @classmethod
    def _check_wait(cls, value: Any) -> float:
        return check_float("retry_wait_s", value, minimum=0.0)

    @field_validator("dtype", mode="before")
    @classmethod
    def _check_dtype(cls, value: Any) -> str | None:
        if value is not None and value not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {value!r}")
        return value

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: Any) -> str | None:
        if value is not None:
            try:
                torch.device(value)
            except (RuntimeError, TypeError):
                raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {value!r}") from None
        return value

    def load_options(self) -> dict[str, Any]:
        """These settings by name (what :class:`LoadConfig` takes besides the models)."""
        return {name: getattr(self, name) for name in LoadOptions.model_fields}


class LoadConfig(LoadOptions):
    """Where the pair comes from and where it runs (frozen: the shared engines' registry is keyed by it, apart from
    ``load_attempts`` and ``retry_wait_s``, which do not change what is loaded)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    small: str
    """Hugging Face id or local folder of the small model."""
    large: str
    """Hugging Face id or local folder of the large model."""

    @field_validator("small", "large", mode="before")
    @classmethod
    def _check_source(cls, value: Any, info: ValidationInfo) -> str:
        return model_source(str(info.field_name), value)

    def _identity(self) -> tuple[Any, ...]:
        return tuple(getattr(self, n) for n in type(self).model_fields if n not in ("load_attempts", "retry_wait_s"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoadConfig) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def resolved_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return DTYPES[self.dtype]
        device = self.resolved_device()
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32

    def hub_kwargs(self) -> dict[str, Any]:
        offline = self.local_files_only or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
        return {
            "revision": self.revision,
            "cache_dir": self.cache_dir,
            "local_files_only": offline,
            "trust_remote_code": self.trust_remote_code,
        }


@dataclass(frozen=True)
class ModelInfo:
    """What the ledger needs to know about one model."""

    source: str
    params: int
    """All parameters (tied weights counted once)."""
    non_embedding_params: int
    """Parameters outside token/position embeddings and an untied output projection."""
    num_layers: int
    attention_width: int
    """Query heads times head size."""
    max_positions: int | None
    """Longest sequence the model accepts, when its config says."""


@dataclass(frozen=True)
class LoadedModel:
    role: Role
    model: PreTrainedModel
    info: ModelInfo


@dataclass(frozen=True)
class ModelPair:
    """Two causal LMs with one vocabulary, ready to run."""

    tokenizer: PreTrainedTokenizerBase
    small: LoadedModel
    large: LoadedModel
    device: torch.device
    vocab_size: int
    """Ids 0..vocab_size-1 are real tokens of both models; padded logit rows beyond are ignored."""
    eos_token_ids: frozenset[int]

    def model(self, role: Role) -> LoadedModel:
        return self.small if role is Role.SMALL else self.large


def describe_model(source: str, model: PreTrainedModel) -> ModelInfo:
    """Parameter counts and attention shape of ``model`` from its modules and config."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    embedding_ids: set[int] = set()
    embedding = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and id(module.weight) not in embedding_ids:
            embedding_ids.add(id(module.weight))
            embedding += module.weight.numel()
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) not in embedding_ids:
        embedding += head.weight.numel()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    max_positions = getattr(config, "max_position_embeddings", None)
    return ModelInfo(
        source=source,
        params=total,
        non_embedding_params=total - embedding,
        num_layers=int(config.num_hidden_layers),
        attention_width=heads * int(head_dim),
        max_positions=int(max_positions) if max_positions else None,
    )


def check_same_vocabulary(small: PreTrainedTokenizerBase, large: PreTrainedTokenizerBase) -> None:
    """Raise ``ValueError`` naming the first id that the two tokenizers map to different tokens."""
    size_small, size_large = len(small), len(large)
    for token_id in range(max(size_small, size_large)):
        token_small = small.convert_ids_to_tokens(token_id) if token_id < size_small else None
        token_large = large.convert_ids_to_tokens(token_id) if token_id < size_large else None
        if token_small != token_large:
            raise ValueError(
                f"the small and large models do not share a tokenizer: id {token_id} is "
                f"{token_small!r} in the small model's and {token_large!r} in the large model's; "
                "pick two models of the same family (same tokenizer)"
            )


def _eos_ids(tokenizer: PreTrainedTokenizerBase, *models: PreTrainedModel) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for model in models:
        config = getattr(model, "generation_config", None)
        value = getattr(config, "eos_token_id", None) if config is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def split_gguf(source: str) -> tuple[str, dict[str, Any]]:
    """``(folder or Hub id, extra from_pretrained arguments)`` of a source: a ``.gguf`` file (local, or
    ``org/repo/file.gguf`` on the Hub) loads through transformers' GGUF support (``gguf_file=``)."""
    if not source.endswith(GGUF_SUFFIX):
        return source, {}
    path = Path(source).expanduser()
    if path.exists():
        return str(path.parent), {"gguf_file": path.name}
    repo, _, file = source.rpartition("/")
    return repo, {"gguf_file": file}


def _gguf_errors(name: str, source: str, error: Exception) -> Exception:
    """What to do about transformers' refusals of a GGUF file, or ``error`` itself."""
    text = str(error)
    if isinstance(error, ImportError) or "requires both PyTorch and GGUF" in text or "accelerate" in text.lower():
        return ImportError(
            f"loading the {name} model from {source!r} needs transformers' GGUF support: "
            f"pip install 'ead-llm[gguf]' (the gguf and accelerate packages) ({text})"
        )
    if "not supported" in text:
        return ValueError(
            f"the {name} model {source!r}: transformers cannot dequantize this GGUF file ({text}); "
            "use the original checkpoint (a Hub id or a folder of safetensors) instead"
        )
    return error


_TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED}
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


def is_transient(error: BaseException) -> bool:
    """Whether a loading error is worth another try: a connection or timeout error, a busy or
    failing file read, or a Hub answer of 408/429/5xx, anywhere in the chain of causes. A missing
    repository, file or permission is not."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ConnectionError | TimeoutError | InterruptedError):
            return True
        if isinstance(current, OSError) and current.errno in _TRANSIENT_ERRNOS:
            return True
        if type(current).__module__.split(".")[0] in ("httpx", "requests", "urllib3") and any(
            word in type(current).__name__ for word in ("Timeout", "Connect", "Network", "Transport", "Protocol")
        ):
            return True
        status = getattr(getattr(current, "response", None), "status_code", None)
        if status in _TRANSIENT_STATUS:
            return True
        current = current.__cause__ or current.__context__
    return False


def _from_pretrained(loader: Any, name: str, source: str, config: LoadConfig, **kwargs: Any) -> Any:
    """``loader.from_pretrained`` with retries (exponential backoff) on transient errors; any other
    error, or the last transient one, is raised as an ``OSError`` that says what to check."""
    retrying = Retrying(
        stop=stop_after_attempt(config.load_attempts),
        wait=wait_exponential(multiplier=config.retry_wait_s, max=30),
        retry=retry_if_exception(is_transient),
    )
    try:
        return retrying(loader.from_pretrained, source, **kwargs)
    except RetryError as err:
        last = err.last_attempt.exception()
        raise OSError(
            f"could not load the {name} model {source!r} after {config.load_attempts} tries ({last}): "
            "check the network and the Hub, or pass a local folder (local_files_only=True works offline)"
        ) from last
    except OSError as err:
        raise OSError(f"could not load the {name} model {source!r}: {err}") from err


def _load(loader: Any, name: str, source: str, config: LoadConfig, **kwargs: Any) -> Any:
    """A tokenizer or model from a Hub id, a folder or a GGUF file."""
    location, gguf = split_gguf(source)
    try:
        return _from_pretrained(loader, name, location, config, **gguf, **kwargs)
    except (ImportError, ValueError, OSError) as err:
        if gguf:
            raise _gguf_errors(name, source, err) from err
        raise


def _load_tokenizer(name: str, source: str, config: LoadConfig, offline: str | None, hub: dict[str, Any]) -> Any:
    """The tokenizer of ``source``; one clear line when the Hub is out of reach (``offline`` says why) and the
    cache does not have it."""
    try:
        return _load(AutoTokenizer, name, source, config, **hub)
    except OSError:
        if offline is None or is_local(source):
            raise
        raise OSError(
            f"the {name} model {source!r} is not in the Hugging Face cache and the Hub cannot be reached "
            f"({offline}): connect to the network, or pass a local folder or .gguf file; with HF_HUB_OFFLINE=1 "
            "(or local_files_only=True) only the cache is read"
        ) from None


def load_pair(config: LoadConfig) -> ModelPair:
    """Load tokenizers and both models, check they share a vocabulary, and put them in eval mode."""
    from ead_llm.drafts.model import register

    register()  # folders of drafts made by ``ead-llm distill`` load like any other model
    check_source("small", config.small)
    check_source("large", config.large)
    hub = config.hub_kwargs()
    offline = None
    if not hub["local_files_only"] and not (is_local(config.small) and is_local(config.large)):
        offline = hub_unreachable()
        if offline is not None:  # the Hub's client would retry for a minute; the cache is all there is
            hub["local_files_only"] = True
    tok_small = _load_tokenizer("small", config.small, config, offline, hub)
    tok_large = _load_tokenizer("large", config.large, config, offline, hub)
    check_same_vocabulary(tok_small, tok_large)
    device = config.resolved_device()
    dtype = config.resolved_dtype()
    models = {}
    for role, source in ((Role.SMALL, config.small), (Role.LARGE, config.large)):
        model = _load(AutoModelForCausalLM, role.value, source, config, dtype=dtype, **hub)
        model.to(device)
        model.eval()
        models[role] = LoadedModel(role=role, model=model, info=describe_model(source, model))
    logit_rows = min(m.model.get_output_embeddings().weight.shape[0] for m in models.values())
    vocab_size = min(len(tok_small), logit_rows)
    return ModelPair(
        tokenizer=tok_small,
        small=models[Role.SMALL],
        large=models[Role.LARGE],
        device=device,
        vocab_size=vocab_size,
        eos_token_ids=_eos_ids(tok_small, models[Role.SMALL].model, models[Role.LARGE].model),
    )
