"""The engine on the real model: reuse and batching must not change a single greedy token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvtier.config import Config, load_config
from kvtier.engine.engine import Engine, FinishReason
from kvtier.engine.runtime import LoadedModel, make_engine, open_cache
from kvtier.engine.sampling import SamplingParams
from kvtier.tiers.base import TierKind
from tests.helpers import shared_full_blocks

B = 16
ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=10)
TURNS = [
    "List three prime numbers.",
    "Now add them up and explain the sum in one sentence.",
    "Write the numbers 1 to 5 in words, separated by commas.",
    "Which of those words is the longest?",
]


def config(tmp: Path, **engine: object) -> Config:
    cfg = load_config(environ={"KVTIER_DATA_DIR": str(tmp / "data"), "KVTIER_ENGINE__DTYPE": "float32"})
    tree = cfg.model_dump()
    tree["engine"] = {**tree["engine"], "pool_bytes": 400 * 46080 * B, **engine}
    tree["host"] = {**tree["host"], "capacity_bytes": 256 * 1024**2}
    tree["disk"] = {**tree["disk"], "capacity_bytes": 256 * 1024**2}
    return Config.model_validate(tree)


def converse(engine: Engine, loaded: LoadedModel) -> list[tuple[list[int], list[int], int]]:
    """Four chat turns; returns (prompt ids, output ids, cached tokens) per turn."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "You answer briefly."}]
    out = []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        ids = loaded.chat_ids(messages)
        (done,) = engine.generate([ids], GREEDY)
        engine.drain_stores()
        messages.append({"role": "assistant", "content": done.text})
        out.append((ids, done.token_ids, done.cached_tokens))
    return out


@pytest.fixture(scope="module")
def baseline(loaded_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory):
    cfg = config(tmp_path_factory.mktemp("cold"))
    return converse(make_engine(loaded_model, cfg, cache=None, keep_resident=False), loaded_model)


def check_reuse(turns, baseline, *, replies_cached: bool = True) -> None:
    """The cached run's tokens are the cold run's, and it reused exactly the whole blocks it could.

    ``replies_cached=False``: only prompts' blocks count (decode-computed ones
    are never cached: bfloat16, or int8 decode products).
    """
    seen: list[list[int]] = []
    for (ids, out, cached), (cold_ids, cold_out, cold_cached) in zip(turns, baseline, strict=True):
        assert ids == cold_ids and out == cold_out, "greedy output changed with the cache"
        assert cold_cached == 0
        assert cached == shared_full_blocks(ids, seen)
        seen.append(ids + out[:-1] if replies_cached else ids)  # a last sampled token never had its KV computed
    assert sum(c for *_, c in turns) > 0


def test_reuse_from_host_then_disk_after_restart_is_exact(loaded_model: LoadedModel, tmp_path: Path, baseline) -> None:
    cfg = config(tmp_path, keep_resident=False)
    cfg = Config.model_validate(cfg.model_dump() | {"cache": cfg.cache.model_dump() | {"write_mode": "write_through"}})
    with open_cache(loaded_model, cfg) as cache:
        turns = converse(make_engine(loaded_model, cfg, cache=cache), loaded_model)
        check_reuse(turns, baseline)
        assert cache.stats().tiers["host"].hit_tokens > 0
    # A new process over the same data_dir: its host memory is empty, its disk tier is not.
    config_file = tmp_path / "kvtier.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    ids, out, _ = baseline[-1]
    child = subprocess.run(
        [sys.executable, "-c", RESTARTED, str(config_file), json.dumps(ids)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    again = json.loads(child.stdout)
    assert again["token_ids"] == out
    assert again["served_from"] == {"disk": again["cached_tokens"]}
    assert again["cached_tokens"] == shared_full_blocks(ids, [ids]) > 0  # turn 4 itself was stored


RESTARTED = """
import json, sys
from kvtier.config import load_config
from kvtier.engine.runtime import load_model, make_engine, open_cache
from kvtier.engine.sampling import SamplingParams
cfg = load_config(sys.argv[1])
loaded = load_model(cfg, progress=False)
with open_cache(loaded, cfg) as cache:
    (done,) = make_engine(loaded, cfg, cache=cache).generate([json.loads(sys.argv[2])], SamplingParams(max_tokens=10))
print(json.dumps({"token_ids": done.token_ids, "cached_tokens": done.cached_tokens,
                  "served_from": {k.value: v for k, v in done.served_from.items()}}))
"""


def test_reuse_from_the_resident_pool_is_exact(loaded_model: LoadedModel, tmp_path: Path, baseline) -> None:
    cfg = config(tmp_path)
    with open_cache(loaded_model, cfg) as cache:
        engine = make_engine(loaded_model, cfg, cache=cache, keep_resident=True)
        turns = converse(engine, loaded_model)
        check_reuse(turns, baseline)
        assert len(engine.resident) > 0


def test_a_cleared_cache_gets_the_resident_prefix_stored_again(loaded_model: LoadedModel, tmp_path: Path) -> None:
    """A resident block counts as stored only in the cache it was stored in: after a clear (or, on the cache
    service, a restart) the next request sharing it stores it again, else the chain's head never returns."""
    cfg = config(tmp_path)
    ids = loaded_model.chat_ids([{"role": "user", "content": "Name the planets of the solar system, in order. " * 4}])
    with open_cache(loaded_model, cfg) as cache:
        engine = make_engine(loaded_model, cfg, cache=cache, keep_resident=True)
        (first,) = engine.generate([ids], GREEDY)
        engine.drain_stores()
        held = cache.stats().tiers["host"].blocks
        assert held == (len(ids) + len(first.token_ids) - 1) // B  # prompt and reply, as computed
        assert cache.clear() == held and cache.stats().tiers["host"].blocks == 0
        (again,) = engine.generate([ids], GREEDY)  # every block shared from the pool, none loaded
        engine.drain_stores()
        assert again.token_ids == first.token_ids and again.served_from == {TierKind.DEVICE: again.cached_tokens}
        assert cache.stats().tiers["host"].blocks == held
        assert cache.probe(cache.keyed(ids)).cached_blocks == len(ids) // B


def test_concurrent_requests_match_one_by_one(loaded_model: LoadedModel, tmp_path: Path) -> None:
    cfg = config(tmp_path)
    prompts = [loaded_model.chat_ids([{"role": "user", "content": t}]) for t in [*TURNS, "Say hello.", "Count to 3."]]
    alone = [make_engine(loaded_model, cfg, cache=None, keep_resident=False).generate([p], GREEDY)[0] for p in prompts]
    engine = make_engine(loaded_model, cfg, cache=None, keep_resident=False)
    together = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


def test_stops_on_eos_stop_strings_and_max_tokens(loaded_model: LoadedModel, tmp_path: Path) -> None:
    engine = make_engine(loaded_model, config(tmp_path), cache=None, keep_resident=False)
    ids = loaded_model.chat_ids([{"role": "user", "content": "Say hi."}])
    (free,) = engine.generate([ids], SamplingParams(max_tokens=40))
    assert free.finish_reason is FinishReason.STOP and free.token_ids[-1] in loaded_model.tokenizer.eos_ids
    (short,) = engine.generate([ids], SamplingParams(max_tokens=2))
    assert short.finish_reason is FinishReason.LENGTH and short.token_ids == free.token_ids[:2]
    word = free.text.strip().split()[0]
    (stopped,) = engine.generate([ids], SamplingParams(max_tokens=40, stop=("never said", word)))
    assert stopped.finish_reason is FinishReason.STOP and word not in stopped.text
    assert stopped.stop_sequence == word and free.stop_sequence is None and short.stop_sequence is None
    assert free.text.startswith(stopped.text)


def test_seeded_sampling_is_repeatable(loaded_model: LoadedModel, tmp_path: Path) -> None:
    engine = make_engine(loaded_model, config(tmp_path), cache=None, keep_resident=False)
    ids = loaded_model.chat_ids([{"role": "user", "content": "Tell me a story."}])
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    a, b = engine.generate([ids, ids], p)
    assert a.token_ids == b.token_ids


def test_a_full_pool_queues_requests_and_an_oversized_one_fails_alone(
    loaded_model: LoadedModel, tmp_path: Path
) -> None:
    prompts = [loaded_model.chat_ids([{"role": "user", "content": t}]) for t in TURNS[:3]]
    need = max(-(-(len(p) + GREEDY.max_tokens) // B) for p in prompts)
    roomy = make_engine(loaded_model, config(tmp_path), cache=None, keep_resident=False)
    alone = [roomy.generate([p], GREEDY)[0].token_ids for p in prompts]
    tight = make_engine(loaded_model, config(tmp_path, pool_bytes=need * 46080 * B), cache=None, keep_resident=False)
    assert tight.pool.num_blocks == need  # room for one request at a time
    assert [c.token_ids for c in tight.generate(prompts, GREEDY)] == alone
    too_big = tight.add_request(tight.keyed(list(range(100, 100 + need * B))), GREEDY)
    ok = tight.add_request(tight.keyed(prompts[0]), GREEDY)
    done = {}
    while tight.has_unfinished():
        tight.step()
        done.update((r.id, r) for r in tight.collect_finished())
    assert done[too_big].finish_reason is FinishReason.ERROR and "KV blocks" in done[too_big].error
    assert done[ok].output_ids == alone[0]


def test_each_block_of_a_conversation_is_hashed_once(
    tmp_path: Path, loaded_model: LoadedModel, baseline: list[tuple[list[int], list[int], int]]
) -> None:
    """A prompt is keyed once (lookup, fetch, store and the resident pool share it); a reply's blocks once more."""
    cfg = config(tmp_path)
    with open_cache(loaded_model, cfg) as cache:
        hashed: list[tuple[int, bool]] = []  # (blocks hashed, chained from the root)
        keys = cache.hasher.keys

        def counted(tokens, namespace, *, parent=None):  # type: ignore[no-untyped-def]
            out = keys(tokens, namespace, parent=parent)
            hashed.append((len(out), parent is None))
            return out

        cache.hasher.keys = counted  # type: ignore[method-assign]
        engine = make_engine(loaded_model, cfg, cache=cache)
        for ids, output, _ in baseline:
            hashed.clear()
            (done,) = engine.generate([ids], GREEDY)
            engine.drain_stores()
            assert done.token_ids == output
            assert [n for n, root in hashed if root] == [len(ids) // B]  # the prompt, once
            assert sum(n for n, _ in hashed) == (len(ids) + len(output) - 1) // B  # the last token has no KV
