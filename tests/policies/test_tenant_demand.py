"""Who is a light sender: prompt tokens per tenant and tier over a window of the engine's clock."""

from __future__ import annotations

from policies.tenant_demand import TenantDemand


def test_a_tenant_sending_under_half_its_share_of_the_tiers_tokens_is_light() -> None:
    demand = TenantDemand(window_s=5.0)
    demand.record(1, "heavy", 1.0, 900, now_s=0.0)
    # one sender: no share to fall short of
    assert demand.light_senders(0.0) == {}
    demand.record(1, "light", 1.0, 100, now_s=1.0)
    demand.record(0, "premium", 1.0, 50, now_s=1.0)
    # light sent 10 % of the tier's tokens, under half its 50 % share; premium is a tier alone
    assert demand.light_senders(1.0) == {1: frozenset({"light"})}
    assert demand.sent(1.0) == {1: {"heavy": 900, "light": 100}, 0: {"premium": 50}}
    demand.record(1, "light", 1.0, 200, now_s=2.0)
    # 300 of 1,200 tokens is half its share exactly: no longer under it
    assert demand.light_senders(2.0) == {1: frozenset()}


def test_shares_are_weighted() -> None:
    demand = TenantDemand(window_s=5.0)
    demand.record(1, "big", 3.0, 600, now_s=0.0)
    demand.record(1, "small", 1.0, 150, now_s=0.0)
    demand.record(1, "other", 1.0, 250, now_s=0.0)
    # shares of 1,000 tokens: big 600, small and other 200 each; half of 200 is 100, and half
    # of 600 is 300
    assert demand.light_senders(0.0) == {1: frozenset()}
    demand.record(1, "big", 3.0, 1000, now_s=0.0)
    # of 2,000: small's and other's shares 400 each, half 200; big's 1,200, half 600
    assert demand.light_senders(0.0) == {1: frozenset({"small"})}


def test_what_was_sent_is_forgotten_after_the_window() -> None:
    demand = TenantDemand(window_s=5.0)
    demand.record(1, "heavy", 1.0, 1000, now_s=0.0)
    demand.record(1, "light", 1.0, 100, now_s=3.0)
    assert demand.light_senders(4.9) == {1: frozenset({"light"})}
    # at 5.5 the heavy tenant's burst at 0.0 has left the window: light sends alone
    assert demand.light_senders(5.5) == {}
    assert demand.sent(5.5) == {1: {"light": 100}}
    demand.record(1, "heavy", 1.0, 20, now_s=6.0)
    assert demand.light_senders(6.0) == {1: frozenset({"heavy"})}
    assert demand.light_senders(20.0) == {}
    # a tenant's latest weight counts
    demand.record(1, "a", 1.0, 100, now_s=21.0)
    demand.record(1, "b", 1.0, 30, now_s=21.0)
    assert demand.light_senders(21.0) == {1: frozenset({"b"})}
    demand.record(1, "b", 0.1, 1, now_s=21.0)
    assert demand.light_senders(21.0) == {1: frozenset()}
