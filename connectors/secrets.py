"""storage_options: `${ENV_VAR}` expansion at use time, and redaction of credentials from messages.

The job spec keeps the unexpanded text (`secret: ${AWS_SECRET_ACCESS_KEY}`), so nothing that prints or
stores the spec can carry a credential; the values are substituted only when a filesystem is built.
Every value under a credential-like key, and every substituted value of a credential-like variable, is
remembered so that error and log messages can be scrubbed with redact(), which also scrubs the values of
credential-like environment variables (AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AZURE_STORAGE_KEY, ...), read by the
providers' own credential chains without any reference in the job.
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
        if _credential_key(_key) or ENV_SECRET_NAMES.search(var):
            _remember(value)          # not a port or a bucket name: those would scrub ordinary text
        return value

    value = REF.sub(sub, options)
    if _credential_key(_key):
        _remember(value)
    return value


def _credential_key(key: str) -> bool:
    return bool(key) and key.lower() not in NOT_SECRET_KEYS and bool(SECRET_KEYS.search(key))


# environment variables whose values are credentials whether or not a job references them: the provider
# chains (boto, gcloud, azure) read them directly, and an error may echo them
ENV_SECRET_NAMES = re.compile(r"SECRET|PASSW|TOKEN|CREDENTIAL|ACCOUNT_KEY|ACCESS_KEY|API_KEY|PRIVATE_KEY|"
                              r"CONNECTION_STRING|SAS_|_SAS$|SIGNATURE|_KEY$|_KEY_ID$", re.IGNORECASE)
MIN_ENV_SECRET_LEN = 8    # and no whitespace: `TOKENIZERS_PARALLELISM=false` is not a credential


def env_secrets() -> list[str]:
    """Values of credential-like environment variables, as they are now."""
    return [v for k, v in os.environ.items()
            if ENV_SECRET_NAMES.search(k) and len(v) >= MIN_ENV_SECRET_LEN and not any(c.isspace() for c in v)]


def redact(text: str) -> str:
    """text with every remembered credential, and every credential-like environment variable's value,
    replaced by `***`."""
    return redactor()(text)


def redactor():
    """redact() with the credentials of this moment looked up once (for many texts in a row)."""
    with _lock:
        secrets = sorted(set(_secrets) | set(env_secrets()), key=len, reverse=True)

    def scrub(text: str) -> str:
        for s in secrets:
            if s in text:
                text = text.replace(s, "***")
        return text
    return scrub
