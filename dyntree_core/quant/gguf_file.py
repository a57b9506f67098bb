"""A fast GGUF reader: scalar metadata and tensor views, skipping the tokenizer arrays.

``gguf.GGUFReader`` builds a Python object for each of the ~300,000 vocabulary strings and merges
of a Qwen tokenizer (16 s of a 25 s model load on a 2-core machine) and its memory-map slices
make row-wise dequantization slow. This reader walks the same format (GGUF v2/v3) with
``struct``, keeps scalar values only, and hands out tensor bytes as plain ``numpy`` views of one
memory map.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in torch order (reversed GGUF ``ne``), raw bytes ``[rows, bytes_per_row]``."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return s

    def skip_string(self) -> None:
        self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype in _SCALARS:
                size = struct.calcsize(_SCALARS[etype])
                if count <= 64:
                    vals = [self.unpack(_SCALARS[etype]) for _ in range(count)]
                    return vals
                self.pos += size * count
                return f"<array of {count}>"
            if etype == _STRING:
                for _ in range(count):
                    self.skip_string()
                return f"<array of {count} strings>"
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf(path: Path | str) -> GGUFFile:
    """Metadata (scalars and short arrays) and memory-mapped tensor views of a GGUF file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    mm = np.memmap(str(path), dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(mm[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version = cur.unpack("<I")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        nd = cur.unpack("<I")
        ne = [cur.unpack("<Q") for _ in range(nd)]
        ttype, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((name, ne, ttype, offset))
    align = int(meta.get("general.alignment", 32))
    start = (cur.pos + align - 1) // align * align
    plain = mm.view(np.ndarray)
    tensors = {}
    for name, ne, ttype, offset in infos:
        qt = GGMLQuantizationType(ttype)
        block, tsize = GGML_QUANT_SIZES[qt]
        n_elem = int(np.prod(ne))
        nbytes = n_elem // block * tsize
        rows = n_elem // ne[0]
        data = plain[start + offset:start + offset + nbytes].reshape(rows, -1)
        tensors[name] = GGUFTensor(name, qt.name, tuple(int(x) for x in reversed(ne)), data)
    return GGUFFile(meta, tensors)
