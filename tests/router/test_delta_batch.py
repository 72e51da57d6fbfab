"""The router streams each engine step's tokens for one client as one frame: a DeltaBatch when the client has
several requests in the step."""
from __future__ import annotations

import zmq


from mii_async import protocol as P
from tests.mesh_helpers import raw_dealer


def test_a_clients_requests_of_one_step_come_in_one_frame(deployment):
    """Six greedy requests from one raw DEALER socket: some frames are DeltaBatches of several requests, and
    each request's deltas, in order, give the tokens and text of the same request made alone."""
    prompts = [[1, 504, 3458, 282, 4649, 30] + [100 + i] for i in range(6)]
    alone = deployment(prompts, max_new_tokens=6, min_new_tokens=6)
    ctx = zmq.Context()
    s = raw_dealer(ctx, deployment.address)
    s.connect(deployment.address)
    try:
        for i, p in enumerate(prompts):
            s.send(P.encode(P.Generate(req_id=f"b{i}", prompt_ids=p, params={"max_new_tokens": 6, "min_new_tokens": 6})))
        got: dict[str, list[P.Delta]] = {f"b{i}": [] for i in range(6)}
        batches = 0
        while any(not d or d[-1].finish_reason is None for d in got.values()):
            assert s.poll(60_000), "no frame from the router in 60 s"
            msg = P.decode(s.recv())
            assert isinstance(msg, (P.Delta, P.DeltaBatch)), msg
            deltas = msg.deltas if isinstance(msg, P.DeltaBatch) else [msg]
            if isinstance(msg, P.DeltaBatch):
                batches += 1
                assert len(deltas) > 1 and len({d.req_id for d in deltas}) == len(deltas)
            for d in deltas:
                got[d.req_id].append(d)
    finally:
        s.close()
        ctx.term()
    assert batches >= 5                  # all six decode together: one frame a step
    for i, r in enumerate(alone):
        ds = got[f"b{i}"]
        assert [t for d in ds for t in d.token_ids] == r.token_ids
        assert "".join(d.text for d in ds) == r.generated_text
        assert ds[0].prompt_ids == prompts[i] and all(d.prompt_ids is None for d in ds[1:])
        assert ds[-1].finish_reason == "length" and ds[-1].usage["completion_tokens"] == 6
