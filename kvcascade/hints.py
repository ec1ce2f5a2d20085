"""Session hints: what the application knows about a request's future (issue #9).

A :class:`SessionHint` says whether the conversation a request belongs to will come back
(``continues``), optionally for how long its KV is worth keeping (``ttl_s``) and how much it
matters relative to other traffic (``priority``). Hints only steer eviction: a wrong hint costs
hit rate, never correctness.

Two ways to attach one:

* Python API: ``ctx.set_state(SessionHint(continues=False))`` on the request's
  :class:`~kvcascade.ReqContext`.
* vLLM connector: the request's ``kv_transfer_params`` carries
  ``{"kvcascade_hint": {"continues": true, "ttl_s": 600, "priority": 1}}`` (vLLM 0.32 and 0.33,
  also over HTTP); :func:`hint_of` parses it on first use and caches the result on the context.
* vLLM 0.33's request hints (``Request.kv_hints``, a ``KvHintsEnvelope`` from
  ``vllm/v1/kv_hints/protocol.py``): an action with ``action_type`` :data:`HINT_ACTION` and
  ``action_version`` :data:`HINT_ACTION_VERSION` whose ``payload`` is the same object;
  :func:`with_envelope_hint` puts it into ``kv_transfer_params`` (``docs/vllm.md``, *Hints*).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ._types import ReqContext
from ._validate import finite_number, is_int

logger = logging.getLogger(__name__)

#: Key of the hint object inside a request's ``kv_transfer_params``.
HINT_PARAM = "kvcascade_hint"

#: Priorities are clamped to this range (a policy keeps one class per priority level).
MAX_PRIORITY = 3

#: ``action_type`` / ``action_version`` of the session hint in a vLLM ``KvHintsEnvelope``.
HINT_ACTION = "kvcascade.session_hint"
HINT_ACTION_VERSION = "1"


@dataclass(frozen=True)
class SessionHint:
    """Per-request hint.

    Attributes:
        continues: True — the session will send another request extending this prompt; False —
            it will not (closed chat, finished agent loop); None — unknown (the default).
        ttl_s: seconds after the request's last use beyond which its blocks are worth nothing
            (None: no limit). Must be > 0.
        priority: relative importance, an int clamped to ``[-MAX_PRIORITY, MAX_PRIORITY]``;
            blocks of a higher priority are evicted only after every lower-priority block that
            can be evicted. Default 0.

    Raises:
        ValueError: ``continues`` not a bool or None, ``ttl_s`` not a positive finite number
            (also an int beyond a float's range), ``priority`` not an int.
    """

    continues: bool | None = None
    ttl_s: float | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        if self.continues is not None and not isinstance(self.continues, bool):
            raise ValueError(f"continues must be true, false or null, got {self.continues!r}")
        ttl = None if self.ttl_s is None else finite_number(self.ttl_s)
        if self.ttl_s is not None and (ttl is None or ttl <= 0):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {self.ttl_s!r:.40}")
        if not is_int(self.priority):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        object.__setattr__(self, "priority", max(-MAX_PRIORITY, min(MAX_PRIORITY, self.priority)))

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> SessionHint | None:
        """The hint in ``params[HINT_PARAM]`` (a request's ``kv_transfer_params``), or None.

        A malformed hint (not an object, unknown field, bad value) is logged as a warning and
        ignored: the request then behaves as unhinted; so are ``params`` that are not a dict (a
        ``ReqContext`` built by hand with a string, say).
        """
        if not params:
            return None
        if not isinstance(params, dict):
            logger.warning("ignoring kv_transfer_params: expected a dict, got %.60r", params)
            return None
        if HINT_PARAM not in params:
            return None
        raw = params[HINT_PARAM]
        if not isinstance(raw, dict):
            logger.warning("ignoring %s: expected an object, got %r", HINT_PARAM, raw)
            return None
        unknown = set(raw) - {"continues", "ttl_s", "priority"}
        if unknown:
            logger.warning("ignoring %s: unknown fields %s", HINT_PARAM, sorted(unknown, key=str))
            return None
        try:
            return cls(**raw)
        except (TypeError, ValueError) as exc:
            logger.warning("ignoring %s: %s", HINT_PARAM, exc)
            return None


def _field(obj: Any, name: str) -> Any:
    """``obj.name`` of a msgspec struct, or ``obj[name]`` of its builtins form (a dict)."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def with_envelope_hint(params: dict[str, Any] | None, envelope: Any) -> dict[str, Any] | None:
    """``params`` (a request's ``kv_transfer_params``) with the session hint of ``envelope``.

    Args:
        params: the request's ``kv_transfer_params`` (or None); never modified.
        envelope: vLLM 0.33's ``KvHintsEnvelope`` (``protocol_version``, ``message_id``,
            ``actions``: each ``action_id``, ``action_type``, ``action_version``, ``payload``),
            its ``msgspec.to_builtins`` dict, or None (vLLM 0.32, or a request without hints).

    Returns:
        ``params`` itself when the envelope has no :data:`HINT_ACTION` action or ``params``
        already carries :data:`HINT_PARAM` (the explicit parameter wins); else a new dict with
        ``params[HINT_PARAM]`` = the action's ``payload`` (the last such action), which
        :meth:`SessionHint.from_params` validates. An action of another ``action_version`` is
        logged as a warning and ignored. Actions of other types are not kvcascade's and are
        left alone.
    """
    if envelope is None or not isinstance(params, dict | None) or (params and HINT_PARAM in params):
        return params  # not a dict: SessionHint.from_params warns
    actions = _field(envelope, "actions") or ()
    if not isinstance(actions, list | tuple):
        logger.warning("ignoring a hints envelope whose actions are %.60r", actions)
        return params
    payload = None
    for action in actions:
        if _field(action, "action_type") != HINT_ACTION:
            continue
        version = _field(action, "action_version")
        if version != HINT_ACTION_VERSION:
            logger.warning(
                "ignoring %s action version %r (this kvcascade reads version %r)",
                HINT_ACTION,
                version,
                HINT_ACTION_VERSION,
            )
            continue
        payload = _field(action, "payload")
    if payload is None:
        return params
    return {**(params or {}), HINT_PARAM: payload}


def hint_of(ctx: ReqContext | None) -> SessionHint | None:
    """The request's hint: the one set with ``ctx.set_state``, else the one parsed from
    ``ctx.kv_transfer_params`` (then cached on ``ctx``); None without a context or hint."""
    if ctx is None:
        return None
    hint = ctx.get_state(SessionHint)
    if hint is None and ctx.kv_transfer_params:
        hint = SessionHint.from_params(ctx.kv_transfer_params)
        if hint is not None:
            ctx.set_state(hint)
    return hint


def admits_new_blocks(ctx: ReqContext | None, policy: object, n: int = 1) -> bool:
    """Whether the request of ``ctx`` may store ``n`` new blocks in the tier of ``policy``.

    Policies that read hints themselves (``uses_hints = True``, e.g. ``turn_aware``) decide
    through their :meth:`~kvcascade.policies.CachePolicy.admits` (``turn_aware``: admission
    control by learned value). The others (LRU, ARC) get the simple hint rule: a request whose
    session will not continue (``continues=False``) stores no new blocks — they would only push
    out blocks that will be read again. Shared prefixes it reuses are already cached;
    promotions for the request itself are not affected.
    """
    if getattr(policy, "uses_hints", False):
        admits = getattr(policy, "admits", None)
        return True if admits is None else bool(admits(ctx, n))
    return may_continue(ctx)


def may_continue(ctx: ReqContext | None) -> bool:
    """False only when the request of ``ctx`` carries a hint that its session will not
    continue (``continues=False``): the hint rule of LRU and ARC in :func:`admits_new_blocks`."""
    hint = hint_of(ctx)
    return hint is None or hint.continues is not False
