"""End to end: the real TRL ``GRPOTrainer`` (simkit.integrations.trl) trains the tiny Llama for
two steps on the CPU with ``num_iterations = 2``, dumps its rollouts, and ``simkit diagnose``
reads both legs. Skipped only when the ``trl`` extra is absent."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")
pytest.importorskip("trl", reason="the trl extra is not installed (pip install 'simkit[trl]')")


def _tokenizer(V=64):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(V - 2)} | {"<pad>": V - 2, "<eos>": V - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _reward(completions, **kwargs):
    """Mean token index / 62: varies between completions, so advantages are not all 0."""
    ids = [[int(t[1:]) for t in c.split() if t[1:].isdigit()] for c in completions]
    return [float(np.mean(x)) / 62.0 if x else 0.0 for x in ids]


@pytest.mark.slow
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_grpo_trainer_dump_feeds_diagnose(tmp_path, top_p):
    from datasets import Dataset
    from trl import GRPOConfig

    from simkit.diagnose import diagnose, read_rollouts
    from simkit.integrations.trl import DumpingGRPOTrainer
    from simkit.lm import models

    torch.manual_seed(0)
    tok = _tokenizer()
    model = models.tiny_llama(vocab_size=64, init_std=0.3)
    model.config.pad_token_id, model.config.eos_token_id = 62, 63
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 62, 63
    prompts = ["t1 t2 t3", "t4 t5 t6", "t7 t8 t9", "t10 t11 t12"]
    data = Dataset.from_dict({"prompt": prompts * 4})
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        num_iterations=2,
        max_steps=2,
        learning_rate=1e-2,
        top_p=top_p,
        temperature=1.0,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        bf16=False,
    )
    dump = tmp_path / "rollouts.parquet"
    trainer = DumpingGRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=args,
        train_dataset=data,
        processing_class=tok,
        dump_path=dump,
    )
    trainer.train()
    ro = read_rollouts(dump)
    assert ro.sources["log_pi"] == "old_per_token_logps"
    assert ro.sources["log_mu"] == "sampling_per_token_logps"
    assert ro.sources["log_pi_update"] == "per_token_logps" and ro.sources["group"] == "prompt_id"
    assert ro.mask.shape[0] == 8 and ro.groups.max() + 1 == 2  # one generation: 2 prompts × 4
    # the second pass updates after the first step: π ≠ π_old on the stale leg
    stale = np.abs(ro.log_pi_update - ro.log_pi)[ro.mask]
    assert stale.max() > 1e-6
    out = tmp_path / "report"
    diagnose(dump, out, n_boot=2, validate=False)
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["legs"]) == {"mismatch", "staleness"} and m["group_size"] == 4
    tr = m["legs"]["mismatch"]["truncation"]
    if top_p < 1.0:
        # generate's top-p: μ renormalised on the nucleus, log w = log K ≤ 0 on every token
        assert tr["share_w_above_1"] == 0.0 and tr["kept_mass"]["value"] < 1.0
    else:
        # same model, same temperature: π_old and μ agree to float32 rounding
        assert np.abs(ro.log_pi - ro.log_mu)[ro.mask].max() < 1e-4
