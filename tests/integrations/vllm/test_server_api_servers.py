"""``kvcert serve --api-server-count 2``: vLLM runs two API server processes on one port and serves ``/metrics``
in prometheus multiprocess mode. One server for the module; two completions are sent concurrently. Each response
must carry its own certificate summary (every API server process loads the middleware and reads the shared
records file), and every scrape of ``/metrics`` (answered by either process) must expose each ``kvcert_*`` and
``kvcert_ledger_*`` series exactly once, with the counts of the two requests.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from vllm_server import TAU, check_summary, complete, metric_values, running_server

PROMPTS = ["The capital of France is", "Water boils at a temperature of 100 degrees"]
API_SERVERS = 2
SCRAPES = 8  # the kernel spreads connections over the API server processes by address hash (SO_REUSEPORT)
LEDGER = 'kvcert_ledger_requests{model="vllm",tier="certified"}'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(responses, scrapes, server log)``: the two responses, then ``SCRAPES`` readings of the ``kvcert_*``
    samples once the engine's ledger summary counts both requests and has stopped changing."""
    tmp = tmp_path_factory.mktemp("serve2")
    with running_server(tmp, api_server_count=API_SERVERS) as (_, base):
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            responses = list(pool.map(lambda p: complete(base, p), PROMPTS))
        # the engine publishes its ledger summary at most every 0.5 s while the ledger changes, and a request's last
        # events can follow the summary that first counts it: wait for both requests and two equal readings 1 s apart
        previous: dict[str, list[float]] = {}
        for _ in range(60):
            current = metric_values(base)
            if current.get(LEDGER, [0.0])[0] >= len(PROMPTS) and current == previous:
                break
            previous = current
            time.sleep(1.0)
        scrapes = [metric_values(base) for _ in range(SCRAPES)]
    return responses, scrapes, (tmp / "server.log").read_text()


def test_two_api_server_processes_ran(served):
    assert served[2].count("Starting vLLM server on") == API_SERVERS  # logged by each API server process


def test_each_response_carries_its_certificate(served):
    responses = served[0]
    assert responses[0]["id"] != responses[1]["id"]
    for resp in responses:
        usage = resp["usage"]
        check_summary(resp["kvcert"], resp["id"], usage["completion_tokens"], usage["prompt_tokens"])


def test_metrics_expose_each_kvcert_series_once_with_both_requests(served):
    responses, scrapes, _ = served
    cells = sum(r["kvcert"]["cells"] for r in responses)
    for values in scrapes:
        assert values, "no kvcert_* series on /metrics"
        assert all(len(v) == 1 for v in values.values()), {k: v for k, v in values.items() if len(v) > 1}
        assert values['kvcert_requests_total{tier="exact"}'] == [float(len(PROMPTS))]
        assert values['kvcert_cells_total{tier="certified"}'] == [float(cells)]
        assert 0.0 <= values['kvcert_max_certificate{tier="certified"}'][0] <= TAU
        assert values['kvcert_violations_total{tier="measured"}'] == [0.0]
        assert values[LEDGER] == [float(len(PROMPTS))]
        assert values['kvcert_ledger_unwritten_reads{model="vllm",tier="certified"}'] == [0.0]
    differ = {k for values in scrapes for k in values.keys() | scrapes[0].keys() if values.get(k) != scrapes[0].get(k)}
    assert not differ, {k: [values.get(k) for values in scrapes] for k in differ}  # every process reads one file
