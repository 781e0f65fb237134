"""The ``[queue]`` section: which ticket a request gets."""

from __future__ import annotations

import msgspec
import pytest

from server.config import GatewayConfig
from server.envelope.queue_tickets import QueueSettings, TenantQueue, Tickets


def test_tickets_take_the_tenant_entry_then_the_defaults() -> None:
    settings = QueueSettings(
        weight=1.0,
        max_queued_per_tenant=8,
        max_wait_s=5.0,
        tenants={
            "big": TenantQueue(weight=4.0, max_queued=32),
            "bulk": TenantQueue(band="background"),
        },
    )
    tickets = Tickets(settings)
    big = tickets.ticket("big")
    assert big is not None
    assert (big.tenant, big.band, big.weight, big.max_queued, big.max_wait_s) == (
        "big",
        "interactive",
        4.0,
        32,
        5.0,
    )
    assert tickets.ticket("big") is big  # built once
    bulk = tickets.ticket("bulk")
    assert bulk is not None and bulk.band == "background" and bulk.max_queued == 8
    item = tickets.ticket("big", batch=True)
    assert item is not None and item.band == "batch"
    asked = tickets.ticket("other", priority="background")
    assert asked is not None and asked.band == "background" and asked.weight == 1.0
    anonymous = tickets.ticket(None)
    assert anonymous is not None and anonymous.tenant == "-"


def test_the_switch_off_gives_no_ticket() -> None:
    assert Tickets(QueueSettings(enabled=False)).ticket("a") is None


def test_the_queue_section_is_validated_at_load() -> None:
    config = msgspec.convert(
        {"queue": {"enabled": False, "tenants": {"a": {"weight": 2}}}}, GatewayConfig
    )
    assert config.queue.enabled is False and config.queue.tenants["a"].weight == 2.0
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"queue": {"tenants": {"a": {"weight": 0}}}}, GatewayConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"queue": {"tenants": {"a": {"band": "batch"}}}}, GatewayConfig)
