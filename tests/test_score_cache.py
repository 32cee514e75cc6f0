"""ScoreCache: a byte-bounded LRU of PRM step scores."""
import random

import pytest

from treeserve.runtime.score_cache import DEFAULT_MAX_BYTES, ENTRY_OVERHEAD_BYTES, ScoreCache, entry_bytes

Q = "Start with 38 and work modulo 100. Step 1: * 7. What is the result?"


def key(*steps):
    return (Q, *steps)


def test_entry_size_is_utf8_length_plus_overhead():
    assert entry_bytes(("ab", "cde")) == 5 + ENTRY_OVERHEAD_BYTES
    assert entry_bytes(("é", "€", "𝄞")) == 2 + 3 + 4 + ENTRY_OVERHEAD_BYTES  # bytes, not characters
    assert entry_bytes(()) == ENTRY_OVERHEAD_BYTES


def test_dict_like_api():
    cache = ScoreCache(1 << 20)
    assert len(cache) == 0 and key("a") not in cache and cache.get(key("a")) is None
    assert cache.get(key("a"), -1.0) == -1.0
    with pytest.raises(KeyError):
        cache[key("a")]
    cache[key("a")] = 0.25
    cache[key("a", "b")] = 0.75
    assert key("a") in cache and cache[key("a")] == 0.25 and cache.get(key("a", "b")) == 0.75
    assert len(cache) == 2
    assert cache.nbytes == entry_bytes(key("a")) + entry_bytes(key("a", "b"))
    assert cache.max_bytes == 1 << 20 and cache.num_evictions == 0


def test_default_bound_is_64_mib():
    assert ScoreCache().max_bytes == DEFAULT_MAX_BYTES == 64 << 20


def test_overwrite_keeps_size_and_replaces_score():
    cache = ScoreCache(1 << 20)
    cache[key("a")] = 0.1
    size = cache.nbytes
    cache[key("a")] = 0.9
    assert cache[key("a")] == 0.9 and cache.nbytes == size and len(cache) == 1


def _cache_holding(n, each=ENTRY_OVERHEAD_BYTES + 2):
    """A cache with room for exactly n entries of `each` bytes (keys of two one-char strings)."""
    return ScoreCache(n * each)


def test_oldest_is_evicted_first():
    cache = _cache_holding(3)
    for i, name in enumerate("abcd"):
        cache[(name, "x")] = float(i)
    assert ("a", "x") not in cache
    assert [k for k in "bcd" if (k, "x") in cache] == ["b", "c", "d"]
    assert cache.num_evictions == 1 and len(cache) == 3


def test_a_hit_refreshes_recency():
    cache = _cache_holding(3)
    for name in "abc":
        cache[(name, "x")] = 1.0
    assert cache[("a", "x")] == 1.0          # a becomes the most recent, b the oldest
    cache[("d", "x")] = 1.0
    assert ("a", "x") in cache and ("b", "x") not in cache
    assert cache.get(("c", "x")) == 1.0      # order now c, a, d; get makes it a, d, c
    cache[("e", "x")] = 1.0
    assert ("a", "x") not in cache and ("c", "x") in cache and ("d", "x") in cache


def test_membership_does_not_refresh():
    cache = _cache_holding(2)
    cache[("a", "x")] = 1.0
    cache[("b", "x")] = 1.0
    assert ("a", "x") in cache
    cache[("c", "x")] = 1.0
    assert ("a", "x") not in cache and ("b", "x") in cache


def test_overwrite_refreshes_recency():
    cache = _cache_holding(2)
    cache[("a", "x")] = 1.0
    cache[("b", "x")] = 1.0
    cache[("a", "x")] = 2.0
    cache[("c", "x")] = 1.0
    assert ("a", "x") in cache and ("b", "x") not in cache


def test_bound_holds_under_a_long_stream_of_varied_keys():
    rng = random.Random(0)
    cache = ScoreCache(200_000)
    inserted = 0
    for i in range(20_000):
        depth = rng.randint(1, 6)
        k = key(*(f"## Step {j}: + {rng.randint(1, 9)}" + "é" * rng.randint(0, 40) for j in range(depth)), str(i))
        cache[k] = rng.random()
        inserted += 1
        assert cache.nbytes <= cache.max_bytes
        if i % 7 == 0 and len(cache):
            cache.get(k)
    assert cache.num_evictions == inserted - len(cache) > 0
    assert cache.nbytes == sum(entry_bytes(k) for k in cache._entries)
    assert cache.nbytes > cache.max_bytes - max(entry_bytes(k) for k in cache._entries)  # it fills up


def test_eviction_makes_room_for_a_large_entry():
    cache = _cache_holding(4)
    for name in "abcd":
        cache[(name, "x")] = 1.0
    big = ("e", "y" * (2 * ENTRY_OVERHEAD_BYTES + 3))  # needs three small entries' room
    cache[big] = 1.0
    assert big in cache and cache.nbytes <= cache.max_bytes
    assert [n for n in "abcd" if (n, "x") in cache] == ["d"] and cache.num_evictions == 3


def test_an_entry_bigger_than_the_bound_is_not_kept_and_flushes_nothing():
    cache = ScoreCache(1000)
    cache[("a",)] = 1.0
    cache[("q", "z" * 1000)] = 0.5
    assert ("q", "z" * 1000) not in cache and ("a",) in cache
    assert cache.num_rejected == 1 and cache.num_evictions == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, "64", None, True])
def test_bad_bound_names_the_setting(bad):
    with pytest.raises(ValueError, match="score_cache_bytes"):
        ScoreCache(bad)


@pytest.mark.parametrize("bad", [["q", "a"], ("q", 3), "q"])
def test_bad_key_is_a_clear_type_error(bad):
    with pytest.raises(TypeError, match="score cache key"):
        ScoreCache()[bad] = 1.0


def test_clear_resets_size():
    cache = ScoreCache(1 << 20)
    cache.update([(key("a"), 1.0), (key("b"), 2.0)])
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and key("a") not in cache
