"""Settings of the HTTP service, read from ``SPECSERVE_*`` environment variables and ``specserve serve`` flags.

Flags win over the environment, the environment over the defaults. Every field here has a flag of the same
name in ``specserve serve`` (``max_queue_size`` is ``--max-queue-size``) and a variable in upper case with the
prefix (``SPECSERVE_MAX_QUEUE_SIZE``). The flags are generated from these fields (``app.cli``): the help is
the field's description and its default, the type its annotation (a bool is ``--x`` / ``--no-x``, a
``Literal`` lists its choices, ``json_schema_extra={"several": True}`` takes several values, joined with
commas), so a new setting needs no other code to become a flag.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.engine.defaults import (
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_DRAFT_SCHEDULE,
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    DEFAULT_PREFILL_STEP_SECONDS,
    DEFAULT_PREFIX_CACHE_MB,
    DEFAULT_SUFFIX_INDEX_MB,
    DEFAULT_TENANT_CACHE_SHARE,
    DRAFT_WEIGHTS_HELP,
    MAX_DRAFT_TOKENS,
    WEIGHTS_HELP,
)
from app.engine.drafting.registry import REGISTRY


class Settings(BaseSettings):
    """Everything the service is configured with."""

    model_config = SettingsConfigDict(env_prefix="SPECSERVE_", extra="ignore", frozen=True)

    target: str = Field(
        "smollm2-135m-instruct",
        description="target model: catalog name, path, or Hugging Face Hub id (owner/repo, owner/repo:QUANT)",
    )
    draft: str = Field(
        "default",
        description="default draft: `default` (the hybrid of lookups and the catalog's draft; `suffix` for a target "
        f"without one), `none`, a built-in drafter ({', '.join(f'`{name}`' for name in REGISTRY)}: "
        "app/engine/drafting/registry.py), or a draft model's catalog name or path",
    )
    num_draft_tokens: int = Field(
        DEFAULT_NUM_DRAFT_TOKENS,
        ge=0,
        le=MAX_DRAFT_TOKENS,
        description="tokens drafted per step unless a request says; the most, when adaptive",
    )
    draft_schedule: Literal["adaptive", "heuristic", "fixed"] = Field(
        DEFAULT_DRAFT_SCHEDULE,
        description="draft length per step: `adaptive` (from measured acceptance and costs), `heuristic` "
        "(+2 after a full accept, -1 otherwise) or `fixed`",
    )
    draft_p_min: float = Field(
        DEFAULT_DRAFT_P_MIN,
        ge=0.0,
        le=1.0,
        description="a model draft stops proposing below this top probability; 0: never",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="weights and activations")
    weights: Literal["auto", "native", "bf16", "float32"] = Field("auto", description=WEIGHTS_HELP)
    draft_weights: Literal["auto", "q8_0", "q4_0", "bf16"] = Field("auto", description=DRAFT_WEIGHTS_HELP)
    device: str = Field("auto", description="`auto`, `cpu`, `cuda` or `cuda:N`")
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 for every interface)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on")
    model_name: str | None = Field(None, description="the model id the OpenAI API reports (default: the target's name)")
    served_model_name: str = Field(
        "",
        description="aliases the OpenAI API also accepts as `model`, comma-separated (the flag also takes them "
        "space-separated, as vLLM's --served-model-name); answers still name model_name",
        json_schema_extra={"several": True},  # --served-model-name a b, as vLLM's; joined with commas
    )
    max_concurrent_requests: int = Field(
        32,
        ge=1,
        le=256,
        description="most generations the worker interleaves at once; within it, requests are admitted by "
        "kv_cache_memory",
    )
    kv_cache_memory: str = Field(
        "auto",
        description="bytes of KV cache the running generations may hold together: a request starts while its cache "
        "(allocated whole when it starts: prompt plus max_new_tokens, its draft's included) fits beside theirs, "
        "else it waits in the queue. A number of bytes, or with a unit: 512MiB, 8GiB, 2GB. `auto`: half the "
        "memory available at start-up (MemAvailable, or the cgroup's memory limit less its usage where lower, as "
        "in a container; free GPU memory on CUDA), else what four full-length requests hold",
    )
    prefill_chunk_tokens: int = Field(
        DEFAULT_PREFILL_CHUNK_TOKENS,
        ge=0,
        le=65_536,
        description="most prompt tokens prefilled per step beside the running requests (0: a prompt whole, "
        "before them); only on the CPU kernels, whose rows do not depend on the batch, where it changes no token",
    )
    prefill_step_seconds: float = Field(
        DEFAULT_PREFILL_STEP_SECONDS,
        ge=0,
        le=60,
        description="chunked prefill sizes its chunks, from measured costs, so that a step takes about this long "
        "while requests decode (what a running stream waits at most between tokens while a prompt is "
        "prefilled); with none decoding, and with 0, chunks of prefill_chunk_tokens whatever they cost",
    )
    prefix_cache_mb: float = Field(
        DEFAULT_PREFIX_CACHE_MB,
        ge=0,
        description="automatic prefix caching: memory (MiB) for the keys and values of prompts and answers already "
        "computed, least recently used evicted first; a prompt that starts like one of them (a chat's next turn, a "
        "shared system prompt) prefills only the rest, with the very tokens of a full prefill. 0: off. Only on "
        "the CPU kernels, whose rows do not depend on the batch",
    )
    suffix_index_mb: float = Field(
        DEFAULT_SUFFIX_INDEX_MB,
        ge=0,
        description="memory (MiB) for the index of earlier answers that the lookups of the `suffix` and `hybrid` "
        "drafts read (per tenant: a request's cache_salt), least recently used answers evicted first; 0: none kept",
    )
    draft_learning: Literal["off", "on"] = Field(
        "off",
        description="the feature draft learns from what it serves: each tenant's finished answers train a small "
        "adapter of the draft while the worker is idle, kept only when it agrees with the target more often on the "
        "tenant's newest answers (docs/service.md, Draft learning); answers never change, only their speed",
    )
    draft_learning_dir: str | None = Field(
        None,
        description="where the draft learning keeps tenants' adapters across restarts (none: in memory only)",
    )
    draft_learning_mb: float = Field(
        64,
        gt=0,
        description="memory (MiB) for the answers the draft learning trains on, all tenants; the tenant holding "
        "most gives its oldest up first",
    )
    tenant_cache_share: float = Field(
        DEFAULT_TENANT_CACHE_SHARE,
        gt=0,
        le=1,
        description="the share of the prefix cache and of the index of earlier answers each tenant is owed: a "
        "tenant that fills a cache while holding more pays with its own least recently used entries, never another "
        "tenant's; a full cache otherwise evicts from the tenant holding the most; a tenant alone may fill it all",
    )
    max_queue_size: int = Field(
        16,
        ge=0,
        le=10_000,
        description="requests waiting for memory (or for one of max_concurrent_requests); a request that can "
        "neither start nor wait is answered 429",
    )
    request_timeout: float = Field(
        300.0, gt=0, description="seconds from arrival until a request is abandoned with an error"
    )
    queue_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds a request may wait in the queue for memory or a place; one not started by then is "
        "refused with 503 (error_type queue_timeout) and a Retry-After from the measured service rate, or, when "
        "streamed (its 200 headers sent), with that error as its last event",
    )
    stream_keepalive: float = Field(
        2.0,
        ge=0,
        description="a stream sends an SSE comment (`: queued`, `: prefilling`, `: running`) at once while its "
        "request is queued and after this many seconds without an event, so that clients and proxies see it "
        "live; 0: never",
    )
    keep_alive_timeout: float = Field(
        75.0,
        gt=0,
        description="seconds an idle HTTP connection is kept open for the client's next request (uvicorn's "
        "timeout_keep_alive; longer than clients' pools keep idle connections, so that the server is not the one "
        "that closes a connection a client is reusing)",
    )
    header_read_timeout: float = Field(
        20.0,
        gt=0,
        description="seconds a connection has to send a request's headers, from its opening or from their first byte "
        "(uvicorn has no such timeout: a client sending them a byte at a time held its connection forever); "
        "slower is closed",
    )
    send_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds a client may read nothing of its answer while the server has more to send (its "
        "connection's buffers full); then the connection is closed and its request cancelled (outcome "
        "client_stalled: the generation stops, its memory is freed)",
    )
    max_stream_backlog: int = Field(
        1024,
        ge=1,
        description="tokens a stream may hold generated but not yet sent (its client reads slower than the "
        "generation); past it the request is cancelled as client_stalled and the stream ends with that error",
    )
    max_connections: int = Field(
        512,
        ge=1,
        description="open HTTP connections the server serves at once (uvicorn's limit_concurrency); a request on "
        "one more is answered 503",
    )
    max_input_tokens: int | None = Field(
        None, ge=1, description="longest prompt in tokens (default: the model's context minus one)"
    )
    max_new_tokens: int = Field(2048, ge=1, description="largest max_new_tokens (max_tokens) a request may ask")
    default_max_new_tokens: int = Field(
        256, ge=1, description="max_new_tokens of a request that does not say (OpenAI completions: 16)"
    )
    max_stop_sequences: int = Field(4, ge=0, le=64, description="most stop strings one request may give")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body in bytes; larger is 413")
    body_read_timeout: float = Field(
        30.0, gt=0, description="seconds a client has to send the whole request body; slower is 408"
    )
    shutdown_grace_period: float = Field(
        25.0,
        ge=0,
        description="on SIGTERM, seconds the requests in flight get to finish before they end with an error; "
        "keep it some seconds under the orchestrator's own (Kubernetes terminationGracePeriodSeconds, compose "
        "stop_grace_period: 30 s in docker/)",
    )
    default_temperature: float | None = Field(
        None,
        ge=0,
        le=100,
        description="the OpenAI routes' temperature when a request sends none; unset: the target's generation config "
        "(its generation_config.json), else 1.0, as vLLM and OpenAI; 0: such requests decode greedily",
    )
    closed_response_schemas: bool = Field(
        True,
        description="response_format's, guided_json's, structured_outputs' and TGI's JSON schemas compiled closed, "
        "as vLLM compiles them: an object that declares properties takes no others unless it says "
        "(additionalProperties); off: as written, open (JSON Schema's default). Tool schemas are always closed",
    )
    log_format: Literal["text", "json"] = Field("text", description="`text` lines or one JSON object per line")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="lowest level logged")
    api_key: SecretStr | None = Field(
        None,
        description="require `Authorization: Bearer <key>` on every route but /health (and /metrics with "
        "metrics_public); unset or empty: no key. Prefer SPECSERVE_API_KEY to the flag, which shows in `ps`",
    )
    api_keys: SecretStr | None = Field(
        None,
        description="several API keys, each its own tenant: `name:key` pairs, comma-separated; a request's prefix "
        "cache and index of earlier answers are its key's, refined by its cache_salt, so no key reads what another "
        "wrote. Names (letters, digits, `.`, `_`, `-`) go in logs, never keys; api_key beside them is named "
        "`default`. Prefer SPECSERVE_API_KEYS to the flag, which shows in `ps`",
    )
    api_key_file: str | None = Field(
        None,
        description="a file of API keys as api_keys takes them, one `name:key` a line (blank lines and lines "
        "starting with `#` skipped); read at start-up",
    )
    isolation: Literal["shared", "strict"] = Field(
        "shared",
        description="the tenant of a request without cache_salt: `shared`: its API key's (without keys: one "
        "tenant for every such request, as a single user's server wants); `strict`: a tenant of its own, so it "
        "reads nothing earlier requests left and leaves nothing for later ones",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="listen on a host other than a loopback address without an API key (behind a proxy that "
        "authenticates, or on a network only trusted clients reach); without it such a server refuses to start",
    )
    allowed_hosts: str = Field(
        "",
        description="comma-separated names a request's Host header may carry (any port; `*` for any), others "
        "answered 400. Empty: localhost, 127.0.0.1 and [::1] on a server without API keys listening on a loopback "
        "address (so that a web page whose name resolves to 127.0.0.1 cannot use it: DNS rebinding), no check "
        "otherwise",
    )
    metrics_public: bool = Field(False, description="with an API key, serve /metrics without it (for a scraper)")
    cors_allow_origins: str = Field(
        "", description="comma-separated origins browsers may call the API from (`*` for any); empty: CORS off"
    )

    @field_validator("api_key", mode="after")
    @classmethod
    def _usable_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None  # SPECSERVE_API_KEY= (empty) is no key, as compose passes an unset variable
        # An HTTP header carries it: anything else could never match (and is a paste error).
        if not all(33 <= ord(c) <= 126 for c in value.get_secret_value()):
            raise ValueError("the API key must be printable ASCII without spaces")
        return value

    @field_validator("api_keys", mode="after")
    @classmethod
    def _usable_keys(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None
        parse_api_keys(value.get_secret_value().split(","), "api_keys")
        return value

    @field_validator("api_key_file", mode="after")
    @classmethod
    def _readable_key_file(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        _read_key_file(value)
        return value

    @property
    def named_api_keys(self) -> dict[str, str]:
        """Every API key by its name (`api_key` as ``default``, then `api_keys`, then the key file's); empty
        without keys. Raises ValueError for a name or a key given twice."""
        keys: dict[str, str] = {}
        if self.api_key is not None:
            keys["default"] = self.api_key.get_secret_value()
        entries: list[tuple[str, str]] = []
        if self.api_keys is not None:
            entries += parse_api_keys(self.api_keys.get_secret_value().split(","), "api_keys")
        if self.api_key_file is not None:
            entries += _read_key_file(self.api_key_file)
        for name, key in entries:
            if name in keys:
                raise ValueError(f"the API key name {name!r} is given twice")
            keys[name] = key
        if len(set(keys.values())) < len(keys):
            # One key under two names would be two tenants that one client cannot tell apart.
            raise ValueError("two API key names have the same key: each key must be its own")
        return keys

    @model_validator(mode="after")
    def _keys_are_distinct(self) -> Settings:
        self.named_api_keys  # noqa: B018  # raises ValueError, a one-line settings error
        return self

    @model_validator(mode="after")
    def _closed_unless_told(self) -> Settings:
        # Fail closed: a server others can reach, with nobody's key asked, serves anyone who finds it.
        if not is_loopback(self.host) and not self.named_api_keys and not self.allow_unauthenticated:
            raise ValueError(
                f"host {self.host} is reachable from other machines and no API key is set: set SPECSERVE_API_KEY "
                "(or api_keys, api_key_file), or allow_unauthenticated (--allow-unauthenticated) to serve it open"
            )
        return self

    @field_validator("kv_cache_memory", mode="after")
    @classmethod
    def _size_or_auto(cls, value: str) -> str:
        parse_bytes(value)  # raises ValueError, a one-line settings error
        return value.strip()

    @property
    def kv_cache_memory_bytes(self) -> int | None:
        """`kv_cache_memory` in bytes; None for `auto` (the runtime measures what is available)."""
        return parse_bytes(self.kv_cache_memory)

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> Settings:
        if self.default_max_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"default_max_new_tokens ({self.default_max_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})"
            )
        return self

    @property
    def cors_origins(self) -> list[str]:
        """The origins of `cors_allow_origins`, as a list (empty: CORS is off)."""
        return [o.strip() for o in self.cors_allow_origins.split(",") if o.strip()]

    @field_validator("allowed_hosts", mode="after")
    @classmethod
    def _hosts_are_names(cls, value: str) -> str:
        for name in value.split(","):
            name = name.strip()
            # A port here would be a paste of a URL's authority: the check takes any port, so it names none.
            with_port = name.count(":") == 1 or (name.startswith("[") and not name.endswith("]"))
            if name and name != "*" and (normal_host(name) is None or with_port):
                raise ValueError(f"allowed_hosts: {name!r} is not a host name or address (give it without a port)")
        return value

    @property
    def trusted_hosts(self) -> frozenset[str] | None:
        """The Host names requests may carry (`normal_host`'s spelling), or None where any will do: the
        `allowed_hosts` given, else the loopback names on a keyless server listening on a loopback address."""
        given = [h.strip() for h in self.allowed_hosts.split(",") if h.strip()]
        if "*" in given:
            return None
        if given:
            return frozenset(n for h in given if (n := normal_host(h)) is not None)
        if is_loopback(self.host) and not self.named_api_keys:
            return frozenset(LOOPBACK_NAMES)
        return None

    @property
    def served_model_names(self) -> list[str]:
        """Every `model` the OpenAI API accepts: first the id its answers report (``model_name``, else the
        target as it was named), then the aliases of ``served_model_name``, each once."""
        aliases = [name.strip() for name in self.served_model_name.split(",") if name.strip()]
        return list(dict.fromkeys([self.model_name or self.target, *aliases]))


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or ``localhost``): reachable from this machine only."""
    if host.strip().lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost: it may resolve to anything


# What a keyless local server answers to by default: the names a browser uses for this machine.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_HOST_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
_IPV6 = re.compile(r"[0-9a-f:.]+")


def normal_host(host: str) -> str | None:
    """`host` (a Host header's value, or a name in allowed_hosts) without its port, lower-case, a name's final dot
    dropped, an IPv6 address in brackets; None where it is not one (a bracket unclosed, a port not digits)."""
    host = host.strip().lower()
    if host.startswith("["):
        address, bracket, port = host[1:].partition("]")
        if not bracket or (port and not (port[:1] == ":" and port[1:].isdigit())):
            return None
    elif host.count(":") > 1:  # a bare IPv6 address, as allowed_hosts may name one
        address = host
    else:
        name, colon, port = host.partition(":")
        name = name.removesuffix(".")
        return name if _HOST_NAME.fullmatch(name) and (not colon or port.isdigit()) else None
    return f"[{address}]" if _IPV6.fullmatch(address) else None


_KEY_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def parse_api_keys(entries: list[str], source: str, unit: str = "entry") -> list[tuple[str, str]]:
    """The (name, key) of each ``name:key`` entry (blank ones skipped); `source` and `unit` (``entry``,
    ``line``) say where a malformed one is in the ValueError it raises, which never quotes a key."""
    out: list[tuple[str, str]] = []
    for number, entry in enumerate(entries, 1):
        entry = entry.strip()
        if not entry:
            continue
        name, sep, key = entry.partition(":")
        if not sep or not _KEY_NAME.fullmatch(name):
            raise ValueError(
                f"{source}, {unit} {number}: expected `name:key`, the name of letters, digits, `.`, `_` or `-`"
            )
        # An HTTP header carries it: anything else could never match (and is a paste error).
        if not key or not all(33 <= ord(c) <= 126 for c in key):
            raise ValueError(f"{source}, key {name!r}: it must be printable ASCII without spaces")
        out.append((name, key))
    return out


def _read_key_file(path: str) -> list[tuple[str, str]]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"api_key_file {path!r} cannot be read: {exc}") from exc
    # A comment line is blanked rather than dropped, so that an entry's number is its line's.
    lines = ["" if line.lstrip().startswith("#") else line for line in lines]
    return parse_api_keys(lines, f"api_key_file {path!r}", "line")


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*")


def parse_bytes(value: str) -> int | None:
    """A size as a setting gives it (``4294967296``, ``512MiB``, ``8 GiB``, ``2GB``) in bytes; None for ``auto``.
    Raises ValueError for anything else, or for less than one byte."""
    if value.strip().lower() == "auto":
        return None
    match = _SIZE.fullmatch(value.lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(
            f"a size must be `auto`, a number of bytes or a number with a unit (512MiB, 8GiB), not {value!r}"
        )
    size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size < 1:
        raise ValueError(f"a size must be at least one byte, not {value!r}")
    return size
