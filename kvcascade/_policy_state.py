"""Cache-policy state across restarts (issue #9 item 5): kept beside the fs tier's data.

A primary-tier policy that learns (``turn_aware``: per-class re-read statistics) has
``save_state(path)`` / ``load_state(path)``. When the cascade has an fs tier, the lifecycle
(:func:`kvcascade._lifecycle.serve_coordinator`, entered by ``open_cascade`` and by the vLLM
connector's loop thread) loads the state when the tiers start from
``<root_dir>/<model>_<digest12>/<file>`` — the fs namespace's directory, next to its
``config.json``, shared by all ranks — and saves it after they drained. ``<file>`` is the policy's
``state_file_name`` attribute (``turn_aware_state.json``), else
``policy_state_<ClassName>.json``. The namespace digest covers the model, dtype, block size,
salt and file format, so a state file is only found by a cascade of the same identity.

Never fatal: a missing file starts fresh silently; an unreadable, corrupt or incompatible one
(another format version, another ``max_turn``) is logged as a warning and ignored; a failed save
is logged and the shutdown goes on. Policies without ``save_state``/``load_state`` (``lru``,
``arc``) get no file.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from .policies.base import CachePolicy
from .tiers.base import SecondaryTier

log = logging.getLogger(__name__)


def supports_state(policy: CachePolicy) -> bool:
    """True if ``policy`` can save and load its learned state."""
    return callable(getattr(policy, "save_state", None)) and callable(
        getattr(policy, "load_state", None)
    )


def state_file_name(policy: CachePolicy) -> str:
    """The state file's name: ``policy.state_file_name``, else ``policy_state_<Class>.json``."""
    name = getattr(policy, "state_file_name", None)
    if isinstance(name, str) and name and "/" not in name and name not in (".", ".."):
        return name
    return f"policy_state_{type(policy).__name__}.json"


def policy_state_path(policy: CachePolicy, tiers: Sequence[SecondaryTier]) -> Path | None:
    """Where ``policy``'s state lives: in the first fs tier's namespace directory (beside its
    ``config.json``); None when the policy has no state or there is no fs tier."""
    if not supports_state(policy):
        return None
    from .tiers.fs import FileSystemTier  # deferred: the fs tier pulls in the I/O helpers

    for tier in tiers:
        if isinstance(tier, FileSystemTier):
            config = Path(tier.root) / tier.mapper.config_relative_path()
            return config.parent / state_file_name(policy)
    return None


def load_policy_state(policy: CachePolicy, path: Path) -> bool:
    """Load ``policy``'s state from ``path``; True if loaded.

    A missing file returns False quietly; any other failure (unreadable, corrupt, incompatible)
    is logged as a warning and returns False — the policy then starts fresh. Never raises.
    """
    try:
        policy.load_state(path)  # type: ignore[attr-defined]
    except FileNotFoundError:
        return False
    except Exception as exc:  # a bad state file must never stop the cascade
        log.warning("kvcascade: ignoring cache-policy state %s (%s); starting fresh", path, exc)
        return False
    log.info("kvcascade: loaded cache-policy state from %s", path)
    return True


def save_policy_state(policy: CachePolicy, path: Path) -> bool:
    """Save ``policy``'s state to ``path`` (the policy writes atomically); True if saved.

    A failure is logged as a warning and returns False. Never raises.
    """
    try:
        policy.save_state(path)  # type: ignore[attr-defined]
    except Exception as exc:  # shutdown must go on
        log.warning("kvcascade: could not save cache-policy state to %s (%s)", path, exc)
        return False
    return True
