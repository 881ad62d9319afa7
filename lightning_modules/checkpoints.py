"""Reading checkpoints: one-line errors, state dicts checked before loading, another model's extractor.

Every checkpoint of a milgp module carries its class and input preprocessing (``checkpoint["milgp"]``)
and the configuration of its extractor and likelihood, so the checkpoint alone rebuilds the model
(:func:`load_module`; docs/lightning.md, "Checkpoints a model can be rebuilt from").
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from lightning_modules.input_error import InputError
from lightning_modules.module_config import import_class, instantiate

__all__ = ["CHECKPOINT_KEY", "check_checkpoint_model", "check_state", "extractor_from_checkpoint", "load_module", "read_checkpoint"]

CHECKPOINT_KEY = "milgp"


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint's contents (``torch.load(weights_only=True)``, memory-mapped, on the CPU)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such checkpoint file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # any unpickling or format failure: the file is not a checkpoint we can read
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"{path}: not a readable PyTorch checkpoint ({reason})") from err


def check_state(module: nn.Module, state: Mapping[str, torch.Tensor], what: str, source: str) -> None:
    """Raise a one-line :class:`InputError` when ``state`` does not fit ``module`` (other tensor
    shapes, missing or extra entries) instead of PyTorch's list of every mismatch. Submodules whose
    state is sized by what they hold (``resizes_on_load``, e.g. the per-bag locals) may differ in
    shape; entries a submodule lists in ``optional_state`` (added after checkpoints were written,
    filled with a default by its own ``_load_from_state_dict``) may be missing."""
    own = module.state_dict()
    resizable = tuple(f"{name}." for name, m in module.named_modules() if name and getattr(m, "resizes_on_load", False))
    optional = {f"{name}.{k}" if name else k for name, m in module.named_modules() for k in getattr(m, "optional_state", ())}
    differ = [
        k for k, v in own.items()
        if k in state and isinstance(v, torch.Tensor) and not k.startswith(resizable) and tuple(state[k].shape) != tuple(v.shape)
    ]
    if differ:
        key = differ[0]
        raise InputError(
            f"{source}: {what} does not match: {key} is {tuple(state[key].shape)} there and {tuple(own[key].shape)} here "
            f"({len(differ)} tensors differ); build the model from the checkpoint alone (load_from_checkpoint(path)) "
            "or with the architecture it was trained with"
        )
    missing = [k for k in own if k not in state and k not in optional]
    extra = [k for k in state if k not in own]
    if missing or extra:
        first = f"{missing[0]!r} is missing there" if missing else f"{extra[0]!r} is not in this model"
        raise InputError(f"{source}: {what} does not match: {first} ({len(missing)} missing, {len(extra)} unexpected entries)")


def extractor_from_checkpoint(path: str | os.PathLike[str], extractor: nn.Module | None = None) -> tuple[nn.Module, dict | None]:
    """The per-slice extractor of a model checkpoint (keys ``extractor.*``) or of a plain state dict.

    Args:
        path: the checkpoint (e.g. an AttCNN's ``best.ckpt``).
        extractor: the architecture to load into; ``None`` builds the one the checkpoint records.

    Returns:
        ``(extractor with the checkpoint's weights, the checkpoint's input preprocessing or None)``.
    """
    ckpt = read_checkpoint(path)
    state = ckpt.get("state_dict", ckpt)
    sub = {k[len("extractor."):]: v for k, v in state.items() if k.startswith("extractor.")} or dict(state)
    if extractor is None:
        config = (ckpt.get("hyper_parameters") or {}).get("extractor")
        if not (isinstance(config, Mapping) and "class_path" in config and "repr" not in config):
            raise InputError(f"{path}: the checkpoint does not record its extractor's configuration; give the extractor it was trained with")
        extractor = instantiate(config)
    check_state(extractor, sub, "the extractor", str(path))
    extractor.load_state_dict(sub)
    return extractor, (ckpt.get(CHECKPOINT_KEY) or {}).get("preprocessing")


def _class_of(class_path: str) -> Any:
    """The class a ``class_path`` names (the path itself when it does not import)."""
    try:
        return import_class(class_path)
    except (ImportError, AttributeError, ValueError):
        return class_path


def check_checkpoint_model(path: str | os.PathLike[str], class_path: str, mode: str | None) -> None:
    """Refuse a checkpoint of another model than the config's: another class, or a GP head of the
    other ``mode`` (the CLI would otherwise build the checkpoint's model in its place without a word,
    and report or resume it under the config's name). A checkpoint that records no milgp module
    passes (Lightning then loads it as it does any)."""
    ckpt = read_checkpoint(path)
    recorded = (ckpt.get(CHECKPOINT_KEY) or {}).get("module")
    if not recorded:
        return
    recorded_mode = (ckpt.get("hyper_parameters") or {}).get("mode")
    if _class_of(recorded) is not _class_of(class_path):
        theirs, ours = recorded.rpartition(".")[2], class_path.rpartition(".")[2]
    elif mode is not None and recorded_mode is not None and mode != recorded_mode:
        theirs, ours = f"{recorded.rpartition('.')[2]} (mode {recorded_mode})", f"{class_path.rpartition('.')[2]} (mode {mode})"
    else:
        return
    raise InputError(f"--ckpt_path {path}: the checkpoint's model is {theirs}, the config's is {ours}; "
                     "give the config the checkpoint was trained with (or a checkpoint of this model)")


def load_module(path: str | os.PathLike[str], map_location: str = "cpu") -> Any:
    """Rebuild the milgp Lightning module saved in ``path`` from the checkpoint alone."""
    ckpt = read_checkpoint(path)
    class_path = (ckpt.get(CHECKPOINT_KEY) or {}).get("module")
    if not class_path:
        raise InputError(f"{path}: not a checkpoint of a milgp module (no {CHECKPOINT_KEY!r} entry)")
    return import_class(class_path).load_from_checkpoint(str(path), map_location=map_location)
