"""The policies registry: one place every consumer takes names and rules from."""

import argparse

import pytest

from tandem.cluster import live_policies, policies, settings
from tandem.cluster.policies import (
    CAPACITY_POLICIES, CHUNKING_POLICIES, EQUAL_PROGRESS, FIRST_COME_FIRST_SERVED, GUARANTEED_NO_EVICT,
    MAX_UTILIZATION, STATIC_BATCH, capacity_policy, chunking_policy,
)


def test_the_registry_holds_tensorrt_llms_policies():
    assert tuple(CAPACITY_POLICIES) == (GUARANTEED_NO_EVICT, MAX_UTILIZATION, STATIC_BATCH)
    assert tuple(CHUNKING_POLICIES) == (FIRST_COME_FIRST_SERVED, EQUAL_PROGRESS)


def test_unknown_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="GUARANTEED_NO_EVICT"):
        capacity_policy("FASTEST")
    with pytest.raises(ValueError, match="EQUAL_PROGRESS"):
        chunking_policy("FASTEST")


def test_reservation_rules():
    # prompt 10, 3 tokens out so far, max_tokens 20, max_seq_len 25
    assert capacity_policy(GUARANTEED_NO_EVICT).reserve_tokens(10, 3, 20, 25) == 25
    assert capacity_policy(STATIC_BATCH).reserve_tokens(10, 3, 12, 100) == 22
    assert capacity_policy(MAX_UTILIZATION).reserve_tokens(10, 3, 20, 25) == 13
    assert capacity_policy(MAX_UTILIZATION).reserve_tokens(10, 0, 20, 25) == 11  # a new request: prompt + 1
    # the gateway's charge: whole blocks, at most the pool
    assert capacity_policy(GUARANTEED_NO_EVICT).charge_tokens(10, 20, 0, 16, 4096) == 32
    assert capacity_policy(GUARANTEED_NO_EVICT).charge_tokens(10, 2000, 4096, 16, 512) == 512


class _View:
    def __init__(self, active, unreserved, growth):
        self.num_active, self._unreserved, self._growth = active, unreserved, growth

    def num_unreserved_blocks(self):
        return self._unreserved

    def num_growth_blocks(self):
        return self._growth


def test_admission_and_headroom_rules():
    busy = _View(active=2, unreserved=5, growth=3)
    assert capacity_policy(GUARANTEED_NO_EVICT).may_admit(busy)
    assert capacity_policy(MAX_UTILIZATION).may_admit(busy)
    assert not capacity_policy(STATIC_BATCH).may_admit(busy)
    assert capacity_policy(STATIC_BATCH).may_admit(_View(0, 0, 0))
    assert capacity_policy(GUARANTEED_NO_EVICT).headroom_blocks(busy) == 5
    assert capacity_policy(MAX_UTILIZATION).headroom_blocks(busy) == 3


def test_settings_live_values_admin_and_bench_take_the_registrys_names():
    assert settings.CAPACITY_POLICY_NAMES == tuple(CAPACITY_POLICIES)
    assert live_policies.FIELDS == {"capacity_scheduler_policy": tuple(CAPACITY_POLICIES),
                                    "context_chunking_policy": tuple(CHUNKING_POLICIES)}
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    for action in parser._actions:
        if action.dest == "capacity_scheduler_policy":
            assert tuple(action.choices) == tuple(CAPACITY_POLICIES)
        if action.dest == "context_chunking_policy":
            assert tuple(action.choices) == tuple(CHUNKING_POLICIES)
    from tandem.bench import capacity_policies as bench_policies

    assert bench_policies.POLICIES == tuple(CAPACITY_POLICIES)


def test_the_admin_apis_enums_name_every_registered_policy_and_no_other():
    from tandem.gateway.admin import pb

    capacity = [n for n in pb.CapacitySchedulerPolicy.keys() if not n.endswith("UNSPECIFIED")]
    chunking = [n for n in pb.ContextChunkingPolicy.keys() if not n.endswith("UNSPECIFIED")]
    assert (capacity, chunking) == (list(CAPACITY_POLICIES), list(CHUNKING_POLICIES))


def test_a_registered_policy_is_found_by_name(monkeypatch):
    monkeypatch.setattr(policies, "CAPACITY_POLICIES", dict(CAPACITY_POLICIES))

    @policies.register_capacity
    class HalfPool(policies.CapacityPolicy):
        name = "HALF_POOL"

        def reserve_tokens(self, num_prompt_tokens, num_output_tokens, max_tokens, max_seq_len):
            return num_prompt_tokens

    assert policies.capacity_policy("HALF_POOL").reserve_tokens(7, 0, 100, 200) == 7
