"""Reading and writing .safetensors files with torch and numpy alone.

Debian 12 has no `safetensors` package, so the EAGLE oracle and the head trainer carry this small
reader/writer. The format: an 8-byte little-endian header length, a JSON header mapping each tensor
name to {dtype, shape, data_offsets} (plus an optional "__metadata__" of strings), then the raw
little-endian bytes. The header is padded with spaces to a multiple of 8 bytes, as the reference
implementation does, so the data starts aligned.
"""

import json
import os
import struct

import numpy as np
import torch

# safetensors dtype name -> (torch dtype, numpy dtype used to move the raw bytes)
_DTYPES = {
    "F64": (torch.float64, np.float64),
    "F32": (torch.float32, np.float32),
    "F16": (torch.float16, np.float16),
    "BF16": (torch.bfloat16, np.int16),
    "I64": (torch.int64, np.int64),
    "I32": (torch.int32, np.int32),
    "I16": (torch.int16, np.int16),
    "U8": (torch.uint8, np.uint8),
    "BOOL": (torch.bool, np.bool_),
}
_NAMES = {t: name for name, (t, _) in _DTYPES.items()}


def load(path):
    """All tensors of one file, as CPU tensors (name -> tensor)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = entry["dtype"]
        if dtype not in _DTYPES:
            raise ValueError(f"{path}: tensor {name}: dtype {dtype} is not supported")
        tdtype, ndtype = _DTYPES[dtype]
        begin, end = entry["data_offsets"]
        arr = np.frombuffer(data[base + begin:base + end], dtype=ndtype).copy()
        t = torch.from_numpy(arr)
        if tdtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        out[name] = t.reshape(entry["shape"])
    return out


def load_folder(folder):
    """Every *.safetensors file of a model folder, merged (sharded checkpoints included)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load(os.path.join(folder, name)))
    if not out:
        raise FileNotFoundError(f"{folder}: no .safetensors file")
    return out


def save(path, tensors, metadata=None):
    """Writes name -> tensor (any of the dtypes above) in name order."""
    header = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in _NAMES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} cannot be written")
        if t.dtype == torch.bfloat16:
            raw = t.view(torch.int16).numpy().tobytes()
        else:
            raw = t.numpy().tobytes()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
