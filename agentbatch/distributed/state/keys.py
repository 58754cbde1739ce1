"""Every Redis key agentbatch uses, in one place.

A batch's keys share the hash tag ``{batch_id}``; this does not make agentbatch Cluster-safe:
the commit script also touches ``ab:batches``, the fleet-wide ``ab:watch`` zset and the Celery
queue lists, so Redis Cluster is refused (``distributed/state/connection.py``,
``CLUSTER_UNSUPPORTED``).
"""

from __future__ import annotations

import hashlib

PREFIX = "ab"
ACTIVE_BATCHES = f"{PREFIX}:batches"  # set of batch ids the recovery sweep watches
SWEEP_LOCK = f"{PREFIX}:sweep:lock"  # one sweeper at a time, fleet-wide
# zset: "<batch id>:<index>" -> progress deadline (ms), every live agent of every batch. One
# fleet-wide set, so a sweep pass costs O(agents due), whatever the number of active batches.
WATCH = f"{PREFIX}:watch"
# zset per task queue list: "<batch id>:<index>" -> when the sweep found that agent's version
# not started while its message waited in that list (ms). Woken once the list has moved past
# it (distributed/workers/sweep.py): an agent only queued costs the sweep no look meanwhile.
PARKED = f"{PREFIX}:parked"
TOOL_DONE_CHANNEL = f"{PREFIX}:tool:done"  # pub/sub: "<key hash>:<token>" when a leader finishes
DEAD_LETTERS = f"{PREFIX}:deadletter"  # list: queue messages no worker could decode
TOMBSTONE_S = 30 * 24 * 3600  # how long a batch's ``gone`` key outlives its retention
# A submitter writes a batch's keys here first; submit.lua renames them into place, never over
# an existing key (deploy/redis-users.acl lets submitters write batch keys no other way).
STAGING = f"{PREFIX}:stage"


def slot_map_key(endpoint: str) -> str:
    """Hash: which agent's conversation each slot of one llama-server holds, and our turns on
    it, fleet-wide (``slot_map.FleetSlots``; ``lua/slot_take.lua``). One per server, expiring
    once idle; keyed by a digest of the endpoint's name, so no URL is spelled in a key."""
    return f"{PREFIX}:slots:{hashlib.sha1(endpoint.encode()).hexdigest()[:16]}"


class BatchKeys:
    """Keys of one batch."""

    def __init__(self, batch_id: str) -> None:
        base = f"{PREFIX}:{{{batch_id}}}"
        self.batch_id = batch_id
        self.plan = f"{base}:plan"  # string: the BatchPlan JSON
        self.meta = f"{base}:meta"  # hash: total, delivered, cancelled, n:<status> counters
        # hash: index -> "<version>:<AgentState JSON>", messages apart (state_entry): the
        # version is the compare-and-set token, read and written with the state in one call
        self.state = f"{base}:state"
        # the fleet-wide deadline zset; this batch's members: member()
        self.watch = WATCH
        # hash: index -> the version last started (claimed, or a tool call of it run): the
        # sweep re-sends a started version at once; one only queued may still be waiting
        self.started = f"{base}:started"
        self.results = f"{base}:results"  # stream: one entry per finished agent
        self.audit = f"{base}:audit"  # stream: (index, version) per commit, when auditing
        self.resends = f"{base}:resends"  # hash: index -> "version:n" re-sends without progress
        # hash: index -> the fencing token last handed to a call of that agent's own (unshared)
        # tool calls; one counter per agent, so successive leaders of any call get more
        self.fence = f"{base}:fence"
        # string: why the batch's keys went (expired after retention, or deleted); outlives
        # them by TOMBSTONE_S so a late reader gets ``BatchExpired``, not ``BatchLost``
        self.gone = f"{base}:gone"
        # hash: "<index>:<version>" -> the provider batch id holding that turn (pricing="batch",
        # distributed/provider_batches.py), "?" while it is being submitted; its own TTL
        self.provider_batches = f"{base}:pbatch"
        self._base = base

    def member(self, index: int) -> str:
        """This agent's member of the fleet-wide ``WATCH`` zset."""
        return f"{self.batch_id}:{index}"

    def pattern(self) -> str:
        """SCAN pattern matching every key of this batch, the tombstone included."""
        return f"{_glob_escape(self._base)}:*"

    def tool_pattern(self) -> str:
        """SCAN pattern of the batch's shared tool-call keys (``tool_hash``): cache, lock,
        fence and coalesced results, which ``agentbatch rm`` deletes with the batch."""
        return _glob_escape(f"{PREFIX}:tool:{tool_hash(self.batch_id, '')}") + "*"

    def staged(self, token: str, name: str) -> str:
        """Where one submit (``token``) stages the batch key ``name`` (plan, meta, state,
        gone) before ``submit.lua`` renames it into place."""
        return f"{STAGING}:{{{self.batch_id}}}:{token}:{name}"

    def lease(self, index: int) -> str:
        return f"{self._base}:lease:{index}"

    def messages(self, index: int) -> str:
        """List: the agent's conversation, one JSON message per entry, appended per turn
        (deleted by the commit that ends the agent)."""
        return f"{self._base}:msgs:{index}"

    def calls(self, index: int) -> str:
        """List: the agent's tool-call log (the result's ``tool_calls``), one JSON record per
        entry, appended per tool round (deleted by the commit that ends the agent)."""
        return f"{self._base}:calls:{index}"

    def tool_results(self, index: int, version: int) -> str:
        return f"{self._base}:tr:{index}:{version}"

    def call_lock(self, index: int, version: int, call_id: str) -> str:
        """String: the lock of one unshared tool call (its holder's token; tool_start.lua)."""
        return f"{self._base}:lock:{index}:{version}:{call_id}"



class PipelineKeys:
    """Keys of one chained pipeline (``patterns/pipeline_chain.py``): its spec, one guard per
    stage a worker submitted, and how it ended. They get the batches' retention."""

    def __init__(self, pipeline_id: str) -> None:
        base = f"{PREFIX}:pipe:{{{pipeline_id}}}"
        self.pipeline_id = pipeline_id
        self.spec = f"{base}:spec"  # string: the PipelineSpec JSON, created only if absent
        self.done = f"{base}:done"  # string: JSON {"stage": n} or {"error": ..., "stage": n}

    def stage(self, n: int) -> str:
        """String (SET NX): the batch id of stage ``n``, set by the worker that submits it."""
        return f"{PREFIX}:pipe:{{{self.pipeline_id}}}:stage:{n}"

    def staged_spec(self, token: str) -> str:
        """Where a submitter writes the spec before RENAMENX puts it in place."""
        return f"{STAGING}:pipe:{{{self.pipeline_id}}}:{token}"


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def tool_hash(batch_id: str | None, digest: str) -> str:
    """The key hash of one shared tool call (``tool_lock`` & co.): a call shared within one
    batch carries its batch (``{id}:<digest>``), so deleting the batch finds its cached and
    coalesced results (``BatchKeys.tool_pattern``); a ``share="fleet"`` call's is the bare
    digest, the fleet's and left to its TTL."""
    return f"{{{batch_id}}}:{digest}" if batch_id is not None else digest


def watch_member(member: str) -> tuple[str, int]:
    """(batch id, index) of a ``WATCH`` member."""
    batch_id, _, index = member.rpartition(":")
    return batch_id, int(index)


def parked_key(list_key: str) -> str:
    """The ``PARKED`` zset of one queue list (kombu's list key: queue and priority step)."""
    return f"{PARKED}:{list_key}"


def tool_lock(key_hash: str) -> str:
    return f"{PREFIX}:tool:{key_hash}:lock"


def tool_result(key_hash: str, token: str) -> str:
    return f"{PREFIX}:tool:{key_hash}:res:{token}"


def tool_fence(key_hash: str) -> str:
    """Counter: the fencing token handed to each successive leader of one call."""
    return f"{PREFIX}:tool:{key_hash}:fence"


def tool_cache(key_hash: str) -> str:
    return f"{PREFIX}:tool:{key_hash}:cache"


def semaphore(name: str) -> str:
    return f"{PREFIX}:sem:{name}"
