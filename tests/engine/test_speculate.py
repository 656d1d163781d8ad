"""Prompt-lookup decoding: the drafts' policy, then the real model, where it must not change a greedy token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from kvtier.engine.engine import Engine
from kvtier.engine.llama import SeqInput
from kvtier.engine.pool import BlockTable
from kvtier.engine.runtime import LoadedModel, make_engine, open_cache, prompt_lookup
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.speculate import PromptLookup
from tests.engine.test_engine import config

GREEDY = SamplingParams(max_tokens=24)
CODE = "def add(a, b):\n    total = a + b\n    return total\n\n\ndef sub(a, b):\n    return a - b\n"
ASKS = [
    f"```python\n{CODE}```\nRepeat the code above exactly.",  # copy-heavy: most drafts land
    "Write the numbers 1 to 5 in words, separated by commas.",
    "Say hello.",  # short, little to look up
]


# -- the drafting policy, no model ---------------------------------------------------------
def test_the_longest_then_latest_match_gives_the_drafts() -> None:
    lookup = PromptLookup(num_draft_tokens=3, min_ngram=1, max_ngram=3)
    assert lookup.propose([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]) == [4, 9, 2]  # "1 2 3" beats the later "2 3"
    assert lookup.propose([1, 2, 3, 9, 2, 3, 4, 2, 3]) == [4, 2, 3]  # the latest "2 3" wins among equals


def test_no_recurring_tail_gives_no_drafts_and_limit_caps_them() -> None:
    lookup = PromptLookup(num_draft_tokens=4, min_ngram=2, max_ngram=3)
    assert lookup.propose([1, 2, 3, 4, 5]) == []
    assert lookup.propose([1, 2, 3, 1, 2], limit=1) == [3]
    assert lookup.propose([1, 2, 3, 1, 2], limit=0) == []
    assert lookup.propose([7]) == []


def test_the_draft_width_grows_while_drafts_land_and_shrinks_after_a_miss() -> None:
    lookup = PromptLookup(num_draft_tokens=8)
    assert lookup.adapt(4, drafted=4, accepted=4) == 6
    assert lookup.adapt(7, drafted=3, accepted=3) == 8  # capped at num_draft_tokens
    assert lookup.adapt(4, drafted=4, accepted=2) == 3
    assert lookup.adapt(1, drafted=1, accepted=0) == 1  # never below one draft


def test_config_orders_the_ngram_bounds_and_switches_off(tmp_path: Path) -> None:
    with pytest.raises(ValidationError):
        config(tmp_path, speculative={"min_ngram": 3, "max_ngram": 2})
    with pytest.raises(ValidationError):
        config(tmp_path, speculative={"draft_tokens": 3})  # unknown keys are refused
    assert prompt_lookup(config(tmp_path, speculative={"prompt_lookup": False})) is None
    assert prompt_lookup(config(tmp_path)) == PromptLookup(3, 2, 3)


# -- the real model ---------------------------------------------------------------------------
def engine(loaded: LoadedModel, tmp: Path, *, on: bool, **kw: object) -> Engine:
    cfg = config(tmp, speculative={"prompt_lookup": on, "num_draft_tokens": 4, "min_ngram": 1, "max_ngram": 3})
    return make_engine(loaded, cfg, **{"cache": None, "keep_resident": False} | kw)


def test_a_verify_row_has_the_bits_of_a_one_token_step(loaded_model: LoadedModel) -> None:
    """Identical by construction: each draft row is computed as its own decode step would compute it."""
    model = loaded_model.model
    pool = model.make_pool(16, 8)
    table = BlockTable()
    pool.grow(table, 80)
    model([SeqInput(list(range(100, 160)), 0, table)], pool)
    tokens = [7, 11, 12, 13, 14]
    alone = [model([SeqInput([tok], 60 + i, table)], pool)[0] for i, tok in enumerate(tokens)]
    table.num_tokens = 60
    rows = model([SeqInput(tokens, 60, table, verify=True)], pool)
    assert torch.equal(rows, torch.stack(alone))


def test_greedy_output_is_identical_alone_and_batched(loaded_model: LoadedModel, tmp_path: Path) -> None:
    prompts = [loaded_model.chat_ids([{"role": "user", "content": t}]) for t in ASKS]
    plain = engine(loaded_model, tmp_path, on=False)
    want = [plain.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert plain.speculation.drafted == 0
    spec = engine(loaded_model, tmp_path, on=True)
    alone = [spec.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert alone == want
    counters = spec.speculation
    assert 0 < counters.accepted <= counters.drafted
    batched = engine(loaded_model, tmp_path, on=True).generate(prompts, GREEDY)
    assert [c.token_ids for c in batched] == want


def test_each_step_leaves_the_pool_as_one_token_steps_would(loaded_model: LoadedModel, tmp_path: Path) -> None:
    """Rejected drafts' positions are uncounted: after every step, the KV held is exactly prompt + output - 1."""
    ids = loaded_model.chat_ids([{"role": "user", "content": ASKS[0]}])
    states = []
    for on in (False, True):
        eng = engine(loaded_model, tmp_path, on=on)
        rid = eng.add_request(eng.keyed(ids), GREEDY)
        tokens: list[int] = []
        pages = set()
        while eng.has_unfinished():
            for out in eng.step():
                tokens += out.token_ids
            for req in eng._running:
                assert req.prefilling or req.table.num_tokens == len(req.all_ids) - 1
                pages.add(tuple(req.table.block_ids))
        (req,) = eng.collect_finished()
        assert req.id == rid and len(pages) == 1  # reserved at admission, never grown nor shrunk by drafts
        refs = [eng.pool.ref_count(b) for b in range(eng.pool.num_blocks)]
        states.append((tokens, pages, eng.pool.num_free, refs))
    assert states[0] == states[1]


def test_cache_hits_and_sampled_requests_decode_as_without_it(loaded_model: LoadedModel, tmp_path: Path) -> None:
    """A second turn served from kvtier decodes the same; a sampled request is never drafted for."""
    first = [{"role": "user", "content": ASKS[0]}]
    runs = []
    for on in (False, True):
        cfg = config(tmp_path / str(on), speculative={"prompt_lookup": on})
        with open_cache(loaded_model, cfg) as cache:
            eng = make_engine(loaded_model, cfg, cache=cache, keep_resident=False)
            (one,) = eng.generate([loaded_model.chat_ids(first)], GREEDY)
            eng.drain_stores()
            turn = [*first, {"role": "assistant", "content": one.text}, {"role": "user", "content": "Again."}]
            (two,) = eng.generate([loaded_model.chat_ids(turn)], GREEDY)
            drafted = eng.speculation.drafted
            warm = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
            (sampled,) = eng.generate([loaded_model.chat_ids(first)], warm)
            assert eng.speculation.drafted == drafted
        runs.append((one.token_ids, two.token_ids, two.cached_tokens > 0, sampled.token_ids))
    assert runs[0] == runs[1]
    assert runs[1][2]
