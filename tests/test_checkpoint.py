"""checkpoint.py in-process: header parsing and file integrity on header-only
(sparse) safetensors shards. No tensor data is read; no model is built."""
import json
import struct

import pytest

from vllm_gemma_qat.checkpoint import (DTYPE_BYTES, CheckpointError, numel,
                                       open_checkpoint, read_header)
from vllm_gemma_qat.testing import synthetic


def write_shard(path, entries: dict, data_bytes=None):
    """A safetensors file with `entries` {name: (dtype, shape)} laid out
    back to back; `data_bytes` overrides the data section's length."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in entries.items():
        size = DTYPE_BYTES[dtype] * numel(shape)
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + (offset if data_bytes is None else data_bytes))
    return path


def test_header_gives_names_dtypes_shapes_and_data_offsets(tmp_path):
    shard = write_shard(tmp_path / "a.safetensors",
                        {"x": ("BF16", (4, 8)), "y": ("F32", (3, ))})
    infos = read_header(shard)
    assert set(infos) == {"x", "y"}
    assert (infos["x"].dtype, infos["x"].shape, infos["x"].nbytes) == (
        "BF16", (4, 8), 64)
    assert infos["y"].offset - infos["x"].offset == 64


def test_truncated_shard_names_file_and_sizes(tmp_path):
    shard = write_shard(tmp_path / "a.safetensors", {"x": ("BF16", (4, 8))},
                        data_bytes=10)
    with pytest.raises(CheckpointError, match=r"a\.safetensors: truncated: "
                       r"header needs \d+ bytes, file has \d+"):
        read_header(shard)


def test_empty_file_is_truncated(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="truncated .no safetensors header"):
        read_header(tmp_path / "a.safetensors")


def test_header_length_beyond_file_is_corrupt(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(CheckpointError, match=r"corrupt safetensors header "
                       r"\(claims 1000000 header bytes"):
        read_header(tmp_path / "a.safetensors")


def test_entry_whose_bytes_disagree_with_dtype_names_tensor(tmp_path):
    shard = write_shard(tmp_path / "a.safetensors", {"norm.weight": (
        "F32", (16, ))})
    raw = bytearray(shard.read_bytes())
    raw[:] = raw.replace(b'"F32"', b'"F16"', 1)  # same length, half the bytes
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"a\.safetensors: corrupt "
                       r"safetensors header entry for tensor norm\.weight"):
        read_header(shard)


def test_tensor_in_two_shards_names_both(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    write_shard(tmp_path / "a.safetensors", {"x": ("BF16", (2, ))})
    write_shard(tmp_path / "b.safetensors", {"x": ("BF16", (2, ))})
    with pytest.raises(CheckpointError, match=r"b\.safetensors: tensor x also "
                       r"in a\.safetensors"):
        open_checkpoint(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    path = synthetic.write_header_only(tmp_path / "c", "e2b", "qat", shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\."
                       r"safetensors: shard named in model\.safetensors\."
                       r"index\.json is missing"):
        open_checkpoint(path)


def test_missing_and_invalid_config(tmp_path):
    write_shard(tmp_path / "a.safetensors", {"x": ("BF16", (2, ))})
    with pytest.raises(CheckpointError, match="missing config.json"):
        open_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        open_checkpoint(tmp_path)


def test_full_size_e2b_headers_across_shards(tmp_path):
    path = synthetic.write_header_only(tmp_path / "c", "e2b", "qat", shards=3)
    ckpt = open_checkpoint(path)
    assert len(ckpt.files) == 3
    lm = [n for n in ckpt.tensors if n.startswith("model.language_model.")]
    assert len(lm) == 540
