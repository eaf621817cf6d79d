"""Tuned kernel configurations as data, read through one lookup.

A kernel family keeps its tuned configs in one JSON file per device, kernels/configs/<kernel>/device=<name>.json
(configs/README.md says what each family's keys and configs are). A file maps a shape key, the family's key
fields in its order ("N=6144,K=4096,rows=16,dtype=bf16"), to a config. The sweeps in benchmarks/ write them
(write_configs); a kernel module registers its family's heuristic (@family) and asks lookup(), which answers
a device or shape that has no entry with that heuristic, never an error. Files are read once per process and
every answer is cached: lookups happen while a model is built and warmed up, and an eager step's repeat of
one is a dictionary hit. Answers are read-only mappings, so no caller can change a cached one.

No Triton here: layers/ reads tables without importing the kernels.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Sequence

import torch

CONFIG_DIR = Path(__file__).with_name("configs")


@dataclass(frozen=True)
class Device:
    """What the heuristics may ask of a device: its table name and the properties they size tiles by."""
    name: str                          # device_name()'s form of the name torch reports
    sms: int                           # multiprocessors
    smem: int = 0                      # opt-in shared memory per block in bytes (0: no CUDA device)
    capability: tuple[int, int] = (0, 0)

    @property
    def fp8_dot(self) -> bool:
        """FP8 x FP8 tensor-core products: Ada (sm_89) and later."""
        return tuple(self.capability) >= (8, 9)


# Triton's interpreter: grids sized for a few multiprocessors, so CPU tests stay small.
CPU = Device("cpu", sms=8)


def device_name(name: str) -> str:
    """A device name as the tables' file names spell it: each run of characters other than letters, digits,
    '.' and '-' made one '_' ("NVIDIA H100 80GB HBM3" -> "NVIDIA_H100_80GB_HBM3")."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_")


@lru_cache(maxsize=None)
def device_spec(device: torch.device) -> Device:
    """The Device of a torch device (CPU for anything but CUDA)."""
    if device.type != "cuda":
        return CPU
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    import triton        # the opt-in limit Triton checks a launch against
    smem = int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    return Device(device_name(props.name), props.multi_processor_count, smem, (props.major, props.minor))


_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}


def dtype_key(dtype: torch.dtype) -> str:
    """A dtype as table keys spell it: "bf16", "fp16", "fp32", "fp8" (e4m3)."""
    return _DTYPE_KEYS.get(dtype, str(dtype).removeprefix("torch."))


def key_dtype(key: str) -> torch.dtype:
    return next(dtype for dtype, name in _DTYPE_KEYS.items() if name == key)


def scale_key(block: Sequence[int] | None) -> str:
    """An FP8 weight's scales: "channel" (one per output row) or "<bn>x<bk>" (one per block)."""
    return "channel" if block is None else f"{block[0]}x{block[1]}"


@dataclass(frozen=True)
class Family:
    keys: tuple[str, ...]
    heuristic: Callable[..., Mapping | None]     # (device, **shape) -> config, or None: the kernel does not run


_FAMILIES: dict[str, Family] = {}
_CACHES: list = []


def family(kernel: str, keys: Sequence[str]):
    """Decorator: register heuristic(device, **shape) as `kernel`'s answer for shapes no table names, the
    shape given by `keys` (the order of a table's shape keys)."""
    def register(heuristic):
        _FAMILIES[kernel] = Family(tuple(keys), heuristic)
        return heuristic
    return register


def cached(fn):
    """functools.lru_cache that clear_cache() also clears: for a kernel module's answers built on lookup."""
    fn = lru_cache(maxsize=None)(fn)
    _CACHES.append(fn)
    return fn


def clear_cache() -> None:
    """Forget every table read and answer given (after CONFIG_DIR or a table file changed)."""
    for fn in _CACHES:
        fn.cache_clear()


def lookup(kernel: str, device: Device, **shape) -> Mapping | None:
    """`kernel`'s tuned config for this shape on this device, else its heuristic's (None: the heuristic says
    the kernel does not run there)."""
    return _lookup(kernel, device, tuple(sorted(shape.items())))


def tuned(kernel: str, device: Device, **shape) -> Mapping | None:
    """The table's entry only: None where nothing was tuned for this shape on this device."""
    return _tuned(kernel, device.name, tuple(sorted(shape.items())))


@cached
def _lookup(kernel: str, device: Device, shape: tuple) -> Mapping | None:
    if kernel not in _FAMILIES:
        raise KeyError(f"tuned: no kernel family {kernel!r} (its module registers it: import it first)")
    entry = _tuned(kernel, device.name, shape)
    return entry if entry is not None else _freeze(_FAMILIES[kernel].heuristic(device, **dict(shape)))


@cached
def _tuned(kernel: str, name: str, shape: tuple) -> Mapping | None:
    table = _table(kernel, name)
    keys = _keys(kernel, table)
    return table["configs"].get(shape_key(keys, dict(shape)))


def _keys(kernel: str, table: Mapping | None) -> tuple[str, ...]:
    registered = _FAMILIES.get(kernel)
    if table is not None and registered is not None and tuple(table["keys"]) != registered.keys:
        raise ValueError(f"tuned: the {kernel} tables are keyed by {table['keys']}, the kernel by {registered.keys}")
    if registered is None and table is None:
        raise KeyError(f"tuned: no kernel family {kernel!r} (its module registers it: import it first)")
    return registered.keys if registered is not None else tuple(table["keys"])


def shape_key(keys: Sequence[str], shape: Mapping) -> str:
    if set(shape) != set(keys):
        raise KeyError(f"tuned: a shape of {sorted(shape)}, the table is keyed by {list(keys)}")
    return ",".join(f"{k}={shape[k]}" for k in keys)


def config_path(kernel: str, name: str, directory: Path | None = None) -> Path:
    return Path(directory or CONFIG_DIR) / kernel / f"device={device_name(name)}.json"


@cached
def _table(kernel: str, name: str) -> Mapping:
    path = config_path(kernel, name)
    if not path.is_file():
        return MappingProxyType({"keys": _keys(kernel, None), "configs": MappingProxyType({})})
    return _freeze(json.loads(path.read_text()))


def _freeze(value):
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def write_configs(kernel: str, device: str, entries: Iterable[tuple[Mapping, Mapping | None]], source: str,
                  directory: Path | None = None, keys: Sequence[str] | None = None) -> Path:
    """Merge (shape, config) entries into `kernel`'s table for `device` (its name as torch reports it,
    spelled as lookup spells it) under `directory` (default CONFIG_DIR): a config replaces the shape's entry,
    None removes it. `source` (the result file or command that measured them) joins the file's sources. keys:
    the table's shape fields, where the kernel's module is not imported. The file is rewritten sorted, one
    entry a line. Returns its path."""
    path = config_path(kernel, device, directory)
    old = json.loads(path.read_text()) if path.is_file() else {}
    keys = tuple(keys or old.get("keys") or _FAMILIES[kernel].keys)
    if old and tuple(old["keys"]) != keys:
        raise ValueError(f"write_configs: {path} is keyed by {old['keys']}, not {list(keys)}")
    configs = dict(old.get("configs", {}))
    for shape, config in entries:
        key = shape_key(keys, shape)
        if config is None:
            configs.pop(key, None)
        else:
            configs[key] = _thaw(config)
    sources = list(old.get("sources", []))
    if source not in sources:
        sources.append(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"  {json.dumps(key)}: {json.dumps(configs[key])}" for key in sorted(configs, key=_key_order)]
    head = {"kernel": kernel, "device": device_name(device), "keys": list(keys), "sources": sources}
    text = "{\n" + "".join(f"  {json.dumps(k)}: {json.dumps(v)},\n" for k, v in head.items())
    path.write_text(text + '  "configs": {\n' + ",\n".join("  " + line for line in lines) + "\n  }\n}\n")
    clear_cache()
    return path


def _thaw(value):
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def _key_order(key: str) -> tuple:
    """Shape keys sorted field by field, numbers as numbers."""
    return tuple((0, int(v), "") if v.lstrip("-").isdigit() else (1, 0, v)
                 for v in (part.split("=", 1)[1] for part in key.split(",")))
