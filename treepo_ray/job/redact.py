"""Secrets out of every config that is printed, saved or logged (the console's "resolved config", config.yaml and
configs/attempt-*.yaml, W&B's config, the benchmarks' JSON): the run itself keeps the real values.

A value is replaced by REDACTED when
- its key names a credential: a word of the key (split at `_`, `-`, `.` and camelCase, any case) is one of
  CREDENTIAL_WORDS (hf_token, password, client_secret; not a tokenizer's pad_token or eos_token), or the key has
  `<word>_key` for a word of KEY_QUALIFIERS (api_key, access_key, private_key, apiKey; not prompt_key); at any
  depth, inside free-form mappings (reward_kwargs, engine_kwargs) and lists of mappings too;
- the user lists it in `log.redact_keys`: a dotted path from the top (custom_reward_function.reward_kwargs.url)
  or a bare key name matched at any depth;
- it holds a string in a well-known secret format (SECRET_FORMATS), whatever its key.
Empty values (None, "", {}, []) and booleans are shown as they are: they hold no secret, and "not set" is worth
seeing.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

import yaml

REDACTED = "<redacted>"

CREDENTIAL_WORDS = frozenset({
    "password", "passwd", "passphrase", "secret", "secrets", "token", "credential", "credentials", "apikey", "auth",
    "authorization", "bearer", "cookie",
})
# `<qualifier>_key` names a credential (api_key, private_key); `prompt_key`, `reward_fn_key` do not.
KEY_QUALIFIERS = frozenset({"api", "access", "private", "secret", "signing", "encryption", "auth", "session"})
# `<special>_token` is a tokenizer's special token (pad_token, eos_token_id), not a credential.
SPECIAL_TOKENS = frozenset({"pad", "eos", "bos", "unk", "sep", "cls", "mask"})

# Well-known token formats, found anywhere in a string (a header "Bearer sk-..." included). Kept short: each is a
# prefix its issuer puts on every key, followed by enough key characters that ordinary text does not match.
SECRET_FORMATS = (
    re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"),                 # OpenAI, Anthropic (sk-ant-...) API keys
    re.compile(r"\bhf_[A-Za-z0-9]{30,}"),                   # Hugging Face access tokens
    re.compile(r"\b(?:gh[pousr]_|github_pat_)[A-Za-z0-9_]{30,}"),  # GitHub tokens
    re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"),           # AWS access key ids
    re.compile(r"\bxox[abeprs]-[A-Za-z0-9-]{10,}"),         # Slack tokens
)
# W&B API keys are 40 hex digits, recognisable only by where they are: under a key that mentions wandb.
WANDB_KEY = re.compile(r"\b[0-9a-f]{40}\b")

_WORD_BREAK = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")


def key_words(key: str) -> list[str]:
    """'hfToken' -> ['hf', 'token']; 'OPENAI_API_KEY' -> ['openai', 'api', 'key']."""
    return [w.lower() for w in _WORD_BREAK.split(str(key)) if w]


def names_credential(key: str) -> bool:
    words = key_words(key)
    for i, word in enumerate(words):
        before = words[i - 1] if i > 0 else ""
        if word in CREDENTIAL_WORDS and not (word == "token" and before in SPECIAL_TOKENS):
            return True
        if word == "key" and before in KEY_QUALIFIERS:
            return True
    return False


def looks_secret(value: Any, path: str = "") -> bool:
    """A string in a well-known secret format (a W&B key only under a path that mentions wandb)."""
    if not isinstance(value, str):
        return False
    if any(fmt.search(value) for fmt in SECRET_FORMATS):
        return True
    return "wandb" in path.lower() and bool(WANDB_KEY.search(value))


def _shown_as_is(value: Any) -> bool:
    return value is None or isinstance(value, bool) or (isinstance(value, (str, dict, list, tuple)) and not value)


def listed_keys(config: dict) -> list[str]:
    """The config dict's own `log.redact_keys`."""
    log = config.get("log")
    return list((log.get("redact_keys") or []) if isinstance(log, dict) else [])


def redacted(config: dict, redact_keys: Iterable[str] = ()) -> dict:
    """A copy of the config dict with its secrets replaced by REDACTED (module docstring). `redact_keys` adds to the
    dict's own `log.redact_keys`."""
    listed = {str(k) for k in [*listed_keys(config), *redact_keys]}
    return _walk(config, "", listed)


def _walk(node: Any, path: str, listed: set[str]) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            hidden = names_credential(key) or where in listed or str(key) in listed
            out[key] = REDACTED if hidden and not _shown_as_is(value) else _walk(value, where, listed)
        return out
    if isinstance(node, (list, tuple)):  # a list's items share its path: keys inside a list of mappings still match
        return [_walk(item, path, listed) for item in node]
    return REDACTED if looks_secret(node, path) else node


def redacted_overrides(overrides: Iterable[str], redact_keys: Iterable[str] = ()) -> list[str]:
    """`key=value` command-line overrides as they may be saved or printed, their secrets replaced as in
    `redacted` (a value that is a whole mapping, such as reward_kwargs={...}, is redacted inside)."""
    listed = list(redact_keys)
    return [_redacted_override(str(item), listed) for item in overrides]


def _redacted_override(item: str, redact_keys: list[str]) -> str:
    key, sep, raw = item.partition("=")
    if not sep:
        return REDACTED if looks_secret(item) else item
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    parts = key.split(".")
    tree = value
    for part in reversed(parts):  # the override as the config dict it sets, so that paths and key names match
        tree = {part: tree}
    hidden = redacted(tree, redact_keys)
    for part in parts:
        hidden = hidden[part]
    if hidden is value or hidden == value:
        return item
    return f"{key}={hidden if isinstance(hidden, str) else json.dumps(hidden)}"
