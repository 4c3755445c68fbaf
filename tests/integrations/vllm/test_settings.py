"""Plugin configuration, records and launch checks: bad configuration fails before any engine starts."""

import json
from types import SimpleNamespace

import pytest
import torch

from kvcert.integrations.vllm import plugin
from kvcert.integrations.vllm.launch import SERVER_MAIN, check_model, server_command
from kvcert.integrations.vllm.records import RecordStore, RequestRecord, merge
from kvcert.integrations.vllm.settings import Settings, enabled, gate_from_spec


def test_settings_roundtrip_and_defaults():
    s = Settings(
        keys="int8", values="int4", gate="certified:0.1", validate=True, records="/tmp/x.sqlite", seed=3, exact_sinks=4
    )
    assert Settings.from_env(s.to_env()) == s
    assert enabled(s.to_env()) and not enabled({})
    assert Settings.from_env({}) == Settings()


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"KVCERT_VLLM_KEYS": "nope"}, "KVCERT_VLLM_KEYS.*unknown codec 'nope'"),
        ({"KVCERT_VLLM_VALUES": "int3"}, "KVCERT_VLLM_VALUES.*unknown codec 'int3'"),
        ({"KVCERT_VLLM_GATE": "certified:-0.1"}, "KVCERT_VLLM_GATE.*threshold must be >= 0"),
        ({"KVCERT_VLLM_GATE": "certified:inf"}, "finite threshold"),
        ({"KVCERT_VLLM_GATE": "certified:2:block"}, "KVCERT_VLLM_GATE.*at most 1"),
        (
            {"KVCERT_VLLM_GATE": "always"},
            r"expected off, certified:TAU\[:UNIT\]\[:box\[:tier-b\]\]\[:values=NU\] or risk:TAU_GATE\[:UNIT\] "
            r"\(UNIT: block",
        ),
        ({"KVCERT_VLLM_GATE": "certified:0.2:page"}, "expected off, certified"),
        ({"KVCERT_VLLM_GATE": "certified:x"}, "'x' is not a number"),
        ({"KVCERT_VLLM_VALIDATE": "yes"}, "KVCERT_VLLM_VALIDATE must be 0 or 1"),
        ({"KVCERT_VLLM_SEED": "1.5"}, "KVCERT_VLLM_SEED must be an integer"),
        ({"KVCERT_VLLM_EXACT_SINKS": "four"}, "KVCERT_VLLM_EXACT_SINKS must be an integer"),
        ({"KVCERT_VLLM_EXACT_SINKS": "-1"}, "KVCERT_VLLM_EXACT_SINKS / --exact-sinks must be a number of positions"),
        ({"KVCERT_VLLM_KEYS": "kivi-4"}, "KVCERT_VLLM_KEYS.*only per-token codecs"),  # blocks of 32: no cell
    ],
)
def test_bad_settings_name_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        Settings.from_env(env)


def test_gate_spec():
    assert gate_from_spec("off").mode == "off"
    g = gate_from_spec("certified:0.2")
    assert (g.mode, g.threshold) == ("certified", 0.2)
    assert gate_from_spec("risk:5").mode == "risk_ranked"
    assert (g.granularity, g.persistent) == ("head", False)
    b = gate_from_spec("certified:0.1:block")
    assert (b.mode, b.threshold, b.granularity, b.block_size, b.persistent) == ("certified", 0.1, "block", 64, True)
    r = gate_from_spec("risk:5:block")
    assert (r.mode, r.granularity, r.persistent) == ("risk_ranked", "block", True)
    t = gate_from_spec("certified:0.1:block-transient")
    assert (t.mode, t.threshold, t.granularity, t.block_size, t.persistent) == ("certified", 0.1, "block", 64, False)
    x = gate_from_spec("certified:0.1:box")
    assert (x.mode, x.threshold, x.granularity, x.persistent, x.box) == ("certified", 0.1, "head", False, True)
    with pytest.raises(ValueError, match="expected off, certified"):
        gate_from_spec("risk:5:box")
    y = gate_from_spec("certified:0.2:block-transient:box:tier-b")
    assert (y.granularity, y.persistent, y.box, y.tier_b) == ("block", False, True, True)
    assert gate_from_spec("certified:0.2:box:tier-b").describe() == "certified(tau=0.2, head, box, tier-b)"
    with pytest.raises(ValueError, match="write ':box:tier-b'"):
        gate_from_spec("certified:0.2:tier-b")
    assert Settings(keys="dither-int8", gate="certified:0.2:box:tier-b").gate_policy.tier_b
    with pytest.raises(ValueError, match="must be a dithered codec"):
        Settings(keys="int8", gate="certified:0.2:box:tier-b")
    assert Settings(keys="dither-int8", gate="certified:0.2:box:tier-b:values=0.1").gate_policy.value_rel == 0.1
    for bad in ("certified:0.2:tier-b:box", "certified:0.2:block:block", "risk:5:box:tier-b"):
        with pytest.raises(ValueError, match="expected off, certified"):
            gate_from_spec(bad)


def test_plugin_is_inert_without_switch_and_fails_closed_with_bad_settings(monkeypatch):
    monkeypatch.delenv("KVCERT_VLLM", raising=False)
    monkeypatch.setenv("KVCERT_VLLM_KEYS", "nope")
    plugin.register()  # switched off: nothing validated, nothing registered
    monkeypatch.setenv("KVCERT_VLLM", "1")
    with pytest.raises(ValueError, match="unknown codec 'nope'"):
        plugin.register()


def test_check_supported_refuses_what_it_cannot_certify():
    from kvcert.integrations.vllm.backend import check_supported

    ok = SimpleNamespace(
        attn_type="decoder", sliding_window=-1, logits_soft_cap=0, alibi_slopes=None, sinks=None, kv_cache_dtype="auto"
    )
    assert check_supported("llama", ok, torch.float32) is None
    assert "model type 'gemma3_text'" in check_supported("gemma3_text", ok, torch.float32)
    for field, value, text in (
        ("sliding_window", 512, "sliding window"),
        ("logits_soft_cap", 30.0, "soft-capping"),
        ("kv_cache_dtype", "fp8", "KV cache dtype 'fp8'"),
        ("attn_type", "encoder_only", "attention type"),
    ):
        bad = SimpleNamespace(**{**vars(ok), field: value})
        assert text in check_supported("llama", bad, torch.float32)


def _spec(**kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.float32, **kw)


def test_backend_publishes_the_measured_packed_cell(monkeypatch):
    from kvcert.integrations.vllm import backend
    from kvcert.quant import bytes_per_token_head, resolve

    monkeypatch.setenv("KVCERT_VLLM_KEYS", "dither-int8")
    monkeypatch.setenv("KVCERT_VLLM_VALUES", "int2")
    spec = backend.KvcertCPUBackend.customize_spec(_spec())
    packed = bytes_per_token_head(resolve("dither-int8", "key"), 64) + bytes_per_token_head(
        resolve("int2", "value"), 64
    )
    witness = 8 + 1  # the log8 witness codes per (token, KV head): 8 band codes and 1 value-residual code
    assert spec.state_content_bytes == -(-(packed + witness) // 4) * 4  # fp32 views of the blocks: a multiple of 4
    assert spec.page_size_bytes == 3 * 128 * spec.state_content_bytes < _spec().page_size_bytes
    with pytest.raises(backend.PackingError, match="cannot store packed codes"):
        backend.KvcertCPUBackend.customize_spec(_spec(sliding_window=256))
    monkeypatch.setattr(backend, "_REFUSED", ["model type 'x'"])  # a layer served uncertified: nothing packed
    assert backend.KvcertCPUBackend.customize_spec(_spec()) == _spec()


def test_a_vllm_without_the_packing_hook_refuses_to_start(monkeypatch):
    from vllm.v1.attention.backend import AttentionBackend

    from kvcert.integrations.vllm import backend

    backend.check_packing_hooks()
    monkeypatch.delattr(AttentionBackend, "customize_spec")
    with pytest.raises(backend.PackingError, match="customize_spec"):
        backend.check_packing_hooks()


def test_check_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert check_model(tmp_path, False) == "llama"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    with pytest.raises(ValueError, match="cannot certify model type 'gemma3_text'"):
        check_model(tmp_path, False)
    assert check_model(tmp_path, True) == "gemma3_text"
    with pytest.raises(ValueError, match="no config.json"):
        check_model(tmp_path / "missing", False)


def test_server_command_configures_the_plugin(tmp_path):
    s = Settings(gate="certified:0.2", records=str(tmp_path / "r.sqlite"))
    argv, env = server_command("py", tmp_path, s, port=8123, base_env={})
    assert argv[:4] == ["py", "-c", SERVER_MAIN, str(tmp_path)]  # vllm serve's positional model
    assert "--no-enable-prefix-caching" in argv and "kvcert.integrations.vllm.http.certificate_middleware" in argv
    assert Settings.from_env(env) == s and env["KVCERT_VLLM"] == "1"
    with pytest.raises(ValueError, match="records"):
        server_command("py", tmp_path, Settings(), port=8123)
    with pytest.raises(ValueError, match="--port"):
        server_command("py", tmp_path, s, port=0)


def test_record_store_prefix_lookup_and_merge(tmp_path):
    store = RecordStore(tmp_path / "r.sqlite")
    a = RequestRecord("cmpl-1-0-ab", reads=3, repaired_reads=1, max_certificate=0.1, cells=9)
    b = RequestRecord("cmpl-1-1-cd", reads=3, repaired_reads=0, max_certificate=0.3, cells=9)
    c = RequestRecord("cmpl-10-0-ef", reads=5)
    store.put([a, b, c])
    found = store.matching("cmpl-1")
    assert sorted(r.request_id for r in found) == ["cmpl-1-0-ab", "cmpl-1-1-cd"]
    m = merge(found, "cmpl-1")
    assert (m.reads, m.repaired_reads, m.cells, m.max_certificate) == (6, 1, 18, 0.3)
    assert m.coverage == pytest.approx(5 / 6) and m.fallback_share == pytest.approx(1 / 6)
    assert RecordStore(tmp_path / "r.sqlite").matching("cmpl-10")[0] == c  # a second process sees the rows
    assert store.matching("cmpl_1") == []  # LIKE wildcards in ids are escaped


def test_a_kv_cache_rebound_while_requests_are_live_fails_closed(monkeypatch):
    """A layer's blocks and host blocks follow vLLM's KV cache tensor: a new tensor with no live request (profiling,
    then the real cache) is taken; a new one while a request is live raises ``PackingError`` naming it (its codes
    and exact K/V are in the old blocks), instead of serving reads of unwritten blocks."""
    from kvcert.integrations.vllm import backend
    from kvcert.integrations.vllm.runtime import Runtime, cell_layout

    rt = Runtime(Settings(), 2, 3, register_exit=False)
    monkeypatch.setattr(backend, "_RUNTIME", rt)
    nbytes = cell_layout(rt.settings, 64, 64, torch.float32).nbytes
    impl = SimpleNamespace(_pool=None, head_size=64)
    table = torch.zeros(1, 2, dtype=torch.int32)
    first, second = (torch.zeros(4, 3, 16, nbytes // 4) for _ in range(2))
    assert backend.KvcertCPUImpl._blocks(impl, first, table, torch.float32).blocks.data_ptr() == first.data_ptr()
    assert backend.KvcertCPUImpl._blocks(impl, second, table, torch.float32).blocks.data_ptr() == second.data_ptr()
    rt.sequences["req-7"] = SimpleNamespace()
    with pytest.raises(backend.PackingError, match="req-7"):
        backend.KvcertCPUImpl._blocks(impl, first, table, torch.float32)
