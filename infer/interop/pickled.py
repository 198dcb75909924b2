"""The tables of a pickled TorchRec module (``torch.save(model)``) read as data, never run: each
``EmbeddingBagConfig`` (name, rows, dim, features, pooling) and a DLRM's dense input width.

Unpickling runs whatever the file names; here no name is ever imported. Every class or function the pickle
refers to becomes an inert record of its path, arguments and state, and tensors become their shapes (storages
are not read), so a file from anyone is safe to read and costs a pass over its object graph, not its weights.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

_CONFIG = "torchrec.modules.embedding_configs.EmbeddingBagConfig"
_COLLECTIONS = (
    "torchrec.modules.embedding_modules.EmbeddingBagCollection",
    "torchrec.quant.embedding_modules.EmbeddingBagCollection",
)
_DLRMS = ("torchrec.models.dlrm.DLRM", "torchrec.models.dlrm.DLRM_DCN", "torchrec.models.dlrm.DLRM_Projection")
_LINEAR = "torch.nn.modules.linear.Linear"
# a pickle nested deeper than this is not a model's module tree
_MAX_DEPTH = 400


class Record(dict[Any, Any]):  # a pickled dict subclass (OrderedDict) is filled by SETITEMS
    """One pickled object: ``path`` (its class or function), ``args`` (as constructed or called), ``state`` (its
    ``__dict__`` as pickled), and ``listed``, the items a list subclass was filled with (a dict subclass keeps
    its own)."""

    path: ClassVar[str] = ""
    args: tuple[Any, ...]
    state: Any
    listed: list[Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:
        record = dict.__new__(cls)
        record.args = args
        record.state = None
        record.listed = []
        return record

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, item: Any) -> None:
        self.listed.append(item)

    def extend(self, items: Any) -> None:
        self.listed.extend(items)

    def __call__(self, *args: Any, **kwargs: Any) -> Record:  # getattr(cls, name)(...) in a pickle
        return _record_type(f"{self.path}()")(*args)

    def attributes(self) -> dict[str, Any]:
        """The pickled ``__dict__`` (a ``(dict, slots)`` pair is merged)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2:
            merged = dict(state[0] or {})
            merged.update(state[1] or {})
            return merged
        return dict(state) if isinstance(state, dict) else {}


_TYPES: dict[str, type[Record]] = {}


def _record_type(path: str) -> type[Record]:
    if path not in _TYPES:
        _TYPES[path] = type("Record", (Record,), {"path": path})
    return _TYPES[path]


class _InertUnpickler(pickle.Unpickler):
    """An unpickler that imports nothing: every global is a ``Record`` type named by its path."""

    def find_class(self, module: str, name: str) -> Any:
        return _record_type(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> None:
        return None  # a tensor's storage: never read


@dataclass(frozen=True)
class PickledTable:
    """One ``EmbeddingBagConfig`` as the pickle holds it."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: str  # TorchRec's PoolingType name: SUM, MEAN, NONE


@dataclass(frozen=True)
class PickledModel:
    """What a pickled TorchRec module says about its tables: ``tables`` in the collection's order, the class of
    its root, and the dense input width of a DLRM (0 otherwise)."""

    root: str
    tables: tuple[PickledTable, ...]
    num_dense_features: int


def read_pickled_model(path: Path) -> PickledModel | None:
    """The tables of the pickled TorchRec module in ``path`` (a ``torch.save`` zip), or None when it holds none
    (not a zip, no ``data.pkl``, no ``EmbeddingBagConfig``). Nothing in the file is run."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if not names:
                return None
            data = archive.read(names[0])
        root = _InertUnpickler(io.BytesIO(data)).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError):
        return None
    collection = next((r for r in _records(root) if r.path in _COLLECTIONS), None)
    configs = collection.attributes().get("_embedding_bag_configs") if collection is not None else None
    if not isinstance(configs, list):
        configs = [r for r in _records(root) if r.path == _CONFIG]
    tables = tuple(_table(c) for c in configs if isinstance(c, Record) and c.path == _CONFIG)
    if not tables:
        return None
    return PickledModel(root.path if isinstance(root, Record) else type(root).__name__, tables, _dense_width(root))


def _table(config: Record) -> PickledTable:
    fields = config.attributes()
    pooling = fields.get("pooling")
    # an enum pickles as a call of its class with its value: PoolingType("MEAN"); TorchRec's default is SUM
    pooling_name = str(pooling.args[0]) if isinstance(pooling, Record) and pooling.args else "SUM"
    return PickledTable(
        str(fields.get("name")),
        int(fields.get("num_embeddings", 0)),
        int(fields.get("embedding_dim", 0)),
        tuple(str(f) for f in fields.get("feature_names", ()) or ()),
        pooling_name,
    )


def _dense_width(root: Any) -> int:
    """A DLRM's dense input width: ``in_features`` of the first Linear of its dense arch."""
    dlrm = next((r for r in _records(root) if r.path in _DLRMS), None)
    if dlrm is None:
        return 0
    dense_arch = (dlrm.attributes().get("_modules") or {}).get("dense_arch")
    linear = next((r for r in _records(dense_arch) if r.path == _LINEAR), None)
    return int(linear.attributes().get("in_features", 0)) if linear is not None else 0


def _records(value: Any) -> Iterator[Record]:
    """Every record reachable from ``value``, depth first in pickle order, each once."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if id(item) in seen or depth > _MAX_DEPTH:
            continue
        seen.add(id(item))
        children: list[Any] = []
        if isinstance(item, Record):
            yield item
            children = [*item.args, item.state, *item.listed, *item.values()]
        elif isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, (list, tuple)):
            children = list(item)
        stack.extend((child, depth + 1) for child in reversed(children))
