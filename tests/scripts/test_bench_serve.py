"""benchmarks/serve.py serves a run, times its clients and ends in one JSON line with each client
count's latency, throughput and batching, and what other requests met while a huge one was refused."""

import json
import subprocess
import sys

from tests.helpers import PYTHONPATH, REPO

SCRIPT = REPO / "benchmarks" / "serve.py"


def test_each_client_count_gets_its_latencies_throughput_and_batches(workdir):
    result = subprocess.run([sys.executable, str(SCRIPT), "--run", "runs/tiny", "--requests", "24", "--clients", "1,4",
                             "--max-wait-ms", "50", "--huge-body-mb", "1"], cwd=workdir, capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    figures = json.loads(lines[-1])
    assert lines[0].split() == ["clients", "sentences/s", "p50", "ms", "p99", "ms", "requests/batch"]
    assert figures["engine"] == "ctranslate2" and figures["server_options"] == ["--max-wait-ms", "50"]
    one, four = figures["results"]
    assert (one["clients"], one["requests"], one["sentences"], one["batches"]) == (1, 24, 24, 24)
    assert (four["clients"], four["requests"], four["sentences"]) == (4, 24, 24) and four["batches"] < 24
    for row in (one, four):
        assert 0 < row["p50_ms"] <= row["p99_ms"] and row["sentences_per_s"] > 0
        assert row["requests_per_batch"] == round(row["requests"] / row["batches"], 2)
    huge = figures["huge_body"]
    assert (huge["body_mb"], huge["status"]) == (1, 413) and huge["body_bytes"] > 1_000_000
    assert huge["error"].startswith(f"the request body is {huge['body_bytes']:,} bytes; this server takes at most ")
    assert huge["probes"] >= 20 and 0 < huge["p50_health_ms"] <= huge["slowest_health_ms"]
    assert 0 < huge["p50_translate_ms"] <= huge["slowest_translate_ms"]
