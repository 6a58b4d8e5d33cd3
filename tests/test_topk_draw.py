"""The CPU chain's top-k over a row's candidates (runtime/llama/rows.py): the set always holds the
row's k likeliest tokens, and where it cannot be found cheaply the whole row is used."""
from __future__ import annotations

import numpy as np
import pytest

from comfyui_a3b.runtime.generation import SamplingParams
from comfyui_a3b.runtime.llama import chain
from comfyui_a3b.runtime.llama.rows import GROUP, top_candidates


def _holds_top_k(row: np.ndarray, ids: np.ndarray, k: int) -> bool:
    kth = np.sort(row)[-k]
    above = set(np.flatnonzero(row > kth).tolist())
    chosen = set(ids.tolist())
    # every token above the k-th logit, and enough tokens at it to make k
    return above <= chosen and int((row[ids] >= kth).sum()) >= k


def _rows(rng):
    yield rng.standard_normal(151936).astype(np.float32)
    yield (rng.standard_normal(49152) * 8).astype(np.float32)
    yield rng.standard_cauchy(32000).astype(np.float32)            # heavy tails, as language models' rows
    yield np.round(rng.standard_normal(50257), 1).astype(np.float32)  # many ties, a vocabulary not a multiple of GROUP
    peaked = rng.standard_normal(151936).astype(np.float32)
    peaked[rng.integers(0, 151936, 30)] += 30                      # a few likely tokens, all in one place or not
    yield peaked
    clustered = np.full(65536, -5.0, np.float32)
    clustered[:200] = rng.standard_normal(200)                     # the likely tokens in the first groups
    yield clustered
    tail = rng.standard_normal(151937).astype(np.float32)
    tail[-1] = 50.0                                                # the best token past the last whole group
    yield tail


@pytest.mark.parametrize("k", [1, 5, 40, 100])
def test_the_candidates_hold_the_rows_top_k(k):
    rng = np.random.default_rng(k)
    for _ in range(5):
        for row in _rows(rng):
            ids = top_candidates(row, k)
            assert ids is not None
            assert np.all(np.diff(ids) > 0)
            assert _holds_top_k(row, ids, k)
            assert ids.shape[0] <= row.shape[0] // GROUP


def test_the_whole_row_is_used_where_candidates_do_not_pay():
    rng = np.random.default_rng(0)
    row = rng.standard_normal(4096).astype(np.float32)
    assert top_candidates(row, 0) is None
    assert top_candidates(row, 40) is None                 # 64 groups: too few for a top 40
    assert top_candidates(row, 16) is not None
    nan = rng.standard_normal(49152).astype(np.float32)
    nan[::7] = np.nan                                      # NaN maxima: no threshold
    assert top_candidates(nan, 40) is None
    flat = np.full(49152, -np.inf, np.float32)
    flat[:10] = 1.0                                        # fewer than k finite logits: every -inf ties
    assert top_candidates(flat, 40) is None


@pytest.mark.parametrize("sp, k", [
    (SamplingParams(temperature=0.7, top_k=40), 40),
    (SamplingParams(temperature=0.7, top_k=40, repeat_penalty=1.1), 40),     # the penalty after top-k
    (SamplingParams(temperature=0.7, top_k=0), 0),
    (SamplingParams(temperature=0.0, top_k=40, repeat_penalty=1.1), 65),     # penalty, then the likeliest
    (SamplingParams(temperature=0.0, repeat_penalty=1.1, repeat_last_n=0), 0),   # (a penalty on nothing)
    (SamplingParams(temperature=0.0, repeat_penalty=0.9), 0),                # a boost: from anywhere
    (SamplingParams(temperature=0.7, top_k=40, samplers=["top_k", "top_p", "infill"]), 40),   # llama.vim
    (SamplingParams(temperature=0.7, top_k=40, repeat_penalty=1.1, samplers=["penalties", "top_k"]), 104),
    (SamplingParams(temperature=0.7, top_k=40, repeat_penalty=1.1, samplers=["penalties", "top_p"]), 0),
    (SamplingParams(temperature=0.7, top_k=40, samplers=["temperature", "top_k"]), 0),
])
def test_a_chain_takes_candidates_where_its_answer_comes_from_the_rows_top(sp, k):
    assert chain.candidates(sp) == k


def test_candidate_rows_stay_on_the_worker_and_whole_rows_go_to_threads():
    from comfyui_a3b.runtime.llama.rows import heavy

    assert not heavy(False, False, False, 40)     # a draw from candidates: on the worker
    assert heavy(False, False, False, 0)          # llama_sampler_sample over the whole row
    assert heavy(True, False, False, 40)          # an entropy reads the whole row
    assert not heavy(False, True, False, 0) and not heavy(True, False, True, 40)   # argmax; backend row
