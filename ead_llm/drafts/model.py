"""A draft that reads its target's hidden states (EAGLE-style), with a head over the target's most frequent tokens.

The draft is one decoder layer (or a few) on top of the target's own features. At position ``p`` it takes the
embedding of token ``x_p`` and the target's final hidden state (after its last norm, what its head reads)
at ``p - 1``, joins them with one linear map, runs its Llama decoder layers with their own attention and KV
cache, normalises, and predicts ``x_{p+1}`` with the target's head restricted to ``draft_vocab_size`` tokens
(FR-Spec, arXiv 2502.14856: the rows of the most frequent tokens; the others get ``-inf``). Its output at ``p``
is also its guess of the target's feature at ``p``: where the target has not run yet (a draft of several
tokens), the next position reads that guess instead (EAGLE, arXiv 2401.15077).

Where no feature exists at all (the first position, or a prompt the draft reads before the target has), the
feature is zero: the draft is trained with zero features over prompts, so it then acts as a small model of
the text alone.

The token embeddings and the head rows are the target's, copied in when the draft is assembled
(:func:`assemble`), so the weights a draft brings of its own are its layers, one linear map and a norm.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

MODEL_TYPE = "ead_feature_draft"


class FeatureDraftConfig(LlamaConfig):
    """A Llama config (one layer by default), plus the size of the draft's head."""

    model_type = MODEL_TYPE

    def __init__(self, draft_vocab_size: int | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("num_hidden_layers", 1)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.draft_vocab_size = draft_vocab_size if draft_vocab_size is not None else self.vocab_size


class FeatureDraft(PreTrainedModel):
    """The draft (see the module docstring). ``forward`` reads whole sequences, for training and checks; the
    engine runs it through :class:`ead_llm.core.fused_draft.FusedDraft` on its paged cache."""

    config_class = FeatureDraftConfig
    base_model_prefix = "draft"
    _supports_sdpa = True
    _supports_attention_backend = True
    reads_target_features = True
    """Marks a model that the engine must hand its target's hidden states (see the runner)."""

    def __init__(self, config: FeatureDraftConfig) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, layer_idx=i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb: Any = LlamaRotaryEmbedding(config)
        self.head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("vocab_index", torch.arange(config.draft_vocab_size), persistent=True)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        """The token embeddings: the draft's logits are over the whole vocabulary (``-inf`` outside its head)."""
        return self.embed_tokens

    def draft_forward(
        self, input_ids: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` [B, T]; ``features`` [B, T, H]: the target's feature at each token's previous position
        (zeros where there is none). Returns the draft's features [B, T, H] and its head's logits [B, T, K]
        (causal over each row; right padding does not reach earlier positions)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        x = self.fc(torch.cat((self.embed_tokens(input_ids), features.to(self.fc.weight.dtype)), dim=-1))
        rotary = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=rotary)
        out = self.norm(x)
        return out, self.head(out)

    def full_logits(self, sub: torch.Tensor) -> torch.Tensor:
        """Head logits [..., K] spread over the vocabulary [..., V], ``-inf`` outside the head's tokens."""
        full = sub.new_full((*sub.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.vocab_index] = sub  # type: ignore[index]
        return full

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutput:
        """Logits over the vocabulary for ``input_ids`` [B, T] given ``features`` (default: none, zeros)."""
        if features is None:
            features = torch.zeros(
                (*input_ids.shape, self.config.hidden_size), dtype=self.fc.weight.dtype, device=input_ids.device
            )
        _, sub = self.draft_forward(input_ids, features, position_ids)
        return CausalLMOutput(logits=self.full_logits(sub))


def register() -> None:
    """Make ``AutoModelForCausalLM.from_pretrained`` load a draft folder (idempotent)."""
    try:
        AutoConfig.register(MODEL_TYPE, FeatureDraftConfig)
        AutoModelForCausalLM.register(FeatureDraftConfig, FeatureDraft)
    except ValueError:  # already registered
        pass


def target_features(target: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The target's final hidden states after its last norm (what its head reads): [B, T, H]."""
    return target.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def previous(features: torch.Tensor) -> torch.Tensor:
    """Features shifted one position right (each position gets its predecessor's; zeros at 0): [B, T, H]."""
    return F.pad(features[:, :-1], (0, 0, 1, 0))


def new_draft(target: Any, vocab_index: torch.Tensor, layers: int = 1, mlp_width: int = 1) -> FeatureDraft:
    """A draft of ``layers`` decoder layers for ``target`` (a Llama-family causal LM), initialised from the
    target's last ``layers`` layers, its embeddings and head rows (``vocab_index``: the tokens it may draft) the
    target's, frozen. ``mlp_width``: each layer's MLP has that many times the target's units (:func:`widened`)."""
    check_shape(len(target.model.layers), layers, mlp_width)
    source = target.config
    config = FeatureDraftConfig(
        draft_vocab_size=int(vocab_index.numel()),
        num_hidden_layers=layers,
        vocab_size=int(source.vocab_size),
        hidden_size=int(source.hidden_size),
        intermediate_size=int(source.intermediate_size) * mlp_width,
        num_attention_heads=int(source.num_attention_heads),
        num_key_value_heads=int(getattr(source, "num_key_value_heads", source.num_attention_heads)),
        head_dim=int(getattr(source, "head_dim", source.hidden_size // source.num_attention_heads)),
        rms_norm_eps=float(source.rms_norm_eps),
        max_position_embeddings=int(source.max_position_embeddings),
        rope_parameters=getattr(source, "rope_parameters", None),
        bos_token_id=source.bos_token_id,
        eos_token_id=source.eos_token_id,
        pad_token_id=source.pad_token_id,
    )
    draft = FeatureDraft(config)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        draft.head.weight.copy_(target.get_output_embeddings().weight[vocab_index])
        draft.vocab_index.copy_(vocab_index)  # type: ignore[operator]
        first = len(target.model.layers) - layers
        for i, mine in enumerate(draft.layers):
            mine.load_state_dict(widened(target.model.layers, first + i, mlp_width))
        draft.norm.weight.copy_(target.model.norm.weight)
        hidden = config.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, :hidden].copy_(torch.eye(hidden))  # starts as the embedding alone
    return draft.to(target.dtype)


def check_shape(target_layers: int, layers: int, mlp_width: int) -> None:
    """A ``ValueError`` unless a draft of ``layers`` layers, each with ``mlp_width`` times the MLP units, can be
    built from a target of ``target_layers`` layers (both start from the target's layers: :func:`widened`)."""
    if not 1 <= layers <= target_layers:
        raise ValueError(f"a draft has 1 to {target_layers} layers for this target, not {layers}")
    if not 1 <= mlp_width <= target_layers:
        raise ValueError(f"a draft's MLP is 1 to {target_layers} times the target's width, not {mlp_width}")


def widened(layers: Any, i: int, times: int) -> dict[str, torch.Tensor]:
    """The state of the target's decoder layer ``layers[i]`` with ``times`` its MLP units: the added units take the
    gate and up rows of the layers before it (``i - 1``, ``i - 2``, ... wrapping round) and zero down columns, so the
    layer computes what the target's does and training grows the rest (Net2Net-style growth)."""
    state = dict(layers[i].state_dict())
    donors = [layers[(i - k) % len(layers)].mlp for k in range(1, times)]
    if donors:
        down = state["mlp.down_proj.weight"]
        state["mlp.gate_proj.weight"] = torch.cat(
            [state["mlp.gate_proj.weight"], *(d.gate_proj.weight for d in donors)]
        )
        state["mlp.up_proj.weight"] = torch.cat([state["mlp.up_proj.weight"], *(d.up_proj.weight for d in donors)])
        state["mlp.down_proj.weight"] = torch.cat([down, down.new_zeros(down.shape[0], down.shape[1] * len(donors))], 1)
    return state


def mlp_width_of(target: Any, config: FeatureDraftConfig) -> int:
    """How many times the target's MLP width a draft's config has (a ``ValueError`` where it is no whole multiple)."""
    times, rest = divmod(int(config.intermediate_size), int(target.config.intermediate_size))
    if rest or times < 1:
        raise ValueError(
            f"the draft's MLP width {config.intermediate_size} is no multiple of its target's "
            f"{target.config.intermediate_size}: is it this target's draft?"
        )
    return times


OWN = ("fc.", "layers.", "norm.")
"""Parameter prefixes that are the draft's own (the rest is copied from the target at assembly)."""


def own_state(draft: FeatureDraft) -> dict[str, torch.Tensor]:
    """The weights a draft brings of its own, and the indices of its head's tokens."""
    state = {k: v for k, v in draft.state_dict().items() if k.startswith(OWN)}
    state["vocab_index"] = draft.vocab_index
    return state


def assemble(target: Any, config: FeatureDraftConfig, own: dict[str, torch.Tensor]) -> FeatureDraft:
    """A whole draft from its own weights (:func:`own_state`) and ``target``'s embeddings and head."""
    draft = new_draft(target, own["vocab_index"].long(), int(config.num_hidden_layers), mlp_width_of(target, config))
    if draft.config.draft_vocab_size != config.draft_vocab_size:
        raise ValueError("the draft's head size does not match its weights")
    missing = [k for k in draft.state_dict() if k.startswith(OWN) and k not in own]
    if missing:
        raise ValueError(f"the draft's own weights lack {missing[:3]}")
    draft.load_state_dict(
        {**draft.state_dict(), **{k: v.to(draft.dtype) for k, v in own.items() if k != "vocab_index"}}
    )
    return draft


def save_folder(folder: Path, model: Any, tokenizer: Any, files: dict[str, str] | None = None) -> None:
    """Write ``model``, ``tokenizer`` and the text ``files`` (name: content) to ``folder`` whole or not at all:
    into a partial folder, then renamed over any earlier ``folder``."""
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    for name, text in (files or {}).items():
        (partial / name).write_text(text)
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    partial.rename(folder)


def card_files(card: dict[str, Any], title: str, intro: str = "") -> dict[str, str]:
    """The text files that go beside a draft: its card as JSON and a README listing it (name: content)."""
    lines = "\n".join(f"- {k}: {v}" for k, v in card.items())
    readme = f"# {title}\n\n" + (f"{intro}\n\n" if intro else "") + lines + "\n"
    return {"draft_card.json": json.dumps(card, indent=1) + "\n", "README.md": readme}


OWN_FILE = "own.safetensors"


def save_own(draft: FeatureDraft, folder: Path) -> None:
    """Write the draft's own weights (float16) and its config to ``folder``: what a project ships, without the
    target's embeddings (:func:`load_own`, then :func:`assemble`)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    own = own_state(draft)
    tensors = {
        k: (v.to(torch.int32) if k == "vocab_index" else v.to(torch.float16)).contiguous() for k, v in own.items()
    }
    save_file(tensors, str(folder / OWN_FILE))
    draft.config.to_json_file(str(folder / "config.json"))


def load_own(folder: Path) -> tuple[FeatureDraftConfig, dict[str, torch.Tensor]]:
    """The config and own weights :func:`save_own` wrote (weights in float32)."""
    from safetensors.torch import load_file

    config = FeatureDraftConfig.from_json_file(str(folder / "config.json"))
    own = {k: v.long() if k == "vocab_index" else v.float() for k, v in load_file(str(folder / OWN_FILE)).items()}
    return config, own
