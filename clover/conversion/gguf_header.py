"""A GGUF file's header read fast: its metadata and its tensors' names and shapes, not their data.

Why not `gguf.GGUFReader`: it builds a numpy view for every part of every metadata field, and a tokenizer's
vocabulary and merges are hundreds of thousands of them. On clover-smol's GGUF (49 152 tokens, 48 900 merges) it
takes 2-3 s a file on two cores, which a llama.cpp runner paid three times before its first token. This reader
walks the same layout with `struct` over a memory map and keeps what the runner needs:

    magic "GGUF", version (u32, 2 or 3), tensor count (u64), metadata count (u64)
    metadata: key (u64 length + UTF-8), value type (u32), value
        scalars: u8 i8 u16 i16 u32 i32 f32 bool (types 0-7), u64 i64 f64 (10-12); string (8): u64 length + bytes;
        array (9): element type (u32), count (u64), the elements
    tensors: name, dims (u32 count + u64 each, ggml order: ne0 first), type (u32), data offset (u64)

Values come back as `GGUFReader`'s `contents()` gives them (a number, a str, a list); an array longer than
`MAX_ARRAY` (a vocabulary) is not decoded: its entry is `Skipped(count)`. `spans` gives each value's bytes in the
file, so a part of the metadata (the tokenizer's) can be hashed without decoding it (`metadata_digest`). The
reference is `GGUFReader` itself: tests/runners/test_gguf_header.py reads files both ways.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_ARRAY = 4096  # arrays decoded at most this long (shapes, sections, token lists); longer ones are skipped
# value type -> struct format of one element (8: string, 9: array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True)
class Skipped:
    """An array too long to decode here (`count` elements)."""

    count: int


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: dict[str, tuple[int, ...]]  # name -> dims in ggml order (ne0 first), as GGUFReader's `shape`
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> its value's bytes [start, end)
    path: Path | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def metadata_digest(self, prefixes: tuple[str, ...]) -> str:
        """sha256 of the keys starting with `prefixes` and their values' bytes, in key order."""
        digest = hashlib.sha256()
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for key in sorted(k for k in self.spans if k.startswith(prefixes)):
                start, end = self.spans[key]
                digest.update(key.encode() + b"\0" + data[start:end])
        return digest.hexdigest()


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor shapes of the GGUF file `path` (module docstring); a clear error for anything else."""
    path = Path(path)
    with open(path, "rb") as f:
        try:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ValueError(f"{path} is not a GGUF file (it is empty)") from None
    with data:
        try:
            return _parse(data, path)
        except struct.error:
            raise ValueError(f"{path}: the GGUF header ends early (a truncated or damaged file)") from None


def _parse(data: mmap.mmap, path: Path) -> GGUFHeader:
    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not read here (2 and 3 are; a big-endian file reads "
                         "as a huge version)")
    at = 24
    metadata: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    for _ in range(n_kv):
        key, at = _string(data, at)
        (kind,) = struct.unpack_from("<I", data, at)
        start = at + 4
        metadata[key], at = _value(data, start, kind)
        spans[key] = (start, at)
    tensors: dict[str, tuple[int, ...]] = {}
    for _ in range(n_tensors):
        name, at = _string(data, at)
        (n_dims,) = struct.unpack_from("<I", data, at)
        dims = struct.unpack_from(f"<{n_dims}Q", data, at + 4)
        at += 4 + 8 * n_dims + 4 + 8  # dims, type, offset
        tensors[name] = tuple(int(d) for d in dims)
    return GGUFHeader(metadata, tensors, spans, path)


def _string(data: mmap.mmap, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", data, at)
    return data[at + 8:at + 8 + n].decode("utf-8", errors="replace"), at + 8 + n


def _value(data: mmap.mmap, at: int, kind: int) -> tuple[Any, int]:
    """The value of type `kind` at `at`, and where the next one starts."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)
    if kind == 8:
        return _string(data, at)
    if kind != 9:
        raise ValueError(f"unknown GGUF value type {kind} at byte {at}")
    element, count = struct.unpack_from("<IQ", data, at)
    at += 12
    if element in _SCALARS:  # fixed size: decoded or jumped over at once
        fmt = _SCALARS[element]
        size = struct.calcsize(fmt)
        if count > MAX_ARRAY:
            return Skipped(count), at + size * count
        return list(struct.unpack_from(f"<{count}{fmt[1]}", data, at)), at + size * count
    if element == 8 and count > MAX_ARRAY:  # a vocabulary: only each string's length is read
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            at += 8 + unpack(data, at)[0]
        return Skipped(count), at
    values = []
    for _ in range(count):  # strings or nested arrays: each one's length is read to find the next
        value, at = _value(data, at, element)
        if count <= MAX_ARRAY:
            values.append(value)
    return (values if count <= MAX_ARRAY else Skipped(count)), at
