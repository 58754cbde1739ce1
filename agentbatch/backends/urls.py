"""Backend URLs: one string names both the server and the protocol to speak to it.

``vllm://gpu-box:8000`` reads better in a batch spec than an HTTP URL plus a driver flag, and
it lets the registry pick per-server behaviour (capabilities, Dynamo hints) from the scheme.
Parsing is strict and happens before anything is sent, so a typo fails the batch up front with
a ``BatchSpecError`` instead of failing every agent at run time.

Query options: ``?model=NAME`` (a default model) and, on OpenAI-compatible URLs, ``?stream=1``
or ``?stream=0`` (stream chat completions, which measures time-to-first-token and lets the
loop guard stop a runaway reply; off by default because a non-streamed reply costs the
client less CPU, except on ``llamacpp://``, see ``llamacpp.py``); on ``openai://`` and
``anthropic://`` URLs,
``?api_key_env=NAME`` (the variable holding that host's key, see ``api_keys``). Any other
query parameter is refused: the URL is stored in the plan in Redis, so ``?api_key=`` must
never be accepted there.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from urllib.parse import SplitResult, parse_qs, urlsplit

from agentbatch.backends.api_keys import (
    KEY_ENV_OPTION,
    OFFICIAL,
    check_key_env,
    resolve_api_key,
    withheld_key_error,
)
from agentbatch.core.errors import BatchSpecError, ConfigError

_TRUE = ("1", "true", "yes", "on", "")  # a bare ``?stream`` switches it on
_FALSE = ("0", "false", "no", "off")

# Self-hosted OpenAI-compatible servers: plain HTTP unless written ``<scheme>+https://``.
SELF_HOSTED_SCHEMES = ("vllm", "sglang", "dynamo", "sim", "llamacpp")
KNOWN_SCHEMES = (*SELF_HOSTED_SCHEMES, "http", "https", "openai", "anthropic", "bedrock")
# Schemes spoken by ``OpenAICompatBackend``, the driver that can stream (``?stream=1``).
STREAMABLE_SCHEMES = (*SELF_HOSTED_SCHEMES, "http", "https", "openai")

OPENAI_HOST = "api.openai.com"
ANTHROPIC_HOST = "api.anthropic.com"
OPENAI_KEY_ENV = "OPENAI_API_KEY"

QUERY_OPTIONS = ("model", "stream", KEY_ENV_OPTION)

_REGION_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+$")


@dataclass(frozen=True)
class BackendTarget:
    """A parsed backend URL.

    ``scheme`` is the backend kind: one of ``SELF_HOSTED_SCHEMES``, ``"http"`` (any generic
    OpenAI-compatible server, whether reached over http or https), ``"openai"``,
    ``"anthropic"`` or ``"bedrock"``. ``base_url`` never ends in ``/`` or ``/v1``.
    """

    scheme: str
    base_url: str
    raw: str
    region: str | None = None
    model: str | None = None
    # ``?stream=1`` / ``?stream=0``: stream chat completions (TTFT measured, loop guard);
    # None: the driver's default
    stream: bool | None = None
    # Kept out of repr/eq so a target can be logged or compared without leaking the key.
    api_key: str | None = field(default=None, repr=False, compare=False)
    key_env: str | None = None  # ``?api_key_env=``: the NAME of the key's variable, never a key

    @property
    def host(self) -> str:
        """Host name of ``base_url`` (lower-case, no port)."""
        return urlsplit(self.base_url).hostname or ""

    @property
    def display(self) -> str:
        """A short, secret-free name for logs and stats, e.g. ``vllm://10.0.0.5:8000``."""
        if self.scheme == "bedrock":
            return f"bedrock://{self.region}" + (f"/{self.model}" if self.model else "")
        if self.scheme == "http":  # generic server: its own URL says it best (http or https)
            return self.base_url
        netloc_and_path = self.base_url.split("://", 1)[1]
        return f"{self.scheme}://{netloc_and_path}"


# ``[v6]`` then nothing or ``:port``: urlsplit ignores what follows the bracket otherwise.
_BRACKETED_HOST_RE = re.compile(r"^\[[^\]]*\](:[^:]*)?$")
_USERINFO_RE = re.compile(r"//[^/?#]*@")


def _split(url: str) -> SplitResult:
    """``urlsplit`` with a malformed host (an unclosed or junk IPv6 literal) refused as a
    spec error naming the URL, credentials masked, instead of a bare ``ValueError``."""
    try:
        parts = urlsplit(url.strip())
        host_port = parts.netloc.rpartition("@")[2]
        if "[" in host_port and not _BRACKETED_HOST_RE.match(host_port):
            raise ValueError("text after the bracketed IPv6 address")
        parts.hostname  # noqa: B018 - validates the bracketed address
    except ValueError as exc:
        shown = _USERINFO_RE.sub("//***@", url)
        raise BatchSpecError(
            f"invalid host in backend URL {shown!r} ({exc}); an IPv6 address goes in "
            "brackets, e.g. vllm://[::1]:8000"
        ) from None
    return parts


def _known() -> str:
    return ", ".join(f"{s}://" for s in KNOWN_SCHEMES)


def is_local_host(host: str) -> bool:
    """Loopback hosts, where plain http carries no risk of leaking a key on the wire."""
    host = host.lower()
    return host in ("localhost", "::1", "0.0.0.0") or host.startswith("127.")


def _netloc(url: str, parts: SplitResult) -> str:
    """``host[:port]`` with credentials dropped; rejects malformed ports up front."""
    try:
        port = parts.port
    except ValueError:
        raise BatchSpecError(f"invalid port in backend URL {url!r}") from None
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{host}:{port}" if port is not None else host


def _strip_path(path: str) -> str:
    """Drop trailing slashes and one optional ``/v1``: we always append ``/v1/...`` ourselves."""
    path = path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return path.rstrip("/")


def parse_backend_url(
    url: str, *, api_key: str | None = None, trust_key_env: bool = True
) -> BackendTarget:
    """Parse a backend URL; see the module docstring and ``KNOWN_SCHEMES``.

    ``api_key`` overrides the environment, which supplies a key only to the provider's
    official host (``api_keys`` says where other hosts' keys come from). A key is *required*
    for api.openai.com, where a missing ``OPENAI_API_KEY`` raises ``ConfigError`` naming the
    variable. ``trust_key_env=False`` (workers running someone else's plan) honours the URL's
    ``api_key_env`` only when the process's ``AGENTBATCH_API_KEYS`` agrees with it.
    """
    if not isinstance(url, str) or "://" not in url:
        raise BatchSpecError(f"backend URL {url!r} has no scheme; expected one of {_known()}")
    raw = url
    parts = _split(url)
    if parts.password is not None:
        # Refuse rather than echo or silently drop it: keys go in api_key / the environment.
        raise BatchSpecError(
            "backend URLs must not carry credentials; pass api_key or set the key's "
            "environment variable instead"
        )
    query = parse_qs(parts.query, keep_blank_values=True)
    _check_query(parts, query)
    full_scheme = parts.scheme.lower()
    base_scheme, _, transport = full_scheme.partition("+")
    if transport not in ("", "http", "https") or base_scheme not in KNOWN_SCHEMES:
        raise BatchSpecError(
            f"unknown backend scheme {full_scheme!r} in {url!r}; known schemes: {_known()}"
            " (self-hosted ones also accept '+https', e.g. vllm+https://)"
        )
    query_model = (query.get("model") or [""])[0] or None
    stream = _parse_stream(url, query.get("stream"))
    if stream and base_scheme not in STREAMABLE_SCHEMES:
        raise BatchSpecError(
            f"?stream=1 in {url!r}: streaming is an option of OpenAI-compatible backends only"
        )
    key_env = _key_env(url, base_scheme, query.get(KEY_ENV_OPTION))
    target = _parse_target(url, raw, parts, base_scheme, transport, query_model)
    if base_scheme in OFFICIAL:
        target = _with_key(target, api_key, key_env, trust_key_env)
    return replace(target, stream=stream) if stream is not None else target


def _check_query(parts: SplitResult, query: dict[str, list[str]]) -> None:
    """Refuse query parameters we do not know, naming them but never echoing their values
    (the URL goes into the plan in Redis, so a ``?api_key=`` there would be stored)."""
    unknown = sorted(set(query) - set(QUERY_OPTIONS))
    if unknown:
        where = f"{parts.scheme}://{parts.hostname or parts.netloc}"
        raise BatchSpecError(
            f"unknown query parameter(s) {', '.join(map(repr, unknown))} in backend URL "
            f"{where}...; known: {', '.join(QUERY_OPTIONS)}. Keys never go in the URL: use "
            f"AGENTBATCH_API_KEYS or ?{KEY_ENV_OPTION}=ENV_VAR_NAME"
        )


def _key_env(url: str, base_scheme: str, values: list[str] | None) -> str | None:
    """``?api_key_env=NAME``: only on URLs whose driver sends a key, and only a valid name."""
    if not values:
        return None
    if base_scheme not in OFFICIAL:
        raise BatchSpecError(
            f"?{KEY_ENV_OPTION}= in {url!r}: only openai:// and anthropic:// URLs take a key"
        )
    try:
        return check_key_env(values[-1])
    except ConfigError as exc:
        raise BatchSpecError(str(exc)) from None


def _with_key(
    target: BackendTarget, api_key: str | None, key_env: str | None, trust_key_env: bool
) -> BackendTarget:
    """``target`` with the key it may be sent (see ``api_keys``), or a ``ConfigError``."""
    key = resolve_api_key(target.scheme, target.base_url, explicit=api_key, key_env=key_env,
                          trust_key_env=trust_key_env)
    if key is None and os.environ.get(OFFICIAL[target.scheme][1]):
        # Only the official https host would have received it: say so, do not drop it quietly.
        raise withheld_key_error(target.scheme, target.base_url)
    if key is None and target.scheme == "openai" and target.host == OPENAI_HOST:
        raise ConfigError(
            f"{target.raw!r} needs an API key: set the {OPENAI_KEY_ENV} environment variable"
        )
    return replace(target, api_key=key, key_env=key_env)


def _parse_stream(url: str, values: list[str] | None) -> bool | None:
    """``?stream=`` as a bool (None when absent); anything but a plain yes/no is a spec
    error, not a silent no."""
    if not values:
        return None
    value = values[-1].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise BatchSpecError(f"stream={values[-1]!r} in {url!r}: expected stream=1 or stream=0")


def _parse_target(
    url: str,
    raw: str,
    parts: SplitResult,
    base_scheme: str,
    transport: str,
    query_model: str | None,
) -> BackendTarget:
    """The target for an already validated scheme (query options applied by the caller)."""
    if base_scheme == "bedrock":
        return _parse_bedrock(raw, parts, query_model)

    netloc = _netloc(url, parts)
    path = _strip_path(parts.path)

    if base_scheme in ("http", "https"):
        if not netloc:
            raise BatchSpecError(f"backend URL {url!r} needs a host")
        return BackendTarget("http", f"{base_scheme}://{netloc}{path}", raw, model=query_model)

    if base_scheme in SELF_HOSTED_SCHEMES:
        if not netloc:
            raise BatchSpecError(
                f"backend URL {url!r} needs a host, e.g. {base_scheme}://127.0.0.1:8000"
            )
        http = transport or "http"
        return BackendTarget(base_scheme, f"{http}://{netloc}{path}", raw, model=query_model)

    # openai:// and anthropic://: hosted APIs, https unless pointed at a loopback proxy.
    default_host = OPENAI_HOST if base_scheme == "openai" else ANTHROPIC_HOST
    host = parts.hostname or default_host
    http = transport or ("http" if is_local_host(host) else "https")
    base = f"{http}://{netloc or default_host}{path}"
    return BackendTarget(base_scheme, base, raw, model=query_model)


def _parse_bedrock(raw: str, parts: SplitResult, query_model: str | None) -> BackendTarget:
    """``bedrock://REGION[/MODEL]``: the 'host' is an AWS region, the path a model id."""
    region = (parts.netloc or "").lower()
    if not region:
        raise BatchSpecError("bedrock:// URL needs a region, e.g. bedrock://us-east-1")
    if not _REGION_RE.match(region):
        raise BatchSpecError(
            f"bedrock:// URL has {region!r} where an AWS region belongs, e.g. bedrock://us-east-1"
        )
    model = parts.path.strip("/") or query_model
    return BackendTarget(
        "bedrock",
        f"https://bedrock-runtime.{region}.amazonaws.com",
        raw,
        region=region,
        model=model or None,
    )
