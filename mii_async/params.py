"""SamplingParams: what a caller may ask of one generation, its validation and its one wire form.

Every value is checked in `__post_init__`; a bad one raises `InvalidParameterError` naming the field, so a bad
request is answered with an error before any engine sees it. Checked once per trust boundary: at the edge
(the client library, the gateway: `from_kwargs`) and in the router (`from_wire`); a worker takes its router's
as they come (`from_wire(trusted=True)`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .errors import InvalidParameterError
from .guided import GUIDED_FIELDS, check_regex, normalize_choice, normalize_json_schema, schema_regex
from .text.unicode_text import check_text

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024    # entries of logit_bias
MAX_ALLOWED_TOKEN_IDS = 1 << 17  # entries of allowed_token_ids (a large vocabulary's size)
MAX_STOP_STRING_LEN = 256
MAX_INT = 2**31 - 1      # bound on counts (max_new_tokens, top_k, …): larger values mean nothing and overflow
MAX_TOKEN_ID = 2**32 - 1 # token ids travel as uint32
GREEDY_BELOW = 1e-5      # a temperature under this is greedy


@dataclass(frozen=True)
class SamplingParams:
    """One request's generation settings. Greedy unless `temperature` ≥ GREEDY_BELOW (and `do_sample` is not
    False); `do_sample=True` without a temperature samples at 1.0."""

    max_new_tokens: int = 128          # upper bound on generated tokens (finish_reason "length")
    min_new_tokens: int = 0            # EOS and stop ids are masked, stop strings not matched, until this many exist
    temperature: float | None = None   # under GREEDY_BELOW (1e-5) means greedy; not given (None): 1.0 with
                                       # do_sample=True (transformers, DeepSpeed-MII), else 0.0 (greedy)
    top_p: float = 1.0                 # nucleus mass in (0, 1]
    top_k: int = 0                     # 0 (or -1) disables
    min_p: float = 0.0                 # drop tokens below min_p * p(max token)
    repetition_penalty: float = 1.0    # CTRL-style, over prompt and output tokens (HF semantics)
    presence_penalty: float = 0.0      # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0     # OpenAI semantics, over output tokens
    seed: int | None = None            # per-request generator: same output whatever else is batched
    stop: tuple[str, ...] = ()         # stop strings, matched across token boundaries
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end the request (besides EOS)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False           # keep going past EOS (benchmarks)
    logprobs: int | None = None        # None: none; n: the sampled token's logprob plus the top n
    prompt_logprobs: int | None = None # None: none; n: each prompt token's logprob given the tokens before it
                                       # (None for the first) plus the top n there; the prompt is computed
                                       # whole (no prefix-cache hits)
    skip_special_tokens: bool = True   # when detokenizing
    return_full_text: bool = False     # DeepSpeed-MII: prepend the prompt to generated_text
    do_sample: bool | None = None      # DeepSpeed-MII/HF: False forces greedy
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits before
                                       # choosing (OpenAI semantics); given as a dict {id: bias} (keys may be
                                       # strings of digits, as in JSON) or as pairs; kept sorted by id
    guided_json: str | None = None     # the output is JSON matching this schema (a dict or its JSON text; kept
                                       # as text); {"type": "object"}: any JSON object (OpenAI's JSON mode)
    guided_regex: str | None = None    # the output matches this regular expression
    guided_choice: tuple[str, ...] | None = None  # the output is one of these strings
    allowed_token_ids: tuple[int, ...] | None = None  # only these ids may be sampled (vLLM's), masked before the
                                       # logprobs are taken as a guide's are; kept sorted, each once; None: any
    priority: int = 0                  # the order among waiting requests (vLLM's): lower first, then arrival;
                                       # a running request is never preempted for a waiting one

    def __post_init__(self) -> None:
        _int(self, "max_new_tokens", lo=1, hi=MAX_INT)
        _int(self, "min_new_tokens", lo=0, hi=MAX_INT)
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidParameterError("min_new_tokens", f"{self.min_new_tokens} exceeds max_new_tokens={self.max_new_tokens}")
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise InvalidParameterError("do_sample", "must be true, false or null")
        if self.temperature is None:
            object.__setattr__(self, "temperature", 1.0 if self.do_sample else 0.0)
        _float(self, "temperature", lo=0.0, hi=100.0)
        _float(self, "top_p", lo=0.0, hi=1.0, lo_open=True)
        _int(self, "top_k", lo=-1, hi=MAX_INT)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _float(self, "min_p", lo=0.0, hi=1.0)
        _float(self, "repetition_penalty", lo=0.0, hi=100.0, lo_open=True)
        _float(self, "presence_penalty", lo=-2.0, hi=2.0)
        _float(self, "frequency_penalty", lo=-2.0, hi=2.0)
        if self.seed is not None:
            _int(self, "seed", lo=0, hi=2**63 - 1)
        _int(self, "priority", lo=-MAX_INT - 1, hi=MAX_INT)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InvalidParameterError("stop", "must be a string or a list of strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidParameterError("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for s in stop:
            if not s or len(s) > MAX_STOP_STRING_LEN:
                raise InvalidParameterError("stop", f"each stop string must have 1 to {MAX_STOP_STRING_LEN} characters")
        check_text("stop", stop)
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and 0 <= i <= MAX_TOKEN_ID for i in ids):
            raise InvalidParameterError("stop_token_ids", "must be a list of token ids (integers in [0, 2**32))")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParameterError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "return_full_text"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(name, "must be true or false")
        if self.logprobs is not None:
            _int(self, "logprobs", lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int(self, "prompt_logprobs", lo=0, hi=MAX_LOGPROBS)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _allowed_ids(self.allowed_token_ids))
        named = [f for f in GUIDED_FIELDS if getattr(self, f) is not None]
        if len(named) > 1:
            raise InvalidParameterError(named[1], f"only one of {', '.join(GUIDED_FIELDS)} may be given")
        if self.guided_json is not None:
            object.__setattr__(self, "guided_json", normalize_json_schema(self.guided_json))
            schema_regex(self.guided_json)             # a schema the compiler refuses is the caller's error
        elif self.guided_regex is not None:
            check_regex(self.guided_regex)
        elif self.guided_choice is not None:
            object.__setattr__(self, "guided_choice", normalize_choice(self.guided_choice))

    @property
    def guide(self) -> tuple[str, Any] | None:
        """(field, value) of the request's guided generation, or None."""
        for f in GUIDED_FIELDS:
            if (v := getattr(self, f)) is not None:
                return f, v
        return None

    @property
    def greedy(self) -> bool:
        """Temperatures under GREEDY_BELOW are greedy too: logits divided by one overflow (vLLM does the same)."""
        return self.do_sample is False or self.temperature < GREEDY_BELOW

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SamplingParams:
        """Build from a caller's keyword arguments; an unknown key is an error that names it."""
        unknown = sorted(set(kwargs) - _FIELDS)
        if unknown:
            raise InvalidParameterError(unknown[0], f"unknown sampling parameter; known ones: {', '.join(sorted(_FIELDS))}")
        return cls(**kwargs)

    def check_vocab(self, vocab_size: int) -> None:
        """Checks what needs the model: token ids inside the vocabulary."""
        for i in self.stop_token_ids:
            if i >= vocab_size:
                raise InvalidParameterError("stop_token_ids", f"id {i} is outside the vocabulary (size {vocab_size})")
        if self.allowed_token_ids and self.allowed_token_ids[-1] >= vocab_size:
            raise InvalidParameterError("allowed_token_ids", f"id {self.allowed_token_ids[-1]} is outside the "
                                                             f"vocabulary (size {vocab_size})")
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            raise InvalidParameterError("logit_bias", f"id {self.logit_bias[-1][0]} is outside the vocabulary "
                                                      f"(size {vocab_size})")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_wire(self) -> dict[str, Any]:
        """The one wire form (Generate.params, AddRequest.params): every field by name, as checked and
        normalized here, tuples as lists (logit_bias as [[id, bias], …])."""
        out = {name: getattr(self, name) for name in _NAMES}
        for name in _TUPLES:
            if (v := out[name]) is not None:
                out[name] = list(v)
        out["logit_bias"] = [list(e) for e in self.logit_bias]
        return out

    @classmethod
    def from_wire(cls, wire: dict[str, Any], *, trusted: bool = False) -> SamplingParams:
        """`to_wire`'s map back. Checked as `from_kwargs` checks a caller's (the router: what a client sent
        may be anything), unless `trusted`: a worker builds its router's, which the router checked and
        normalized, without checking them again."""
        if not trusted:
            return cls.from_kwargs(**wire)
        assert wire.keys() == _FIELDS, f"not SamplingParams.to_wire()'s fields: {sorted(wire.keys() ^ _FIELDS)}"
        p = object.__new__(cls)
        for name in _NAMES:
            object.__setattr__(p, name, wire[name])
        for name in _TUPLES:
            if (v := wire[name]) is not None:
                object.__setattr__(p, name, tuple(v))
        object.__setattr__(p, "logit_bias", tuple((i, b) for i, b in wire["logit_bias"]))
        return p


_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))
_FIELDS = set(_NAMES)
_TUPLES = ("stop", "stop_token_ids", "guided_choice", "allowed_token_ids")   # tuples of scalars: lists on the wire


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _allowed_ids(v: Any) -> tuple[int, ...]:
    """A non-empty list of token ids → sorted distinct ids, checked."""
    if not isinstance(v, (list, tuple)) or not v or not all(_is_int(i) and 0 <= i <= MAX_TOKEN_ID for i in v):
        raise InvalidParameterError("allowed_token_ids", "must be a non-empty list of token ids (integers in "
                                                         "[0, 2**32))")
    if len(v) > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidParameterError("allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(v)}")
    return tuple(sorted(set(v)))


def _logit_bias(v: Any) -> tuple[tuple[int, float], ...]:
    """{id: bias} (ids as ints or strings of digits) or [(id, bias), …] → sorted ((id, bias), …), checked."""
    if isinstance(v, dict):
        v = list(v.items())
    if not isinstance(v, (list, tuple)) or not all(isinstance(e, (list, tuple)) and len(e) == 2 for e in v):
        raise InvalidParameterError("logit_bias", "must map token ids to biases: {id: bias}")
    if len(v) > MAX_LOGIT_BIAS:
        raise InvalidParameterError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
    out: dict[int, float] = {}
    for key, bias in v:
        tid = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 11 else key
        if not _is_int(tid) or not 0 <= tid <= MAX_TOKEN_ID:
            raise InvalidParameterError("logit_bias", f"keys must be token ids (integers in [0, 2**32)), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:   # (NaN too)
            raise InvalidParameterError("logit_bias", f"the bias of token {tid} must be a number in [-100, 100], "
                                                      f"got {bias!r}")
        if tid in out:
            raise InvalidParameterError("logit_bias", f"token {tid} appears twice")
        out[tid] = float(bias)
    return tuple(sorted(out.items()))


def _int(p: SamplingParams, name: str, lo: int, hi: int | None = None) -> None:
    v = getattr(p, name)
    if not _is_int(v):
        raise InvalidParameterError(name, f"must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        raise InvalidParameterError(name, f"must be in [{lo}, {hi if hi is not None else '∞'}], got {v}")


def _float(p: SamplingParams, name: str, lo: float, hi: float, lo_open: bool = False) -> None:
    v = getattr(p, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidParameterError(name, f"must be a number, got {v!r}")
    try:
        v = float(v)
    except OverflowError:                 # an integer too large for a float
        raise InvalidParameterError(name, f"must be in [{lo}, {hi}], got an integer of {v.bit_length()} bits") from None
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        raise InvalidParameterError(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    object.__setattr__(p, name, v)
