"""Lua scripts beside the Redis code, registered once per client.

Each script is its file with ``lua/_prelude.lua`` in front: the helpers that read and write
the encodings every script shares (the state entry's version, the JSON array a variable-length
argument travels as, a script's counted variable keys, the started mark). Each script names
its KEYS and ARGV in a header comment and binds them to locals at its top.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

_LUA_DIR = Path(__file__).with_name("lua")
NAMES = ("claim", "commit", "resend", "tool_touch", "tool_start", "renew", "release", "record_tool",
         "sem_acquire", "tool_lead",
         "lock_renew",
         "tool_finish",
         "sem_throttle", "sem_success",
         "note", "sem_renew", "rate_take", "park", "wake",
         "cancel", "submit", "pay_lost", "hedge_intent", "forget", "slot_take", "slot_give")


@cache
def source(name: str) -> str:
    return (_LUA_DIR / "_prelude.lua").read_text() + (_LUA_DIR / f"{name}.lua").read_text()


class Scripts:
    """``scripts.claim(keys=[...], args=[...])`` runs EVALSHA, loading the script on a miss."""

    def __init__(self, client: Any) -> None:
        for name in NAMES:
            setattr(self, name, client.register_script(source(name)))

    claim: Any
    commit: Any
    resend: Any
    tool_touch: Any
    tool_start: Any
    renew: Any
    release: Any
    record_tool: Any
    sem_acquire: Any
    sem_throttle: Any
    sem_success: Any
    sem_renew: Any
    rate_take: Any
    tool_lead: Any
    tool_finish: Any
    lock_renew: Any
    note: Any
    submit: Any
    park: Any
    wake: Any
    cancel: Any
    pay_lost: Any
    hedge_intent: Any
    forget: Any
    slot_take: Any
    slot_give: Any
