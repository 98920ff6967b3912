"""Where each mapping preset comes from: the upstream library file (or paper) it reproduces.

Pure data, read by the docs hook (``docs/hooks/simkit_docs.py``) for the mapping catalogue.
Nothing in :mod:`simkit` imports this module, so editing it does not change the code hash of
:mod:`simkit.mappings` (which keys every cached figure). ``tests/test_preset_sources.py`` checks
that the table has exactly one entry per (mapping, preset) of the registry.

The verl presets were re-checked at verl-project/verl 1dda039 (:data:`VERL_PRESET_CHANGES`);
the entries that name b178a3c hold at 1dda039 too unless that table says otherwise.

Format: ``PRESET_SOURCES[mapping][preset]`` = ``"repo path/to/file.py (function or option) @
commit"`` for a library preset, ``"paper: ..."`` for a paper's values. "file not confirmed"
marks an entry whose upstream file was not checked against the repository.
"""

VERL = "volcengine/verl"
#: verl moved to verl-project/verl; presets re-checked at 1dda039 (2026-08-22)
VERL_NEW = "verl-project/verl"
TRL = "huggingface/trl"
SKYRL = "NovaSky-AI/SkyRL"
PRIME_RL = "PrimeIntellect-ai/prime-rl"
ROLL = "alibaba/ROLL"
_VERL_CORE_NEW = f"{VERL_NEW} verl/trainer/ppo/core_algos.py"
_SKYRL_PPO = f"{SKYRL} skyrl/backends/skyrl_train/utils/ppo_utils.py"
_DPPO_PAPER = "arXiv 2602.04879"
_VERL_CORE = f"{VERL} verl/trainer/ppo/core_algos.py"
_VERL_RC = f"{VERL} verl/trainer/ppo/rollout_corr_helper.py"
_VERL_CFG = f"{VERL} verl/trainer/config/algorithm.py"
_TRL_CFG = f"{TRL} trl/trainer/grpo_config.py"
_TRL_IS = (
    f"{_TRL_CFG} (vllm_importance_sampling_mode={{mode}}, vllm_importance_sampling_clip_max"
    " default 3.0, clip_min unset) @ f2cd577; applied in trl/trainer/grpo_trainer.py"
)
_ICEPOP = "paper: Ling team 2025 (Ring-1T, IcePop), arXiv 2510.18855, α = 0.5, β = 5"
_RL_COLLAPSE = "paper: Liu, Li et al. 2025 (rl-collapse), arXiv 2512.01374"

PRESET_SOURCES: dict[str, dict[str, str]] = {
    "dual_clip": {
        "paper": "paper: Ye et al. 2020 (AAAI), arXiv 1912.09729, dual-clip loss (c = 3)",
        "verl": f"{_VERL_CORE} (compute_policy_loss_vanilla; clip_ratio_c 3.0 in "
        "verl/trainer/config/actor/actor.yaml) @ b178a3c",
    },
    "dapo": {
        "paper": "paper: Yu et al. 2025 (DAPO), arXiv 2503.14476, §3.1 (clip-higher 0.2/0.28)",
        "verl": f"{_VERL_CORE} (compute_policy_loss_vanilla with clip_ratio_high 0.28, "
        "clip_ratio_c 3.0) @ b178a3c",
    },
    "gspo": {
        "paper": "paper: Zheng et al. 2025 (GSPO), arXiv 2507.18071 (ε 3e-4 / 4e-4)",
        "libraries": f"{VERL} verl/trainer/config/actor/actor.yaml (clip_ratio_low/high 0.2) "
        f"@ b178a3c; {_TRL_CFG} (epsilon 0.2) @ f2cd577",
        "verl": f"{_VERL_CORE} (compute_policy_loss_gspo, clamp(log s, max=10)) @ b178a3c",
    },
    "luffy": {
        "paper": "paper: Yan et al. 2025 (LUFFY), arXiv 2504.14945, policy shaping γ = 0.1",
        "normalized": "paper: Yan et al. 2025, arXiv 2504.14945 (γ = 0.1), rescaled by simkit "
        "so that c(1) = 1 (no upstream file)",
    },
    "cispo": {
        "paper": "paper: MiniMax 2025 (MiniMax-M1), arXiv 2506.13585, Eq. 4 (no lower bound)",
        "verl": f"{VERL} examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh "
        "(clip_ratio_low=10, clip_ratio_high=0.2) @ b178a3c",
        "trl": f"{TRL} trl/trainer/grpo_trainer.py (loss_type cispo, "
        "torch.clamp(coef_1, max=self.epsilon_high)) @ f2cd577; epsilon_high = 5.0 as TRL's "
        "docs recommend (that docs page not confirmed)",
    },
    "tis_token": {
        "verl": f"{_VERL_RC} (compute_rollout_correction_weights; rollout_is_threshold 2.0 in "
        "verl/trainer/config/algorithm.py) @ b178a3c",
        "trl": _TRL_IS.format(mode="token_truncate"),
        "openrlhf": "OpenRLHF/OpenRLHF openrlhf/models/loss.py (PolicyLoss, "
        "vllm_is_truncated_threshold: exp(log ratio).clamp(min=low, max=high)); default "
        "[0.5, 5.0] of is_correction_threshold in openrlhf/cli/train_ppo_ray.py @ 3c3be62",
        "slime": "THUDM/slime slime/utils/arguments.py (--tis-clip default 2.0, --tis-clip-low "
        "default 0) @ 624b824",
    },
    "mis_token": {
        "icepop": _ICEPOP,
        "trl": _TRL_IS.format(mode="token_mask"),
    },
    "mis_seq": {
        "rl_collapse": f"{_RL_COLLAPSE}, sequence MIS W·1[W ≤ 2]",
        "trl": _TRL_IS.format(mode="sequence_mask") + "; sequence_mask is the field's default at "
        "f2cd577 (its docstring's list still calls token_truncate the default)",
    },
    "geo_mask": {
        "rl_collapse": f"{_RL_COLLAPSE}, Geo-Mask band [0.5, 2]",
        "verl": f"{_VERL_CFG} (RolloutCorrectionConfig.decoupled_geo_rs, "
        'rs_threshold "0.999_1.001", as documented) @ b178a3c',
        "verl_head": f"{_VERL_RC} (compute_rollout_rejection_mask, rollout_rs seq_mean_k1, "
        'threshold "0.999_1.001", as computed) @ b178a3c',
    },
    "opsm": {
        "slime": "THUDM/slime slime/utils/arguments.py (--use-opsm, --opsm-delta default 1e-4) "
        "@ 624b824; the formula: DeepSeek-AI 2025 (DeepSeek-V3.2), arXiv 2512.02556",
        "trl": f"{_TRL_CFG} (off_policy_mask_threshold, suggested 0.5) @ f2cd577; applied in "
        "trl/trainer/grpo_trainer.py",
    },
    "vespo": {
        "release": "VESPO release (arXiv 2602.10693 v3 code): lower clamp log W ≥ log(1e-8) "
        "(repository and file not confirmed)",
        "trl": f"{TRL} trl/trainer/grpo_trainer.py (GRPOTrainer.get_gamma_weights, "
        "lower_clamp = math.log(1e-8)) @ f2cd577",
    },
    "icepop": {
        "icepop": _ICEPOP,
        "trl": _TRL_IS.format(mode="token_mask"),
        "verl": f"{VERL_NEW} verl/trainer/config/algorithm.py "
        "(RolloutCorrectionConfig.decoupled_token_icepop and bypass_pg_token_icepop: "
        'rollout_is="token", rollout_is_threshold "0.5_5.0", new at 1dda039); applied in '
        "verl/trainer/ppo/rollout_corr_helper.py (compute_rollout_correction_weights) @ 1dda039",
    },
    "dro": {
        "kimi15": f"{ROLL} roll/pipeline/agentic/agentic_actor_pg_worker.py (_compute_kimi15_loss, "
        "kimi15_tau 0.1) @ 8eb27cc",
    },
    "dppo_tv": {
        "verl": f"{_VERL_CORE_NEW} (compute_policy_loss_dppo_tv); clip_ratio_c 3.0 in "
        "verl/trainer/config/actor/actor.yaml and verl/workers/config/actor.py @ 1dda039",
        "verl_fallback": f"{_VERL_CORE_NEW} (compute_policy_loss_dppo_tv, "
        'config.get("clip_ratio_c", 20.0): only when the key is absent) @ 1dda039',
        "skyrl": f"{_SKYRL_PPO} (dppo_policy_loss, binary_tv, delta 0.2/0.2 in "
        "skyrl/train/config/config.py, no truncation) @ a956457",
        "prime_rl": f"{PRIME_RL} src/prime_rl/trainer/rl/loss.py (default_loss_fn: "
        "dppo_mask 0.2/0.2, kl_tau 1e-3 in packages/prime-rl-configs/src/prime_rl/configs/"
        "trainer.py) @ 559b447",
    },
    "dppo_kl": {
        "verl": f"{_VERL_CORE_NEW} (compute_policy_loss_dppo_kl); clip_ratio_c 3.0 in "
        "verl/trainer/config/actor/actor.yaml @ 1dda039",
        "verl_fallback": f"{_VERL_CORE_NEW} (compute_policy_loss_dppo_kl, "
        'config.get("clip_ratio_c", 20.0)) @ 1dda039',
        "skyrl": f"{_SKYRL_PPO} (dppo_policy_loss, binary_kl, delta 0.2/0.2) @ a956457",
    },
    "luspo": {
        "trl": f"{TRL} trl/trainer/grpo_trainer.py (loss_type luspo; epsilon 0.2 in "
        "trl/trainer/grpo_config.py) @ f2cd577",
    },
    "rollout_is": {
        "skyrl": f"{_SKYRL_PPO} (rollout_is_policy_loss; eps_clip_low/high 0.2 in "
        "skyrl/train/config/config.py) @ a956457",
    },
    "segment_is": {
        "roll": f"{ROLL} roll/utils/train_infer_corrections.py (weight_type segment; "
        "upper_bound 1.2 in roll/configs/base_config.py) @ 8eb27cc",
    },
    "kl_rs": {
        "verl_k3": f"{_VERL_CFG} (RolloutCorrectionConfig.decoupled_k3_rs: rollout_rs "
        "seq_mean_k3, rs_threshold 0.01); mask in verl/trainer/ppo/rollout_corr_helper.py "
        "(compute_rollout_rejection_mask) @ b178a3c",
        "verl_token_k3": f"{_VERL_RC} (compute_rollout_rejection_mask, rollout_rs token_k3) "
        "@ b178a3c; threshold 0.01 taken from decoupled_k3_rs (no verl preset names it)",
    },
}


#: where each 2026 mapping's formula comes from (paper and upstream file at commit), rendered
#: on the catalogue page beside the class docstring (``tests/test_docs_hook.py``)
MAPPING_SOURCES: dict[str, str] = {
    "dro": f"paper: Kimi k1.5, arXiv 2501.12599; {_VERL_CORE_NEW} (compute_policy_loss_dro) @ "
    f"1dda039; {ROLL} roll/pipeline/agentic/agentic_actor_pg_worker.py (_compute_kimi15_loss) @ "
    f"8eb27cc; {PRIME_RL} src/prime_rl/trainer/rl/loss.py (kl_tau·(log r)²) @ 559b447",
    "dppo_tv": f"paper: DPPO, {_DPPO_PAPER}; {_VERL_CORE_NEW} (compute_policy_loss_dppo_tv) @ "
    f"1dda039; {_SKYRL_PPO} (dppo_policy_loss) @ a956457; {PRIME_RL} "
    "src/prime_rl/trainer/rl/loss.py (default_loss_fn) @ 559b447",
    "dppo_kl": f"paper: DPPO, {_DPPO_PAPER}; {_VERL_CORE_NEW} (compute_policy_loss_dppo_kl) @ "
    f"1dda039; {_SKYRL_PPO} (dppo_policy_loss) @ a956457",
    "luspo": f"paper: LUSPO, arXiv 2602.05261; {TRL} trl/trainer/grpo_trainer.py "
    "(loss_type luspo) @ f2cd577",
    "rollout_is": f"{_SKYRL_PPO} (rollout_is_policy_loss) @ a956457",
    "segment_is": f"{ROLL} roll/utils/train_infer_corrections.py (weight_type segment) @ 8eb27cc",
    "gepo": "paper: GEPO, arXiv 2508.17850; yelurebajrang/HeteroRL_GEPO README.md "
    "(importance weight computation) @ 1d53653",
}

#: the verl presets re-checked at verl-project/verl 1dda039 against volcengine/verl b178a3c
#: (rendered on the catalogue page): (mapping, preset, status, what changed or why not)
VERL_PRESET_CHANGES: tuple[tuple[str, str, str, str], ...] = (
    ("dual_clip", "verl", "unchanged", "clip_ratio_c 3.0 in actor.yaml and ActorConfig"),
    ("dapo", "verl", "unchanged", "compute_policy_loss_vanilla unchanged; clip_ratio_c 3.0"),
    ("gspo", "verl", "unchanged", "compute_policy_loss_gspo still clamps log s at 10"),
    (
        "cispo",
        "verl",
        "source moved",
        "clip_ratio_low=10, clip_ratio_high=0.2 as before; the example is now "
        "examples/cispo_trainer/run_qwen3_8b_fsdp.sh (run_cispo_qwen2_5_0_5b_gsm8k.sh removed)",
    ),
    (
        "tis_token",
        "verl",
        "unchanged",
        'rollout_is_threshold 2.0; the threshold may now also be a "lower_upper" string (IcePop)',
    ),
    ("geo_mask", "verl", "unchanged", 'decoupled_geo_rs rs_threshold "0.999_1.001"'),
    ("geo_mask", "verl_head", "unchanged", "compute_rollout_rejection_mask seq_mean_k1 unchanged"),
    ("kl_rs", "verl_k3", "unchanged", "decoupled_k3_rs: seq_mean_k3, 0.01"),
    ("kl_rs", "verl_token_k3", "unchanged", "the 11 rollout_rs options are the same"),
    (
        "icepop",
        "verl",
        "new",
        'decoupled_token_icepop, bypass_pg_token_icepop: token IS zeroed outside "0.5_5.0"',
    ),
    ("dppo_tv", "verl", "new", "compute_policy_loss_dppo_tv (clip_ratio_c 3.0)"),
    ("dppo_tv", "verl_fallback", "new", "clip_ratio_c absent from the config: 20"),
    ("dppo_kl", "verl", "new", "compute_policy_loss_dppo_kl (clip_ratio_c 3.0)"),
    ("dppo_kl", "verl_fallback", "new", "clip_ratio_c absent from the config: 20"),
)
