"""The packed-weights cache keeps the files each precision used last and deletes the rest (``models.packed_cache``)."""

import os
import time

from dyntree_core.models.packed_cache import KEEP_PER_PRECISION, PARTIAL_AGE_S, mark_used, precision_of, prune


def _file(d, name, age_s, size=1000):
    p = d / name
    p.write_bytes(b"x" * size)
    t = time.time() - age_s
    os.utime(p, (t, t))
    return p


def test_prune_keeps_the_files_used_last_per_precision_and_the_one_in_use(tmp_path):
    int4 = [_file(tmp_path, f"packed-int4-torch2.13.0-v3-{i:08x}.safetensors", age_s=100 * (i + 1)) for i in range(5)]
    int8 = _file(tmp_path, "packed-int8-torch2.13.0-v3-aaaaaaaa.safetensors", age_s=10_000)
    emb = _file(tmp_path, "packed-int4-torch2.13.0-v3-bbbbbbbb-embhead.safetensors", age_s=50)
    stale = _file(tmp_path, "packed-int4-torch2.13.0-v3-cccccccc.safetensors.partial", age_s=PARTIAL_AGE_S + 60)
    fresh = _file(tmp_path, "packed-int4-torch2.13.0-v3-dddddddd.safetensors.partial", age_s=5)
    other = _file(tmp_path, "notes.txt", age_s=10_000)
    in_use = int4[4]  # the oldest int4 file, just loaded
    got = prune(tmp_path, in_use)
    left = {p.name for p in tmp_path.iterdir()}
    # int4: the file in use and the one used last besides it (the -embhead file); int8 untouched
    assert KEEP_PER_PRECISION == 2
    assert left == {in_use.name, emb.name, int8.name, fresh.name, other.name}
    assert set(got.files) == set(int4[:4]) | {stale}
    assert got.nbytes == 5 * 1000 and "removed 5 older packed file(s)" in got.text()
    assert prune(tmp_path, in_use).files == ()  # (nothing more to do)


def test_marking_a_file_used_saves_it_from_the_next_prune(tmp_path):
    old = _file(tmp_path, "packed-int4-torch2.13.0-v3-00000001.safetensors", age_s=1000)
    mid = _file(tmp_path, "packed-int4-torch2.13.0-v3-00000002.safetensors", age_s=500)
    new = _file(tmp_path, "packed-int4-torch2.13.0-v3-00000003.safetensors", age_s=100)
    mark_used(old)
    said = []
    prune(tmp_path, new, said.append)
    assert {p.name for p in tmp_path.iterdir()} == {old.name, new.name}
    assert said == ["  removed 1 older packed file(s) (0.0 GB)"] and not mid.exists()
    assert precision_of(new) == "int4" and precision_of(tmp_path / "m.gguf") is None
    assert prune(tmp_path / "missing", new).files == ()
