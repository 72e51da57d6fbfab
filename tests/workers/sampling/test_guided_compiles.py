"""The guide compiler's bookkeeping under races: a request for a regex whose queued compile is just being skipped
(nobody waited for it any more) gets a compile of its own, not the skipped compile's failure."""
from __future__ import annotations

from concurrent.futures import Future

import pytest


def test_a_request_that_comes_as_its_compile_is_skipped_still_compiles(default_model_dir, monkeypatch):
    """A compile queued behind another whose only request went away is skipped; a request for the same regex
    that arrives at that moment (here: as the skip's failure is being set) is compiled, not failed."""
    from mii_async.workers.sampling import guide_compiler as gc

    compiler = gc.GuideCompiler(default_model_dir, [2])
    late: list[Future] = []

    class Racing(Future):
        def set_exception(self, exc):
            if not late and "no request waits" in str(exc):
                late.append(compiler.index(("guided_regex", "x[0-9]{2}")))    # the request arriving just now
            super().set_exception(exc)

    monkeypatch.setattr(gc, "Future", Racing)
    try:
        with compiler._child_lock:                     # a compile in progress: the next one queues behind it
            unwanted = compiler.index(("guided_regex", "x[0-9]{2}"))
            compiler.release(unwanted)                 # its only request was aborted meanwhile
        with pytest.raises(Exception, match="no request waits"):
            unwanted.result(timeout=60)
        assert late and late[0] is not unwanted
        index, _ = late[0].result(timeout=120)
        assert index is not None
    finally:
        compiler.close()


def test_a_slow_compile_nobody_waits_for_is_stopped(default_model_dir, monkeypatch):
    """A compile running past ABANDON_AFTER_S whose only request went away is stopped with its child, so that
    a guide asked next is compiled by a fresh child instead of waiting behind it."""
    import time

    from mii_async.workers.sampling import guide_compiler as gc

    monkeypatch.setattr(gc, "ABANDON_AFTER_S", 0.5)                     # the compile below takes seconds
    compiler = gc.GuideCompiler(default_model_dir, [2])
    try:
        compiler.index(("guided_regex", "[0-9]")).result(timeout=120)     # the child is up
        slow = compiler.index(("guided_regex", "[^\\n]{0,300}z"))          # seconds of work, hundreds of MiB
        time.sleep(gc.ABANDON_AFTER_S + 0.5)
        assert not slow.done(), "the slow compile should still be running"
        compiler.release(slow)                                             # its request was aborted
        with pytest.raises(Exception, match="no request waits"):          # stopped: run to its end, it would
            slow.result(timeout=30)                                        # have given its index
        index, _ = compiler.index(("guided_regex", "y[0-9]{2}")).result(timeout=120)
        assert index is not None
    finally:
        compiler.close()
