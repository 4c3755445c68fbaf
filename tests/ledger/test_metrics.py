import urllib.request

import numpy as np

from kvcert.ledger import Ledger, observed
from kvcert.ledger.metrics import serve_metrics


def test_prometheus_endpoint_on_localhost():
    a_led, b_led = Ledger(model="m-a"), Ledger(model="m-b")
    uid = a_led.open_request()
    a_led.write(
        "kv",
        0,
        np.arange(4),
        np.array([uid, uid, uid, -1]),
        observed(np.array([1, 1, 0, 1], bool)),
        rule="probabilistic",
    )
    a_led.read("kv", 0, np.array([uid]), np.array([0]), np.array([4]))
    server, thread, port = serve_metrics({"m-a": a_led, "m-b": b_led})
    try:
        assert port > 0
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in body.splitlines() if ln and not ln.startswith("#")}
    assert lines['kvcert_ledger_identity_fail_closed{model="m-a",tier="certified"}'] == 1.0
    assert lines['kvcert_ledger_identity_fail_closed{model="m-b",tier="certified"}'] == 0.0
    assert lines['kvcert_ledger_delta_spent_max{model="m-a",tier="certified"}'] == a_led.summary()["delta_spent_max"]
    assert lines['kvcert_ledger_coverage{model="m-a",tier="empirical"}'] == 0.5  # 2 of 4 reads compressed
    assert lines['kvcert_ledger_fallback_rate{model="m-a",tier="empirical"}'] == 1 / 3
    assert 'kvcert_ledger_eprocess_log_m{model="m-a",stat="crossed",tier="certified"}' in lines
