"""Prompts with verifiable rewards for the gradient study (:mod:`simkit.lm.experiment`).

RLVR rewards are programs, not learned models: a checker reads the response and returns a
number (DeepSeek-R1, Guo et al. 2025, §2.2.2 "rule-based rewards": accuracy and format
rewards). This module provides small checkers (pure functions, one per rule) and tasks that
pair a list of prompts with a checker:

- :class:`TokenTask` works on token ids only, so it runs on a random-init model without a
  tokenizer (the tiny Llama of the tests): R = 1 if a ``target`` token appears in the response
  (``kind="presence"``) or R = the fraction of response tokens equal to it (``"fraction"``).
- :class:`ArithmeticTask` ("What is 3+4?" → the first integer of the decoded response must be
  7) and :class:`KeywordTask` ("What is the capital of France?" → the response must contain
  "Paris") need a tokenizer (SmolLM2's).

Every task has ``prompt_ids(tokenizer=None) -> list[list[int]]`` (one token-id list per prompt)
and ``rewards(prompt_index, response_ids, response_mask, tokenizer=None) -> (N,) float64``
where ``prompt_index`` (N,) says which prompt each response answers, ``response_ids`` (N, T)
the sampled tokens and ``response_mask`` (N, T) which of them are valid (before/at EOS).
Prompts are drawn uniformly, so J = mean over prompts of E[R | prompt].
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from simkit._validation import positive_int

#: task name -> class (see :func:`get_task`)
TASKS: dict[str, type] = {}
_INTEGER = re.compile(r"[-+]?\d+")


# --- checkers (pure) -------------------------------------------------------------------------


def parse_first_integer(text: str) -> int | None:
    """The first integer written in ``text`` (optional sign, ASCII digits), or None."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


def arithmetic_reward(text: str, expected: int) -> float:
    """1.0 if the first integer of ``text`` equals ``expected``, else 0.0 (accuracy reward)."""
    return 1.0 if parse_first_integer(text) == int(expected) else 0.0


def contains_keyword(text: str, keyword: str) -> bool:
    """True iff ``keyword`` occurs in ``text`` as a whole word, ignoring case."""
    if not keyword:
        raise ValueError("keyword must be a non-empty string")
    return re.search(rf"(?<!\w){re.escape(keyword)}(?!\w)", text, flags=re.IGNORECASE) is not None


def token_presence_reward(response_ids, response_mask, target: int) -> np.ndarray:
    """R_i = 1 if token ``target`` is among the valid tokens of response i, else 0; (N,).

    ``response_ids`` (N, T) int and ``response_mask`` (N, T) bool (numpy or torch arrays).
    """
    ids, mask = _ids_and_mask(response_ids, response_mask)
    return np.any((ids == target) & mask, axis=1).astype(np.float64)


def token_fraction_reward(response_ids, response_mask, target: int) -> np.ndarray:
    """R_i = (number of valid tokens equal to ``target``) / (number of valid tokens); (N,).

    An empty response gets 0.
    """
    ids, mask = _ids_and_mask(response_ids, response_mask)
    hits = np.sum((ids == target) & mask, axis=1)
    lengths = mask.sum(axis=1)
    return np.divide(hits, lengths, out=np.zeros(len(ids)), where=lengths > 0)


def _ids_and_mask(response_ids, response_mask) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(_to_numpy(response_ids))
    mask = np.asarray(_to_numpy(response_mask)).astype(bool)
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise ValueError(
            f"response_ids and response_mask must both have shape (N, T), got {ids.shape} and "
            f"{mask.shape}"
        )
    return ids, mask


def _to_numpy(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x


def _check_index(prompt_index, n_prompts: int, n: int) -> np.ndarray:
    idx = np.asarray(_to_numpy(prompt_index))
    if idx.shape != (n,) or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"prompt_index must be an integer array of shape ({n},), got {idx.shape}")
    if n and (idx.min() < 0 or idx.max() >= n_prompts):
        raise ValueError(f"prompt_index entries must be in [0, {n_prompts}), got {idx.min()}..")
    return idx


def _decode(tokenizer, response_ids, response_mask) -> list[str]:
    if tokenizer is None:
        raise ValueError("this task needs a tokenizer to decode the responses")
    ids, mask = _ids_and_mask(response_ids, response_mask)
    return [
        tokenizer.decode([int(t) for t in row[m]], skip_special_tokens=True)
        for row, m in zip(ids, mask)
    ]


def _encode(tokenizer, text: str, chat: bool) -> list[int]:
    if tokenizer is None:
        raise ValueError("this task needs a tokenizer to encode its prompts")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text)["input_ids"]]


def _register(cls):
    TASKS[cls.name] = cls
    return cls


# --- tasks -----------------------------------------------------------------------------------


@_register
@dataclass(frozen=True)
class TokenTask:
    """Token-level verifiable reward for tokenizer-free models (module docstring).

    ``n_prompts`` random prompts of ``prompt_length`` tokens in [0, ``vocab_size``) from
    ``seed``; R = 1{``target`` ∈ response} (``kind="presence"``) or the fraction of response
    tokens equal to ``target`` (``kind="fraction"``).
    """

    vocab_size: int = 64
    target: int = 1
    n_prompts: int = 4
    prompt_length: int = 4
    kind: str = "presence"
    seed: int = 0
    name = "token"

    def __post_init__(self):
        positive_int(self.vocab_size, "vocab_size")
        positive_int(self.n_prompts, "n_prompts")
        positive_int(self.prompt_length, "prompt_length")
        if not 0 <= self.target < self.vocab_size:
            raise ValueError(f"target must be a token in [0, {self.vocab_size}), got {self.target}")
        if self.kind not in ("presence", "fraction"):
            raise ValueError(f"kind must be 'presence' or 'fraction', got {self.kind!r}")

    def prompt_ids(self, tokenizer=None) -> list[list[int]]:
        rng = np.random.default_rng(self.seed)
        ids = rng.integers(0, self.vocab_size, size=(self.n_prompts, self.prompt_length))
        return [[int(t) for t in row] for row in ids]

    def rewards(self, prompt_index, response_ids, response_mask, tokenizer=None) -> np.ndarray:
        ids, mask = _ids_and_mask(response_ids, response_mask)
        _check_index(prompt_index, self.n_prompts, len(ids))
        fn = token_presence_reward if self.kind == "presence" else token_fraction_reward
        return fn(ids, mask, self.target)


@_register
@dataclass(frozen=True)
class ArithmeticTask:
    """ "What is a+b?" with a, b uniform in [0, ``max_operand``] from ``seed``; R = 1 iff the first
    integer of the decoded response is a + b (:func:`arithmetic_reward`). Prompts use the
    tokenizer's chat template when ``chat`` and one exists."""

    n_prompts: int = 8
    max_operand: int = 9
    chat: bool = True
    seed: int = 0
    name = "arithmetic"

    def __post_init__(self):
        positive_int(self.n_prompts, "n_prompts")
        positive_int(self.max_operand, "max_operand")

    def questions(self) -> list[tuple[str, int]]:
        """(question, expected answer) pairs."""
        rng = np.random.default_rng(self.seed)
        pairs = rng.integers(0, self.max_operand + 1, size=(self.n_prompts, 2))
        return [(f"What is {a}+{b}? Answer with the number only.", int(a + b)) for a, b in pairs]

    def prompt_ids(self, tokenizer=None) -> list[list[int]]:
        return [_encode(tokenizer, q, self.chat) for q, _ in self.questions()]

    def rewards(self, prompt_index, response_ids, response_mask, tokenizer=None) -> np.ndarray:
        texts = _decode(tokenizer, response_ids, response_mask)
        idx = _check_index(prompt_index, self.n_prompts, len(texts))
        answers = [a for _, a in self.questions()]
        return np.array([arithmetic_reward(t, answers[i]) for t, i in zip(texts, idx)])


#: (question, keyword) pairs of :class:`KeywordTask`
KEYWORD_QUESTIONS = (
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the largest planet of the solar system?", "Jupiter"),
    ("Which gas do plants absorb from the air?", "carbon"),
    ("What colour is the sky on a clear day?", "blue"),
    ("What is the capital of Italy?", "Rome"),
    ("How many legs does a spider have?", "eight"),
    ("What is frozen water called?", "ice"),
)


@_register
@dataclass(frozen=True)
class KeywordTask:
    """Short factual questions; R = 1 iff the response contains the expected keyword
    (:func:`contains_keyword`, whole word, case-insensitive). The first ``n_prompts`` of
    :data:`KEYWORD_QUESTIONS`."""

    n_prompts: int = 8
    chat: bool = True
    name = "keyword"

    def __post_init__(self):
        positive_int(self.n_prompts, "n_prompts")
        if self.n_prompts > len(KEYWORD_QUESTIONS):
            raise ValueError(f"n_prompts must be <= {len(KEYWORD_QUESTIONS)}, got {self.n_prompts}")

    def prompt_ids(self, tokenizer=None) -> list[list[int]]:
        return [_encode(tokenizer, q, self.chat) for q, _ in KEYWORD_QUESTIONS[: self.n_prompts]]

    def rewards(self, prompt_index, response_ids, response_mask, tokenizer=None) -> np.ndarray:
        texts = _decode(tokenizer, response_ids, response_mask)
        idx = _check_index(prompt_index, self.n_prompts, len(texts))
        return np.array(
            [float(contains_keyword(t, KEYWORD_QUESTIONS[i][1])) for t, i in zip(texts, idx)]
        )


def get_task(name: str, **kwargs):
    """Build task ``name`` (``"token"``, ``"arithmetic"``, ``"keyword"``) with keyword settings."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; available tasks: {', '.join(TASKS)}") from None
    return cls(**kwargs)
