"""The approximate prefix index (gateway/request/prefix.py): block hashes of prompts, chained, and a
per-replica LRU of them. Routing on it is tested in test_router.py."""

import pytest

from gateway.config import ConfigError, parse_config
from gateway.request.prefix import BLOCK_CHARS, BLOCK_IDS, MAX_PROMPT_BLOCKS, prompt_blocks
from gateway.routing.prefix_index import PrefixIndex

SYSTEM = "You are the support assistant of tenant seven. " * 40  # ~1,900 characters


def _chat(system, question):
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def test_blocks_are_full_blocks_chained_so_equal_text_gives_equal_leading_hashes():
    a = prompt_blocks(_chat(SYSTEM, "What are your hours?"))
    b = prompt_blocks(_chat(SYSTEM, "How do I reset my password, please?"))
    full = len("system\x1f" + SYSTEM) // BLOCK_CHARS
    assert len(a) >= full and len(b) >= full
    assert a[:full] == b[:full]  # the shared system prompt
    other = prompt_blocks(_chat(SYSTEM.replace("seven", "eight"), "What are your hours?"))
    assert all(x != y for x, y in zip(a, other, strict=False))  # differs in block 0: every later hash differs
    assert prompt_blocks(_chat("short", "hi")) == ()  # no full block


def test_a_change_inside_one_block_changes_it_and_every_later_block():
    text = "".join(chr(ord("a") + i % 26) for i in range(BLOCK_CHARS * 4))
    changed = text[:BLOCK_CHARS + 3] + "#" + text[BLOCK_CHARS + 4:]
    a, b = prompt_blocks({"prompt": text}), prompt_blocks({"prompt": changed})
    assert len(a) == len(b) == 4
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_message_boundaries_and_roles_count():
    one = prompt_blocks({"messages": [{"role": "user", "content": "x" * 600}]})
    two = prompt_blocks({"messages": [{"role": "user", "content": "x" * 300}, {"role": "user", "content": "x" * 300}]})
    assert one != two  # the split between messages shows
    assert (prompt_blocks({"messages": [{"role": "system", "content": "y" * 600}]})[0]
            != prompt_blocks({"messages": [{"role": "user", "content": "y" * 600}]})[0])


def test_prompt_shapes_and_garbage():
    ids = list(range(BLOCK_IDS * 3 + 5))
    assert len(prompt_blocks({"prompt": ids})) == 3
    assert prompt_blocks({"prompt": [ids]}) == prompt_blocks({"prompt": ids})
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "z" * 700},
                                                       {"type": "image_url", "image_url": {"url": "data:..."}}]}]}
    assert len(prompt_blocks(parts)) == 2
    assert len(prompt_blocks({"input": "w" * 1000})) == 3
    assert len(prompt_blocks({"prompt": "v" * BLOCK_CHARS * (MAX_PROMPT_BLOCKS + 10)})) == MAX_PROMPT_BLOCKS
    for junk in ({}, {"messages": 5}, {"messages": [5, None, [1]]}, {"prompt": [None, {}]}, {"prompt": [[{}] * 100]},
                 {"prompt": [True] * 200}, {"input": {"a": 1}}):
        assert isinstance(prompt_blocks(junk), tuple)  # never raises


def test_index_matches_leading_blocks_only():
    index = PrefixIndex(100)
    index.insert((1, 2, 3))
    assert index.match((1, 2, 3, 4)) == 3
    assert index.match((1, 2, 9, 3)) == 2
    assert index.match((7, 1, 2)) == 0
    assert index.match(()) == 0


def test_index_is_bounded_and_forgets_least_recently_used_tails_first():
    index = PrefixIndex(6)
    index.insert((1, 2, 3, 4))
    index.insert((10, 20, 30, 40))  # 8 blocks > 6: the oldest prompt's tail goes first
    assert len(index) == 6
    assert index.match((1, 2, 3, 4)) == 2 and index.match((10, 20, 30, 40)) == 4
    index.insert((1, 2))  # used again: now the most recent
    index.insert((50, 60, 70))
    assert len(index) == 6
    assert index.match((1, 2)) == 2 and index.match((50, 60, 70)) == 3 and index.match((10, 20, 30, 40)) == 1
    for i in range(1000):
        index.insert((i, i + 1_000_000))
    assert len(index) == 6  # the bound holds whatever comes
    index.clear()
    assert len(index) == 0 and index.match((999,)) == 0


def test_config_takes_prefix_routing_on_a_diffusion_model_only_with_its_prefix_cache():
    ar = {"name": "m", "kind": "autoregressive", "source": "x", "routing": "prefix"}
    assert parse_config({"models": [ar]}).models[0].routing == "prefix"
    assert parse_config({"models": [{**ar, "routing": "p2c"}]}).models[0].routing == "p2c"
    diffusion = {"name": "d", "kind": "diffusion", "source": "x", "routing": "prefix", "resources": {"num_gpus": 0}}
    # On a GPU a diffusion model's sampler is fast unless told otherwise: its prefix cache is on.
    on_gpu = {**diffusion, "resources": {"num_gpus": 1}}
    assert parse_config({"models": [on_gpu]}).models[0].engine_args == {"device": "cuda", "sampler": "fast"}
    for engine_args in ({}, {"sampler": "fast", "prefix_cache": False}, {"sampler": "exact", "prefix_cache": True}):
        with pytest.raises(ConfigError) as e:
            parse_config({"models": [{**diffusion, "engine_args": engine_args}]})
        assert "models.0" in str(e.value) and "routing" in str(e.value) and "prefix_cache" in str(e.value)
    for engine_args in ({"sampler": "fast"}, {"sampler": "fast", "prefix_cache": True}):
        assert parse_config({"models": [{**diffusion, "engine_args": engine_args}]}).models[0].routing == "prefix"
