"""Constructor configurations of modules passed as objects, so that a checkpoint can rebuild them.

The LightningCLI records the extractor and likelihood of a model it builds as
``{"class_path": ..., "init_args": {...}}``; a model built in Python receives objects, which
Lightning leaves out of the saved hyperparameters. :func:`module_config` recovers such a
configuration from the object itself — its ``config()`` method when it has one (the extractors of
this package), otherwise the attributes that carry its constructor's argument names (the milgp
likelihoods and ψ densities keep theirs) — and :func:`instantiate` builds an object back from it.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Mapping

import torch

__all__ = ["import_class", "instantiate", "module_config"]

_PLAIN = (bool, int, float, str, type(None))


def _value(value: Any, owner: str, name: str) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
        return list(value)
    if isinstance(value, (dict, list, tuple, torch.Tensor)):
        raise ValueError(f"{owner}: cannot record the value of argument {name!r} ({type(value).__name__})")
    return module_config(value)


def module_config(obj: Any) -> dict[str, Any]:
    """``{"class_path", "init_args"}`` that rebuilds ``obj`` with :func:`instantiate`.

    Raises:
        ValueError: naming the class and argument when a required argument cannot be read back.
    """
    cls = type(obj)
    class_path = f"{cls.__module__}.{cls.__qualname__}"
    if callable(getattr(obj, "config", None)):
        return {"class_path": class_path, "init_args": dict(obj.config())}
    init_args: dict[str, Any] = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if hasattr(obj, name):
            init_args[name] = _value(getattr(obj, name), class_path, name)
        elif param.default is inspect.Parameter.empty:
            raise ValueError(f"{class_path}: the required argument {name!r} is not readable from the object")
    return {"class_path": class_path, "init_args": init_args}


def import_class(class_path: str) -> Any:
    """The class a dotted ``class_path`` (``package.module.Name``) names, imported."""
    module_name, _, class_name = class_path.rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)


def instantiate(config: Mapping[str, Any]) -> Any:
    """Build an object from ``{"class_path", "init_args"}`` (nested configurations too)."""
    cls = import_class(str(config["class_path"]))
    args = {k: instantiate(v) if isinstance(v, Mapping) and "class_path" in v else v for k, v in dict(config.get("init_args") or {}).items()}
    return cls(**args)
