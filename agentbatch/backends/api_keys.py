"""Which API key (if any) goes to which host: keys go only where their owner sent them.

A key taken from the environment (``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``) goes only to the
provider's official host over https. Any other host gets a key only when one is given for it
explicitly, because in distributed mode the batch's URL is written by the *submitter* while the
key lives on the *worker*:

* ``AGENTBATCH_API_KEYS='{"host:port": "ENV_VAR_NAME"}'`` maps a host (``host:port``, or a bare
  ``host`` for every port) to the *name* of the variable holding its key; it is read where the
  request is sent (on the worker), so the plan in Redis never holds a key;
* ``?api_key_env=ENV_VAR_NAME`` on the backend URL names the variable for that one backend. In
  the submitting process it is honoured as written; a worker honours it only when its own
  ``AGENTBATCH_API_KEYS`` maps the host to the same variable, so a plan cannot make a worker
  send one of its variables to a host of the plan's choosing. Either way the name must be
  one ``AGENTBATCH_API_KEYS`` lists or end in ``_API_KEY`` (``check_key_env``), so a URL cannot
  send ``REDIS_PASSWORD`` or ``AWS_SECRET_ACCESS_KEY`` as a bearer token.
"""

from __future__ import annotations

import json
import os
import re
from urllib.parse import urlsplit

from agentbatch.core.errors import ConfigError

API_KEYS_ENV = "AGENTBATCH_API_KEYS"
KEY_ENV_OPTION = "api_key_env"
KEY_SUFFIX = "_API_KEY"  # a variable so named may be given by ?api_key_env= (check_key_env)
# backend scheme -> (official host, environment variable whose key may go to it)
OFFICIAL: dict[str, tuple[str, str]] = {
    "openai": ("api.openai.com", "OPENAI_API_KEY"),
    "anthropic": ("api.anthropic.com", "ANTHROPIC_API_KEY"),
}
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_env_name(name: str, what: str) -> str:
    """``name`` if it can be an environment variable's name; ``ConfigError`` naming ``what``."""
    if not isinstance(name, str) or not _ENV_NAME_RE.match(name):
        raise ConfigError(f"{what} must name an environment variable (letters, digits, _)")
    return name


def check_key_env(name: str) -> str:
    """``name`` if a backend URL may name it as a key's variable; ``ConfigError`` otherwise.

    Any variable of the sending process would otherwise go out as a bearer token; only those
    the operator listed as keys, or named like keys, may.
    """
    check_env_name(name, KEY_ENV_OPTION)
    if name.endswith(KEY_SUFFIX) or name in host_key_map().values():
        return name
    raise ConfigError(
        f"{KEY_ENV_OPTION}={name}: only a variable named *{KEY_SUFFIX} or one that "
        f"{API_KEYS_ENV} lists can hold an API key (e.g. ?{KEY_ENV_OPTION}=LOCAL_LLM"
        f"{KEY_SUFFIX}, or {API_KEYS_ENV}='{{\"host:port\": \"{name}\"}}')")


def host_key_map() -> dict[str, str]:
    """``AGENTBATCH_API_KEYS`` parsed: lower-case ``host[:port]`` -> variable name."""
    raw = os.environ.get(API_KEYS_ENV, "").strip()
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise ConfigError(
            f'{API_KEYS_ENV} must be a JSON object like {{"host:port": "ENV_VAR_NAME"}}'
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f'{API_KEYS_ENV} must be a JSON object like {{"host:port": "ENV_VAR"}}')
    return {
        str(host).strip().lower(): check_env_name(name, f"{API_KEYS_ENV}[{host!r}]")
        for host, name in data.items()
    }


def _read(name: str, netloc: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"the API key for {netloc} is to come from {name}, which is not set")
    return value


def resolve_api_key(
    scheme: str,
    base_url: str,
    *,
    explicit: str | None = None,
    key_env: str | None = None,
    trust_key_env: bool = True,
) -> str | None:
    """The key to send to ``base_url`` for an ``openai``/``anthropic`` backend, or None.

    ``explicit`` (an ``api_key`` argument) wins. ``key_env`` is the URL's ``api_key_env``;
    ``trust_key_env=False`` (workers) accepts it only when ``AGENTBATCH_API_KEYS`` agrees.
    Raises ``ConfigError`` when a named variable is unset or a worker refuses ``key_env``.
    """
    if explicit:
        return explicit
    parts = urlsplit(base_url)
    host = (parts.hostname or "").lower()
    netloc = parts.netloc.lower()
    mapping = host_key_map()
    mapped = mapping.get(netloc) or mapping.get(host)
    if key_env is not None:
        check_key_env(key_env)
        if not trust_key_env and key_env != mapped:
            raise ConfigError(
                f"{KEY_ENV_OPTION}={key_env} for {netloc}: a worker sends a key only to a host "
                f"its own {API_KEYS_ENV} maps to that variable"
            )
        return _read(key_env, netloc)
    if mapped:
        return _read(mapped, netloc)
    official_host, env_name = OFFICIAL[scheme]
    if host == official_host and parts.scheme == "https":
        return os.environ.get(env_name) or None
    return None


def withheld_key_error(scheme: str, base_url: str) -> ConfigError:
    """The error for a non-official host when the environment holds a key we will not send."""
    official_host, env_name = OFFICIAL[scheme]
    netloc = urlsplit(base_url).netloc.lower()
    keyless = f", or write http://{netloc} for a server that needs no key"
    return ConfigError(
        f"{scheme}://{netloc} is not https://{official_host}, so the {env_name} key is not sent to "
        f"it; give it a key explicitly with {API_KEYS_ENV}='{{\"{netloc}\": \"ENV_VAR\"}}' "
        f"(read where the requests are sent) or ?{KEY_ENV_OPTION}=ENV_VAR on the URL"
        + (keyless if scheme == "openai" else "")
    )
