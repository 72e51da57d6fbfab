"""examples/background_jobs.py against the session's deployment (a real router and worker process)."""
from __future__ import annotations

import re

from tests.examples.helpers import run_example


def test_jobs_run_and_a_timed_out_job_is_aborted(deployment):
    """Every ordinary job is done (the greedy capital question says "Paris"); the deliberately long job
    (512 tokens, ignore_eos) times out, is reported cancelled, and is aborted on the server: afterwards
    nothing runs or waits, no KV block is used, and the engine ran far fewer steps than that job alone needs."""
    out = run_example("background_jobs.py", "--router", deployment.address, "--jobs", "4", "--workers", "2",
                      "--queue-size", "2", "--max-new-tokens", "12", "--slow-job-timeout", "0.3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    jobs = [line for line in lines if line.startswith("job ")]
    assert len(jobs) == 5, out.stdout
    assert re.match(r"job  0 cancelled .*ran past its 0.3 s timeout; aborted on the server", jobs[0]), jobs[0]
    assert all(re.match(r"job  \d done .* \d+ tokens, (stop|length) \| ", j) for j in jobs[1:]), out.stdout
    assert "What is the capital of France?" in jobs[1] and "Paris" in jobs[1]
    assert re.search(r"^summary: 4 done, 1 cancelled, 0 failed; 5 jobs in [\d.]+s with 2 workers$", out.stdout,
                     re.MULTILINE), out.stdout
    m = re.search(r"^server after the run: running=0 waiting=0 used_blocks=0; (\d+) engine steps", out.stdout,
                  re.MULTILINE)
    assert m, out.stdout
    assert int(m[1]) < 200, f"{m[1]} engine steps: the cancelled job went on generating"
