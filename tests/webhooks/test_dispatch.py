"""The leader's webhook loop against a real PostgreSQL and a receiver in a namespace of its own:
what each event row sends, signed; retries; a slow endpoint that delays nobody else; targets
the egress floor refuses, never dialled; giving up after a day."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from collections.abc import AsyncIterator, Sequence

import pytest
import sqlalchemy as sa

import space
from space.db import tables as t
from space.db.sealing import Sealer
from space.db.store import Store
from space.db.store.webhooks import Webhook
from space.webhooks import signing
from space.webhooks.dispatch import Webhooks, plan
from space.webhooks.events import EVENT_TYPES, TIMED_OUT
from space.webhooks.targets import egress_floor
from tests.webhooks.receiver import Receiver

# (type, from, to, reason) of one sandbox's life, and what each sends
LIFE = [
    (("created", None, "pending", None), ["sandbox.created"]),
    (("state", "pending", "starting", None), []),
    (("state", "starting", "running", None), ["sandbox.running"]),
    (("requested", "running", "paused", "idle for 60 s"), ["sandbox.idle_paused"]),
    (("state", "pausing", "paused", None), ["sandbox.paused"]),
    (("state", "resuming", "running", None), ["sandbox.resumed"]),
    (("requested", "running", "suspended", TIMED_OUT), ["sandbox.timed_out"]),
    (("state", "suspending", "suspended", None), ["sandbox.suspended"]),
    (("state", "resuming", "error", "its VM is gone"), ["sandbox.failed"]),
    (("requested", "error", "deleted", None), []),
    (("state", "deleting", "deleted", None), ["sandbox.deleted"]),
]


@pytest.fixture
async def hooks(store: Store, sealer: Sealer) -> AsyncIterator[Webhooks]:
    w = Webhooks(store, sealer, egress_floor([]))
    try:
        yield w
    finally:
        await w.close()


async def endpoint(
    store: Store, sealer: Sealer, tenant_id: str, url: str, events: Sequence[str] = EVENT_TYPES
) -> tuple[Webhook, str]:
    return await store.create_webhook(tenant_id, url, list(events), "", sealer)


async def events(store: Store, tenant_id: str, sandbox_id: str,
                 rows: list[tuple[str, str | None, str | None, str | None]]) -> None:  # fmt: skip
    async with store.engine.begin() as c:
        for kind, before, after, reason in rows:
            await c.execute(t.events.insert().values(
                sandbox_id=sandbox_id, tenant_id=tenant_id, type=kind, from_state=before,
                to_state=after, reason=reason,  # and settled: past the queue's wait
                at=sa.func.now() - sa.text("interval '3 seconds'")))  # fmt: skip


async def until(predicate: object, timeout: float = 20) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.2)


async def run_until_settled(hooks: Webhooks, store: Store, tenant_id: str, webhook_id: str,
                            timeout: float = 20) -> None:  # fmt: skip
    async def settled() -> bool:
        await hooks.once()
        found = await store.deliveries(tenant_id, webhook_id, 500)
        return bool(found) and all(d.state != "pending" for d in found)

    await until(settled, timeout)


async def test_each_event_is_sent_once_signed_to_the_endpoints_that_want_it(
    store: Store, sealer: Sealer, hooks: Webhooks, receiver: Receiver
) -> None:
    tenant = await store.create_tenant("wh-all")
    other = await store.create_tenant("wh-other")
    every, secret = await endpoint(store, sealer, tenant.id, f"{receiver.url}/ok")
    only, _ = await endpoint(store, sealer, tenant.id, f"{receiver.url}/ok?only",
                             ["sandbox.deleted"])  # fmt: skip
    await events(store, tenant.id, "sb-life", [row for row, _ in LIFE])
    await events(store, other.id, "sb-theirs", [("created", None, "pending", None)])
    await run_until_settled(hooks, store, tenant.id, every.id)
    await run_until_settled(hooks, store, tenant.id, only.id)

    wanted = [kind for _, kinds in LIFE for kind in kinds]
    got = receiver.requests("/ok")
    assert [r["headers"]["Space-Event"] for r in got] == wanted
    for r in got:
        signing.verify(secret, r["headers"]["Space-Signature"], r["body"])
        space.verify_webhook(secret, r["headers"]["Space-Signature"], r["body"])  # the SDK's
        body = json.loads(r["body"])
        assert body["sandbox_id"] == "sb-life" and body["tenant_id"] == tenant.id
        assert body["type"] == r["headers"]["Space-Event"]
        assert r["headers"]["Space-Webhook-Id"] == every.id
    assert json.loads(got[-1]["body"])["reason"] is None
    (deleted,) = receiver.requests("/ok?only")
    assert deleted["headers"]["Space-Event"] == "sandbox.deleted"
    # Once each: the loop again finds nothing more to send.
    await hooks.once()
    await asyncio.sleep(0.5)
    assert len(receiver.requests("/ok")) == len(wanted)
    # A signature is this secret's, for this body, and fresh.
    r = got[0]
    with pytest.raises(space.WebhookSignatureError, match="does not match"):
        space.verify_webhook(secret, r["headers"]["Space-Signature"], r["body"] + b" ")
    with pytest.raises(space.WebhookSignatureError, match="does not match"):
        space.verify_webhook("whsec_other", r["headers"]["Space-Signature"], r["body"])
    with pytest.raises(space.WebhookSignatureError, match="replay"):
        space.verify_webhook(secret, r["headers"]["Space-Signature"], r["body"],
                             now=time.time() + 600)  # fmt: skip


async def test_a_failed_delivery_is_tried_again_and_every_try_is_shown(
    store: Store, sealer: Sealer, hooks: Webhooks, receiver: Receiver
) -> None:
    tenant = await store.create_tenant("wh-flaky")
    hook, _ = await endpoint(store, sealer, tenant.id, f"{receiver.url}/flaky",
                             ["sandbox.created"])  # fmt: skip
    await events(store, tenant.id, "sb-flaky", [("created", None, "pending", None)])
    await run_until_settled(hooks, store, tenant.id, hook.id)
    (delivery,) = await store.deliveries(tenant.id, hook.id, 10)
    assert delivery.state == "delivered"
    assert [a.status for a in delivery.attempts] == [503, 200]
    waited = (delivery.attempts[1].at - delivery.attempts[0].at).total_seconds()
    assert 1.5 < waited < 10, waited  # the first retry comes 2 s later


async def test_a_slow_endpoint_delays_only_itself(
    store: Store, sealer: Sealer, hooks: Webhooks, receiver: Receiver
) -> None:
    tenant = await store.create_tenant("wh-slow")
    await endpoint(store, sealer, tenant.id, f"{receiver.url}/slow")
    await endpoint(store, sealer, tenant.id, f"{receiver.url}/ok?fast")
    await events(store, tenant.id, "sb-slow", [("created", None, "pending", None)] * 6)
    started = time.monotonic()
    await hooks.once()
    assert time.monotonic() - started < 2.0  # the loop never waits for an endpoint

    async def all_fast_ones_came() -> bool:
        await hooks.once()  # (one at a time to an endpoint: the rest at the next passes)
        return len(receiver.requests("/ok?fast")) == 6

    await until(all_fast_ones_came, timeout=10)
    assert len(receiver.requests("/slow")) == 1  # one in flight to an endpoint


async def test_a_target_the_floor_refuses_is_never_dialled(
    store: Store, sealer: Sealer, hooks: Webhooks
) -> None:
    """A name that resolves to loopback (and a cloud metadata literal, which registration
    refuses, put in behind its back): each attempt says why, and nothing is dialled."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    tenant = await store.create_tenant("wh-refused")
    named, _ = await endpoint(store, sealer, tenant.id, f"http://localhost:{port}/")
    metadata, _ = await endpoint(store, sealer, tenant.id, "http://169.254.169.254/latest")
    await events(store, tenant.id, "sb-refused", [("created", None, "pending", None)] * 2)
    await hooks.once()

    async def tried() -> bool:
        await hooks.once()
        found = [await store.deliveries(tenant.id, h.id, 10) for h in (named, metadata)]
        return all(any(x.attempts for x in d) for d in found)

    await until(tried)
    for hook in (named, metadata):
        later, first = await store.deliveries(tenant.id, hook.id, 10)  # newest first
        (attempt,) = first.attempts
        assert attempt.status is None and attempt.error is not None
        assert attempt.error.startswith("refused:") and "never dialled" in attempt.error
        assert first.state == "pending"  # tried again later: the name may change
        # The endpoint is backed off, not each delivery: the next waits as long.
        assert later.attempts == [] and later.next_at >= first.next_at
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()


async def test_an_endpoint_that_answers_gigabytes_is_not_read(
    store: Store, sealer: Sealer, hooks: Webhooks, receiver: Receiver
) -> None:
    tenant = await store.create_tenant("wh-huge")
    hook, _ = await endpoint(store, sealer, tenant.id, f"{receiver.url}/huge", ["sandbox.created"])
    await events(store, tenant.id, "sb-huge", [("created", None, "pending", None)])
    started = time.monotonic()
    await run_until_settled(hooks, store, tenant.id, hook.id)
    (delivery,) = await store.deliveries(tenant.id, hook.id, 10)
    assert delivery.state == "delivered" and time.monotonic() - started < 10


async def test_events_are_queued_once_their_neighbours_have_committed(
    store: Store, sealer: Sealer
) -> None:
    """An event is read a moment after it is written: a transaction that took a lower id and
    commits later is never passed over."""
    tenant = await store.create_tenant("wh-lag")
    await endpoint(store, sealer, tenant.id, "http://203.0.113.2:8080/ok?lag")
    async with store.engine.begin() as c:
        await c.execute(t.events.insert().values(sandbox_id="sb-lag", tenant_id=tenant.id,
                                                 type="created", to_state="pending"))  # fmt: skip
    assert await store.queue_deliveries(plan) == 0
    await asyncio.sleep(2.5)
    assert await store.queue_deliveries(plan) == 1


async def test_a_delivery_is_given_up_after_a_day(
    store: Store, sealer: Sealer, hooks: Webhooks, receiver: Receiver
) -> None:
    tenant = await store.create_tenant("wh-late")
    hook, _ = await endpoint(store, sealer, tenant.id, f"{receiver.url}/flaky",
                             ["sandbox.created"])  # fmt: skip
    await events(store, tenant.id, "sb-late", [("created", None, "pending", None)])
    assert await store.queue_deliveries(plan) == 1  # queued, not yet tried
    d = t.webhook_deliveries.c
    async with store.engine.begin() as c:
        await c.execute(t.webhook_deliveries.update().where(d.webhook_id == hook.id).values(
            created_at=sa.func.now() - sa.text("interval '25 hours'")))  # fmt: skip
    await run_until_settled(hooks, store, tenant.id, hook.id)
    (delivery,) = await store.deliveries(tenant.id, hook.id, 10)
    assert delivery.state == "failed"
    assert [a.status for a in delivery.attempts] == [503]


async def test_the_end_of_a_build_is_sent_to_the_tenant_that_asked_for_it(
    store: Store, sealer: Sealer, hooks: Webhooks, receiver: Receiver
) -> None:
    asker = await store.create_tenant("wh-builder")
    bystander = await store.create_tenant("wh-bystander")
    mine, _ = await endpoint(store, sealer, asker.id, f"{receiver.url}/ok?builds",
                             ["template.build_finished"])  # fmt: skip
    theirs, _ = await endpoint(store, sealer, bystander.id, f"{receiver.url}/ok?theirs")
    await store.register_worker("wk-builds", "http://wk.invalid", "i", 4, 4096)
    name = f"wh-tpl-{secrets.token_hex(3)}"
    await store.request_build(name, "r1", "steps = []", b"", None, tenant_id=asker.id)
    assert await store.begin_build(name, "r1", "wk-builds", "b1") is not None
    await store.finish_build(name, "b1", {"digest": "sha256:x"}, None)
    await store.request_build(name, "r2", "steps = []", b"", None, tenant_id=asker.id)
    await store.fail_queued_build(name, "r2", "no worker has room")
    await store.request_build(name, "r3", "steps = []", b"", None)  # nobody's: nobody is told
    await store.fail_queued_build(name, "r3", "refused")

    async def both_sent() -> bool:
        await hooks.once()
        found = await store.deliveries(asker.id, mine.id, 10)
        return len(found) == 2 and all(d.state == "delivered" for d in found)

    await until(both_sent)

    got = [json.loads(r["body"]) for r in receiver.requests("/ok?builds")]
    assert [(b["type"], b["template"], b["state"], b["error"]) for b in got] == [
        ("template.build_finished", name, "ready", None),
        ("template.build_finished", name, "failed", "no worker has room"),
    ]  # fmt: skip
    assert all(b["tenant_id"] == asker.id and "sandbox_id" not in b for b in got)
    assert receiver.requests("/ok?theirs") == []
    assert await store.deliveries(bystander.id, theirs.id, 10) == []
    # Not a sandbox's event: no sandbox of that name has it.
    assert await store.events(asker.id, name) == []
