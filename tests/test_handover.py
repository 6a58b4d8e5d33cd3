"""From the worker thread to the event loop: many streams' tokens in one hand-over, each stream's
in order (serve/bridge.py), over a real server and the fake engine."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx

from serve_helpers import TEXT, TOKEN


def test_items_put_while_the_loop_is_busy_go_over_in_one_wake_up():
    from comfyui_a3b.serve.bridge import Handover, Inbox

    loop = asyncio.new_event_loop()
    try:
        h = Handover(loop)
        inboxes = [Inbox.__new__(Inbox) for _ in range(4)]
        got: list[tuple[int, int]] = []
        for k, ib in enumerate(inboxes):
            ib.put = lambda item, k=k: got.append((k, item))
        t = threading.Thread(target=lambda: [h.put(inboxes[i % 4], i) for i in range(40)])
        t.start()
        t.join()                                  # the loop ran nothing meanwhile
        loop.run_until_complete(asyncio.sleep(0))
        assert h.wakeups == 1
        assert [i for _, i in got] == list(range(40)) and all(k == i % 4 for k, i in got)
        h.put(inboxes[0], "late")                 # after a delivery, the next item wakes the loop again
        loop.run_until_complete(asyncio.sleep(0))
        assert h.wakeups == 2 and got[-1] == (0, "late")
    finally:
        loop.close()


def test_sixteen_streams_each_get_every_token_in_order(server):
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    texts: dict[int, str] = {}

    def one(k: int) -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60, trust_env=False) as c:
            with c.stream("POST", url, json={"prompt": f"p{k}", "max_tokens": 40, "temperature": 0,
                                             "stream": True}) as r:
                out = []
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ch = json.loads(line[6:])["choices"][0]
                        out.append(ch["text"])
                texts[k] = "".join(out)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(texts) == 16 and all(t == TEXT[:40] for t in texts.values()), texts
