"""LRUPolicy: scripted scenarios, then a property test against a plain list of keys."""

from hypothesis import given
from hypothesis import strategies as st

from kvtier.tiers.eviction import EvictionPolicy, LRUPolicy


def always(_key: object) -> bool:
    return True


def test_victims_come_coldest_first_and_hits_warm_a_key():
    policy = LRUPolicy()
    for key in "abc":
        policy.on_put(key)
    assert policy.victims(3, always) == ["a", "b", "c"]
    # A hit makes "a" the hottest key.
    policy.on_hit("a")
    assert policy.victims(3, always) == ["b", "c", "a"]
    # Putting a key again counts as a use.
    policy.on_put("b")
    assert policy.victims(3, always) == ["c", "a", "b"]


def test_victims_skip_keys_that_cannot_go_and_remove_nothing():
    policy = LRUPolicy()
    for key in "abcd":
        policy.on_put(key)
    pinned = {"a", "c"}
    assert policy.victims(1, lambda k: k not in pinned) == ["b"]
    assert policy.victims(5, lambda k: k not in pinned) == ["b", "d"]
    # Asking for victims dropped nothing: the tier reports real evictions with on_remove.
    assert len(policy) == 4
    policy.on_remove("b")
    assert policy.victims(4, always) == ["a", "c", "d"]
    assert policy.victims(0, always) == []
    assert policy.victims(2, lambda k: False) == []


def test_unknown_keys_are_ignored():
    policy = LRUPolicy()
    policy.on_hit("ghost")
    policy.on_remove("ghost")
    assert len(policy) == 0 and "ghost" not in policy


def test_lru_satisfies_the_protocol():
    policy: EvictionPolicy[str] = LRUPolicy()
    policy.on_put("x")
    assert policy.victims(1, always) == ["x"]


operations = st.lists(st.tuples(st.sampled_from(["put", "hit", "remove", "victims"]),
                                st.integers(0, 7), st.integers(0, 5)), max_size=60)


@given(operations)
def test_lru_matches_a_list_model(ops):
    policy = LRUPolicy()
    model: list[int] = []  # coldest first
    for op, key, count in ops:
        if op == "put":
            if key in model:
                model.remove(key)
            model.append(key)
            policy.on_put(key)
        elif op == "hit":
            if key in model:
                model.remove(key)
                model.append(key)
            policy.on_hit(key)
        elif op == "remove":
            if key in model:
                model.remove(key)
            policy.on_remove(key)
        else:
            parity = key % 2
            evictable = [k for k in model if k % 2 == parity]
            assert policy.victims(count, lambda k, p=parity: k % 2 == p) == evictable[:count]
        assert policy.keys() == model
