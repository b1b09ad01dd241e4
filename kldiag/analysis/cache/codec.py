"""Derived results as bytes and back, exactly: the result store's encoding (store.py).

A result (a Diagnosis, a view's frames) is a tree of Python values. `encode` turns it into a JSON
tree plus named numpy arrays for reduce.save_arrays's layout; `decode` rebuilds an equal tree.
JSON keeps what pickle would lose nothing of here, without running code from a file another user
may have written: only kldiag's own dataclasses are rebuilt (by field, no __init__ or __post_init__
run), and a value of any other type makes the result uncacheable (`Uncacheable`: computed each
time, never wrong).

Encoded exactly: None, bool, int, float (NaN and +-inf included: JSON's NaN/Infinity, float repr
round-trips), str, list, tuple, dict (any encodable keys, in order), set, frozenset, numpy scalars
and arrays of a non-object dtype, pandas DataFrames (numeric, bool, datetime and object columns of
encodable values; a RangeIndex or an array index), pyarrow Tables (Arrow IPC bytes, schema and
metadata kept), pathlib paths and kldiag dataclasses.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path, PurePath
from typing import Any

import numpy as np

TREE = "tree"  # the JSON tree's array name (uint8 bytes); the others are "a<i>"


class Uncacheable(TypeError):
    """A value the codec does not encode exactly: the result is recomputed instead of stored."""


def encode(value: Any) -> dict[str, np.ndarray]:
    """The arrays of save_arrays's layout holding `value`; raises Uncacheable."""
    arrays: dict[str, np.ndarray] = {}
    tree = json.dumps(_enc(value, arrays), separators=(",", ":"))
    arrays[TREE] = np.frombuffer(tree.encode(), np.uint8)
    return arrays


def decode(arrays: dict[str, np.ndarray]) -> Any:
    """The value `encode` was given; raises ValueError/KeyError/TypeError on a file that is not one.
    Tagged objects are rebuilt by json's object_hook, innermost first, as the parser meets them."""
    return json.loads(bytes(arrays[TREE]).decode(), object_hook=lambda d: _dec(d, arrays))


def _array(v: np.ndarray, arrays: dict[str, np.ndarray]) -> dict:
    if v.dtype.hasobject:
        return {"__ao": [_enc(x, arrays) for x in v.ravel().tolist()], "shape": list(v.shape)}
    name = f"a{len(arrays)}"
    arrays[name] = v
    return {"__a": name}


def _enc(v: Any, arrays: dict[str, np.ndarray]) -> Any:
    if v is None or isinstance(v, (bool, str)) or type(v) in (int, float):
        return v
    if isinstance(v, list) and type(v) is list:
        return [_enc(x, arrays) for x in v]
    if type(v) in (tuple, set, frozenset):
        items = sorted(v, key=repr) if type(v) is not tuple else v
        return {f"__{type(v).__name__}": [_enc(x, arrays) for x in items]}
    if type(v) is dict:
        if all(type(k) is str and not k.startswith("__") for k in v):  # a JSON object as it is
            return {k: _enc(x, arrays) for k, x in v.items()}
        return {"__d": [[_enc(k, arrays), _enc(x, arrays)] for k, x in v.items()]}
    if isinstance(v, np.generic) and not v.dtype.hasobject:
        return {"__np": v.dtype.str, "v": v.item() if v.dtype.kind not in "mMV" else str(v.view(np.int64))}
    if isinstance(v, np.ndarray):
        return _array(v, arrays)
    if isinstance(v, PurePath):
        return {"__path": str(v)}
    if dataclasses.is_dataclass(v) and not isinstance(v, type) and type(v).__module__.startswith("kldiag."):
        cls = type(v)
        return {"__dc": f"{cls.__module__}:{cls.__qualname__}",
                "f": _enc({f.name: getattr(v, f.name) for f in dataclasses.fields(v)}, arrays)}
    mod = type(v).__module__.split(".")[0]
    if mod == "pandas":
        return _frame(v, arrays)
    if mod == "pyarrow":
        return _table(v, arrays)
    raise Uncacheable(f"{type(v).__module__}.{type(v).__qualname__}")


def _frame(v: Any, arrays: dict[str, np.ndarray]) -> dict:
    import pandas as pd

    if type(v) is not pd.DataFrame or v.columns.nlevels != 1 or v.attrs:
        raise Uncacheable(type(v).__qualname__)
    cols = []
    for name in v.columns:
        col = v.iloc[:, len(cols)]
        if isinstance(col.dtype, pd.StringDtype):  # pandas 3's default for strings
            na = col.dtype.na_value
            cols.append([_enc(name, arrays), {"__str": [None if x is None else str(x)
                                                         for x in col.to_numpy(dtype=object, na_value=None)],
                                               "storage": col.dtype.storage, "nan": na is not pd.NA}])
            continue
        if not isinstance(col.dtype, np.dtype):  # another extension dtype (category, nullable Int64, ...)
            raise Uncacheable(f"DataFrame column of dtype {col.dtype}")
        cols.append([_enc(name, arrays), _array(col.to_numpy(), arrays)])
    idx = v.index
    if type(idx) is pd.RangeIndex and idx.name is None:
        index = {"range": [idx.start, idx.stop, idx.step]}
    elif isinstance(idx.dtype, np.dtype) and idx.nlevels == 1:
        index = {"values": _array(idx.to_numpy(), arrays), "name": _enc(idx.name, arrays)}
    else:
        raise Uncacheable(f"DataFrame index {type(idx).__qualname__}")
    return {"__df": cols, "index": index}


def _table(v: Any, arrays: dict[str, np.ndarray]) -> dict:
    import pyarrow as pa

    if not isinstance(v, pa.Table):
        raise Uncacheable(type(v).__qualname__)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, v.schema) as w:
        w.write_table(v)
    return {"__pa": _array(np.frombuffer(sink.getvalue(), np.uint8), arrays)}


def _dec(t: dict, arrays: dict[str, np.ndarray]) -> Any:
    """One JSON object, its members already decoded: a plain dict, or the value its tag stands for."""
    tag = next(iter(t), "")
    if not tag.startswith("__"):
        return t
    body = t[tag]
    if tag == "__d":
        return {k: x for k, x in body}
    if tag in ("__tuple", "__set", "__frozenset"):
        return {"__tuple": tuple, "__set": set, "__frozenset": frozenset}[tag](body)
    if tag == "__np":
        dt = np.dtype(body)
        return np.array(t["v"], dt)[()] if dt.kind not in "mM" else np.int64(t["v"]).view(dt)
    if tag == "__a":
        return np.array(arrays[body])  # a copy: the file's buffer is read-only
    if tag == "__ao":
        out = np.empty(len(body), object)
        out[:] = body
        return out.reshape(t["shape"])
    if tag == "__str":
        import pandas as pd

        dtype = pd.StringDtype(storage=t["storage"], na_value=np.nan if t["nan"] else pd.NA)
        return pd.array(body, dtype=dtype)
    if tag == "__path":
        return Path(body)
    if tag == "__dc":
        return _dataclass(body, t["f"])
    if tag == "__df":
        return _dec_frame(body, t["index"])
    if tag == "__pa":
        import pyarrow as pa

        return pa.ipc.open_stream(pa.py_buffer(body.tobytes())).read_all()
    raise ValueError(f"unknown tag {tag!r}")


def _dataclass(name: str, fields: dict) -> Any:
    module, _, qual = name.partition(":")
    if not module.startswith("kldiag."):  # never import a module a file names, but our own
        raise ValueError(f"not a kldiag class: {name}")
    cls: Any = importlib.import_module(module)
    for attr in qual.split("."):
        cls = getattr(cls, attr)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"not a dataclass: {name}")
    if {f.name for f in dataclasses.fields(cls)} != set(fields):
        raise ValueError(f"{name}'s fields changed")
    obj = object.__new__(cls)  # by field, as dataclasses.replace would not run __post_init__ twice
    for key, value in fields.items():
        object.__setattr__(obj, key, value)
    return obj


def _dec_frame(cols: list, index: dict) -> Any:
    import pandas as pd

    idx = pd.RangeIndex(*index["range"]) if "range" in index else pd.Index(index["values"], name=index["name"])
    names = [name for name, _ in cols]
    if len(set(map(repr, names))) != len(names):
        raise ValueError("duplicate column names")
    data = {name: col for name, col in cols}
    return pd.DataFrame(data, index=idx, columns=pd.Index(names) if names else None)
