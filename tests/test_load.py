"""Loading a user's model.py: what it must define, and one-line errors for everything else."""

from __future__ import annotations

import os
import sys
import textwrap
from collections import OrderedDict

import pytest
import torch

from autoplan.errors import AutoplanError
from autoplan.load import (
    ModelSpec,
    default_loss,
    import_file,
    load_model_file,
    make_model_spec,
)

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def write(tmp_path, body: str, name: str = "model.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def load_error(path: str, **kwargs) -> str:
    with pytest.raises(AutoplanError) as info:
        load_model_file(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message, f"error is not one line: {message!r}"
    assert message.strip() == message and message
    return message


GOOD = """
import torch
model = torch.nn.Linear(4, 3)
example_inputs = (torch.randn(2, 4),)
"""


# --------------------------------------------------------------------------------- happy paths


def test_load_module_and_tuple(tmp_path):
    spec = load_model_file(write(tmp_path, GOOD))
    assert isinstance(spec, ModelSpec)
    assert isinstance(spec.module, torch.nn.Linear)
    assert isinstance(spec.example_inputs, tuple) and len(spec.example_inputs) == 1
    assert spec.example_inputs[0].shape == (2, 4)
    assert spec.loss_fn is default_loss
    assert spec.name == "Linear"  # the module's class name, from a file or from Python alike


def test_load_builders_single_tensor_list_and_loss(tmp_path):
    path = write(
        tmp_path,
        """
        import torch
        def model():
            return torch.nn.Linear(4, 3)
        def example_inputs():
            return [torch.randn(2, 4)]
        def loss_fn(out, x):
            return out.sum()
        """,
        name="builders.py",
    )
    spec = load_model_file(path)
    assert isinstance(spec.module, torch.nn.Linear)
    assert isinstance(spec.example_inputs, tuple)
    assert spec.loss_fn.__name__ == "loss_fn"
    assert spec.name == "Linear"

    single = load_model_file(
        write(tmp_path, "import torch\nmodel = torch.nn.ReLU()\nexample_inputs = torch.ones(3)\n", "one.py")
    )
    assert len(single.example_inputs) == 1 and single.example_inputs[0].shape == (3,)


def test_custom_names(tmp_path):
    path = write(
        tmp_path,
        """
        import torch
        net = torch.nn.Linear(2, 2)
        batch = torch.zeros(1, 2)
        crit = lambda out, x: out.mean()
        """,
    )
    spec = load_model_file(path, model_name="net", inputs_name="batch", loss_name="crit")
    assert isinstance(spec.module, torch.nn.Linear)
    assert spec.loss_fn(torch.ones(2), None).item() == 1.0


def test_file_folder_on_sys_path_while_importing(tmp_path):
    (tmp_path / "helper_mod_for_autoplan.py").write_text("import torch\nWIDTH = 5\n")
    path = write(
        tmp_path,
        """
        import torch
        from helper_mod_for_autoplan import WIDTH
        model = torch.nn.Linear(WIDTH, 1)
        example_inputs = (torch.randn(2, WIDTH),)
        """,
    )
    before = list(sys.path)
    spec = load_model_file(path)
    assert spec.module.in_features == 5
    assert sys.path == before


def test_examples_load():
    for name in ("mlp", "resnet", "gpt"):
        spec = load_model_file(os.path.join(EXAMPLES, f"{name}.py"))
        assert isinstance(spec.module, torch.nn.Module)
        assert all(isinstance(t, torch.Tensor) for t in spec.example_inputs)
        assert spec.loss_fn is not default_loss


# --------------------------------------------------------------------------------- errors


def test_file_not_found(tmp_path):
    message = load_error(str(tmp_path / "nope.py"))
    assert "nope.py" in message and "not found" in message


def test_folder_instead_of_file(tmp_path):
    assert "folder" in load_error(str(tmp_path))


def test_file_raises_while_importing(tmp_path):
    path = write(tmp_path, 'raise ValueError("bad config\\nsecond line")\n', "x.py")
    message = load_error(path)
    assert message == f"{path} raised ValueError while loading: bad config"


def test_file_with_syntax_error(tmp_path):
    message = load_error(write(tmp_path, "model = (\n", "broken.py"))
    assert "syntax error" in message and "broken.py" in message


def test_missing_model(tmp_path):
    path = write(tmp_path, "import torch\nexample_inputs = torch.ones(1)\n", "x.py")
    message = load_error(path)
    assert message.startswith(f"{path} defines no 'model'")
    assert "--model NAME" in message


def test_missing_inputs(tmp_path):
    message = load_error(write(tmp_path, "import torch\nmodel = torch.nn.ReLU()\n"))
    assert "defines no 'example_inputs'" in message


def test_model_of_wrong_type(tmp_path):
    message = load_error(write(tmp_path, "import torch\nmodel = 3\nexample_inputs = torch.ones(1)\n"))
    assert "model must be an nn.Module or a function returning one, got int" in message


def test_model_builder_returns_wrong_type(tmp_path):
    path = write(tmp_path, "import torch\nmodel = lambda: 'x'\nexample_inputs = torch.ones(1)\n")
    assert "model() must return an nn.Module, got str" in load_error(path)


def test_model_builder_raises(tmp_path):
    path = write(
        tmp_path,
        "import torch\ndef model():\n    raise RuntimeError('no\\nway')\nexample_inputs = torch.ones(1)\n",
    )
    assert "model() raised RuntimeError: no" in load_error(path)


def test_inputs_of_wrong_type(tmp_path):
    path = write(tmp_path, "import torch\nmodel = torch.nn.ReLU()\nexample_inputs = 3\n")
    message = load_error(path)
    assert message.endswith("example_inputs must be a tensor, a tuple of tensors or a dict of keyword arguments, "
                            "got int")


def test_keyword_inputs_without_tensor(tmp_path):
    path = write(tmp_path, "import torch\nmodel = torch.nn.ReLU()\nexample_inputs = {'x': 1}\n")
    assert load_error(path).endswith("example_inputs holds no tensor: give at least one tensor input")


def test_inputs_tuple_with_non_tensor(tmp_path):
    path = write(tmp_path, "import torch\nmodel = torch.nn.ReLU()\nexample_inputs = (torch.ones(1), 2)\n")
    assert "item 1 is int" in load_error(path)


def test_inputs_empty(tmp_path):
    path = write(tmp_path, "import torch\nmodel = torch.nn.ReLU()\nexample_inputs = ()\n")
    assert "empty" in load_error(path)


def test_loss_not_callable(tmp_path):
    path = write(tmp_path, GOOD + "loss_fn = 3\n")
    assert "loss_fn must be a function" in load_error(path)


def test_make_model_spec_errors_are_one_line():
    with pytest.raises(AutoplanError, match="got set$"):
        make_model_spec(torch.nn.ReLU(), {torch.ones(1)})
    with pytest.raises(AutoplanError, match=r"example_inputs\['a'\] nests tensors in a container"):
        make_model_spec(torch.nn.ReLU(), {"a": [torch.ones(1)]})
    with pytest.raises(AutoplanError, match="got str"):
        make_model_spec("model", torch.ones(1))
    with pytest.raises(AutoplanError, match="loss_fn must be a function"):
        make_model_spec(torch.nn.ReLU(), torch.ones(1), loss_fn=1.0)


class _Keywords(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, input_ids, attention_mask=None, labels=None, return_dict=True):
        out = input_ids * self.scale if attention_mask is None else input_ids * self.scale * attention_mask
        loss = ((out - labels) ** 2).mean()
        return {"loss": loss, "logits": out} if return_dict else (loss, out)


def test_keyword_inputs_call_the_model_by_name():
    """A dict of keyword arguments: its tensors are the inputs, in the dict's order; None and
    flags are passed unchanged on every call; a batch may be given by keyword."""
    x, y = torch.ones(2, 3), torch.zeros(2, 3)
    spec = make_model_spec(_Keywords(), {"labels": y, "attention_mask": None, "input_ids": x, "return_dict": True})
    assert spec.input_names == ("labels", "input_ids")
    assert spec.fixed_kwargs == {"attention_mask": None, "return_dict": True}
    assert spec.example_inputs[0] is y and spec.example_inputs[1] is x
    output = spec.call(spec.module, spec.example_inputs)
    assert spec.loss_fn(output, *spec.example_inputs).item() == 4.0  # output["loss"]: no loss_fn needed
    assert spec.positional((), {"input_ids": x, "labels": y}) == (y, x)
    with pytest.raises(AutoplanError, match="the batch has no 'labels'"):
        spec.positional((), {"input_ids": x})
    with pytest.raises(AutoplanError, match="unknown keyword 'mask'"):
        spec.positional((), {"input_ids": x, "labels": y, "mask": x})


def test_make_model_spec_accepts_builders():
    spec = make_model_spec(lambda: torch.nn.ReLU(), lambda: (torch.ones(2),), name="relu")
    assert isinstance(spec.module, torch.nn.ReLU)
    assert spec.example_inputs[0].shape == (2,)
    assert spec.name == "relu" and spec.loss_fn is default_loss


def test_import_file_gives_module(tmp_path):
    module = import_file(write(tmp_path, "VALUE = 7\ndef build(n=1):\n    return n * VALUE\n", "m.py"))
    assert module.build(2) == 14


# --------------------------------------------------------------------------------- default_loss


def test_default_loss_tensor_is_float_mean():
    out = torch.tensor([1, 2, 3, 4])
    loss = default_loss(out, torch.ones(1))
    assert loss.dtype == torch.float32 and loss.item() == 2.5


def test_default_loss_tuple_list_dict():
    a, b = torch.full((2,), 3.0), torch.zeros(2)
    assert default_loss((a, b)).item() == 3.0
    assert default_loss([None, a, b]).item() == 3.0
    assert default_loss({"logits": a, "other": b}).item() == 3.0
    assert default_loss(((a,), b)).item() == 3.0


def test_default_loss_prefers_loss_attribute():
    from transformers.modeling_outputs import CausalLMOutput

    logits = torch.full((2, 3), 5.0)
    with_loss = CausalLMOutput(loss=torch.tensor(0.25), logits=logits)
    assert default_loss(with_loss).item() == 0.25
    without_loss = CausalLMOutput(loss=None, logits=logits)
    assert default_loss(without_loss).item() == 5.0


def test_default_loss_needs_a_tensor():
    with pytest.raises(AutoplanError) as info:
        default_loss("text")
    assert "\n" not in str(info.value)


def test_default_loss_dict_with_loss_key():
    out = OrderedDict(loss=torch.tensor(1.5), logits=torch.zeros(2))
    assert default_loss(out).item() == 1.5
