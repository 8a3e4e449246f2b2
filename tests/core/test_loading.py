"""Loading pairs from local folders: vocabulary checks, parameter counts, device and dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, check_same_vocabulary, describe_model, load_pair
from ead_llm.core.request import Request, SamplingParams
from ead_llm.policies.base import LargeOnly
from ead_llm.testing.tiny import SMALL_SHAPE, build_tiny_pair, char_tokenizer, tiny_model


def test_loads_offline_from_folders(llama_paths, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = LoadConfig(small=str(llama_paths[0]), large=str(llama_paths[1]))
    assert config.hub_kwargs()["local_files_only"] is True
    pair = load_pair(config)
    assert pair.device == torch.device("cpu")
    assert next(pair.small.model.parameters()).dtype == torch.float32
    assert not pair.large.model.training


def test_folders_may_be_paths(llama_paths) -> None:
    """A ``pathlib.Path`` names a folder as its text does (``from_pretrained`` takes both), in the config and the
    adapters; a number is still refused with the field's name."""
    from ead_llm import EntropyAdaptiveLLM

    config = LoadConfig(small=llama_paths[0], large=llama_paths[1])
    assert config == LoadConfig(small=str(llama_paths[0]), large=str(llama_paths[1]))
    assert load_pair(config).small.info.source == str(llama_paths[0])
    llm = EntropyAdaptiveLLM(small=Path(llama_paths[0]), large=Path(llama_paths[1]), max_tokens=4)
    assert llm.small == str(llama_paths[0]) and isinstance(llm.invoke("1+1="), str)
    with pytest.raises(ValueError, match="large must be a Hugging Face model id or a local folder, got 3"):
        LoadConfig(small=llama_paths[0], large=3)


def test_parameter_counts(llama_pair) -> None:
    small = llama_pair.small.model
    info = llama_pair.small.info
    h, layers, mlp, vocab = SMALL_SHAPE.hidden, SMALL_SHAPE.layers, SMALL_SHAPE.mlp, llama_pair.vocab_size
    per_layer = 4 * h * h + 3 * h * mlp + 2 * h  # attention, gated MLP, two RMSNorms
    assert info.non_embedding_params == layers * per_layer + h  # final norm
    assert info.params == sum(p.numel() for p in small.parameters())
    assert info.params - info.non_embedding_params == 2 * vocab * h  # untied input and output embeddings
    assert info.num_layers == layers and info.attention_width == h
    assert llama_pair.large.info.params > 10 * info.params


def test_tied_embeddings_counted_once(gpt2_pair) -> None:
    model = gpt2_pair.small.model
    info = describe_model("x", model)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert info.params == sum(unique.values())
    wte = model.transformer.wte.weight.numel()
    wpe = model.transformer.wpe.weight.numel()
    assert info.params - info.non_embedding_params == wte + wpe


def test_mismatched_tokenizers_name_the_first_differing_id(tmp_path: Path) -> None:
    a = char_tokenizer("0123456789+=")
    b = char_tokenizer("0123456789=+")
    with pytest.raises(ValueError, match=r"id 14 is '\+' in the small model's and '=' in the large"):
        check_same_vocabulary(a, b)
    small, _ = build_tiny_pair(tmp_path / "a", tokenizer=a)
    _, large = build_tiny_pair(tmp_path / "b", tokenizer=b)
    with pytest.raises(ValueError, match="do not share a tokenizer: id 14"):
        load_pair(LoadConfig(small=str(small), large=str(large)))


def test_extra_tokens_in_one_tokenizer_are_refused() -> None:
    with pytest.raises(ValueError, match="id 16 is '#'"):
        check_same_vocabulary(char_tokenizer("0123456789+=#"), char_tokenizer("0123456789+="))


def test_padded_embedding_rows_are_fine(tmp_path: Path) -> None:
    tokenizer = char_tokenizer()
    small_dir, large_dir = tmp_path / "small", tmp_path / "large"
    for folder, seed, pad in ((small_dir, 0, None), (large_dir, 1, 64)):
        model = tiny_model("llama", SMALL_SHAPE, tokenizer, seed=seed)
        if pad:
            model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=pad)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    pair = load_pair(LoadConfig(small=str(small_dir), large=str(large_dir)))
    assert pair.large.model.get_output_embeddings().weight.shape[0] == 128
    assert pair.vocab_size == len(tokenizer)
    done = Engine(pair).generate([Request("12", LargeOnly(), SamplingParams(max_tokens=20, temperature=1.0))])[0]
    assert all(t < len(tokenizer) for t in done.token_ids)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"small": "/does/not/exist", "large": "/does/not/exist"},
            "small model folder '/does/not/exist' does not exist",
        ),
        ({"small": "", "large": "x"}, "small must be"),
        ({"small": "a", "large": "b", "dtype": "float64"}, "dtype must be one of"),
        ({"small": "a", "large": "b", "device": "gpu0"}, "device must be a torch device"),
    ],
)
def test_bad_load_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_pair(LoadConfig(**kwargs))


def test_unknown_hub_id_offline_fails_with_context(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = LoadConfig(small="ead-llm-test/not-a-model", large="ead-llm-test/not-a-model", cache_dir=str(tmp_path))
    with pytest.raises(OSError, match="could not load the small model 'ead-llm-test/not-a-model'"):
        load_pair(config)


class _Recording:
    """A loader that records its keyword arguments and finds nothing (an empty cache)."""

    def __init__(self) -> None:
        self.kwargs: list[dict] = []

    def from_pretrained(self, source: str, **kwargs: object) -> None:
        self.kwargs.append(kwargs)
        raise OSError(f"{source} is not in the cache")


def test_unreachable_hub_reads_only_the_cache_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import ead_llm.core.loading as loading

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(loading, "hub_unreachable", lambda: "huggingface.co does not resolve: no network")
    loader = _Recording()
    monkeypatch.setattr(loading, "AutoTokenizer", loader)
    config = LoadConfig(small="org/small-model", large="org/large-model", load_attempts=5, retry_wait_s=0.0)
    with pytest.raises(OSError, match="not in the Hugging Face cache") as caught:
        load_pair(config)
    message = str(caught.value)
    assert "'org/small-model' is not in the Hugging Face cache" in message
    assert "does not resolve: no network" in message and "HF_HUB_OFFLINE=1" in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # one line, no chain of causes
    assert [k["local_files_only"] for k in loader.kwargs] == [True]  # one try, from the cache only


def test_reachable_hub_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import ead_llm.core.loading as loading

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(loading, "hub_unreachable", lambda: None)
    loader = _Recording()
    monkeypatch.setattr(loading, "AutoTokenizer", loader)
    with pytest.raises(OSError, match="could not load the small model 'org/small-model'"):
        load_pair(LoadConfig(small="org/small-model", large="org/large-model", retry_wait_s=0.0))
    assert [k["local_files_only"] for k in loader.kwargs] == [False]


def test_hub_unreachable_when_its_host_does_not_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from ead_llm.core import sources

    asked: list[str] = []

    def no_dns(host: str, *args: object) -> None:
        asked.append(host)
        raise socket.gaierror(-2, "Name or service not known")

    for name in sources.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.org")
    monkeypatch.setattr(sources.socket, "getaddrinfo", no_dns)
    reason = sources.hub_unreachable()
    assert reason is not None and "hub.example.org does not resolve" in reason and asked == ["hub.example.org"]
    monkeypatch.setattr(sources.socket, "getaddrinfo", lambda *a: [])
    assert sources.hub_unreachable() is None
    monkeypatch.setattr(sources.socket, "getaddrinfo", no_dns)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")  # the proxy resolves names: nothing to check here
    assert sources.hub_unreachable() is None


def test_dtype_and_device_are_overridable(llama_paths) -> None:
    config = LoadConfig(small=str(llama_paths[0]), large=str(llama_paths[1]), device="cpu", dtype="bfloat16")
    pair = load_pair(config)
    assert next(pair.large.model.parameters()).dtype == torch.bfloat16
    done = Engine(pair).generate([Request("1", LargeOnly(), SamplingParams(max_tokens=4))])[0]
    assert len(done.token_ids) >= 1


def test_default_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    config = LoadConfig(small="a", large="b")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert config.resolved_device().type == "cpu" and config.resolved_dtype() == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert config.resolved_device().type == "cuda" and config.resolved_dtype() == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert config.resolved_dtype() == torch.float32


def test_sliding_window_models_are_refused_with_a_reason() -> None:
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    from ead_llm.core.model_runner import check_full_attention

    for config in (
        LlamaConfig(),
        GPT2Config(),
        Qwen2Config(use_sliding_window=False),
        MistralConfig(sliding_window=None),
    ):
        check_full_attention("ok", config)
    with pytest.raises(ValueError, match="sliding"):
        check_full_attention("mistral-0.1", MistralConfig(sliding_window=4096))
    with pytest.raises(ValueError, match="sliding_attention"):
        check_full_attention("hybrid", Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=1))


class _Flaky:
    """A loader whose first ``failures`` calls raise ``error``, then loads for real."""

    def __init__(self, real, failures: int, error: BaseException) -> None:
        self.real, self.failures, self.error, self.calls = real, failures, error, 0

    def from_pretrained(self, source, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self.real.from_pretrained(source, **kwargs)


def test_loading_retries_transient_errors_with_backoff(llama_paths, monkeypatch: pytest.MonkeyPatch) -> None:
    import ead_llm.core.loading as loading

    small, large = map(str, llama_paths)
    flaky = _Flaky(loading.AutoTokenizer, 2, ConnectionError("connection reset by peer"))
    monkeypatch.setattr(loading, "AutoTokenizer", flaky)
    pair = load_pair(LoadConfig(small=small, large=large, retry_wait_s=0.0))
    assert flaky.calls == 4 and pair.vocab_size > 0  # small: 2 failures + 1 success; large: 1


def test_loading_gives_up_with_a_clear_message(llama_paths, monkeypatch: pytest.MonkeyPatch) -> None:
    import ead_llm.core.loading as loading

    small, large = map(str, llama_paths)
    down = _Flaky(loading.AutoTokenizer, 99, TimeoutError("read timed out"))
    monkeypatch.setattr(loading, "AutoTokenizer", down)
    with pytest.raises(OSError, match=r"could not load the small model .* after 3 tries \(read timed out\).*local"):
        load_pair(LoadConfig(small=small, large=large, load_attempts=3, retry_wait_s=0.0))
    assert down.calls == 3
    missing = _Flaky(loading.AutoTokenizer, 99, OSError("org/model is not a valid model identifier (404)"))
    monkeypatch.setattr(loading, "AutoTokenizer", missing)
    with pytest.raises(OSError, match=r"could not load the small model .*404"):
        load_pair(LoadConfig(small=small, large=large, retry_wait_s=0.0))
    assert missing.calls == 1  # not transient: no retry


def test_what_counts_as_transient() -> None:
    import errno
    from types import SimpleNamespace

    from ead_llm.core.loading import is_transient

    http = type("HTTPError", (Exception,), {})
    busy, gone = http("busy"), http("gone")
    busy.response, gone.response = SimpleNamespace(status_code=503), SimpleNamespace(status_code=404)  # type: ignore[attr-defined]
    wrapped = OSError("We couldn't connect to the Hub")
    wrapped.__cause__ = ConnectionError("refused")
    assert is_transient(ConnectionError()) and is_transient(TimeoutError()) and is_transient(busy)
    assert is_transient(OSError(errno.EIO, "i/o error")) and is_transient(wrapped)
    assert not is_transient(gone) and not is_transient(OSError("no file named config.json"))
    assert not is_transient(ValueError("bad config")) and not is_transient(FileNotFoundError(errno.ENOENT, "x"))
    with pytest.raises(ValueError, match="load_attempts"):
        LoadConfig(small="a", large="b", load_attempts=0)
    assert LoadConfig(small="a", large="b", load_attempts=2) == LoadConfig(small="a", large="b")


def test_the_adapters_take_the_load_options_as_they_are() -> None:
    """One declaration of how a pair loads: ``LoadConfig`` and the adapters' constructors share ``LoadOptions``;
    a config's identity (the shared engines' key) leaves out how often loading is retried."""
    from ead_llm.adapters.pair_model import PairModel
    from ead_llm.core.loading import LoadOptions

    assert issubclass(PairModel, LoadOptions) and issubclass(LoadConfig, LoadOptions)
    assert not set(LoadOptions.model_fields) & set(PairModel.__annotations__)  # inherited, not declared again
    same = LoadConfig(small="a", large="b", load_attempts=1, retry_wait_s=0.0)
    assert same == LoadConfig(small="a", large="b") and hash(same) == hash(LoadConfig(small="a", large="b"))
    assert LoadConfig(small="a", large="b", dtype="float16") != LoadConfig(small="a", large="b")
    with pytest.raises(ValueError, match="dtype must be one of"):
        LoadConfig(small="a", large="b", dtype="float8")
