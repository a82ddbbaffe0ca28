"""A GGUF file read where it lies: the header's index agrees with gguf's own reader, and each
tensor is a view of the file's bytes; a file that is no GGUF we read is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from loomllm.workers.models import sources
from loomllm.workers.models.gguf_file import GgufFile, UnsupportedTensorType


def test_the_header_index_agrees_with_gguf_s_reader():
    path = Path(sources.resolve_model("smollm2").path)
    gguf = GgufFile(path)
    reader = GGUFReader(str(path))
    assert gguf.architecture == "llama"
    assert set(gguf.tensors) == {t.name for t in reader.tensors}
    for tensor in reader.tensors:
        info = gguf.tensors[tensor.name]
        assert info.type_id == tensor.tensor_type.value
        assert info.shape == tuple(reversed(tensor.shape.tolist()))
        assert info.offset == tensor.data_offset
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
        raw = np.asarray(next(t for t in reader.tensors if t.name == name).data)
        view = gguf.tensor(name)
        assert view.dtype == torch.uint8 and view.shape[0] == gguf.tensors[name].shape[0]
        assert np.array_equal(view.numpy(), raw.reshape(view.shape)), name
    norm = gguf.tensor("blk.0.attn_norm.weight")  # float32 as stored
    assert norm.dtype == torch.float32 and norm.shape == (1, 576)


@pytest.mark.parametrize(
    ("head", "says"),
    [
        (b"GGML" + bytes(20), "is not a GGUF file"),
        (b"GGUF" + bytes([0, 0, 0, 3]) + bytes(16), "version"),
    ],
)
def test_a_file_that_is_no_gguf_we_read_is_refused(head, says, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(head)
    with pytest.raises(ValueError, match=says):
        GgufFile(path)


def test_a_tensor_of_a_type_gguf_does_not_know_is_refused_by_name(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("w.weight", np.zeros((2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gguf = GgufFile(path)
    info = gguf.tensors["w.weight"]
    gguf.tensors["w.weight"] = type(info)(info.name, 99, info.shape, info.offset)
    with pytest.raises(UnsupportedTensorType, match="w.weight is type 99"):
        gguf.tensor("w.weight")
