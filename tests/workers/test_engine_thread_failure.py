"""A step that fails in the local pipeline's engine thread (here: the forward raises after the step in flight
was read and handed over between its layers) ends every request with an error or its last token, and leaves
nothing running: no KV block held, the thread idle and still serving."""
from __future__ import annotations

import threading

from mii_async.config import EngineConfig
from mii_async.engine_thread import EngineThread
from mii_async.params import SamplingParams
from mii_async.text.request_state import Ended


def test_a_failed_launch_leaves_nothing_running(tiny_model):
    pipe = EngineThread(EngineConfig.from_kwargs(str(tiny_model("llama")), num_blocks=128, async_scheduling=True))
    try:
        runner = pipe.engine.runner
        execute, calls = runner.execute, []

        def failing(plan, ids=None, between_layers=None):
            calls.append(1)
            if len(calls) == 4 and between_layers is not None:
                between_layers()                 # the step in flight goes out: request 0's last token
                raise RuntimeError("injected failure after the early read")
            return execute(plan, ids, between_layers)

        runner.execute = failing
        events: dict[int, list] = {0: [], 1: []}
        done = {i: threading.Event() for i in events}

        def sink_of(i):
            def sink(ev):
                events[i].append(ev)
                if isinstance(ev, Ended) or ev.finish_reason is not None:
                    done[i].set()
            return sink

        pipe.submit(0, [5, 6, 7, 8], SamplingParams(max_new_tokens=2, min_new_tokens=2), sink_of(0))
        pipe.submit(1, [9, 10, 11], SamplingParams(max_new_tokens=40, min_new_tokens=40), sink_of(1))
        assert all(d.wait(60) for d in done.values())
        assert len(calls) >= 4
        assert [e.finish_reason for e in events[0]] == [None, "length"]
        assert isinstance(events[1][-1], Ended) and events[1][-1].reason == "error"
        stats = pipe.stats()
        assert stats["used_blocks"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
        assert not pipe.engine.has_work()
        # still serving
        again = threading.Event()
        got = []
        pipe.submit(2, [5, 6, 7], SamplingParams(max_new_tokens=3, min_new_tokens=3),
                    lambda ev: (got.append(ev), ev.finish_reason and again.set()))
        assert again.wait(60) and len(got) == 3
    finally:
        pipe.close()
