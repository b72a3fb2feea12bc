"""storage_options: `${ENV_VAR}` expansion at use time, and redaction of credentials from messages.

The job spec keeps the unexpanded text (`secret: ${AWS_SECRET_ACCESS_KEY}`), so nothing that prints or
stores the spec can carry a credential; the values are substituted only when a filesystem is built.
Every substituted value, and every literal value under a credential-like key, is remembered so that
error and log messages can be scrubbed with redact().
"""
from __future__ import annotations

import os
import re
import threading
from typing import Any

REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
SECRET_KEYS = re.compile(r"secret|password|passwd|token|credential|account_key|sas|private|key$|^key|"
                         r"connection_string|signature", re.IGNORECASE)
NOT_SECRET_KEYS = {"key_prefix", "endpoint_url", "region_name", "anon"}
MIN_SECRET_LEN = 4        # shorter values would scrub ordinary words out of messages

_secrets: set[str] = set()
_lock = threading.Lock()


class MissingEnvVar(KeyError):
    """A `${VAR}` reference whose variable is not set; the message names the key."""

    def __str__(self) -> str:
        return self.args[0]


def _remember(value: str) -> None:
    if len(value) >= MIN_SECRET_LEN:
        with _lock:
            _secrets.add(value)


def references(options: Any, where: str) -> list[tuple[str, str]]:
    """(key path, variable) of every `${VAR}` in options (nested dicts and lists)."""
    out = []
    if isinstance(options, dict):
        for k, v in options.items():
            out += references(v, f"{where}.{k}")
    elif isinstance(options, (list, tuple)):
        for i, v in enumerate(options):
            out += references(v, f"{where}[{i}]")
    elif isinstance(options, str):
        out += [(where, m.group(1)) for m in REF.finditer(options)]
    return out


def check_references(options: Any, where: str) -> None:
    """Raise MissingEnvVar naming the first key whose `${VAR}` is unset (job-file validation)."""
    for key, var in references(options, where):
        if var not in os.environ:
            raise MissingEnvVar(f"{key}: environment variable {var} is not set (referenced as ${{{var}}})")


def expand(options: Any, where: str = "storage_options", _key: str = "") -> Any:
    """A copy of options with every `${VAR}` replaced from the environment. Substituted values and
    literal values under credential-like keys are remembered for redact()."""
    if isinstance(options, dict):
        return {k: expand(v, f"{where}.{k}", str(k)) for k, v in options.items()}
    if isinstance(options, list):
        return [expand(v, f"{where}[{i}]", _key) for i, v in enumerate(options)]
    if isinstance(options, tuple):
        return tuple(expand(v, f"{where}[{i}]", _key) for i, v in enumerate(options))
    if not isinstance(options, str):
        return options

    def sub(m: re.Match) -> str:
        var = m.group(1)
        if var not in os.environ:
            raise MissingEnvVar(f"{where}: environment variable {var} is not set (referenced as ${{{var}}})")
        value = os.environ[var]
        _remember(value)
        return value

    value = REF.sub(sub, options)
    if _key and _key.lower() not in NOT_SECRET_KEYS and SECRET_KEYS.search(_key):
        _remember(value)
    return value


def redact(text: str) -> str:
    """text with every remembered credential replaced by `***`."""
    with _lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for s in secrets:
        if s in text:
            text = text.replace(s, "***")
    return text
