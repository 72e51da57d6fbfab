"""The seed document's example runs as written (but for the model) as a plain script against real processes:
mii_query_handle in process, serve(model_name=…, tensor_parallel=2, port=50051, enable_rest=True), the
client's call, the seed's curl byte for byte against port 50051, and terminate_server() from plain code."""
from __future__ import annotations

import json

import pytest

from tests.compat.scripts import failed, port_in_use, run_script, write_script

# The seed's example, verbatim but for the model: the default model in process, a tiny Llama for
# tensor_parallel=2 (MODEL_T1 / MODEL_T2 are replaced by their paths). Lines marked "# test:" are the test's.
SEED = '''
import json, subprocess, sys                                                        # test:
MODEL_T1, MODEL_T2, CURL = sys.argv[1], sys.argv[2], sys.argv[3]                    # test:
import mii_async as mii

pipe = mii.mii_query_handle(MODEL_T1, tensor_parallel=1)
result = pipe.query(prompts=["DeepSpeed is", "Seattle is"], max_new_tokens=128)
print("LOCAL", json.dumps([[r.generated_text, r.generated_length] for r in result]))  # test:

client = mii.serve(model_name=MODEL_T2, tensor_parallel=2, port=50051, enable_rest=True)
result = client(prompts=["DeepSpeed is", "Seattle is"], max_new_tokens=128)
print("SERVED", json.dumps([r.token_ids for r in result]))                             # test:
h = client.health()                                                                   # test:
print("CURL", subprocess.run(CURL, shell=True, capture_output=True, text=True).stdout)  # test:
client.terminate_server()
print("CLOSED", client.closed)                                                        # test:
import os, time                                                                       # test:
def alive(pid):                                                   # test: a zombie counts as gone
    try: return "Z" not in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]  # test:
    except FileNotFoundError: return False                                            # test:
pids = [client._process.pid, client._gateway.pid] + [p for r in h["replicas"] for p in r["pids"]]  # test:
deadline = time.monotonic() + 30                                                      # test:
while any(map(alive, pids)) and time.monotonic() < deadline: time.sleep(0.1)          # test:
print("LEFT", json.dumps([p for p in pids if alive(p)]))                              # test:
'''
CURL = """curl -X POST http://localhost:50051/generate -d '{"prompts": ["DeepSpeed is"], "max_new_tokens": 128}'"""


def _line(out: str, tag: str) -> str:
    return next(line[len(tag) + 1:] for line in out.splitlines() if line.startswith(tag + " "))


def test_seed_example_runs_as_a_plain_script(tmp_path, default_model_dir, tiny_llama):
    """Every line of the seed's example does what it says: answers in process and from a tensor_parallel=2
    deployment (the same tokens as the in-process engine), the seed's curl answered on port 50051 with
    DeepSpeed-MII's fields, and terminate_server() from plain code stopping every process."""
    if port_in_use(50051):
        pytest.skip("port 50051, which the seed's example names, is taken on this host")
    import mii_async

    with mii_async.pipeline(str(tiny_llama)) as pipe:
        want = [r.token_ids for r in pipe(["DeepSpeed is", "Seattle is"], max_new_tokens=128)]
        [curl_want] = pipe(["DeepSpeed is"], max_new_tokens=128)
    script = write_script(tmp_path, "seed.py", SEED)
    proc = run_script(script, str(default_model_dir), str(tiny_llama), CURL)
    assert proc.returncode == 0, failed(proc)
    local = json.loads(_line(proc.stdout, "LOCAL"))
    assert len(local) == 2 and all(text and n > 0 for text, n in local), local
    assert json.loads(_line(proc.stdout, "SERVED")) == want
    [answer] = json.loads(_line(proc.stdout, "CURL"))
    assert answer == {"generated_text": curl_want.generated_text, "prompt_length": curl_want.prompt_length,
                      "generated_length": curl_want.generated_length, "finish_reason": curl_want.finish_reason}
    assert _line(proc.stdout, "CLOSED") == "True"
    assert json.loads(_line(proc.stdout, "LEFT")) == [], "terminate_server() left processes running"
