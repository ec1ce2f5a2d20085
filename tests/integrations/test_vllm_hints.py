"""Request hints from vLLM onto kvcascade's SessionHint (issue #16 item 5).

vLLM 0.32 carries them in ``kv_transfer_params`` (also over HTTP:
``tests/integrations/test_vllm_serve.py`` sends one), vLLM 0.33 also in ``Request.kv_hints``, a
``KvHintsEnvelope`` (``vllm/v1/kv_hints/protocol.py``). The envelope rules run without vLLM; the
adapter test runs a real vLLM ``Request`` through the connector's request view (skipped without
vLLM).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import pytest

from kvcascade._types import ReqContext
from kvcascade.hints import HINT_ACTION, HINT_PARAM, SessionHint, hint_of, with_envelope_hint

try:  # vLLM 0.33's own classes (msgspec structs) where it is installed
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
except ImportError:  # vLLM 0.32 / no vLLM: 0.33's fields, as its protocol.py declares them

    @dataclasses.dataclass(frozen=True)
    class KvHintAction:  # type: ignore[no-redef]
        action_id: str
        action_type: str
        action_version: str
        payload: dict[str, Any]

    @dataclasses.dataclass(frozen=True)
    class KvHintsEnvelope:  # type: ignore[no-redef]
        protocol_version: str
        message_id: str
        actions: list[KvHintAction]


def builtins(env: KvHintsEnvelope) -> dict[str, Any]:
    """The envelope as ``msgspec.to_builtins`` gives it (what vLLM hands a tier as a dict)."""
    return {
        "protocol_version": env.protocol_version,
        "message_id": env.message_id,
        "actions": [
            {f: getattr(a, f) for f in ("action_id", "action_type", "action_version", "payload")}
            for a in env.actions
        ],
    }


def envelope(*actions: tuple[str, str, dict[str, Any]]) -> KvHintsEnvelope:
    return KvHintsEnvelope(
        "1", "m-1", [KvHintAction(f"a-{i}", t, v, p) for i, (t, v, p) in enumerate(actions)]
    )


def test_envelope_action_becomes_the_session_hint() -> None:
    """The kvcascade action's payload is the hint, as a struct and as its builtins dict; other
    actions are left alone; the request's other parameters are kept and never modified."""
    env = envelope(
        ("router.pin", "3", {"x": 1}),
        (HINT_ACTION, "1", {"continues": True, "ttl_s": 600, "priority": 9}),
    )
    params = {"max_offload_tokens": 64}
    for form in (env, builtins(env)):
        merged = with_envelope_hint(params, form)
        assert merged == {"max_offload_tokens": 64, HINT_PARAM: env.actions[1].payload}
        assert hint_of(ReqContext("r", merged)) == SessionHint(True, 600, 3)
    assert params == {"max_offload_tokens": 64}


def test_explicit_parameter_wins_and_absent_envelope_changes_nothing() -> None:
    env = envelope((HINT_ACTION, "1", {"continues": True}))
    explicit = {HINT_PARAM: {"continues": False}}
    assert with_envelope_hint(explicit, env) is explicit
    assert with_envelope_hint(None, None) is None
    assert with_envelope_hint({"a": 1}, envelope(("other", "1", {}))) == {"a": 1}
    assert with_envelope_hint(None, env) == {HINT_PARAM: {"continues": True}}


def test_other_version_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    env = envelope((HINT_ACTION, "2", {"continues": False}))
    with caplog.at_level(logging.WARNING, logger="kvcascade.hints"):
        assert with_envelope_hint(None, env) is None
    assert "version '2'" in caplog.text


def test_malformed_payload_leaves_the_request_unhinted(caplog: pytest.LogCaptureFixture) -> None:
    """A payload SessionHint refuses is logged and ignored (the request behaves as unhinted)."""
    merged = with_envelope_hint(None, envelope((HINT_ACTION, "1", {"continues": "yes"})))
    with caplog.at_level(logging.WARNING, logger="kvcascade.hints"):
        assert hint_of(ReqContext("r", merged)) is None
    assert "continues must be" in caplog.text


def test_connector_request_view_reads_the_envelope() -> None:
    """A real vLLM ``Request`` with ``kv_hints`` (as vLLM 0.33 sets it): the connector's view
    hands the scheduler ``kv_transfer_params`` with the hint; without, the request's own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm", reason="vLLM is not installed in this environment")
        from vllm import SamplingParams
        from vllm.v1.request import Request

        from kvcascade.integrations.vllm import _RequestView

    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"a": 1}})
    req = Request("r-1", [1, 2, 3], params, None)
    assert _RequestView(req).kv_transfer_params == {"a": 1}
    req.kv_hints = envelope((HINT_ACTION, "1", {"continues": False}))  # type: ignore[attr-defined]
    view = _RequestView(req)
    assert view.kv_transfer_params == {"a": 1, HINT_PARAM: {"continues": False}}
    assert hint_of(ReqContext("r-1", view.kv_transfer_params)) == SessionHint(False)
