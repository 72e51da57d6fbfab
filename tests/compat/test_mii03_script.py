"""A DeepSpeed-MII 0.3-style script runs as plain processes against real ones: pipeline, serve with MII's
keywords (deployment_name, tensor_parallel, replica_num, enable_restful_api, restful_api_port, max_length),
mii.client(deployment_name) from another process, generate with streaming_fn and max_length, REST on the
MII route /mii/{deployment_name}, and GET /terminate stopping the deployment."""
from __future__ import annotations

import json
import uuid

from tests.compat.scripts import Lines, failed, free_port, run_script, start_script, write_script
from tests.mesh_helpers import wait_gone

SERVER = '''
import json, sys
import mii_async as mii

MODEL, NAME, REST_PORT = sys.argv[1], sys.argv[2], int(sys.argv[3])

pipe = mii.pipeline(MODEL, tensor_parallel=1, max_length=512)
response = pipe(["w5 w9 w33", "w7"], max_new_tokens=12, ignore_eos=True)
print("PIPELINE", json.dumps([r.token_ids for r in response]))
pipe.close()

client = mii.serve(MODEL, deployment_name=NAME, tensor_parallel=2, replica_num=1, enable_restful_api=True,
                   restful_api_port=REST_PORT, max_length=512, enable_terminate=True)
health = client.health()
pids = [client._process.pid, client._gateway.pid] + [p for r in health["replicas"] for p in r["pids"]]
print("READY", json.dumps(pids))
print("TERMINATED", client.wait_terminated(300))
'''

CLIENT = '''
import json, sys
import requests
import mii_async as mii

NAME, REST_PORT = sys.argv[1], int(sys.argv[2])
client = mii.client(NAME)

pieces = []
def callback(response):
    pieces.append([response[0].generated_text, response[0].generated_length, response[0].finish_reason])

final = client.generate(["w5 w9 w33"], streaming_fn=callback, max_new_tokens=12, ignore_eos=True)
print("STREAMED", json.dumps({"pieces": pieces, "text": final[0].generated_text, "ids": final[0].token_ids}))

capped = client.generate(["w5 w9 w33", "w7"], max_length=8, ignore_eos=True)
print("CAPPED", json.dumps([[r.prompt_length, r.token_ids, r.finish_reason] for r in capped]))

url = f"http://localhost:{REST_PORT}"
r = requests.post(f"{url}/mii/{NAME}", json={"prompts": ["w5 w9 w33"], "max_length": 10, "ignore_eos": True})
print("REST", r.status_code, r.text)
r = requests.post(f"{url}/mii/not-{NAME}", json={"prompts": ["w5 w9 w33"]})
print("REST_OTHER", r.status_code)
r = requests.get(f"{url}/terminate")
print("TERMINATE", r.status_code)
'''


def test_deepspeed_mii_03_script(tmp_path, tiny_llama):
    """Served under MII's keywords, found by name from another process: the streaming callback gets every
    piece and the pieces make the answer; max_length bounds prompt + output on the client and on the MII
    route, which answers for the deployment's name and no other; GET /terminate stops every process, the
    serving script's wait returns, and the name is free again."""
    import mii_async
    from mii_async import deployment_registry

    name = f"mii03-{uuid.uuid4().hex[:8]}"
    rest_port = free_port()
    with mii_async.pipeline(str(tiny_llama)) as pipe:
        want = [r.token_ids for r in pipe(["w5 w9 w33", "w7"], max_new_tokens=12, ignore_eos=True)]
        [plen3, plen1] = [r.prompt_length for r in pipe(["w5 w9 w33", "w7"], max_new_tokens=1)]
    server = start_script(write_script(tmp_path, "serve.py", SERVER), str(tiny_llama), name, str(rest_port))
    pids: list[int] = []
    try:
        lines = Lines(server)
        assert json.loads(lines.wait_for("PIPELINE", 300)) == want
        pids = json.loads(lines.wait_for("READY", 300))
        assert deployment_registry.find(name).address.startswith("tcp://127.0.0.1:")
        proc = run_script(write_script(tmp_path, "client.py", CLIENT), name, str(rest_port))
        assert proc.returncode == 0, failed(proc)
        out = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in proc.stdout.splitlines() if " " in line}

        streamed = json.loads(out["STREAMED"])
        pieces = streamed["pieces"]
        assert streamed["ids"] == want[0]
        assert "".join(text for text, _, _ in pieces) == streamed["text"]
        assert sum(n for _, n, _ in pieces) == 12
        assert [reason for _, _, reason in pieces] == [None] * (len(pieces) - 1) + ["length"]

        capped = json.loads(out["CAPPED"])
        assert [c[0] for c in capped] == [plen3, plen1]
        assert capped == [[plen3, want[0][:8 - plen3], "length"], [plen1, want[1][:8 - plen1], "length"]]

        status, body = out["REST"].split(" ", 1)
        [answer] = json.loads(body)
        assert status == "200" and answer["prompt_length"] == plen3
        assert answer["generated_length"] == 10 - plen3 and answer["finish_reason"] == "length"
        assert out["REST_OTHER"] == "404"
        assert out["TERMINATE"] == "200"

        assert lines.wait_for("TERMINATED", 120) == "True"
        assert server.wait(60) == 0
        assert not wait_gone(pids), "processes left behind"
        assert deployment_registry.find(name) is None
    finally:
        server.kill()
        server.wait()
