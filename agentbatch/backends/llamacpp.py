"""llama.cpp's ``llama-server`` (``llamacpp://host:port``): OpenAI-compatible, with its own ways.

It checks ``GET /props`` (a server that is not llama.cpp is refused, naming what answered),
renders batched prompts with the server's template (``/apply-template``), sends a JSON schema
as a whitespace-free GBNF ``grammar`` with the reply's forced start prefilled
(``compact_json``, ``jump_forward``), streams turns by default so ``loop_guard`` can stop a
runaway reply (a streamed request says ``Connection: close``: the server drops it anyway),
keeps the embedded engine's turns in flight to ``total_slots`` (``inflight_hint``), and at
warm-up checks that the server's prompt cache works (``probe_cache``: a warning names the flags
that defeat it) and whether pinning turns to slots keeps the prefix, in which case a turn goes
with ``id_slot`` to its agent's slot while that slot still holds its conversation, and without
(the server then restores the conversation from its host-memory cache) once another agent's
turn took the slot (``SlotPicker``; on a distributed worker the fleet's shared one,
``share_slots``: ``distributed/state/slot_map.py``). An agent moved to another server of a
pool for load takes its conversation along where the servers share a ``--slot-save-path``
(``save_conversation``, ``restore_conversation``: ``/slots`` save and restore;
``pool.EndpointPool._carry``).
``tool_choice="required"`` is not enforced here. Why each default, with the measurements:
docs/engine-llamacpp.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from agentbatch.backends.base import BackendCapabilities
from agentbatch.backends.batch_prompting import ServerTemplate, text_conversations
from agentbatch.backends.gbnf import Unsupported, split_gbnf, to_gbnf
from agentbatch.backends.openai_compat import OpenAICompatBackend, response_format
from agentbatch.backends.slot_placement import Placement, SlotPlacer
from agentbatch.core.errors import (
    BackendError,
    BackendUnavailable,
    BatchSpecError,
    ConfigError,
    ServerError,
)
from agentbatch.core.model_io import Message, ModelRequest, ModelResponse

if TYPE_CHECKING:
    from agentbatch.core.plan import BatchPlan

log = logging.getLogger(__name__)

PROPS_TIMEOUT_S = 10.0
# A slot file written or read for a moved agent (``save_conversation``): a few MB for a small
# model's conversation, read back in milliseconds (benchmarks/results/slot_carry.json).
SLOT_FILE_TIMEOUT_S = 30.0
# A fleet's slot placer (``SlotPlacer``) bounds each call itself; a turn waits at most this
# for its release before its reply goes on (the release then finishes on its own).
PLACER_WAIT_S = 5.0
# Jump-forward only when the forced start is worth it: ``{"`` (one token) is not.
MIN_PREFILL_CHARS = 6

CAPABILITIES = BackendCapabilities(
    native_json_schema=True,
    prefix_cache_metrics=True,
    # Measured on SmolLM2-135M, 4 slots, 40 structured agents, 3 interleaved rounds, twice:
    # with the warm-up llama.cpp computed as many prompt tokens (2573 vs 2571; 2608 vs 2601),
    # since it fills one slot and the others compute the prefix anyway, and the batch took
    # 74.7 s vs 56.3 s (median, busy machine) and 35.0 s vs 36.4 s (quieter): no gain.
    prefix_warming=False,
    batch_prompting=True,
    tool_choice_required=False,
)


TtftListener = Callable[[float], None]
ON_TTFT: ContextVar[TtftListener | None] = ContextVar("agentbatch_llamacpp_on_ttft", default=None)


@contextmanager
def observe_ttft(listener: TtftListener) -> Iterator[None]:
    """Within this block (and tasks started in it), streamed turns report their TTFT."""
    token = ON_TTFT.set(listener)
    try:
        yield
    finally:
        ON_TTFT.reset(token)


# A repeat of the warm-up request that finds less than this share of its prompt cached
# computed the shared prefix again.
CACHED_SHARE = 0.5
# The flags of this llama.cpp build (b11434's ``llama-server --help``) under which a repeat of
# a request computes its prefix again, named in the warm-up warning.
CACHE_DEFEATING_FLAGS = (
    "--cache-ram 0 with --slot-prompt-similarity 0 (each request takes the least recently "
    "used slot, and nothing is restored into it)",
    "--no-cache-prompt (for clients that do not send cache_prompt: agentbatch does)",
    "a context (-c divided by -np) too small for the shared prefix",
)


@dataclass(frozen=True)
class CacheProbe:
    """What the warm-up saw: tokens of the prefix request, and how many were cached on a
    repeat sent without ``id_slot`` (``unpinned_cached``) and on one pinned back to a slot
    after another slot was used (``pinned_cached``; None with one slot)."""

    prompt_tokens: int
    unpinned_cached: int
    pinned_cached: int | None

    @property
    def defeated(self) -> bool:
        """The server's own slot choice computed the prefix again."""
        return self.unpinned_cached < CACHED_SHARE * self.prompt_tokens

    @property
    def pinning_keeps_prefix(self) -> bool:
        """A slot kept the prefix while another slot served a request: pinning is safe."""
        return (self.pinned_cached is not None
                and self.pinned_cached >= CACHED_SHARE * self.prompt_tokens)


class SlotPicker:
    """Which slot a turn is pinned to, from what this process knows each slot holds
    (``holds``: the agent whose conversation a slot's cache has, learned from where each turn
    ran). A turn is pinned to its agent's slot when that slot still holds its conversation
    and no turn of ours is on it; an agent's first turn to a free slot that holds no agent's
    conversation. Every other turn goes without ``id_slot``: llama.cpp restores from its
    host-memory prompt cache only into a slot it picks itself, after saving what that slot
    held there, while a pinned turn takes the slot as it is and discards whatever
    conversation it held, unsaved (``server-context.cpp`` ``get_available_slot`` with
    ``--slot-prompt-similarity 0``; measured in docs/engine-llamacpp.md). A turn never waits
    for a slot one of our own turns holds, which is what made pinning by agent index lose."""

    MAX_AGENTS = 65_536

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.busy = [0] * slots
        self.last_used = [0.0] * slots
        self.homes: OrderedDict[str, int] = OrderedDict()
        self.holds: list[str | None] = [None] * slots

    def acquire(self, agent_key: str) -> Placement:
        home = self.homes.get(agent_key)
        free = [s for s in range(self.slots) if self.busy[s] == 0]
        blank = [s for s in free if self.holds[s] is None]
        if home is not None and self.busy[home] == 0 and self.holds[home] == agent_key:
            place = Placement(home, home)  # its conversation is there
        elif home is None and blank:
            slot = self._oldest(blank)  # a first turn: nobody's conversation is lost
            place = Placement(slot, slot)
        else:  # the server picks, saves what it held, restores this agent's conversation
            place = Placement(None, self._oldest(free) if free else None)
        if place.slot is not None:
            self.busy[place.slot] += 1
            self.last_used[place.slot] = time.monotonic()
        return place

    def _oldest(self, slots: list[int]) -> int:
        return min(slots, key=lambda s: (self.last_used[s], s))

    def held(self, agent_key: str) -> Placement | None:
        """The idle slot holding the agent's conversation, taken (busy) to be saved from;
        None when no slot holds it now. Given back with ``release(place, agent_key)``."""
        home = self.homes.get(agent_key)
        if home is None or self.busy[home] or self.holds[home] != agent_key:
            return None
        self.busy[home] += 1
        return Placement(home, home)

    def claim(self) -> Placement | None:
        """A free slot, taken (busy) to restore a conversation into: one holding nobody's
        first, else the one used longest ago; None when every slot is busy. Given back with
        ``release(place, agent_key)`` once restored (it then holds the agent's conversation),
        or ``release(place)`` if not (it then holds nobody's)."""
        free = [s for s in range(self.slots) if self.busy[s] == 0]
        if not free:
            return None
        blank = [s for s in free if self.holds[s] is None]
        slot = self._oldest(blank or free)
        self.busy[slot] += 1
        return Placement(slot, slot)

    def release(self, place: Placement, agent_key: str = "", landed: int | None = None
                ) -> None:
        """The turn ended; it ran on ``landed`` (what the server said), else on the slot sent
        or expected. That slot now holds this agent's conversation."""
        if place.slot is not None:
            self.busy[place.slot] = max(0, self.busy[place.slot] - 1)
        ran = place.ran_on(landed)
        if ran is None or not 0 <= ran < self.slots:
            return
        self.last_used[ran] = time.monotonic()
        self.holds[ran] = agent_key or None
        if agent_key:
            self.homes[agent_key] = ran
            self.homes.move_to_end(agent_key)
            if len(self.homes) > self.MAX_AGENTS:
                self.homes.popitem(last=False)


def _first_turn(request: ModelRequest) -> bool:
    """No reply of the model's in the conversation yet: no slot can hold it."""
    return not any(m.get("role") == "assistant" for m in request.messages)


class _Landed:
    """Where an unpinned turn ran: llama-server's ``id_slot``, from its reply's ``__verbose``
    (asked for with ``verbose`` and ``response_fields``)."""

    def __init__(self) -> None:
        self.slot: int | None = None

    def hear(self, chunk: Any) -> None:
        verbose = chunk.get("__verbose") if isinstance(chunk, dict) else None
        slot = verbose.get("id_slot") if isinstance(verbose, dict) else None
        if isinstance(slot, int) and not isinstance(slot, bool):
            self.slot = slot


_LANDED: ContextVar[_Landed | None] = ContextVar("agentbatch_llamacpp_landed", default=None)


class _SlotEchoSession:
    """The backend's HTTP session, passing on what llama-server says about where a turn ran
    (``_Landed``) while the base class reads the reply as usual."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def post_json(self, path: str, body: dict[str, Any], headers: dict[str, str],
                        timeout: float, **kwargs: Any) -> Any:
        reply = await self._inner.post_json(path, body, headers, timeout, **kwargs)
        landed = _LANDED.get()
        if landed is not None:
            landed.hear(reply)
        return reply

    @asynccontextmanager
    async def post_lines(self, path: str, body: dict[str, Any], headers: dict[str, str],
                         timeout: float) -> AsyncIterator[AsyncIterator[str]]:
        async with self._inner.post_lines(path, body, headers, timeout) as lines:
            landed = _LANDED.get()
            yield lines if landed is None else _listening(lines, landed)


async def _listening(lines: AsyncIterator[str], landed: _Landed) -> AsyncIterator[str]:
    """``lines`` unchanged; the one SSE event carrying ``__verbose`` is read on the way."""
    async for line in lines:
        if "__verbose" in line and line.startswith("data:"):
            with suppress(ValueError, RecursionError):
                landed.hear(json.loads(line[5:]))
        yield line


_PINNED: ContextVar[int | None] = ContextVar("agentbatch_llamacpp_pinned", default=None)


def slot_for(agent_key: str, slots: int) -> int:
    """The slot an agent is pinned to: its index modulo ``slots`` for the engines' keys
    (``batch:index``), so a batch's agents spread evenly; else a stable hash of the key."""
    tail = agent_key.rpartition(":")[2]
    if tail.isdigit():
        return int(tail) % slots
    return zlib.crc32(agent_key.encode()) % slots


def carry_file(endpoint: str, slot: int) -> str:
    """The file slot ``slot`` of ``endpoint`` is saved to when a turn of the agent it holds
    moves (``save_conversation``): one per server slot, overwritten by that slot's next
    save. A slot holds one agent at a time, fleet-wide where the fleet's map pins, so no
    two carries in flight share a file, and a save directory holds at most one file per slot
    of the servers that use it."""
    return f"agentbatch-carry-{zlib.crc32(endpoint.encode()):08x}-{slot}.bin"


class LlamaCppBackend(OpenAICompatBackend):
    """``Backend`` for ``llama-server``; see the module docstring for what it adds."""

    def __init__(self, target: Any, *, slot_affinity: bool | None = None,
                 compact_json: bool = True,
                 jump_forward: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("capabilities", CAPABILITIES)
        kwargs.setdefault("stream", True)  # see the module docstring
        super().__init__(target, **kwargs)
        # True: agent index modulo slots, always; False: never; None (default): the warm-up
        # probe decides, and turns then go to a free slot (``SlotPicker``).
        self.slot_affinity = slot_affinity
        self.cache_probe: CacheProbe | None = None
        self._picker: SlotPicker | None = None
        self._placer: SlotPlacer | None = None  # the fleet's picker, on a distributed worker
        self._releases: set[asyncio.Task[None]] = set()  # a placer's releases under way
        self.compact_json = compact_json
        self.jump_forward = jump_forward and compact_json
        self._splits: dict[int, tuple[Any, tuple[str, str] | None]] = {}
        # id(schema) -> (schema, grammar or None): schemas are built once per plan, so the
        # grammar is too; holding the schema keeps its id from being reused.
        self._grammars: dict[int, tuple[Any, str | None]] = {}
        self._props: dict[str, Any] | None = None
        self._props_task: asyncio.Task[dict[str, Any]] | None = None
        self._no_slots = False  # /props unreadable: requests go without id_slot
        self._slot_files = True  # False once the server said it saves no slots (501)
        # where unpinned turns ran; every other call goes to the session unchanged
        self._session = cast(Any, _SlotEchoSession(self._session))
        self.template = ServerTemplate(self._apply_template)

    # -- identity ---------------------------------------------------------------------------

    async def props(self) -> dict[str, Any]:
        """``GET /props``, cached; ``ConfigError`` naming what answered if it is not llama.cpp."""
        if self._props is not None:
            return self._props
        text = await self._session.get_text("/props", PROPS_TIMEOUT_S)
        if text is None:
            status = await self._session.get_status("/props", PROPS_TIMEOUT_S)
            if status is None or status == 503:  # down, or llama.cpp still loading its model
                said = "no answer" if status is None else "HTTP 503 (loading the model?)"
                raise BackendUnavailable(f"{self.name}: GET /props got {said}")
        props: Any = None
        if text is not None:
            try:
                props = json.loads(text)
            except ValueError:
                props = None
        if not isinstance(props, dict) or not isinstance(props.get("total_slots"), int):
            raise ConfigError(
                f"{self.name} is not a llama.cpp server: {await self._what_answered(text)}; "
                "point llamacpp:// at llama-server, or use the URL scheme of the server that "
                "answered (vllm://, sglang://, http://)"
            )
        self._props = props
        return props

    async def _what_answered(self, props_text: str | None) -> str:
        """A short description of the server at this URL, for the refusal above."""
        if props_text is None:
            status = await self._session.get_status("/props", PROPS_TIMEOUT_S)
            seen = f"GET /props got HTTP {status}"
        else:
            seen = f"GET /props returned no llama.cpp properties ({props_text[:80]!r})"
        models = await self._session.get_text("/v1/models", PROPS_TIMEOUT_S)
        owners: set[str] = set()
        if models is not None:
            try:
                data = json.loads(models).get("data") or []
                owners = {str(m.get("owned_by")) for m in data if isinstance(m, dict)}
            except (ValueError, AttributeError):
                owners = set()
        if owners - {"None"}:
            seen += f"; its /v1/models says owned_by={', '.join(sorted(owners))}"
        elif models is not None:
            seen += "; it answers /v1/models (an OpenAI-compatible server)"
        return seen

    async def total_slots(self) -> int:
        return max(1, int((await self.props())["total_slots"]))

    @property
    def inflight_hint(self) -> int | None:
        """The server's slot count once ``/props`` was read (at preflight): the embedded
        engine keeps at most this many turns in flight, so its near-done-first order decides
        which turn takes a free slot, not llama.cpp's first-come queue (``setup.inflight_hint``;
        measured in ``bench_engine``)."""
        return int(self._props["total_slots"]) if self._props else None

    @property
    def batch_limit(self) -> int | None:
        """Prompts per batched request: the server's slot count once known (see
        ``MicroBatchingBackend``); more would only wait in llama.cpp's deferred queue."""
        return int(self._props["total_slots"]) if self._props else None

    async def learn_inflight_hint(self) -> None:
        """Read ``/props`` (so ``inflight_hint`` is known) where no preflight ran: a worker."""
        await self.props()

    async def preflight(self, plan: BatchPlan) -> None:
        """Before the fan-out: this is llama.cpp, and the options the batch set can apply;
        then, for a batch that warms its prefix, the cache probe (``probe_cache``)."""
        await self.props()
        if plan.max_server_waiting is not None:
            status = await self._session.get_status("/metrics", PROPS_TIMEOUT_S)
            if status != 200:
                raise BatchSpecError(
                    f"max_server_waiting={plan.max_server_waiting} cannot apply to "
                    f"{self.name}: its /metrics answered "
                    f"{status if status is not None else 'nothing'} (start llama-server with "
                    "--metrics, or drop max_server_waiting)"
                )
        if plan.warm_prefix and plan.total > 1 and self.cache_probe is None:
            if plan.max_server_waiting is not None:
                load = await self.fetch_load()
                if load is None or load.waiting > plan.max_server_waiting:
                    return  # the probe would jump the queue the batch promised to respect
            from agentbatch.core.render import warmup_request

            await self.probe_cache(warmup_request(plan))

    # -- warm-up: does the prompt cache work, and does pinning keep it -----------------------

    async def probe_cache(self, request: ModelRequest) -> CacheProbe | None:
        """Send the shared prefix (``max_tokens`` 1) pinned to slot 0, a request to slot 1,
        the prefix to slot 0 again, then unpinned, reading each reply's cached-token count.
        The unpinned repeat shows whether the server's own slot choice keeps the prefix (if
        not, one warning names the flags that defeat it); the third whether a slot keeps it
        while another slot works (then, with ``slot_affinity`` unset, turns are pinned:
        ``SlotPicker``). Neither can be read from ``/props`` or ``/slots`` on this build.
        None if the server did not answer.

        What slot 1 gets depends on what slot 0 held. Where slot 0 had to compute the
        prefix (nothing cached yet), slot 1 gets a one-word prompt: a request pinned with
        ``id_slot`` is never restored from llama.cpp's host-memory cache, so the prefix sent
        there computed it a second time on every server (issue 26 item 2). Where slot 0
        already held it (an earlier batch left it), slot 1 gets the prefix, which it most
        likely holds too: the one-word prompt overwrote it there, and on a server without a
        host cache the unpinned repeat, landing on slot 1, then computed it again (about
        300 tokens on every server for every batch)."""
        slots = await self.total_slots()
        try:
            pinned: int | None = None
            if slots > 1:
                total, held = await self._probe_once(request, 0)
                # Slot 1 works between the two requests to slot 0 (so a server that clears
                # idle slots shows it).
                warm = held >= CACHED_SHARE * total
                await self._probe_once(request if warm else request.model_copy(
                    update={"messages": [{"role": "user", "content": "ok"}]}), 1)
                pinned = (await self._probe_once(request, 0))[1]
                unpinned = (await self._probe_once(request, None))[1]
            else:
                total = (await self._probe_once(request, None))[0]
                unpinned = (await self._probe_once(request, None))[1]
        except (BackendError, KeyError, TypeError, ValueError) as exc:
            log.info("%s: cache probe at warm-up failed (%s); turns go unpinned", self.name, exc)
            return None
        probe = self.cache_probe = CacheProbe(total, unpinned, pinned)
        if probe.defeated:
            fix = ("agentbatch pins its turns to slots (id_slot), which keeps the prefix "
                   "cached for this batch; other clients of this server still pay for it"
                   if probe.pinning_keeps_prefix and self.slot_affinity is None else
                   "every turn of this batch computes its shared prefix again")
            log.warning(
                "%s: a repeat of the warm-up request found %d of its %d prompt tokens cached: "
                "a setting of this llama-server defeats its prompt cache. On this build that "
                "is one of: %s. Restart it without that setting; meanwhile %s.",
                self.name, unpinned, total, "; ".join(CACHE_DEFEATING_FLAGS), fix)
        if self.slot_affinity is None and probe.pinning_keeps_prefix:
            self._picker = SlotPicker(slots)
        log.debug("%s: cache probe %s; pinning %s", self.name, probe,
                  "on" if self._picker else "off")
        return probe

    async def pinned_slots(self) -> int | None:
        """The slot count once the warm-up probe found that pinning turns to slots keeps the
        prefix (then turns are pinned: ``SlotPicker``); None otherwise."""
        return await self.total_slots() if self._picker is not None else None

    def share_slots(self, placer: SlotPlacer) -> bool:
        """Pin turns through ``placer`` (the fleet's shared ``SlotPicker``): a distributed
        worker, whose submitter's probe found pinning keeps the prefix. The first placer
        stays, as does a picker of this process's own."""
        if self._picker is None and self._placer is None:
            self._placer = placer
        return self._picker is not None or self._placer is placer

    async def _probe_once(self, request: ModelRequest, slot: int | None) -> tuple[int, int]:
        """(prompt tokens, cached prompt tokens) of one unstreamed ``max_tokens`` 1 request."""
        body = {**OpenAICompatBackend.build_body(self, request), "max_tokens": 1,
                "cache_prompt": True}
        for key in ("stream", "stream_options", "id_slot"):
            body.pop(key, None)
        if slot is not None:
            body["id_slot"] = slot
        reply = await self._session.post_json("/v1/chat/completions", body, {},
                                              request.timeout_s or self.timeout,
                                              model_request=False)
        timings = reply.get("timings") if isinstance(reply, dict) else None
        if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
            cached = int(timings["cache_n"])
            return cached + int(timings["prompt_n"]), cached
        usage = reply["usage"]
        return int(usage["prompt_tokens"]), int(usage["prompt_tokens_details"]["cached_tokens"])

    # -- requests ---------------------------------------------------------------------------

    def grammar_for(self, schema: Any) -> str | None:
        """The compact GBNF grammar for ``schema``, or None (send the schema itself)."""
        if not self.compact_json or not isinstance(schema, dict):
            return None
        return _per_schema(self._grammars, schema, self._translate)

    def _translate(self, schema: dict[str, Any]) -> str | None:
        try:
            return to_gbnf(schema)
        except Unsupported as exc:
            log.debug("%s: schema sent as response_format (%s)", self.name, exc)
            return None

    def split_for(self, schema: Any) -> tuple[str, str] | None:
        """(forced prefix, grammar for the rest) of ``schema``, or None (see ``jump_forward``)."""
        return _per_schema(self._splits, schema, _split_worth_it)

    def _prefill(self, request: ModelRequest) -> tuple[str, str] | None:
        """(prefix, grammar for the rest) when ``request`` is sent with jump-forward."""
        schema = (request.json_schema or {}).get("schema", request.json_schema)
        if not request.messages or request.messages[-1].get("role") == "assistant":
            return None
        return self._jump_split(schema)

    def build_body(self, request: ModelRequest) -> dict[str, Any]:
        body = super().build_body(request)
        rf = body.get("response_format")
        if rf is not None:
            grammar = self.grammar_for(rf["json_schema"]["schema"])
            if grammar is not None:
                del body["response_format"]
                body["grammar"] = grammar
                split = self._prefill(request)
                if split is not None:
                    # the reply's forced start goes as a prefilled assistant turn, which
                    # llama-server continues (and returns whole); the grammar covers the rest
                    body["messages"] = [*body["messages"],
                                        {"role": "assistant", "content": split[0]}]
                    body["grammar"] = split[1]
        return body

    def _extra_headers(self, request: ModelRequest) -> dict[str, str]:
        """A streamed turn asks for its connection to be closed after it: llama-server drops
        it anyway, without saying so (docs/engine-llamacpp.md), and a pooled one fails the
        next request sent on it."""
        return {"Connection": "close"} if self.stream else {}

    def _extra_body(self, request: ModelRequest) -> dict[str, Any]:
        extra: dict[str, Any] = {"cache_prompt": True}
        slots = int(self._props["total_slots"]) if self._props else 0
        if self.slot_affinity and slots > 0 and request.agent_key:
            extra["id_slot"] = slot_for(request.agent_key, slots)
        elif _PINNED.get() is not None:
            extra["id_slot"] = _PINNED.get()
        elif _LANDED.get() is not None:  # the reply says which slot the server picked
            extra.update(verbose=True, response_fields=["id_slot"])
        return extra

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if self.slot_affinity and self._props is None and not self._no_slots:
            await self._learn_slots()
        picker, placer = self._picker, self._placer
        place: Placement | None = None
        if picker is not None:
            place = picker.acquire(request.agent_key)
        elif placer is not None and request.agent_key:
            place = await placer.acquire(request.agent_key, _first_turn(request))
        landed = _Landed() if place is not None and place.send is None else None
        token = _PINNED.set(place.send if place is not None else None)
        heard = _LANDED.set(landed)
        released: asyncio.Task[None] | None = None
        try:
            response = await super().complete(request)
        finally:
            _LANDED.reset(heard)
            _PINNED.reset(token)
            heard_slot = landed.slot if landed is not None else None
            if picker is not None and place is not None:
                picker.release(place, request.agent_key, heard_slot)
            elif placer is not None and place is not None:
                # a task, so a cancelled turn still gives its slot back (bounded: SlotPlacer)
                released = asyncio.ensure_future(
                    placer.release(place, request.agent_key, heard_slot))
                self._releases.add(released)
                released.add_done_callback(self._releases.discard)
        if released is not None:  # before the reply is committed: the next turn sees it
            await asyncio.wait({released}, timeout=PLACER_WAIT_S)
        split = self._prefill(request)
        if split is not None and response.text is not None \
                and not response.text.startswith(split[0]):
            # a server that returns only the continuation of a prefill: make the reply whole
            response = response.model_copy(update={"text": split[0] + response.text})
        listener = ON_TTFT.get()
        if listener is not None and response.ttft_s is not None:
            listener(response.ttft_s)
        return response

    # -- a moved agent's conversation, carried between servers (``EndpointPool``) ----------

    async def save_conversation(self, agent_key: str) -> str | None:
        """Save the slot holding the agent's conversation in the server's
        ``--slot-save-path`` (``POST /slots/{id}?action=save``), under the slot's own file
        name (``carry_file``). Only where turns are pinned (``SlotPicker``, or on a
        distributed worker the fleet's map: they know which slot holds whom) and the slot is
        idle. A server started without the path says so once (501); it is not asked
        again."""
        if not self._carries():
            return None
        place = await self._slot_held(agent_key)
        if place is None:
            return None
        name = carry_file(self.name, place.slot) if place.slot is not None else None
        try:
            reply = await self._slot_action(place.slot, "save", name) if name else None
        finally:
            await self._slot_back(place, agent_key)
        return name if reply and reply.get("n_saved") else None

    async def restore_conversation(self, agent_key: str, name: str) -> bool:
        """Restore ``name`` (another server's ``save_conversation``) into a free slot, which
        then holds the agent's conversation, so its next turn is pinned there and computes
        only what is new. False, with the slot holding nobody's, if the file is not there
        (the servers do not share a ``--slot-save-path``) or the restore failed."""
        if not self._carries():
            return False
        place = await self._slot_claimed()
        if place is None:
            return False
        restored = False
        try:
            reply = await self._slot_action(place.slot, "restore", name)
            restored = bool(reply and reply.get("n_restored"))
        finally:
            await self._slot_back(place, agent_key if restored else "")
        return restored

    def _carries(self) -> bool:
        """Turns are pinned here (so a slot is known to hold an agent), and the server has
        not said it saves no slots."""
        return (self._picker is not None or self._placer is not None) and self._slot_files

    async def _slot_held(self, agent_key: str) -> Placement | None:
        if self._picker is not None:
            return self._picker.held(agent_key)
        return await self._placer.held(agent_key) if self._placer is not None else None

    async def _slot_claimed(self) -> Placement | None:
        if self._picker is not None:
            return self._picker.claim()
        return await self._placer.claim() if self._placer is not None else None

    async def _slot_back(self, place: Placement, agent_key: str) -> None:
        """Give back a slot taken by ``_slot_held`` / ``_slot_claimed``: it then holds
        ``agent_key``'s conversation ("": nobody's)."""
        if self._picker is not None:
            self._picker.release(place, agent_key)
        elif self._placer is not None:
            await self._placer.release(place, agent_key, None)

    async def _slot_action(self, slot: int | None, action: str, name: str
                           ) -> dict[str, Any] | None:
        """One ``/slots`` action, bounded by ``SLOT_FILE_TIMEOUT_S``; its reply, or None."""
        try:
            reply = await self._session.post_json(
                f"/slots/{slot}?action={action}", {"filename": name}, {},
                SLOT_FILE_TIMEOUT_S, model_request=False)
        except BackendError as exc:
            if getattr(exc, "status", None) == 501:  # started without --slot-save-path
                self._slot_files = False
            log.debug("%s: slot %s %s %s failed: %s", self.name, slot, action, name, exc)
            return None
        return reply if isinstance(reply, dict) else None

    async def _learn_slots(self) -> None:
        """Read ``total_slots`` once per loop for every concurrent caller. ``id_slot`` is only
        a hint: if ``/props`` cannot be read, requests go without it (and say so once)."""
        loop = asyncio.get_running_loop()
        task = self._props_task
        if task is None or task.get_loop() is not loop:
            task = self._props_task = loop.create_task(self.props())
        try:
            await asyncio.shield(task)
        except (BackendError, ConfigError) as exc:
            if not self._no_slots:
                log.warning("%s: /props unreadable, so no id_slot or batch limit (%s)",
                            self.name, exc)
            self._no_slots = True

    async def _learn_context(self) -> tuple[bool, int | None]:
        """The context of one slot, ``default_generation_settings.n_ctx`` on ``/props``
        (``--ctx-size`` divided by ``--parallel``): a prompt must fit the slot it runs in."""
        try:
            props = await self.props()
        except BackendUnavailable:
            return False, None
        except (BackendError, ConfigError):
            return True, None
        settings = props.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        return True, n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None

    async def count_tokens(self, prompt: str | list[Message],
                           tools: list[dict[str, Any]] | None = None) -> int | None:
        """Messages rendered by the server's template (``/apply-template``, tools included),
        then counted by its ``/tokenize``."""
        if not self._counts:
            return None
        if not isinstance(prompt, str):
            body: dict[str, Any] = {"messages": prompt, **({"tools": tools} if tools else {})}
            try:
                prompt = await self._apply_template_body(body)
            except BackendError as exc:
                if exc.status is not None and 400 <= exc.status < 500 and exc.status != 429:
                    self._counts = False
                return None
        return await self._post_count("/tokenize", {"content": prompt, "add_special": True})

    async def _apply_template(self, messages: list[Message]) -> str:
        return await self._apply_template_body({"messages": messages})

    async def _apply_template_body(self, request: dict[str, Any]) -> str:
        body = await self._session.post_json("/apply-template", request, {}, PROPS_TIMEOUT_S,
                                             model_request=False)
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, str):
            raise ServerError(f"{self.name}: /apply-template returned no prompt", status=200)
        return prompt

    async def _batch_prompts(self, prompts: list[str], messages: list[list[Message]] | None,
                             model: str) -> tuple[list[str], dict[str, Any]]:
        """Prompts rendered by the server's template when the conversations are given."""
        if self._props is None and not self._no_slots:
            await self._learn_slots()  # for ``batch_limit`` from the next batch on
        if messages is not None:
            prompts = await self.template.render_many(text_conversations(messages))
        return prompts, {"cache_prompt": True}

    def _batch_schema(self, json_schema: dict[str, Any]
                      ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """llama.cpp ignores ``response_format`` on completions: the compact grammar (for the
        part after the prefill, with jump-forward), or its own top-level ``json_schema``."""
        schema = response_format(json_schema)["json_schema"]["schema"]
        split = self._jump_split(schema)
        if split is not None:
            return None, {"grammar": split[1]}
        grammar = self.grammar_for(schema)
        return None, ({"grammar": grammar} if grammar is not None else {"json_schema": schema})

    def _batch_prefill(self, json_schema: dict[str, Any]) -> str:
        """Jump-forward on batched prompts too: each prompt ends with the reply's forced start
        (the rendered template ends with the assistant header, so this is the same text a
        prefilled chat turn renders to)."""
        split = self._jump_split(response_format(json_schema)["json_schema"]["schema"])
        return split[0] if split is not None else ""

    def _jump_split(self, schema: Any) -> tuple[str, str] | None:
        """(prefix, grammar for the rest) when replies to ``schema`` go with jump-forward."""
        if not self.jump_forward or self.grammar_for(schema) is None:
            return None
        return self.split_for(schema)


def _split_worth_it(schema: dict[str, Any]) -> tuple[str, str] | None:
    try:
        split = split_gbnf(schema)
    except Unsupported:
        return None
    return split if split is not None and len(split[0]) >= MIN_PREFILL_CHARS else None


def _per_schema(cache: dict[int, tuple[Any, Any]], schema: Any, build: Callable[[Any], Any]
                ) -> Any:
    """``build(schema)``, once per schema object: schemas are built once per plan, and the
    cache holds each schema so its id cannot be reused while the entry lives."""
    hit = cache.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    if len(cache) >= 64:
        cache.clear()
    value = build(schema)
    cache[id(schema)] = (schema, value)
    return value
