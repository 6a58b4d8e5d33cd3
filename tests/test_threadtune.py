"""The thread count of batches of several requests' single tokens follows what measured faster."""
from comfyui_a3b.runtime.llama.threadtune import EXPLORE, ThreadTuner, size_class


def run(tuner: ThreadTuner, steps: int, tokens: int, cost: dict[int, float]) -> list[int]:
    """`steps` batches of `tokens` tokens, each costing cost[threads] seconds per token."""
    chosen = []
    for _ in range(steps):
        t = tuner.choose(tokens, prompt_chunk=False)
        tuner.observe(tokens, False, t, cost[t] * tokens)
        chosen.append(t)
    return chosen


def test_idle_cores_make_it_take_all_threads_and_a_busy_machine_the_decode_threads():
    tuner = ThreadTuner(decode=1, prompt=2)
    chosen = run(tuner, 4 * EXPLORE, 4, {1: 0.016, 2: 0.008})        # idle: 2 threads twice as fast
    assert chosen[:3] == [1, 2, 2]                                  # the batch threads measured twice first
    assert chosen[2:].count(2) >= len(chosen[2:]) - 4               # then the faster, but for the looks
    chosen = run(tuner, 8 * EXPLORE, 4, {1: 0.016, 2: 0.5})          # a burner arrives: barriers stall
    late = chosen[2 * EXPLORE:]
    assert late.count(1) >= len(late) - len(late) // EXPLORE - 1
    assert 2 in late                                                # it still looks now and then


def test_prompt_chunks_are_never_tuned_and_single_tokens_are():
    tuner = ThreadTuner(decode=1, prompt=2)
    assert tuner.choose(64, prompt_chunk=True) == 2
    tuner.observe(64, True, 2, 1.0)
    assert tuner.cost == {}
    same = ThreadTuner(decode=4, prompt=4)
    assert same.choose(8, prompt_chunk=False) == 4 and same.runs == {}
    # one request alone on idle cores: both threads decode its token faster, and the tuner finds it
    chosen = run(ThreadTuner(decode=1, prompt=2), 4 * EXPLORE, 1, {1: 0.012, 2: 0.008})
    assert chosen[0] == 1 and chosen[-EXPLORE:].count(2) >= EXPLORE - 2
    # on a busy machine one thread stays
    chosen = run(ThreadTuner(decode=1, prompt=2), 4 * EXPLORE, 1, {1: 0.012, 2: 0.2})
    assert chosen[-2 * EXPLORE:].count(1) >= 2 * EXPLORE - 2


def test_batch_sizes_are_measured_apart():
    assert [size_class(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [0, 1, 2, 2, 3, 3, 4, 4]
    tuner = ThreadTuner(decode=1, prompt=2)
    run(tuner, 40, 2, {1: 0.01, 2: 0.02})     # two tokens: one thread is faster
    run(tuner, 40, 8, {1: 0.02, 2: 0.01})     # eight tokens: two are
    assert tuner.choose(2, False) == 1 and tuner.choose(8, False) == 2


def test_a_count_a_hundred_times_slower_costs_a_few_percent_not_a_look_every_few_batches():
    # a busy machine: two threads stall at every barrier (200 ms a token against 2 ms on one)
    tuner = ThreadTuner(decode=1, prompt=2)
    cost = {1: 0.002, 2: 0.2}
    chosen = run(tuner, 4000, 4, cost)
    spent = sum(cost[t] * 4 for t in chosen)
    ideal = 4000 * cost[1] * 4
    assert spent <= ideal * 1.25          # measuring both once, then looks bounded by LOOK_SHARE
    assert chosen[2:].count(2) >= 1       # it still looks, now and then


def test_when_the_slower_count_becomes_faster_the_tuner_follows():
    tuner = ThreadTuner(decode=1, prompt=2)
    run(tuner, 200, 4, {1: 0.002, 2: 0.02})     # busy: one thread
    chosen = run(tuner, 2000, 4, {1: 0.002, 2: 0.001})   # the other work ended: two threads win
    assert chosen[-100:].count(2) >= 90
