"""Loading what the user wants planned: a model, example inputs and a loss function.

A user's ``model.py`` defines ``model`` (an ``nn.Module`` or a zero-argument function returning
one), ``example_inputs`` (a tensor, a tuple of tensors, a dict of keyword arguments, or a
zero-argument function returning one of those) and optionally ``loss_fn(output, *inputs) ->
scalar tensor``. With keyword inputs (``{"input_ids": ..., "labels": ..., "attention_mask":
None}``) the model is called as ``model(**example_inputs)``; the tensors among them are the
program's inputs, in the dict's order, and the rest (``None`` placeholders, flags) are passed as
they are on every call. A model whose output has a ``loss`` needs no ``loss_fn``. Build big models under
``torch.device("meta")``: planning never needs the weights, and the program allocates and
initialises only each rank's shards (with ``init_weights(module)`` where the file defines it;
see :mod:`autoplan.codegen.materialize`). The training data, ``batches``, is read by
:mod:`autoplan.data`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from autoplan.errors import AutoplanError

__all__ = ["ModelSpec", "default_loss", "make_model_spec", "load_model_file", "import_file", "spec_from_file_module"]


@dataclass
class ModelSpec:
    """A model to plan: ``loss_fn(module(*example_inputs), *example_inputs)`` is the scalar
    whose gradient a training step follows."""

    module: torch.nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    loss_fn: Callable[..., torch.Tensor]
    name: str
    # keyword inputs: the names of ``example_inputs`` (the model is called with keywords) and
    # the keyword arguments that are not tensors, passed unchanged on every call
    input_names: tuple[str, ...] | None = None
    fixed_kwargs: dict[str, Any] = field(default_factory=dict)
    # ``init_weights(module)`` from the model file: initialises a meta-device model shard by
    # shard (see autoplan.codegen.materialize); None uses the model's own initialisation
    init_weights: Callable[[torch.nn.Module], Any] | None = None

    def call(self, module: Any, inputs: tuple[Any, ...]) -> Any:
        """``module`` (the user's model or a copy of it) called on ``inputs`` the way the user
        calls the model: positionally, or by keyword with the fixed keyword arguments."""
        if self.input_names is None:
            return module(*inputs)
        return module(**dict(zip(self.input_names, inputs)), **self.fixed_kwargs)

    def positional(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
        """A batch given like the example inputs (positionally, or as keywords) as the
        positional tuple the program takes; one-line errors for a name that is not an input."""
        if not kwargs:
            return tuple(args)
        names = self.input_names or ()
        unknown = [k for k in kwargs if k not in names and k not in self.fixed_kwargs]
        if unknown or args:
            what = f"unknown keyword {unknown[0]!r}" if unknown else "positional and keyword inputs mixed"
            raise AutoplanError(f"{what}: pass the batch as the example inputs were given "
                                f"({', '.join(names) or 'positionally'})")
        missing = [n for n in names if n not in kwargs]
        if missing:
            raise AutoplanError(f"the batch has no {missing[0]!r}: pass every tensor input ({', '.join(names)})")
        return tuple(kwargs[n] for n in names)

    def with_inputs(self, inputs: tuple[torch.Tensor, ...]) -> ModelSpec:
        """The same model and loss on other inputs of the same kind (a microbatch, a device)."""
        return replace(self, example_inputs=tuple(inputs))

    def to(self, device: str | torch.device) -> ModelSpec:
        """The model and its example inputs on ``device`` (the module is moved in place), so
        that a graph traced from it creates its own tensors there too."""
        if not any(t.is_meta for t in [*self.module.parameters(), *self.module.buffers()]):
            self.module.to(device)  # a meta model is allocated shard by shard where it runs
        return self.with_inputs(tuple(x.to(device) if isinstance(x, torch.Tensor) else x
                                      for x in self.example_inputs))


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):  # includes transformers' ModelOutput
        values = list(output.values())
    elif isinstance(output, (tuple, list)):
        values = list(output)
    else:
        return None
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def default_loss(output: Any, *inputs: torch.Tensor) -> torch.Tensor:
    """The loss used when the user gives none: ``output.loss`` when the output has one that is
    not None (a transformers ModelOutput computed with labels), else the mean of the output's
    first tensor (a tensor, tuple/list or dict), as float."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    tensor = _first_tensor(output)
    if tensor is None:
        raise AutoplanError(
            f"the model returned {type(output).__name__} with no tensor in it: "
            "return a tensor (or a tuple/dict of tensors), or define loss_fn(output, *inputs)"
        )
    return tensor.float().mean()


def _type_name(value: Any) -> str:
    return type(value).__name__


def _resolve_module(model: Any, where: str, label: str = "model") -> torch.nn.Module:
    if isinstance(model, torch.nn.Module):
        return model
    if callable(model):  # a builder function (or a class constructible without arguments)
        try:
            built = model()
        except AutoplanError:
            raise
        except Exception as e:  # the user's builder failed
            raise AutoplanError(
                f"{where}{label}() raised {_type_name(e)}: {_first_line(e)}"
            ) from e
        if isinstance(built, torch.nn.Module):
            return built
        raise AutoplanError(
            f"{where}{label}() must return an nn.Module, got {_type_name(built)}"
        )
    raise AutoplanError(
        f"{where}{label} must be an nn.Module or a function returning one, got {_type_name(model)}"
    )


def _as_input_tuple(value: Any, where: str, label: str = "example_inputs") -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)):
        if not value:
            raise AutoplanError(f"{where}{label} is empty: give at least one tensor")
        bad = [i for i, v in enumerate(value) if not isinstance(v, torch.Tensor)]
        if bad:
            raise AutoplanError(
                f"{where}{label} must be a tensor or a tuple of tensors, "
                f"but item {bad[0]} is {_type_name(value[bad[0]])} (for None placeholders or flags, give "
                f"a dict of keyword arguments)"
            )
        return tuple(value)
    raise AutoplanError(
        f"{where}{label} must be a tensor, a tuple of tensors or a dict of keyword arguments, "
        f"got {_type_name(value)}"
    )


def _unaliased(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The inputs with a tensor given twice (``input_ids=ids, labels=ids``) copied: export
    traces an aliased pair differently from two tensors, and a batch cut into microbatches
    (or passed again at run time) holds two."""
    seen: set[int] = set()
    out = []
    for x in inputs:
        out.append(x.clone() if id(x) in seen else x)
        seen.add(id(x))
    return tuple(out)


def _split_keywords(value: Mapping[Any, Any], where: str, label: str
                    ) -> tuple[tuple[torch.Tensor, ...], tuple[str, ...], dict[str, Any]]:
    """Keyword inputs as (tensors, their names, the other keyword arguments)."""
    bad = [k for k in value if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise AutoplanError(f"{where}{label} has the key {bad[0]!r}: keyword inputs need argument names as keys")
    nested = [k for k, v in value.items() if isinstance(v, (tuple, list, dict))
              and any(isinstance(x, torch.Tensor) for x in (v.values() if isinstance(v, dict) else v))]
    if nested:
        raise AutoplanError(f"{where}{label}[{nested[0]!r}] nests tensors in a container: give each tensor "
                            "its own keyword")
    tensors = {k: v for k, v in value.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise AutoplanError(f"{where}{label} holds no tensor: give at least one tensor input")
    fixed = {k: v for k, v in value.items() if k not in tensors}
    return tuple(tensors.values()), tuple(tensors), fixed


def _resolve_inputs(example_inputs: Any, where: str, label: str = "example_inputs") -> Any:
    if not isinstance(example_inputs, (torch.Tensor, tuple, list, Mapping)) and callable(example_inputs):
        try:
            example_inputs = example_inputs()
        except AutoplanError:
            raise
        except Exception as e:
            raise AutoplanError(
                f"{where}{label}() raised {_type_name(e)}: {_first_line(e)}"
            ) from e
    if isinstance(example_inputs, Mapping):
        return example_inputs
    return _as_input_tuple(example_inputs, where, label)


def make_model_spec(
    model: Any,
    example_inputs: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    name: str | None = None,
    *,
    _where: str = "",
    _labels: tuple[str, str, str] = ("model", "example_inputs", "loss_fn"),
) -> ModelSpec:
    """A ModelSpec from a module (or a zero-argument function building one), example inputs
    (a tensor, a tuple/list of tensors, a dict of keyword arguments, or a zero-argument
    function returning one of those)
    and an optional ``loss_fn(output, *inputs)`` (default: :func:`default_loss`). ``name``
    defaults to the module's class name, wherever the model comes from."""
    module = _resolve_module(model, _where, _labels[0])
    inputs = _resolve_inputs(example_inputs, _where, _labels[1])
    if loss_fn is None:
        loss_fn = default_loss
    elif not callable(loss_fn):
        raise AutoplanError(
            f"{_where}{_labels[2]} must be a function {_labels[2]}(output, *inputs) returning a scalar "
            f"tensor, got {_type_name(loss_fn)}"
        )
    names: tuple[str, ...] | None = None
    fixed: dict[str, Any] = {}
    if isinstance(inputs, Mapping):
        inputs, names, fixed = _split_keywords(inputs, _where, _labels[1])
    inputs = _unaliased(inputs)
    return ModelSpec(module=module, example_inputs=inputs, loss_fn=loss_fn, name=name or type(module).__name__,
                     input_names=names, fixed_kwargs=fixed)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0].strip() if text else ""
    if len(line) > 200:
        line = line[:197] + "..."
    return line or "(no message)"


def import_file(path: str) -> types.ModuleType:
    """Imports a Python file as a fresh module (its folder on sys.path while importing).
    Errors are one-line AutoplanErrors."""
    if not os.path.exists(path):
        raise AutoplanError(f"{path} not found: give the path of a Python file that defines model")
    if os.path.isdir(path):
        raise AutoplanError(f"{path} is a folder: give the path of a Python file that defines model")
    folder = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    mod_name = f"autoplan_user_{stem}_{abs(hash(os.path.abspath(path))):x}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise AutoplanError(f"{path} cannot be imported: give the path of a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)
    sys.modules[mod_name] = module  # dataclasses and pickling look the module up
    try:
        spec.loader.exec_module(module)
    except AutoplanError:
        sys.modules.pop(mod_name, None)
        raise
    except BaseException as e:
        sys.modules.pop(mod_name, None)
        if isinstance(e, KeyboardInterrupt):
            raise
        if isinstance(e, SyntaxError):
            where = f" (line {e.lineno})" if e.lineno else ""
            raise AutoplanError(
                f"{path} has a syntax error{where}: {e.msg}"
            ) from e
        raise AutoplanError(
            f"{path} raised {_type_name(e)} while loading: {_first_line(e)}"
        ) from e
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    return module


def load_model_file(
    path: str,
    model_name: str = "model",
    inputs_name: str = "example_inputs",
    loss_name: str = "loss_fn",
    require_loss: bool = False,
) -> ModelSpec:
    """Imports ``path`` and returns the ModelSpec of its ``model``, ``example_inputs`` and
    ``loss_fn`` (optional unless ``require_loss``: a loss the user named must exist). Every
    problem is a one-line AutoplanError."""
    return spec_from_file_module(import_file(path), path, model_name, inputs_name, loss_name, require_loss)


def spec_from_file_module(
    module: types.ModuleType,
    path: str,
    model_name: str = "model",
    inputs_name: str = "example_inputs",
    loss_name: str = "loss_fn",
    require_loss: bool = False,
) -> ModelSpec:
    """The ModelSpec of a model file already imported (:func:`import_file`) from ``path``;
    see :func:`load_model_file`."""
    if not hasattr(module, model_name):
        raise AutoplanError(
            f"{path} defines no {model_name!r}: define {model_name} = ... "
            "(an nn.Module or a function returning one), or pass --model NAME"
        )
    if not hasattr(module, inputs_name):
        raise AutoplanError(
            f"{path} defines no {inputs_name!r}: define {inputs_name} = ... "
            "(a tensor, a tuple of tensors, a dict of keyword arguments, or a function returning one), "
            "or pass --inputs NAME"
        )
    if require_loss and not hasattr(module, loss_name):
        raise AutoplanError(
            f"{path} defines no {loss_name!r}: define {loss_name}(output, *inputs), or leave out --loss "
            "to use the default loss (output.loss, else the mean of the first output)"
        )
    loss_fn = getattr(module, loss_name, None)
    if loss_fn is not None and not callable(loss_fn):
        raise AutoplanError(
            f"{path}: {loss_name} must be a function {loss_name}(output, *inputs) returning a scalar "
            f"tensor, got {_type_name(loss_fn)}"
        )
    init_weights = getattr(module, "init_weights", None)
    if init_weights is not None and not callable(init_weights):
        raise AutoplanError(f"{path}: init_weights must be a function init_weights(module), got "
                            f"{_type_name(init_weights)}")
    spec = make_model_spec(
        getattr(module, model_name),
        getattr(module, inputs_name),
        loss_fn,
        _where=f"{path}: ",
        _labels=(model_name, inputs_name, loss_name),
    )
    return replace(spec, init_weights=init_weights)
