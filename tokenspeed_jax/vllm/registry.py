"""Backend registries in the style of vLLM's ``AttentionBackendEnum`` / ``MLAPrefillBackendEnum``.

* :class:`AttentionBackendEnum` maps a backend name to a class path (``TOKENSPEED_MLA`` and a ``CUSTOM``
  placeholder); :func:`register_backend` overrides a member's class (decorator or direct path).
* :class:`MLAPrefillBackendEnum` does the same for MLA prefill backends; :func:`register_mla_prefill_backend`
  also accepts a new name (creating a member, as vLLM does).
* Per-compute-capability priorities (:func:`get_backend_priorities`, :func:`set_backend_priorities`) and
  the selectors :func:`get_attn_backend` / :func:`get_mla_prefill_backend`: an explicitly requested
  backend is validated and its reasons raised; otherwise the first valid backend in priority order wins,
  and if none is valid a ``ValueError`` lists every backend's reasons.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from typing import Any


def resolve_obj_by_qualname(qualname: str) -> Any:
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


class _EnumMeta(enum.EnumMeta):
    def __getitem__(cls, name: str):
        try:
            return super().__getitem__(name)
        except KeyError:
            raise ValueError(f"Unknown {cls._what()}: {name!r}. Valid options are: "
                             f"{', '.join(cls.__members__)}") from None


class _PathEnum(enum.Enum, metaclass=_EnumMeta):

    def get_path(self) -> str:
        path = self._overrides().get(self, self.value)
        if not path:
            raise ValueError(f"Backend {self.name} must be registered before use: "
                             f"{self._register_name()}({type(self).__name__}.{self.name}, 'module.Class')")
        return path

    def get_class(self) -> type:
        return resolve_obj_by_qualname(self.get_path())

    def is_overridden(self) -> bool:
        return self in self._overrides()

    def clear_override(self) -> None:
        self._overrides().pop(self, None)


class AttentionBackendEnum(_PathEnum):
    """Attention backends of the adapter (the value is the default class path)."""

    TOKENSPEED_MLA = "tokenspeed_jax.vllm.backend.TokenspeedMLABackend"
    CUSTOM = None

    @staticmethod
    def _overrides():
        return _ATTN_OVERRIDES

    @staticmethod
    def _register_name():
        return "register_backend"

    @staticmethod
    def _what():
        return "attention backend"




class MLAPrefillBackendEnum(_PathEnum):
    """MLA prefill backends of the adapter."""

    TOKENSPEED_MLA = "tokenspeed_jax.vllm.backend.TokenspeedMLAPrefillBackend"
    CUSTOM = None

    @staticmethod
    def _overrides():
        return _PREFILL_OVERRIDES

    @staticmethod
    def _register_name():
        return "register_mla_prefill_backend"

    @staticmethod
    def _what():
        return "MLA prefill backend"

    @classmethod
    def register(cls, name: str, value: str) -> MLAPrefillBackendEnum:
        """Add a new member (vLLM's dynamic registration of a custom prefill backend)."""
        if name in cls._member_map_:
            raise ValueError(f"MLA prefill backend {name} already exists; use register_mla_prefill_backend("
                             f"MLAPrefillBackendEnum.{name}, ...) to override it")
        if not name.isidentifier() or hasattr(cls, name):
            raise ValueError(f"name: invalid or reserved backend name {name!r}")
        member = object.__new__(cls)
        member._name_ = name
        member._value_ = value
        setattr(cls, name, member)
        cls._member_map_[name] = member
        cls._value2member_map_[value] = member
        cls._member_names_.append(name)
        return member



_ATTN_OVERRIDES: dict[AttentionBackendEnum, str] = {}
_PREFILL_OVERRIDES: dict[MLAPrefillBackendEnum, str] = {}


def _registrar(table: dict, backend, class_path: str | None) -> Callable[[type], type]:
    if class_path is not None:
        table[backend] = class_path
        return lambda cls: cls

    def decorator(cls: type) -> type:
        table[backend] = f"{cls.__module__}.{cls.__qualname__}"
        return cls

    return decorator


def register_backend(backend: AttentionBackendEnum, class_path: str | None = None) -> Callable[[type], type]:
    """Override ``backend``'s class: ``register_backend(AttentionBackendEnum.CUSTOM, "pkg.Cls")`` or as a
    class decorator."""
    if not isinstance(backend, AttentionBackendEnum):
        raise TypeError(f"backend: expected an AttentionBackendEnum member, got {backend!r}")
    return _registrar(_ATTN_OVERRIDES, backend, class_path)


def register_mla_prefill_backend(backend: MLAPrefillBackendEnum | str,
                                 class_path: str | None = None) -> Callable[[type], type]:
    """Override an MLA prefill backend, or register a new one by name (string)."""
    if isinstance(backend, str):
        backend = MLAPrefillBackendEnum.register(backend, class_path or "")
    elif not isinstance(backend, MLAPrefillBackendEnum):
        raise TypeError(f"backend: expected an MLAPrefillBackendEnum member or a name, got {backend!r}")
    return _registrar(_PREFILL_OVERRIDES, backend, class_path)


# ------------------------------------------------------------------------------------------ priorities
# Keys: compute-capability major (9 Hopper, 10 Blackwell, ...) or None for non-CUDA platforms.
_ATTN_PRIORITIES: dict[int | None, list[AttentionBackendEnum]] = {
    None: [AttentionBackendEnum.TOKENSPEED_MLA],
    9: [AttentionBackendEnum.TOKENSPEED_MLA],
    10: [AttentionBackendEnum.TOKENSPEED_MLA],
}
_PREFILL_PRIORITIES: dict[int | None, list[MLAPrefillBackendEnum]] = {
    None: [MLAPrefillBackendEnum.TOKENSPEED_MLA],
    9: [MLAPrefillBackendEnum.TOKENSPEED_MLA],
    10: [MLAPrefillBackendEnum.TOKENSPEED_MLA],
}


def _major(device_capability) -> int | None:
    return None if device_capability is None else int(device_capability[0])


def get_backend_priorities(device_capability, *, prefill: bool = False) -> list:
    """Backends to try for this capability, most preferred first (empty when none is listed)."""
    table = _PREFILL_PRIORITIES if prefill else _ATTN_PRIORITIES
    return list(table.get(_major(device_capability), []))


def set_backend_priorities(major: int | None, backends: list, *, prefill: bool = False) -> None:
    """Set the priority list of a capability major (None: non-CUDA platforms)."""
    enum_cls = MLAPrefillBackendEnum if prefill else AttentionBackendEnum
    for b in backends:
        if not isinstance(b, enum_cls):
            raise TypeError(f"backends: expected {enum_cls.__name__} members, got {b!r}")
    (_PREFILL_PRIORITIES if prefill else _ATTN_PRIORITIES)[major] = list(backends)


def get_attn_backend(head_size: int, dtype, kv_cache_dtype: str | None, block_size: int | None, *,
                     use_mla: bool = True, has_sink: bool = False, use_sparse: bool = False,
                     device_capability=None, backend: AttentionBackendEnum | str | None = None,
                     **config: Any) -> type:
    """Select the attention backend class (``config`` goes to ``validate_configuration``, e.g.
    ``model_config=``)."""

    def reasons_of(member):
        try:
            cls = member.get_class()
        except (ImportError, AttributeError, ValueError) as e:
            return None, [f"{type(e).__name__}: {e}"]
        return cls, cls.validate_configuration(head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                                               use_sparse, device_capability, **config)

    return _select(backend, AttentionBackendEnum, get_backend_priorities(device_capability), reasons_of,
                   "attention backend")


def get_mla_prefill_backend(dtype, *, device_capability=None, backend: MLAPrefillBackendEnum | str | None = None,
                            **config: Any) -> type:
    """Select the MLA prefill backend class."""

    def reasons_of(member):
        try:
            cls = member.get_class()
        except (ImportError, AttributeError, ValueError) as e:
            return None, [f"{type(e).__name__}: {e}"]
        return cls, cls.validate_configuration(device_capability, dtype, **config)

    return _select(backend, MLAPrefillBackendEnum, get_backend_priorities(device_capability, prefill=True),
                   reasons_of, "MLA prefill backend")


def _select(backend, enum_cls, priorities, reasons_of, what: str) -> type:
    if backend is not None:
        member = enum_cls[backend] if isinstance(backend, str) else backend
        cls, reasons = reasons_of(member)
        if reasons:
            raise ValueError(f"Selected {what} {member.name} is not valid for this configuration. "
                             f"Reasons: {reasons}")
        return cls
    every: dict[str, list[str]] = {}
    for member in priorities:
        cls, reasons = reasons_of(member)
        if not reasons:
            return cls
        every[member.name] = reasons
    raise ValueError(f"No valid {what} found. Reasons: {every if every else 'no backend listed for this device'}")
